"""The ways of reading a column's rows, behind one :class:`Reader` protocol.

Every read path (a column's items, serving's batches, tf.data, the numpy iterator, verify)
asks a reader for ranges of rows, through the protocol only. One implementation per way of
reading, chosen in one place (:func:`choose_reader`):

* :class:`DirectReader` - uncompressed, unfiltered data, contiguous or chunked: byte offsets
  come from HDF5 once (``get_offset`` or the chunk table from ``chunk_iter``), then every read
  is an ``os.preadv`` straight into the result array. No HDF5 call, no HDF5 global lock, and
  the GIL is released during the copy, so threads read in parallel.
* :class:`ChunkReader` - compressed or filtered data (gzip, lzf, shuffle, fletcher32): each
  chunk's stored bytes decoded by :mod:`h5store.codecs`, never past the chunk's declared size.
  HDF5's own filters inflate without bound: a 1.8 MB file could make one read allocate a
  gigabyte. A file open for writing reads its chunks through HDF5.
* :class:`H5Reader` - anything else (a writer's unfiltered data, filters h5store does not
  decode): ``read_direct`` per coalesced run, with a chunk cache.
* :class:`MemoryReader` - an array already in memory (``in_memory=True`` serving).
* :class:`~h5store.remote_reader.RemoteReader` and
  :class:`~h5store.remote_reader.RemoteChunkReader` - a file in object storage
  (``s3://``): the two above with ranged GETs in place of ``os.preadv``.

Every reader passes :class:`h5store.testing.ReaderTests` (``tests/test_readers.py``); a new
one (a remote reader, say) subclasses :class:`ReaderBase`, is chosen in
:func:`choose_reader`, and passes the kit too.
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from h5store.chunk_reader import ChunkReader
from h5store.direct_reader import DirectReader
from h5store.errors import CorruptRecordError
from h5store.layout import ReadPlan, plan_reads
from h5store.objstore import is_remote
from h5store.reader_protocol import Reader, ReaderBase
from h5store.remote_reader import RemoteChunkReader, remote_reader

__all__ = [
    "ChunkReader",
    "DirectReader",
    "H5Reader",
    "MemoryReader",
    "Reader",
    "ReaderBase",
    "choose_reader",
    "copy_dataset",
    "read_whole",
]


class H5Reader(ReaderBase):
    """Reads through h5py, one ``read_direct`` per coalesced run."""

    stable = False  # HDF5 reads chunk addresses: under the commit lock, rebound after a commit
    releases_gil = False  # h5py holds the GIL and HDF5's global lock

    def __init__(self, ds: h5py.Dataset) -> None:
        self.ds = ds
        # Through HDF5 each call costs ~20 us: merge runs separated by < 64 KiB of rows.
        row_nbytes = int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize
        self.max_gap = max(0, (64 << 10) // max(row_nbytes, 1))

    def rebind(self, ds: h5py.Dataset) -> None:
        self.ds = ds

    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        ds = self.ds
        out = np.empty((plan.total, *ds.shape[1:]), dtype=ds.dtype)
        o = 0
        n = ds.shape[0]
        for a, b in plan.runs.tolist():
            if b > n:
                raise CorruptRecordError(f"{ds.file.filename}:{ds.name}: read of rows [{a}, {b}) past the end ({n})")
            try:
                ds.read_direct(out, np.s_[a:b], np.s_[o : o + b - a])
            except OSError as e:
                raise CorruptRecordError(f"{ds.file.filename}:{ds.name}: rows [{a}, {b}) unreadable ({e})") from None
            o += b - a
        return out


class MemoryReader(ReaderBase):
    """Reads from an array already in memory (shared with forked or spawned workers)."""

    stable = True
    releases_gil = False  # numpy copies hold the GIL (and are fast)
    resident = True
    survives_fork = True  # the array is shared: a forked child keeps it

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        if len(plan.runs) and int(plan.runs[-1, 1]) > len(self.array):
            raise CorruptRecordError(f"in-memory data: read of rows {plan.runs[-1].tolist()} past the end "
                                     f"({len(self.array)})")
        if len(plan.runs) == 1:
            a, b = plan.runs[0]
            return self.array[a:b]
        return np.concatenate([self.array[a:b] for a, b in plan.runs.tolist()]) if len(plan.runs) else self.array[:0]

    def read_scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        arr = self.array
        for j, a, n in zip(dest.tolist(), starts.tolist(), counts.tolist()):
            out[j, :n] = arr[a : a + n]

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.array[rows]


def read_whole(ds: h5py.Dataset, path: str, where: str | None = None, rows: int | None = None,
               via_hdf5: bool = False) -> np.ndarray:
    """All rows of ``ds`` (or its first ``rows``), filtered chunks decoded by :class:`ChunkReader`.

    For tables (index, checksum, frames) and whole-dataset copies: h5py's ``ds[...]`` on a
    compressed dataset inflates each chunk without bound. Unfiltered data, and filters the
    chunk reader does not decode, are read by h5py. ``via_hdf5`` for a file open for writing.

    Examples
    --------
    >>> index = read_whole(f["mel/index"], "speech.h5")  # doctest: +SKIP
    """
    n = int(ds.shape[0]) if ds.shape else 0
    n = n if rows is None else min(rows, n)
    chunked = RemoteChunkReader if is_remote(path) else ChunkReader
    reader = chunked.for_dataset(ds, path, where, cache_bytes=0, via_hdf5=via_hdf5)
    if reader is None:
        return ds[...] if rows is None else ds[:rows]
    try:
        return reader.read_runs(plan_reads(np.array([0], np.int64), np.array([n], np.int64)))
    finally:
        reader.close()


def choose_reader(ds: h5py.Dataset, path: str, where: str, writable: bool) -> Reader:
    """The reader of ``ds``: the one place a way of reading is chosen.

    A reader of a file open read-only reads unfiltered data directly
    (:class:`DirectReader`); compressed chunks are decoded by :class:`ChunkReader`, never
    past their declared size (HDF5's filters inflate without bound), a writer's through
    HDF5; anything else goes through h5py (:class:`H5Reader`). A remote file (``s3://``)
    is read by :func:`~h5store.remote_reader.remote_reader`'s readers.
    """
    try:
        reader: Reader | None = None
        if is_remote(path):
            reader = remote_reader(ds, path, where)
        elif not writable:
            reader = DirectReader.for_dataset(ds, path, where)
        if reader is None and not is_remote(path):
            reader = ChunkReader.for_dataset(ds, path, where, via_hdf5=writable)
    except (RuntimeError, OSError) as e:  # h5py's text for a damaged chunk B-tree
        if "memory allocation failed" in str(e):  # out of memory (an address-space limit), not damage
            raise MemoryError(f"{where}: HDF5 could not allocate memory to read the chunk table ({e})") from None
        raise CorruptRecordError(f"{where}: unreadable chunk table ({e})") from None
    return reader if reader is not None else H5Reader(ds)


def copy_dataset(ds: Any, out: np.ndarray, path: str | None = None, where: str | None = None) -> None:
    """Copy all of ``ds`` into ``out`` in blocks of ~64 MiB (compressed chunks decoded by
    :class:`ChunkReader`, never past their declared size)."""
    n = int(ds.shape[0]) if ds.shape else 0
    row = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
    step = max(1, (64 << 20) // row)
    kind = RemoteChunkReader if is_remote(path) else ChunkReader
    chunked = kind.for_dataset(ds, path, where, cache_bytes=0) if path else None
    for a in range(0, n, step):
        b = min(n, a + step)
        if chunked is not None:
            out[a:b] = chunked.read_runs(plan_reads(np.array([a]), np.array([b])))
        else:
            ds.read_direct(out, np.s_[a:b], np.s_[a:b])
    if chunked is not None:
        chunked.close()
