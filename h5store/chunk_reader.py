"""Filtered chunks (gzip, lzf, zstd, blosc, shuffle, fletcher32) decoded by h5store itself: :class:`ChunkReader`.

A read's chunks are decoded by a small pool of threads (:func:`set_decode_threads`): every
decoder releases the GIL (``os.pread``, zlib, liblzf, zstd and libblosc2 through C calls)
and none takes HDF5's global lock, so a batch touching eight chunks decodes them on as
many cores as there are.
"""

from __future__ import annotations

import os
import threading
import weakref
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np

from h5store.codecs import DECODERS, _TooLarge, decode_chunk, stored_limit
from h5store.errors import CorruptRecordError
from h5store.layout import ReadPlan, piece_spans
from h5store.reader_protocol import PerProcessFile, ReaderBase

__all__ = ["ChunkReader", "decode_threads", "set_decode_threads"]

_THREADS: list[int | None] = [None]  # set_decode_threads's value (None: the default)
_POOL: dict[str, Any] = {"pool": None, "pid": -1, "size": 0}
_POOL_LOCK = threading.Lock()


def decode_threads() -> int:
    """Threads that decode a read's chunks: :func:`set_decode_threads`'s value, else the
    ``H5STORE_DECODE_THREADS`` environment variable, else ``min(4, os.cpu_count())``.

    Examples
    --------
    >>> decode_threads() >= 1
    True
    """
    if _THREADS[0] is not None:
        return _THREADS[0]
    env = os.environ.get("H5STORE_DECODE_THREADS", "")
    if env.strip():
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"H5STORE_DECODE_THREADS must be an int >= 1, got {env!r}") from None
    return max(1, min(4, os.cpu_count() or 1))


def set_decode_threads(n: int | None) -> None:
    """Decode compressed chunks with ``n`` threads per process: the reading thread and
    ``n - 1`` in a pool (1: in the reading thread alone; None: the default, see
    :func:`decode_threads`).

    Each DataLoader worker has its own pool: with many workers, fewer threads each.

    Examples
    --------
    >>> set_decode_threads(2); decode_threads()
    2
    >>> set_decode_threads(None)
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"decode threads must be an int >= 1 or None, got {n!r}")
    _THREADS[0] = n


def _decode_pool(size: int) -> ThreadPoolExecutor:
    """This process's decoding pool (a forked child makes its own: the parent's threads are
    not in it)."""
    with _POOL_LOCK:
        pool = _POOL["pool"]
        if pool is None or _POOL["pid"] != os.getpid() or _POOL["size"] != size:
            if pool is not None and _POOL["pid"] == os.getpid():
                pool.shutdown(wait=False)
            pool = ThreadPoolExecutor(size, thread_name_prefix="h5store-decode")
            _POOL.update(pool=pool, pid=os.getpid(), size=size)
        return pool



_live: weakref.WeakSet[Any] = weakref.WeakSet()  # every ChunkReader of this process


def _locks_anew_in_child() -> None:
    for r in list(_live):
        r._after_fork()


os.register_at_fork(after_in_child=_locks_anew_in_child)

class ChunkReader(PerProcessFile, ReaderBase):
    """Reads filtered chunked data (gzip, lzf, zstd, blosc, shuffle, fletcher32) itself, never past a chunk's size.

    HDF5's deflate filter (and h5py's lzf filter) grow their output until the stream
    ends, so a chunk declaring 64 KiB can inflate to gigabytes before HDF5 looks at its
    size: a 1.8 MB file made a read take a minute and a gigabyte. This reader asks HDF5
    once for the address of every chunk (``chunk_iter``), reads a chunk's stored bytes
    with ``os.pread`` (bounded by the size a valid chunk can store), and undoes the
    filters with :mod:`zlib`, liblzf (the copy h5py bundles; a pure-Python decoder where
    it cannot be found) and numpy, each stopped at the chunk's declared size: a chunk that would decode to more, to less, or does not decode at all
    raises :class:`~h5store.errors.CorruptRecordError` naming the file, the dataset and the
    chunk. Unallocated chunks read as the fill value, as through HDF5.

    ``pread`` and every decoder release the GIL and take no HDF5 lock: the chunks one read
    needs are decoded by a pool of threads at once (:func:`set_decode_threads`), and
    reader threads (tf.data, the numpy iterator) decode in parallel too. The chunks last
    read are kept (``cache_bytes``, like HDF5's chunk cache of an h5store file), shared by
    the threads, so items that share a chunk decode it once. A writer's reader (``via_hdf5``) asks HDF5 for
    each chunk instead (``read_direct_chunk``): its chunks move as it writes, and HDF5
    holds what it has not yet written to the file.

    Examples
    --------
    >>> r = ChunkReader.for_dataset(f.h5["mel/data"], f.path)  # doctest: +SKIP
    >>> r.read_runs(plan_reads(np.array([0]), np.array([10])))  # doctest: +SKIP
    """

    stable = False  # a compressed chunk rewritten by a commit moves: rebound after commits
    releases_gil = True  # pread, zlib, zstd, liblzf and libblosc2 (through ctypes) release it
    survives_fork = False  # its descriptor is per process: reopened in a forked child

    def __init__(self, ds: h5py.Dataset, path: str, where: str | None = None, cache_bytes: int = 16 << 20,
                 via_hdf5: bool = False) -> None:
        self.path = path
        self.where = where or f"{path}:{ds.name}"
        self.shape = tuple(int(d) for d in ds.shape)
        self.dtype = ds.dtype
        self.chunks = tuple(int(c) for c in ds.chunks)
        self.chunk_rows = self.chunks[0]
        self.chunk_bytes = int(np.prod(self.chunks, dtype=np.int64)) * self.dtype.itemsize
        plist = ds.id.get_create_plist()
        self.filters = tuple(int(plist.get_filter(i)[0]) for i in range(plist.get_nfilters()))
        fill = ds.fillvalue
        self.fill = np.zeros((), self.dtype) if fill is None else np.asarray(fill, self.dtype)
        # The grid of chunks across a row (one cell when chunks hold whole rows, as h5store writes).
        self.grid = tuple(-(-s // c) for s, c in zip(self.shape[1:], self.chunks[1:]))
        self.ncell = int(np.prod(self.grid, dtype=np.int64))
        self.cache_chunks = max(1, cache_bytes // max(self.chunk_bytes, 1))
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        _live.add(self)
        self._fd: int | None = None
        self._pid = -1
        self.ds = ds if via_hdf5 else None
        if via_hdf5:
            self.cache_chunks = 0  # its chunks change as it writes
        else:
            self._load_table(ds)

    @classmethod
    def for_dataset(cls, ds: h5py.Dataset, path: str, where: str | None = None, cache_bytes: int = 16 << 20,
                    via_hdf5: bool = False) -> ChunkReader | None:
        """A reader for ``ds`` when it is chunked plain numbers whose filters it decodes, else None.

        None for unfiltered data (:class:`DirectReader`'s) and for filters other than
        gzip, lzf, shuffle and fletcher32, which h5store never writes: those are left to
        HDF5 (:class:`H5Reader`), and ``untrusted=True`` refuses them.
        """
        if ds.chunks is None or not ds.shape or ds.dtype.kind not in "biufc" or ds.dtype.hasobject:
            return None
        if ds.dtype.shape != () or ds.is_virtual or ds.external:
            return None
        plist = ds.id.get_create_plist()
        filters = [int(plist.get_filter(i)[0]) for i in range(plist.get_nfilters())]
        if not filters or any(f not in DECODERS for f in filters):
            return None
        return cls(ds, path, where, cache_bytes, via_hdf5)

    def _load_table(self, ds: h5py.Dataset) -> None:
        """The stored chunks, by key ``row chunk * ncell + cell``: only those HDF5 lists, so
        the table's size follows the file's, not the shape it declares."""
        nrc = -(-self.shape[0] // self.chunk_rows)
        infos: list[Any] = []
        if nrc and self.ncell:
            ds.id.chunk_iter(infos.append)
        found: list[tuple[int, int, int, int]] = []
        for info in infos:
            off = info.chunk_offset
            if len(off) != len(self.chunks) or any(o % c for o, c in zip(off, self.chunks)):
                raise CorruptRecordError(f"{self.where}: a chunk at {tuple(off)} is not on the chunk grid "
                                         f"{self.chunks}; the file is damaged")
            c = off[0] // self.chunk_rows
            if c < nrc and info.byte_offset is not None:  # (past the rows the dataset holds now: unused)
                cell = int(np.ravel_multi_index([o // ch for o, ch in zip(off[1:], self.chunks[1:])], self.grid))
                found.append((c * self.ncell + cell, info.byte_offset, info.size, info.filter_mask))
        found.sort()
        table = np.array(found, np.int64).reshape(-1, 4)
        self.keys, self.addr, self.size, self.mask = (np.ascontiguousarray(table[:, k]) for k in range(4))
        # h5store's own files store every chunk: then a chunk's key is its place in the table.
        self.dense = len(found) == nrc * self.ncell and bool(np.all(self.keys == np.arange(len(found))))

    def _slot(self, key: int) -> int:
        """Where chunk ``key`` is in the table, or -1 when it is not stored (fill value)."""
        if self.dense:
            return key
        i = int(self.keys.searchsorted(key))
        return i if i < len(self.keys) and int(self.keys[i]) == key else -1

    def _cell_offset(self, cell: int) -> tuple[int, ...]:
        return tuple(int(i) * ch for i, ch in zip(np.unravel_index(cell, self.grid), self.chunks[1:]))

    def rebind(self, ds: h5py.Dataset) -> None:
        """A writer committed: take the chunks' new addresses (a rewritten chunk moved).

        Called under the commit lock. The decoded chunks are dropped: a chunk that was the
        partial last one when it was decoded holds more rows now.
        """
        if self.ds is not None:
            self.ds = ds
            return
        if tuple(int(d) for d in ds.shape[1:]) != self.shape[1:] or tuple(ds.chunks or ()) != self.chunks:
            raise CorruptRecordError(f"{self.where}: the dataset changed layout while open")
        self.shape = tuple(int(d) for d in ds.shape)
        self._load_table(ds)
        with self._lock:
            self._cache.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = PerProcessFile.__getstate__(self)
        state["_lock"], state["_cache"] = None, OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _live.add(self)

    def _after_fork(self) -> None:
        """In a forked child: locks anew (a parent thread may have held one at the fork, and
        it does not exist here to release it); the cache, maybe mid-update then, emptied."""
        self._lock = threading.Lock()
        self._cache = OrderedDict()

    def _raw(self, c: int, cell: int) -> tuple[bytes, int] | None:
        """The stored bytes of chunk ``(c, cell)`` and its filter mask; None when unallocated."""
        limit = stored_limit(self.chunk_bytes)
        if self.ds is not None:
            offset = (c * self.chunk_rows, *self._cell_offset(cell))
            info = self.ds.id.get_chunk_info_by_coord(offset)
            if info.byte_offset is None:
                return None
            if info.size > limit:
                raise self._refuse(c, f"stores {info.size} bytes, more than a valid chunk of {self.chunk_bytes} "
                                   f"bytes can")
            mask, raw = self.ds.id.read_direct_chunk(offset)
            return bytes(raw), int(mask)
        k = self._slot(c * self.ncell + cell)
        if k < 0:
            return None
        at, n = int(self.addr[k]), int(self.size[k])
        if n > limit:
            raise self._refuse(c, f"stores {n} bytes, more than a valid chunk of {self.chunk_bytes} bytes can")
        raw = os.pread(self._file(), n, at)
        if len(raw) != n:
            raise self._refuse(c, f"short read ({len(raw)} of {n} bytes at byte {at}): the file is truncated")
        return raw, int(self.mask[k])

    def _refuse(self, c: int, why: str) -> CorruptRecordError:
        a = c * self.chunk_rows
        return CorruptRecordError(f"{self.where}: chunk {c} (rows [{a}, {min(a + self.chunk_rows, self.shape[0])})) "
                                  f"{why}; refused, nothing of it is returned (run `h5store verify --deep` on the "
                                  "file, and recreate or restore it)")

    def _decode(self, key: tuple[int, int]) -> np.ndarray:
        """Chunk ``key = (c, cell)`` read and decoded (no cache): an array of the chunk shape."""
        c, cell = key
        got = self._raw(c, cell)
        if got is None:
            return np.broadcast_to(self.fill, self.chunks)
        limit = self.chunk_bytes
        try:
            data = decode_chunk(got[0], got[1], self.filters, self.dtype.itemsize, limit)
        except _TooLarge:
            raise self._refuse(c, f"decodes to more than its {limit} bytes (a decompression bomb, or damage)") from None
        except (zlib.error, ValueError) as e:
            raise self._refuse(c, f"does not decode ({e})") from None
        nbytes = len(data) if isinstance(data, bytes) else int(data.nbytes)
        if nbytes != limit:
            raise self._refuse(c, f"decodes to {nbytes} bytes, not its {limit} bytes")
        return np.frombuffer(data, self.dtype).reshape(self.chunks)

    def _remember(self, key: tuple[int, int], values: np.ndarray) -> None:
        if self.cache_chunks:
            with self._lock:
                self._cache[key] = values
                while len(self._cache) > self.cache_chunks:
                    self._cache.popitem(last=False)

    def chunk(self, c: int, cell: int = 0) -> np.ndarray:
        """Chunk ``c`` (of cell ``cell`` across a row) decoded: an array of the chunk shape."""
        return self.chunks_of([(c, cell)])[(c, cell)]

    def chunks_of(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
        """Chunks ``keys`` decoded, those not cached by the decoding threads at once."""
        found: dict[tuple[int, int], np.ndarray] = {}
        missing: list[tuple[int, int]] = []
        if self.cache_chunks:
            with self._lock:
                for key in keys:
                    hit = self._cache.get(key)
                    if hit is not None:
                        self._cache.move_to_end(key)
                        found[key] = hit
                    elif key not in found:
                        missing.append(key)
        else:
            missing = list(dict.fromkeys(keys))
        if not missing:
            return found
        threads = decode_threads() if self.ds is None else 1  # a writer's chunks come through HDF5
        if len(missing) > 1 and threads > 1:
            # One share of the chunks per thread, the calling thread decoding the first: one
            # hand-over per thread and batch, not one per chunk (each costs ~10-20 us of Python).
            self._file()  # one descriptor, opened before the threads share it
            parts = min(threads, len(missing))
            shares = [missing[i::parts] for i in range(parts)]
            pool = _decode_pool(threads - 1)
            futures = [pool.submit(self._decode_each, share) for share in shares[1:]]
            decoded = [self._decode_each(shares[0]), *(fut.result() for fut in futures)]
        else:
            shares, decoded = [missing], [self._decode_each(missing)]
        for share, values in zip(shares, decoded):
            for key, chunk in zip(share, values):
                found[key] = chunk
                self._remember(key, chunk)
        return found

    def _decode_each(self, keys: list[tuple[int, int]]) -> list[np.ndarray]:
        return [self._decode(key) for key in keys]

    def read_scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """Rows ``[starts[j], +counts[j])`` into ``out[dest[j], :counts[j]]``, copied straight
        from the decoded chunks (no intermediate array of the batch)."""
        if not (self.ncell == 1 and self.chunks[1:] == self.shape[1:]):
            ReaderBase.read_scatter(self, out, dest, starts, counts)
            return
        rows, n = self.chunk_rows, self.shape[0]
        pieces: list[tuple[int, int, int, int, int]] = []  # (out item, its row, chunk, first, end row in the chunk)
        for j, a0, k in zip(dest.tolist(), starts.tolist(), counts.tolist()):
            if a0 + k > n:
                raise CorruptRecordError(f"{self.where}: read of rows [{a0}, {a0 + k}) past the end ({n})")
            o = 0
            for c, a, end in piece_spans(a0, a0 + k, rows):
                base = c * rows
                pieces.append((j, o, c, a - base, end - base))
                o += end - a
        got = self.chunks_of([(c, 0) for c in dict.fromkeys(p[2] for p in pieces)])
        for j, o, c, a, end in pieces:
            out[j, o : o + end - a] = got[(c, 0)][a:end]

    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        out = np.empty((plan.total, *self.shape[1:]), dtype=self.dtype)
        rows = self.chunk_rows
        whole = self.ncell == 1 and self.chunks[1:] == self.shape[1:]
        pieces: list[tuple[int, int, int, int]] = []  # (out row, chunk, first row, end row in the chunk)
        o = 0
        for a0, b0 in plan.runs.tolist():
            if b0 > self.shape[0]:
                raise CorruptRecordError(f"{self.where}: read of rows [{a0}, {b0}) past the end ({self.shape[0]})")
            for c, a, end in piece_spans(a0, b0, rows):
                base = c * rows
                pieces.append((o, c, a - base, end - base))
                o += end - a
        cells = range(self.ncell)
        got = self.chunks_of([(c, k) for c in dict.fromkeys(p[1] for p in pieces) for k in cells])
        for o, c, a, end in pieces:
            if whole:
                out[o : o + end - a] = got[(c, 0)][a:end]
                continue
            for k in cells:
                box = tuple(slice(i, min(i + ch, s))
                            for i, ch, s in zip(self._cell_offset(k), self.chunks[1:], self.shape[1:]))
                part = tuple(slice(0, s.stop - s.start) for s in box)
                out[(slice(o, o + end - a), *box)] = got[(c, k)][(slice(a, end), *part)]
        return out
