"""One column of a group: the reads, appends and overwrites of one feature's items.

A column (``<group>/<name>/{data,index,checksum[,frames]}``, see :mod:`h5store.format`)
moves typed rows described by a :class:`~h5store.format.ColumnSpec`; it knows nothing of
Feature classes (as SQLAlchemy's Table knows nothing of mappers). Reads are planned per
batch (:func:`h5store.layout.plan_reads`) and go through the column's
:class:`~h5store.readers.Reader`, chosen once per process
(:func:`~h5store.readers.choose_reader`); a reader whose rows can move at a commit reads
under the file's commit lock. Appends are staged and written in whole chunks.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import h5py
import numpy as np

from h5store.checksum import crc32
from h5store.column_writes import ColumnWrites, chunk_rows
from h5store.errors import CorruptRecordError, FormatError, SchemaError
from h5store.format import ABSENT, ATTR_COLUMN, CHECKSUM, DATA, FRAMES, INDEX, ColumnSpec, bad_ranges, codec_family
from h5store.handle import FileHandle
from h5store.layout import gather, plan_reads
from h5store.readers import MemoryReader, Reader, choose_reader, read_whole

__all__ = ["Column", "ColumnTables", "create_column", "hdf5_filters", "load_filter_plugins", "open_subgroup"]

_INDEX_CHUNK = 1 << 13
_ZSTD_FILTER, _BLOSC_FILTER = 32015, 32001  # hdf5plugin's registered filter ids
_BLOSC_COMPRESSORS = {"blosclz": 0, "lz4": 1, "lz4hc": 2, "zlib": 4, "zstd": 5}

#: What a read-only column has loaded, handed to a forked child: spec, rows of data, index,
#: checksum, frames (None where not loaded).
ColumnTables = tuple[ColumnSpec, int, "np.ndarray | None", "np.ndarray | None", "np.ndarray | None"]


def open_subgroup(g: h5py.Group, name: str, where: str) -> h5py.Group:
    """``g[name]``; :class:`~h5store.errors.FormatError` naming ``where`` when it cannot be opened."""
    try:
        return g[name]
    except (KeyError, OSError) as e:  # h5py: "Unable to open object (incorrect metadata checksum ...)"
        raise FormatError(f"{where}: unreadable ({e})") from None


def _open_table(g: h5py.Group, name: str) -> h5py.Dataset:
    """Open an index-like dataset without HDF5's chunk cache.

    Tables are read whole, once, into numpy: a chunk cache (``rdcc_nbytes`` per dataset)
    would only keep a second copy, ~19 MB per process for the ids of a million items.
    """
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(0, 0, 1.0)
    return h5py.Dataset(h5py.h5d.open(g.id, name.encode("utf-8"), dapl=dapl))


def load_filter_plugins(spec: ColumnSpec) -> None:
    """Register the HDF5 filters ``spec``'s codec needs to be written (``import hdf5plugin``).

    Only zstd and blosc need it, and only to write: h5store decodes their chunks itself.
    Imported here, not with h5store (it loads a dozen shared libraries).
    """
    if codec_family(spec.compression) in ("zstd", "blosc"):
        try:
            import hdf5plugin  # noqa: F401 - registers filters 32001 and 32015 with HDF5
        except ImportError:
            raise SchemaError(f"compression={spec.compression!r} needs hdf5plugin: pip install hdf5plugin") from None


def hdf5_filters(spec: ColumnSpec) -> dict[str, Any]:
    """The ``create_dataset`` keywords of ``spec``'s filter pipeline.

    zstd and blosc byte-shuffle numbers wider than one byte (floats compress ~1.5-2x better
    so): zstd through HDF5's shuffle filter before it, blosc inside its own chunks.

    Examples
    --------
    >>> hdf5_filters(ColumnSpec(dtype="float32", shape=(None, 80), layout="ragged", compression="zstd"))
    {'shuffle': True, 'compression': 32015, 'compression_opts': (3,)}
    """
    out: dict[str, Any] = {}
    family = codec_family(spec.compression)
    wide = spec.np_dtype.itemsize > 1
    if family == "zstd":
        load_filter_plugins(spec)
        out["shuffle"] = wide or spec.shuffle
        out["compression"] = _ZSTD_FILTER
        out["compression_opts"] = (spec.compression_opts if spec.compression_opts is not None else 3,)
    elif family == "blosc":
        load_filter_plugins(spec)
        cname = spec.compression.split(":", 1)[1] if ":" in (spec.compression or "") else "lz4"
        level = spec.compression_opts if spec.compression_opts is not None else 5
        # cd_values: (reserved x4, level, shuffle, compressor); the filter fills in the first four.
        out["compression"] = _BLOSC_FILTER
        out["compression_opts"] = (0, 0, 0, 0, level, 1 if wide else 0, _BLOSC_COMPRESSORS[cname])
    elif spec.compression:
        out["compression"] = spec.compression
        if spec.compression_opts is not None:
            out["compression_opts"] = spec.compression_opts
    if spec.shuffle and family != "zstd":
        out["shuffle"] = True
    if spec.fletcher32:
        out["fletcher32"] = True
    return out


def create_column(parent: h5py.Group, name: str, spec: ColumnSpec, n_items: int) -> h5py.Group:
    """Create an empty column in ``parent`` for a group that already holds ``n_items`` ids."""
    g = parent.create_group(name)
    g.attrs[ATTR_COLUMN] = json.dumps(spec.to_dict(), sort_keys=True)
    filters = hdf5_filters(spec)
    inner = spec.inner
    g.create_dataset(DATA, shape=(0, *inner), maxshape=(None, *inner), dtype=spec.np_dtype,
                     chunks=(chunk_rows(spec), *inner), **filters)
    index = np.full((n_items, 2), ABSENT, dtype=np.int64)
    g.create_dataset(INDEX, data=index, maxshape=(None, 2), chunks=(_INDEX_CHUNK, 2))
    g.create_dataset(CHECKSUM, data=np.zeros(n_items, np.uint32), maxshape=(None,), chunks=(_INDEX_CHUNK,))
    if spec.layout == "blobs":
        g.create_dataset(FRAMES, shape=(0, 2), maxshape=(None, 2), dtype=np.int64, chunks=(_INDEX_CHUNK, 2))
    return g


class Column(ColumnWrites):
    """One column of a group: reads, appends and overwrites of its items (the writing half:
    :class:`~h5store.column_writes.ColumnWrites`).

    ``where`` names the file, group and column in error messages.
    """

    def __init__(self, g: h5py.Group, spec: ColumnSpec, where: str, writable: bool, path: str,
                 handle: FileHandle | None = None) -> None:
        self.g = g
        self.spec = spec
        self.where = where
        self.writable = writable
        if writable:
            load_filter_plugins(spec)  # a writer's partial chunks are compressed by HDF5
        self.path = path
        # A reader's h5py objects belong to one open of the file (``handle.generation``); a
        # reader reads metadata only inside ``handle.reading()`` and rebinds after a reopen.
        self._handle = None if writable else handle
        self._gen = handle.generation if handle is not None else 0
        self._gpath = g.name  # kept as text: an h5py object of a closed file has no name
        self._bind(g)
        self._items: int | None = None  # a reader's snapshot: rows of index and checksum
        if self.data.dtype != spec.np_dtype or tuple(self.data.shape[1:]) != spec.inner:
            raise FormatError(
                f"{where}: data is {self.data.dtype}{tuple(self.data.shape[1:])}, the schema says "
                f"{spec.np_dtype}{spec.inner}"
            )
        self._frames_n = self._frames_ds.shape[0] if self._frames_ds is not None else 0
        self._index: np.ndarray | None = None
        self._checksum: np.ndarray | None = None
        self._frames: np.ndarray | None = None
        self._ok: np.ndarray | None = None  # a reader's items whose whole bytes passed their CRC-32
        self._reader: Reader | None = None
        self._reader_pid = -1
        # writer state
        self._size = int(self.data.shape[0])  # logical rows, pending included
        # Appended rows not written yet: the last ``_staged`` rows of ``data`` (rows
        # ``[_size - _staged, _size)``) sit at the front of one reused buffer, each copied once.
        self._stage: np.ndarray | None = None
        self._staged = 0
        self._direct_rows: int | None = None  # rows per directly written chunk (0: never), once known
        self._pending_frames: list[np.ndarray] = []
        self._dirty_from: int | None = None

    def _bind(self, g: h5py.Group) -> None:
        self.g = g
        try:
            self.data: h5py.Dataset = g[DATA]
            self._index_ds: h5py.Dataset = _open_table(g, INDEX)
            self._checksum_ds: h5py.Dataset = _open_table(g, CHECKSUM)
            self._frames_ds: h5py.Dataset | None = _open_table(g, FRAMES) if self.spec.layout == "blobs" else None
        except KeyError as e:
            raise FormatError(f"{self.where}: missing dataset ({e})") from None

    @contextlib.contextmanager
    def _h5(self) -> Iterator[None]:
        """Around every read of HDF5 metadata or chunks: see :meth:`FileHandle.reading`."""
        h = self._handle
        if h is None:
            yield
            return
        h.check_usable()  # after a write error: that error, not "unreadable" data
        with h.reading() as f:
            if h.generation != self._gen:
                # The file was reopened after a commit: the same objects in the new open.
                # Everything this reader already holds (tables, direct offsets) stays valid:
                # committed rows never change or move; only what HDF5 reads is rebound.
                self._bind(open_subgroup(f, self._gpath, self.where))
                if self._reader is not None:
                    self._reader.rebind(self.data)
                self._gen = h.generation
            yield

    # ---------------------------------------------------------------- snapshot
    @property
    def size(self) -> int:
        """Rows of ``data`` (pending ones included)."""
        return self._size

    @property
    def stored_items(self) -> int:
        """Rows of the stored index (items in the file at its last commit)."""
        return int(self._index_ds.shape[0])

    def snapshot(self, n: int) -> None:
        """A reader sees the first ``n`` items (its open's commit) until it refreshes."""
        self._items = n

    def drop_index(self) -> None:
        """Forget the loaded index (read again when next needed)."""
        self._index = None

    def tables(self) -> ColumnTables:
        """What this column has loaded: ``(spec, size, index, checksum, frames)``, numpy only."""
        return self.spec, self._size, self._index, self._checksum, self._frames

    def adopt(self, loaded: ColumnTables, n: int) -> None:
        """Take over ``loaded`` (another process's :meth:`tables`) where it still describes the
        file, ``n`` items: a table whose dataset changed size since is read afresh."""
        spec, size, index, checksum, frames = loaded
        if self.spec != spec or self._size != size:
            return
        if index is not None and len(index) == self.stored_items == n:
            self._index = index
            if checksum is not None and len(checksum) == n:
                self._checksum = checksum
        if frames is not None and self._frames_ds is not None and len(frames) == self._frames_ds.shape[0]:
            self._frames = frames

    # ---------------------------------------------------------------- tables
    def _read_table(self, name: str, what: str, rows: int | None = None) -> np.ndarray:
        """A whole table (a reader: its first ``rows``, the snapshot it opened), refused (not
        allocated) when it declares more bytes than the file holds."""
        with self._h5():
            ds: h5py.Dataset = getattr(self, name)
            nbytes = ds.dtype.itemsize * int(np.prod(ds.shape, dtype=object))
            if nbytes > ds.file.id.get_filesize() + (1 << 20):
                raise CorruptRecordError(f"{self.where}: {what} declares {ds.shape} rows, more than the file holds")
            if rows is not None and ds.shape[0] < rows:
                raise CorruptRecordError(f"{self.where}: {what} has {ds.shape[0]} rows, {rows} expected")
            try:
                return read_whole(ds, self.path, f"{self.where}/{what}", None if rows is None or self.writable else rows,
                                  via_hdf5=self.writable)
            except (OSError, RuntimeError, ValueError) as e:  # h5py's words for damaged chunks or B-trees
                raise CorruptRecordError(f"{self.where}: {what} unreadable ({e})") from None

    @property
    def index(self) -> np.ndarray:
        """``(N, 2)`` int64 ``[start, stop)`` per item, validated once when first read (with the
        checksums: an item the index marks absent must have none)."""
        if self._index is None:
            idx = self._read_table("_index_ds", "index", self._items)
            self._validate_index(idx)
            c = self._checksum if self._checksum is not None else self._read_table("_checksum_ds", "checksum", self._items)
            if self._stray(idx, c).any() and self._checksum is None:
                # A writer may have filled an absent item between the two reads (it writes the
                # index row first, then the checksum): read both again before calling it damage.
                idx = self._read_table("_index_ds", "index", self._items)
                self._validate_index(idx)
                c = self._read_table("_checksum_ds", "checksum", self._items)
            self._check_absent(idx, c)
            self._index, self._checksum = idx, c
        return self._index

    @property
    def checksums(self) -> np.ndarray:
        idx = self.index  # reads the checksums with it
        if self._checksum is None:  # an index adopted without them
            c = self._read_table("_checksum_ds", "checksum", self._items)
            self._check_absent(idx, c)
            self._checksum = c
        return self._checksum

    @staticmethod
    def _stray(idx: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Rows the index marks absent that have a CRC-32 (an absent item's is 0)."""
        if len(c) != len(idx):
            return np.zeros(0, bool)
        return (idx[:, 0] == ABSENT) & (c != 0)

    def _check_absent(self, idx: np.ndarray, c: np.ndarray) -> None:
        # An index row damaged into [-1, -1] would make a stored item look absent: every read,
        # iteration and served epoch would leave it out without an error. Its CRC-32 says it is not.
        if len(c) != len(idx):
            raise CorruptRecordError(f"{self.where}: checksum has {len(c)} rows, index {len(idx)}")
        stray = self._stray(idx, c)
        if stray.any():
            row = int(np.argmax(stray))
            raise CorruptRecordError(f"{self.where}: index row {row} marks the item absent but its checksum is "
                                     f"{int(c[row])}: the index or the checksum is damaged")

    @property
    def frames(self) -> np.ndarray:
        if self._frames is None:
            assert self._frames_ds is not None
            fr = self._read_table("_frames_ds", "frames", None if self.writable else self._frames_n)
            self._check_ranges(fr, int(self.data.shape[0]), "frames")
            self._frames = fr
        return self._frames

    def _target_len(self) -> int:
        return len(self.frames) if self.spec.layout == "blobs" else int(self.data.shape[0])

    def _validate_index(self, idx: np.ndarray) -> None:
        if idx.ndim != 2 or idx.shape[1] != 2:
            raise CorruptRecordError(f"{self.where}: index has shape {idx.shape}, expected (N, 2)")
        self._check_ranges(idx, self._target_len() if self.spec.layout != "blobs" else len(self.frames), "index")

    def _check_ranges(self, r: np.ndarray, limit: int, what: str) -> None:
        if not len(r):
            return
        bad = bad_ranges(r, limit, fixed=self.spec.layout == "fixed" and what == "index")
        if bad.any():
            row = int(np.argmax(bad))
            raise CorruptRecordError(
                f"{self.where}: {what} row {row} = {r[row].tolist()} points outside the {limit} stored rows"
            )

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        """Rows (or blobs) per item; 0 for absent items."""
        idx = self.index
        return idx[:, 1] - idx[:, 0]

    @property
    def present(self) -> np.ndarray:
        return self.index[:, 0] != ABSENT

    # ---------------------------------------------------------------- reading
    def reader(self) -> Reader:
        """This process's reader of ``data`` (:func:`~h5store.readers.choose_reader`)."""
        reader = self._reader
        if reader is None or (self._reader_pid != os.getpid() and not reader.survives_fork):
            self._reader = None
            with self._h5():
                self._reader = choose_reader(self.data, self.path, self.where, self.writable)
            self._reader_pid = os.getpid()
        return self._reader

    def use_memory(self, array: np.ndarray) -> None:
        """Serve reads from ``array`` (this column's whole ``data``, e.g. in shared memory)."""
        if array.shape != self.data.shape or array.dtype != self.data.dtype:
            raise ValueError(f"{self.where}: in-memory copy is {array.dtype}{array.shape}, data is {self.data.dtype}{self.data.shape}")
        self._reader = MemoryReader(array)

    def close_reader(self, forget: bool = False) -> None:
        """Close this process's reader descriptors (reopened by the next read); with ``forget``
        (the file is being closed) the reader too, chosen again on the next read (an in-memory
        one is kept)."""
        reader = self._reader
        if reader is not None:
            reader.close()
            if forget and not reader.resident:
                self._reader = None

    def _read(self, fn: Callable[[Reader], Any]) -> Any:
        """``fn(reader)``; under the commit lock where the reader's rows can move (not ``stable``)."""
        reader = self.reader()
        if self._handle is None or reader.stable:
            return fn(reader)
        # Its chunk addresses come from HDF5 and may change at a commit (a rewritten
        # compressed chunk moves): read under the commit lock, rebound after a commit.
        with self._h5():
            return fn(self.reader())

    def _missing(self, rows: np.ndarray) -> None:
        absent = self.index[rows, 0] == ABSENT
        if absent.any():
            raise KeyError(int(rows[np.argmax(absent)]))

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray, max_gap: int = 0) -> list[np.ndarray]:
        """Rows ``[start, stop)`` of ``data`` for each pair, one planned read for all."""
        self.flush_pending()
        plan = plan_reads(starts, stops, max_gap=max_gap)
        return gather(plan, self._read(lambda r: r.read_runs(plan)))

    def read_scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """Rows ``[starts[j], +counts[j])`` of ``data`` into ``out[dest[j], :counts[j]]`` (see :class:`Reader`)."""
        self.flush_pending()
        self._read(lambda r: r.read_scatter(out, dest, starts, counts))

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Row ``rows[j]`` of ``data`` at ``[j]``."""
        self.flush_pending()
        return self._read(lambda r: r.take(rows))

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """Hold the file's commit lock (a reader's h5py objects rebound if a commit happened)."""
        return self._h5()

    def read_items(self, rows: Sequence[int] | np.ndarray, verify: bool = False) -> list[np.ndarray]:
        """Whole items at group ``rows`` (absent rows raise ``KeyError(row)``)."""
        rows = np.asarray(rows, dtype=np.int64)
        self.flush_pending()
        idx = self.index[rows]
        self._missing(rows)
        if self.spec.layout == "blobs":
            return self.read_blob_spans(rows, np.zeros(len(rows), np.int64), idx[:, 1] - idx[:, 0], verify)
        parts = self.read_ranges(idx[:, 0], idx[:, 1], max_gap=self._gap())
        if self.spec.layout == "fixed":
            parts = [p[0] for p in parts]
        if verify:
            self.verify(rows, parts)
        return parts

    def _gap(self) -> int:
        return self.reader().max_gap

    def read_blobs(self, row: int, first: int, stop: int) -> list[np.ndarray]:
        """Blobs ``first..stop-1`` of the item at ``row`` (only their bytes are read once the
        whole item's CRC-32 was checked): :meth:`read_blob_spans` for one item."""
        return self.read_blob_spans(np.array([row]), np.array([first]), np.array([stop]))[0]

    def read_blob_spans(self, rows: np.ndarray, first: np.ndarray, stop: np.ndarray,
                        verify: bool = True) -> list[list[np.ndarray]]:
        """Blobs ``first[j]..stop[j]-1`` of the item at ``rows[j]``, for a whole batch at once.

        Planned for all of them: the spans' frames gathered and checked (each span's blobs must
        join: they are cut out of one read) with a few numpy calls, one planned read of every
        span's bytes (neighbouring spans joined), and Python only to cut the blobs out. A reader
        thread holds the GIL for microseconds per clip, not for a dozen numpy calls per clip.
        With ``verify``, a span that is a whole item is checked against its CRC-32; a part of
        one cannot be, so the first part read of an item reads and checks the whole item
        (remembered per process by a reader). Serving passes False and applies its own
        ``verify=`` policy.
        """
        rows = np.asarray(rows, dtype=np.int64)
        first = np.asarray(first, dtype=np.int64)
        stop = np.asarray(stop, dtype=np.int64)
        self.flush_pending()
        self._missing(rows)
        idx = self.index[rows]
        n = idx[:, 1] - idx[:, 0]
        bad = (first < 0) | (first > stop) | (stop > n)
        if bad.any():
            j = int(np.argmax(bad))
            raise IndexError(f"{self.where}: blobs [{int(first[j])}, {int(stop[j])}) out of range for an item of "
                             f"{int(n[j])}")
        count = stop - first
        total = int(count.sum())
        whole = (first == 0) & (stop == n) if verify else np.zeros(len(rows), bool)
        part = ~whole & (count > 0) if verify else whole
        if part.any():
            part &= ~self._checked(rows)
        if part.any():
            # A part of an item cannot be checked against its CRC-32: the first time a part of
            # an item is read (by a reader; every time by a writer), the whole item is read and
            # checked, as serving does, and the part cut out of it.
            out: list[list[np.ndarray]] = [[] for _ in range(len(rows))]
            full = self.read_blob_spans(rows[part], np.zeros(int(part.sum()), np.int64), n[part])
            for j, blobs in zip(np.flatnonzero(part).tolist(), full):
                out[j] = blobs[int(first[j]) : int(stop[j])]
            rest = np.flatnonzero(~part)
            if len(rest):
                for j, blobs in zip(rest.tolist(), self.read_blob_spans(rows[rest], first[rest], stop[rest])):
                    out[j] = blobs
            return out
        if not total:
            if whole.any():  # empty whole items: an index emptied by damage fails their CRC-32
                self.verify(rows[whole], [np.zeros(0, np.uint8)] * int(whole.sum()))
            return [[] for _ in range(len(rows))]
        # flat frame numbers of every span, and each frame's clip
        clip_of = np.repeat(np.arange(len(rows)), count)
        ends = np.cumsum(count)
        flat = np.arange(total, dtype=np.int64) - np.repeat(ends - count, count) + np.repeat(idx[:, 0] + first, count)
        spans = self.frames[flat]
        same = clip_of[1:] == clip_of[:-1]
        broken = same & (spans[1:, 0] != spans[:-1, 1])
        if broken.any():
            # The CRC-32 covers the item's bytes, not where its blobs split them: frames must join.
            raise CorruptRecordError(f"{self.where}: the blob frames of the item at row "
                                     f"{int(rows[clip_of[int(np.argmax(broken))]])} are not contiguous")
        has = count > 0
        lo = np.zeros(len(rows), np.int64)
        hi = np.zeros(len(rows), np.int64)
        lo[has] = spans[(ends - count)[has], 0]
        hi[has] = spans[ends[has] - 1, 1]
        blocks = self.read_ranges(lo[has], hi[has])
        if whole.any():  # whole items: their CRC-32 can be checked (a part of one cannot)
            full = [np.zeros(0, np.uint8)] * len(rows)
            for j, b in zip(np.flatnonzero(has).tolist(), blocks):
                full[j] = b
            self.verify(rows[whole], [full[j] for j in np.flatnonzero(whole).tolist()])
        out: list[list[np.ndarray]] = [[] for _ in range(len(rows))]
        local = (spans - np.repeat(lo, count)[:, None]).tolist()
        pos = 0
        for j, block in zip(np.flatnonzero(has).tolist(), blocks):
            c = int(count[j])
            out[j] = [block[a:b] for a, b in local[pos : pos + c]]
            pos += c
        return out

    def verify(self, rows: np.ndarray, parts: Sequence[np.ndarray]) -> None:
        """Raise :class:`CorruptRecordError` unless each part matches its stored CRC-32."""
        expect = self.checksums[rows]
        for r, p, c in zip(rows.tolist(), parts, expect.tolist()):
            if crc32(np.ascontiguousarray(p)) != c:
                raise CorruptRecordError(f"{self.where}: item at row {r} fails its checksum")
        if not self.writable:
            self._checked(rows[:0])
            assert self._ok is not None
            self._ok[rows] = True

    def _checked(self, rows: np.ndarray) -> np.ndarray:
        """Bool per row: its whole item passed its CRC-32 in this process (a writer: never
        remembered, its items can be overwritten). A reader's committed items never change."""
        if self.writable:
            return np.zeros(len(rows), bool)
        n = len(self.index)
        if self._ok is None or len(self._ok) < n:
            ok = np.zeros(n, bool)
            if self._ok is not None:
                ok[: len(self._ok)] = self._ok
            self._ok = ok
        return self._ok[rows]
