"""Rows of a file in object storage, read by the byte offsets HDF5 reported:
:class:`RemoteReader` (unfiltered rows) and :class:`RemoteChunkReader` (compressed chunks).

Both are :class:`DirectReader` and :class:`ChunkReader` with the network in place of
``os.preadv``: the offsets come from HDF5 once (the chunk table, read through the file's
metadata blocks), then a read's byte ranges go to :meth:`RemoteObject.read
<h5store.objstore.RemoteObject.read>` all at once: one coalesced set of concurrent ranged
GETs per feature and batch, never one request per item. Compressed chunks are fetched the
same way and decoded by the bounded decoders of :mod:`h5store.codecs` (never past a chunk's
declared size). A range that comes back short raises; nothing partial is returned.

Examples
--------
>>> r = remote_reader(f.h5["mel/data"], "s3://bucket/speech.h5")  # doctest: +SKIP
>>> r.read_runs(plan_reads(np.array([0]), np.array([10])))  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from typing import Any

import h5py
import numpy as np

from h5store.chunk_reader import ChunkReader
from h5store.direct_reader import DirectReader
from h5store.errors import CorruptRecordError
from h5store.layout import byte_offsets, piece_spans
from h5store.objstore import RemoteObject, remote_object
from h5store.reader_protocol import ReaderBase

__all__ = ["RemoteChunkReader", "RemoteReader", "remote_reader"]


class RemoteReader(ReaderBase):
    """Unfiltered rows of a remote file at the offsets HDF5 reported: one batch, one set of GETs.

    ``starts``, ``offsets`` and ``piece_rows`` are :class:`~h5store.direct_reader.DirectReader`'s
    extent table. A batch's ranges (a range crossing extents split at their ends) are
    fetched together by :meth:`RemoteObject.read <h5store.objstore.RemoteObject.read>`
    and copied into the caller's buffer.

    Examples
    --------
    >>> r = RemoteReader.for_dataset(f.h5["mel/data"], "s3://bucket/speech.h5")  # doctest: +SKIP
    """

    stable = True  # an object is immutable: its offsets never move
    releases_gil = True  # s3fs runs the requests on fsspec's event-loop thread; the caller waits with the GIL released
    survives_fork = True  # the client is made again per process (RemoteObject.store)

    def __init__(self, obj: RemoteObject, shape: tuple[int, ...], dtype: np.dtype, starts: np.ndarray,
                 offsets: np.ndarray, piece_rows: np.ndarray, where: str | None = None) -> None:
        self.obj = obj
        self.where = where or obj.url
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.row_nbytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.starts = np.asarray(starts, np.int64)
        self.offsets = np.asarray(offsets, np.int64)
        self.piece_rows = np.asarray(piece_rows, np.int64)

    @classmethod
    def for_dataset(cls, ds: h5py.Dataset, url: str, where: str | None = None) -> RemoteReader | None:
        """A remote reader when ``ds`` is plain numeric bytes in the file, else None."""
        d = DirectReader.for_dataset(ds, url, where)
        if d is None:
            return None
        return cls(remote_object(url), d.shape, d.dtype, d.starts, d.offsets, d.piece_rows, d.where)

    # Runs land one after the other in a fresh array through ``_scatter``, as DirectReader's do.
    read_runs = DirectReader.read_runs

    def read_scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """Rows ``[starts[j], +counts[j])`` into ``out[dest[j]]``: one set of ranged GETs for all."""
        if not out.flags.c_contiguous:
            ReaderBase.read_scatter(self, out, dest, starts, counts)
            return
        self._scatter(out, dest, np.asarray(starts, np.int64), np.asarray(counts, np.int64), per_row=False)

    def _scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 per_row: bool) -> None:
        rb = self.row_nbytes
        keep = counts > 0
        dest, starts, counts = np.asarray(dest, np.int64)[keep], starts[keep], counts[keep]
        if not rb or not len(dest):
            return
        stop = int((starts + counts).max())
        if stop > self.shape[0]:
            raise CorruptRecordError(f"{self.where}: read of rows up to {stop} past the end ({self.shape[0]} rows)")
        slot = rb if per_row or out.ndim == 1 else out.strides[0]
        byte, inside = byte_offsets(self.starts, self.offsets, self.piece_rows, rb, starts, counts)
        at_out = dest * slot
        if inside.all():
            file_a, out_a, nbytes = byte, at_out, counts * rb
        else:  # ranges crossing extents (chunks not end to end): one range per extent they touch
            fa: list[int] = []
            oa: list[int] = []
            nb: list[int] = []
            for o, s, c, b, ok in zip(at_out.tolist(), starts.tolist(), counts.tolist(), byte.tolist(),
                                      inside.tolist()):
                if ok:
                    fa.append(b), oa.append(o), nb.append(c * rb)
                    continue
                for p, first, end in piece_spans(s, s + c, self.piece_rows, self.starts):
                    fa.append(int(self.offsets[p]) + (first - int(self.starts[p])) * rb)
                    oa.append(o)
                    nb.append((end - first) * rb)
                    o += (end - first) * rb
            file_a, out_a, nbytes = np.array(fa, np.int64), np.array(oa, np.int64), np.array(nb, np.int64)
        got = self.obj.read(file_a, file_a + nbytes)
        flat = out.reshape(-1).view(np.uint8)
        for d, n, data in zip(out_a.tolist(), nbytes.tolist(), got):
            flat[d : d + n] = np.frombuffer(data, np.uint8)


class RemoteChunkReader(ChunkReader):
    """Compressed chunks of a remote file: a read's missing chunks fetched in one set of GETs,
    then decoded by :class:`~h5store.chunk_reader.ChunkReader`'s bounded decoders and threads.

    Examples
    --------
    >>> r = RemoteChunkReader.for_dataset(f.h5["mel/data"], "s3://bucket/speech.h5")  # doctest: +SKIP
    """

    stable = True  # an object is immutable: its chunks never move
    survives_fork = True  # the client is made again per process

    def __init__(self, ds: h5py.Dataset, url: str, where: str | None = None, cache_bytes: int = 16 << 20,
                 via_hdf5: bool = False) -> None:
        super().__init__(ds, url, where, cache_bytes, via_hdf5=False)
        self.obj = remote_object(url)
        self._pending: dict[tuple[int, int], Any] = {}  # fetched, not yet decoded
        self._plock = threading.Lock()

    def _file(self) -> int:
        return -1  # nothing local to open

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_plock"], state["_pending"] = None, {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plock = threading.Lock()

    def _after_fork(self) -> None:
        super()._after_fork()
        self._plock = threading.Lock()
        self._pending = {}

    def chunks_of(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
        """Chunks ``keys`` decoded; the stored bytes of those not cached fetched first, together."""
        with self._lock:
            todo = [k for k in dict.fromkeys(keys) if k not in self._cache]
        fetch: list[tuple[tuple[int, int], int, int]] = []
        for key in todo:
            slot = self._slot(key[0] * self.ncell + key[1])
            if slot >= 0:
                fetch.append((key, int(self.addr[slot]), int(self.size[slot])))
        if fetch:
            self._check_sizes(fetch)
            got = self.obj.read([a for _, a, _ in fetch], [a + n for _, a, n in fetch])
            with self._plock:
                for (key, _, _), data in zip(fetch, got):
                    self._pending[key] = data
        try:
            return super().chunks_of(keys)
        finally:
            if fetch:
                with self._plock:
                    for key, _, _ in fetch:
                        self._pending.pop(key, None)

    def _check_sizes(self, fetch: list[tuple[tuple[int, int], int, int]]) -> None:
        from h5store.codecs import stored_limit

        limit = stored_limit(self.chunk_bytes)
        for (c, _), _, n in fetch:
            if n > limit:
                raise self._refuse(c, f"stores {n} bytes, more than a valid chunk of {self.chunk_bytes} bytes can")

    def _raw(self, c: int, cell: int) -> tuple[bytes, int] | None:
        k = self._slot(c * self.ncell + cell)
        if k < 0:
            return None
        with self._plock:
            data = self._pending.pop((c, cell), None)
        at, n = int(self.addr[k]), int(self.size[k])
        if data is None:  # another thread's read took it first: fetched on its own
            self._check_sizes([((c, cell), at, n)])
            data = self.obj.read([at], [at + n])[0]
        return bytes(data), int(self.mask[k])


def remote_reader(ds: h5py.Dataset, url: str, where: str) -> ReaderBase | None:
    """The remote reader of ``ds``: :class:`RemoteReader` for unfiltered data,
    :class:`RemoteChunkReader` for compressed chunks; None for what h5py must read."""
    return RemoteReader.for_dataset(ds, url, where) or RemoteChunkReader.for_dataset(ds, url, where)
