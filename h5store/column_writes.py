"""The writing half of a :class:`~h5store.column.Column`: appends staged into whole chunks, overwrites, flushes.

Appended rows are copied once into a staging buffer; its whole chunks are written as it
fills (raw, ``H5Dwrite_chunk``, where no filter applies), the partial last chunk stays
staged until a read or a commit writes everything (:meth:`ColumnWrites.flush`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import h5py
import numpy as np

from h5store.checksum import crc32
from h5store.errors import ReadOnlyError, SchemaError
from h5store.format import ABSENT, ColumnSpec
from h5store.layout import grow_capacity
from h5store.reader_protocol import Reader

__all__ = ["ColumnWrites", "chunk_rows"]

_CHUNK_BYTES = 1 << 19  # ~512 KiB chunks: large sequential reads, modest waste in small files
_FILTERED_CHUNK_BYTES = 32 << 10  # compressed (filtered) data: see chunk_rows
_SPILL_BYTES = 32 << 20  # pending rows are written in blocks of this size
# Whole chunks at least this large are written with H5Dwrite_chunk, straight from the staging
# buffer: no copy into HDF5's chunk cache and no selection machinery (half the CPU per byte of
# a hyperslab write). Smaller chunks go through one hyperslab write per spill, which beats a
# Python call per chunk.
_DIRECT_CHUNK_BYTES = 64 << 10


def chunk_rows(spec: ColumnSpec) -> int:
    """Rows per chunk of a new column's ``data``: ``spec.chunk_rows``, else a size that suits its rows."""
    if spec.chunk_rows:
        return spec.chunk_rows
    # Narrow rows (scalars, log values) get at most 16k rows per chunk: HDF5 rewrites the whole
    # last chunk on every append commit, so a 512 KiB chunk of scalars would cost 512 KiB each.
    # Compressed chunks are decoded whole on every read that touches them: keep them small.
    # 32 KiB served fastest of 16/32/64/256 KiB (blosc:lz4 and zstd, whole items and 64-frame
    # windows, in-process and in workers: benchmarks/bench_codecs.py) for ~1-4% of ratio.
    target = _FILTERED_CHUNK_BYTES if spec.filtered else _CHUNK_BYTES
    return max(1, min(target // max(spec.row_nbytes, 1), 1 << 14))


class ColumnWrites:
    """Appends, overwrites and flushes of a :class:`~h5store.column.Column` (its reading half
    provides the tables: ``index``, ``checksums``, ``frames``)."""

    spec: ColumnSpec
    where: str
    writable: bool
    data: h5py.Dataset
    _index_ds: h5py.Dataset
    _checksum_ds: h5py.Dataset
    _frames_ds: h5py.Dataset | None
    _index: np.ndarray | None
    _checksum: np.ndarray | None
    _frames: np.ndarray | None
    _reader: Reader | None
    _size: int
    _stage: np.ndarray | None
    _staged: int
    _direct_rows: int | None
    _pending_frames: list[np.ndarray]
    _dirty_from: int | None

    # The reading half's tables (properties of Column).
    index: np.ndarray
    checksums: np.ndarray
    frames: np.ndarray

    def _need_writable(self) -> None:
        if not self.writable:
            raise ReadOnlyError.opened(self.where)

    def grow_items(self, n: int) -> None:
        """Make room for group rows up to ``n`` (new rows absent)."""
        idx, crc = self.index, self.checksums
        if n > len(idx):
            extra = n - len(idx)
            self._index = np.concatenate([idx, np.full((extra, 2), ABSENT, np.int64)])
            self._checksum = np.concatenate([crc, np.zeros(extra, np.uint32)])
            self._mark(len(idx))

    def _mark(self, row: int) -> None:
        self._dirty_from = row if self._dirty_from is None else min(self._dirty_from, row)

    def _new_rows(self, rows: np.ndarray | Sequence[int]) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        stored = self.index[rows, 0] != ABSENT
        if np.any(stored):
            raise ValueError(f"{self.where}: item at row {int(rows[np.argmax(stored)])} already stored")
        return rows

    def append_block(self, start: int, n: int, lengths: np.ndarray, data: np.ndarray, crc: np.ndarray) -> None:
        """Items for rows ``start..n-1`` already concatenated in ``data`` (the ids column: its
        rows are the refs rows themselves)."""
        self.grow_items(n)
        stops = self._size + np.cumsum(lengths)
        self.index[start:] = np.stack([stops - lengths, stops], axis=1)
        self.checksums[start:] = crc
        self._mark(start)
        self._stage_block(data)

    def append(self, rows: np.ndarray, items: Sequence[Any], crcs: Sequence[int] | None = None) -> None:
        """Store ``items`` (already validated arrays, or blob lists) for group ``rows``.

        ``crcs`` are the items' :func:`item_crc` when the caller computed them already (ingest
        does, in its workers, so the one writer does not spend its time hashing).
        """
        self._need_writable()
        if not len(items):
            return
        rows = self._new_rows(rows)
        crc = np.empty(len(items), np.uint32)
        if self.spec.layout == "blobs":
            blobs = [[np.frombuffer(memoryview(b).cast("B"), np.uint8) for b in item] for item in items]
            counts = np.fromiter((len(b) for b in blobs), np.int64, len(blobs))
            flat = [b for item in blobs for b in item]
            sizes = np.fromiter((len(b) for b in flat), np.int64, len(flat))
            if flat:
                self._stage_rows(int(sizes.sum()), lambda out: np.concatenate(flat, out=out))
            ends = self._size + np.cumsum(sizes)
            frame_rows = np.stack([ends - sizes, ends], axis=1) if len(flat) else np.zeros((0, 2), np.int64)
            f0 = len(self.frames) + sum(len(p) for p in self._pending_frames)
            fstops = f0 + np.cumsum(counts)
            self.index[rows] = np.stack([fstops - counts, fstops], axis=1)
            if crcs is None:
                for j, item in enumerate(blobs):
                    crc[j] = crc32(b"".join(item))
            self._pending_frames.append(frame_rows)
            added = int(sizes.sum())
        else:
            # Each item is copied once, straight into the staging buffer (converted to the
            # column's dtype on the way, as a cast of the whole block would).
            if self.spec.layout == "fixed":
                lengths = np.ones(len(items), np.int64)
                self._stage_rows(len(items), lambda out: np.stack(items, out=out, casting="unsafe"))
            else:
                lengths = np.fromiter((len(x) for x in items), np.int64, len(items))
                self._stage_rows(int(lengths.sum()), lambda out: np.concatenate(items, out=out, casting="unsafe"))
            stops = self._size + np.cumsum(lengths)
            self.index[rows] = np.stack([stops - lengths, stops], axis=1)
            if crcs is None:
                for j, x in enumerate(items):
                    crc[j] = crc32(np.ascontiguousarray(x))
            added = int(stops[-1]) - self._size
        if crcs is not None:
            crc[:] = np.asarray(crcs, dtype=np.uint32)
        self.checksums[rows] = crc
        self._mark(int(rows.min()))
        self._add_staged(added)

    def append_rows(self, rows: np.ndarray, lengths: np.ndarray, crcs: np.ndarray,
                    fill: Callable[[np.ndarray], object]) -> None:
        """Store items that arrive already concatenated (ragged and fixed layouts).

        The item of group row ``rows[j]`` is ``lengths[j]`` rows (1 for a fixed layout);
        ``fill(out)`` writes all of them, in order, into ``out``, an uninitialised
        ``(lengths.sum(), *inner)`` array of the column's dtype (e.g. ``np.copyto`` from a
        block, or a read from a file). Ingest hands its workers' results over this way: no
        array per item in the writer, and one copy into the staging buffer. ``crcs`` are the
        items' :func:`item_crc`. Nothing is stored when ``fill`` raises.
        """
        self._need_writable()
        if self.spec.layout == "blobs":
            raise SchemaError(f"{self.where}: blob items cannot be appended as rows")
        if not len(rows):
            return
        rows = self._new_rows(rows)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(lengths) != len(rows) or np.any(lengths < 0) or (self.spec.layout == "fixed" and np.any(lengths != 1)):
            raise ValueError(f"{self.where}: lengths {lengths.tolist()} do not fit {len(rows)} {self.spec.layout} items")
        stops = self._size + np.cumsum(lengths)
        added = int(stops[-1]) - self._size
        self._stage_rows(added, fill)
        self.index[rows] = np.stack([stops - lengths, stops], axis=1)
        self.checksums[rows] = np.asarray(crcs, dtype=np.uint32)
        self._mark(int(rows.min()))
        self._add_staged(added)

    # Staging: appended rows are copied once into a buffer of _SPILL_BYTES that lives until the
    # next commit (allocating a fresh block per spill costs a page fault per 4 KiB, about what
    # the copy itself costs). When it is full, its whole chunks are written and the partial
    # last chunk stays staged, so during an ingest every chunk is written whole, once, in
    # order; flush_pending (a read, a commit) writes everything.
    def _stage_rows(self, n: int, fill: Callable[[np.ndarray], object]) -> None:
        """Have ``fill`` write ``n`` new rows after the staged ones (not counted until :meth:`_add_staged`)."""
        need = self._staged + n
        if self._stage is not None and len(self._stage) < need and self._staged:
            # Full: write the whole chunks, keep the partial last one, and reuse the buffer.
            self._write_staged(keep_tail=True)
            need = self._staged + n
        old = self._stage
        if old is None or len(old) < need:
            # Full size at once: untouched pages cost no memory, so a small column never uses
            # more than it stages, and growing step by step would fault in fresh pages (and
            # copy) at every step. One call larger than the spill size gets a buffer of its
            # own size, dropped once written.
            size = max(need, self._stage_cap())
            grown = np.empty((size, *self.spec.inner), dtype=self.spec.np_dtype)
            if old is not None and self._staged:
                grown[: self._staged] = old[: self._staged]
            self._stage = grown
        fill(self._stage[self._staged : need])

    def _stage_cap(self) -> int:
        return max(1, _SPILL_BYTES // max(self.spec.row_nbytes, 1))

    def _add_staged(self, n: int) -> None:
        self._staged += n
        self._size += n

    def _stage_block(self, block: np.ndarray) -> None:
        """Stage rows already indexed by the caller (the ids column, whose index is the refs')."""
        self._need_writable()
        self._stage_rows(len(block), lambda out: np.copyto(out, block, casting="unsafe"))
        self._add_staged(len(block))

    def _chunk_rows_direct(self) -> int:
        """Rows per chunk when whole chunks may be written raw (H5Dwrite_chunk), else 0.

        Only for chunks of whole rows, large enough, with no filter of any kind: the bytes
        written are then exactly what HDF5 would have stored.
        """
        if self._direct_rows is None:
            ds = self.data
            chunks = ds.chunks
            ok = (chunks is not None and tuple(chunks[1:]) == self.spec.inner and ds.dtype == self.spec.np_dtype
                  and ds.dtype.isnative and ds.id.get_create_plist().get_nfilters() == 0
                  and chunks[0] * self.spec.row_nbytes >= _DIRECT_CHUNK_BYTES)
            self._direct_rows = int(chunks[0]) if ok and chunks is not None else 0
        return self._direct_rows

    def _write_staged(self, keep_tail: bool) -> None:
        """Write the staged rows; with ``keep_tail``, all but those of a last partial chunk."""
        n = self._staged
        start = self._size - n
        if self.data.shape[0] < self._size:
            self.data.resize(grow_capacity(self.data.shape[0], self._size, minimum=chunk_rows(self.spec)), axis=0)
        buf = self._stage
        assert buf is not None
        chunks = self.data.chunks
        per = int(chunks[0]) if chunks else 1
        head = min(n, -start % per)  # rows completing a chunk begun by an earlier write
        body = (n - head) // per * per  # whole chunks
        if not body:
            keep_tail = False  # a chunk larger than the spill size: write what there is
        done = head + body if keep_tail else n
        direct = self._chunk_rows_direct()
        if direct and body:
            if head:
                self.data.write_direct(buf, np.s_[:head], np.s_[start : start + head])
            raw = memoryview(buf[head : head + body]).cast("B")
            step = direct * self.spec.row_nbytes
            zeros = (0,) * len(self.spec.inner)
            dsid = self.data.id
            for k in range(body // direct):
                dsid.write_direct_chunk((start + head + k * direct, *zeros), raw[k * step : (k + 1) * step])
            if done > head + body:
                self.data.write_direct(buf, np.s_[head + body : done], np.s_[start + head + body : start + done])
        elif done:
            self.data.write_direct(buf, np.s_[:done], np.s_[start : start + done])
        self._staged = n - done
        if len(buf) > self._stage_cap():
            # A call larger than the spill size grew the buffer: do not keep that memory.
            self._stage = np.array(buf[done:n]) if self._staged else None
        elif self._staged:
            buf[: self._staged] = buf[done:n]  # the partial chunk moves to the front
        self._merge_frames()
        self._reader = None

    def _merge_frames(self) -> None:
        if self._pending_frames:
            fr = np.concatenate(self._pending_frames)
            self._pending_frames = []
            self._frames = np.concatenate([self.frames, fr]) if self._frames is not None or len(fr) else fr

    def overwrite(self, row: int, item: np.ndarray) -> None:
        """Replace the stored item at ``row`` by one of the same shape."""
        self._need_writable()
        self.flush_pending()
        if self.spec.layout == "blobs":
            raise SchemaError(f"{self.where}: blob items cannot be overwritten in place")
        a, b = (int(v) for v in self.index[row])
        old_shape = (b - a, *self.spec.inner) if self.spec.layout == "ragged" else self.spec.inner
        if item.shape != old_shape:
            raise SchemaError(f"{self.where}: overwrite needs shape {old_shape}, got {item.shape}")
        self.data[a:b] = item if self.spec.layout == "ragged" else item[None]
        self.checksums[row] = crc32(np.ascontiguousarray(item, dtype=self.spec.np_dtype))
        self._mark(row)

    def flush_pending(self) -> None:
        """Write staged rows to ``data`` (growing it geometrically)."""
        if self._staged:
            self._write_staged(keep_tail=False)
        elif self._pending_frames:  # blob items without a byte: frames only
            self._merge_frames()
            self._reader = None

    def flush(self) -> None:
        """Write everything pending and trim ``data`` to its logical length."""
        if not self.writable:
            return
        self.flush_pending()
        self._stage = None  # a commit point: do not hold up to _SPILL_BYTES per column between commits
        if self.data.shape[0] != self._size:
            self.data.resize(self._size, axis=0)
        if self._frames_ds is not None and self._frames is not None and len(self._frames) != self._frames_ds.shape[0]:
            old = self._frames_ds.shape[0]
            self._frames_ds.resize(len(self._frames), axis=0)
            self._frames_ds[old:] = self._frames[old:]
        if self._dirty_from is not None:
            d = self._dirty_from
            n = len(self.index)
            if self._index_ds.shape[0] != n:
                self._index_ds.resize(n, axis=0)
                self._checksum_ds.resize(n, axis=0)
            self._index_ds[d:n] = self.index[d:n]
            self._checksum_ds[d:n] = self.checksums[d:n]
            self._dirty_from = None
