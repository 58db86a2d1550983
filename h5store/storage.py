"""Ragged concatenated columns on HDF5: the format, the writer, and the fast read paths.

A *column* is one feature of one group (see ``docs/format.md``)::

    <group>/<name>/data      every item concatenated along axis 0
    <group>/<name>/index     (N, 2) int64 [start, stop) rows of `data` (or of `frames`) per id;
                             an absent item is [-1, -1]
    <group>/<name>/checksum  (N,) uint32 CRC-32 of each item's bytes (0 when absent)
    <group>/<name>/frames    (F, 2) int64 [start, stop) bytes of `data` per blob ("blobs" layout)

Storage knows nothing of Feature classes (as SQLAlchemy's Table knows nothing of mappers):
it moves typed rows described by a :class:`ColumnSpec`.

Reads are planned per batch (:func:`h5store.layout.plan_reads`) and go through one of
four readers, chosen once per process:

* :class:`DirectReader` - uncompressed, unfiltered data, contiguous or chunked: byte offsets
  come from HDF5 once (``get_offset`` or the chunk table from ``chunk_iter``), then every read
  is an ``os.preadv`` straight into the result array. No HDF5 call, no HDF5 global lock, and
  the GIL is released during the copy, so threads read in parallel.
* :class:`ChunkReader` - compressed or filtered data (gzip, lzf, shuffle, fletcher32): each
  chunk's stored bytes decoded by h5store (``zlib``, liblzf, numpy), never past the chunk's
  declared size. HDF5's own filters inflate without bound: a 1.8 MB file could make one read
  allocate a gigabyte. A file open for writing reads its chunks through HDF5.
* :class:`H5Reader` - anything else (a writer's unfiltered data, filters h5store does not
  decode): ``read_direct`` per coalesced run, with a chunk cache.
* :class:`MemoryReader` - an array already in memory (``in_memory=True`` serving).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import h5py
import numpy as np

from h5store.checksum import crc32
from h5store.errors import CorruptRecordError, FormatError, ReadOnlyError, SchemaError
from h5store.handle import FileHandle
from h5store.layout import ReadPlan, gather, grow_capacity, plan_reads
from h5store.refs import Refs

__all__ = [
    "FORMAT_VERSION",
    "ChunkReader",
    "Column",
    "ColumnSpec",
    "DirectReader",
    "GroupStore",
    "H5Reader",
    "MemoryReader",
    "Tables",
    "check_root",
    "init_root",
]

FORMAT_VERSION = 1
ATTR_FORMAT = "h5store_format"
ATTR_SCHEMA = "h5store_schema"
ATTR_VERSION = "h5store_version"
ATTR_SCHEMA_CRC = "h5store_schema_crc32"
ABSENT = -1
LAYOUTS = ("fixed", "ragged", "blobs")
COMPRESSIONS = (None, "gzip", "lzf")
_CHUNK_BYTES = 1 << 19  # ~512 KiB chunks: large sequential reads, modest waste in small files
_SPILL_BYTES = 32 << 20  # pending rows are written in blocks of this size
# Whole chunks at least this large are written with H5Dwrite_chunk, straight from the staging
# buffer: no copy into HDF5's chunk cache and no selection machinery (half the CPU per byte of
# a hyperslab write). Smaller chunks go through one hyperslab write per spill, which beats a
# Python call per chunk.
_DIRECT_CHUNK_BYTES = 64 << 10
_INDEX_CHUNK = 1 << 13


@dataclass(frozen=True)
class ColumnSpec:
    """How one column is stored.

    ``shape`` is the per-item shape: ``(None, 80)`` is ragged along its first axis, ``(3,)``
    fixed, ``()`` a scalar per item. The "blobs" layout stores each item as a sequence of
    variable-length byte strings (e.g. a video's JPEG frames); its ``dtype`` is uint8 and
    ``shape`` ``(None,)``.
    """

    dtype: str
    shape: tuple[int | None, ...]
    layout: str
    compression: str | None = None
    compression_opts: int | None = None
    shuffle: bool = False
    fletcher32: bool = False
    chunk_rows: int | None = None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise SchemaError("; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        try:
            dt = np.dtype(self.dtype)
            if dt.hasobject or dt.kind in "OUSV":
                out.append(f"dtype must be numeric or bool, got {self.dtype!r}")
        except TypeError:
            out.append(f"unknown dtype {self.dtype!r}")
        if self.layout not in LAYOUTS:
            out.append(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if any(d is not None and (not isinstance(d, int) or d < 0) for d in self.shape):
            out.append(f"shape dims must be ints >= 0 or None, got {self.shape!r}")
        if any(d is None for d in self.shape[1:]):
            out.append(f"only the first axis may be variable (None), got {self.shape!r}")
        if self.layout == "fixed" and None in self.shape:
            out.append(f"a fixed layout needs a fixed shape, got {self.shape!r}")
        if self.layout == "blobs" and (self.dtype != "uint8" or tuple(self.shape) != (None,)):
            out.append(f"a blobs layout stores bytes: dtype 'uint8', shape (None,), got {self.dtype!r} {self.shape!r}")
        if self.layout == "ragged" and (not self.shape or self.shape[0] is not None):
            out.append(f"a ragged layout needs shape (None, ...), got {self.shape!r}")
        if self.compression not in COMPRESSIONS:
            out.append(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if self.chunk_rows is not None and self.chunk_rows <= 0:
            out.append(f"chunk_rows must be > 0, got {self.chunk_rows}")
        return out

    @property
    def inner(self) -> tuple[int, ...]:
        """Shape of one row of ``data``."""
        if self.layout == "fixed":
            return tuple(int(d) for d in self.shape)  # type: ignore[arg-type]
        if self.layout == "blobs":
            return ()
        return tuple(int(d) for d in self.shape[1:])  # type: ignore[arg-type]

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.inner, dtype=np.int64)) * self.np_dtype.itemsize

    @property
    def filtered(self) -> bool:
        return bool(self.compression or self.shuffle or self.fletcher32)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ColumnSpec:
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        return cls(**d)


# --------------------------------------------------------------------------- root
def init_root(f: h5py.File, schema: dict[str, Any], version: str) -> None:
    """Stamp an empty file as an h5store file of this format version."""
    f.attrs[ATTR_FORMAT] = FORMAT_VERSION
    f.attrs[ATTR_VERSION] = version
    text = json.dumps(schema, sort_keys=True)
    f.attrs[ATTR_SCHEMA] = text
    # Variable-length strings live in HDF5's global heap, which has no checksum of its own.
    f.attrs[ATTR_SCHEMA_CRC] = np.uint32(crc32(text.encode("utf-8")))


def check_root(f: h5py.File, path: str) -> dict[str, Any]:
    """The schema dict of an h5store file; ``FormatError`` for anything else."""
    try:
        fmt = f.attrs.get(ATTR_FORMAT)
        raw = f.attrs.get(ATTR_SCHEMA)
    except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as anything
        raise FormatError(f"{path}: unreadable root attributes ({e})") from None
    if fmt is None or raw is None:
        raise FormatError(f"{path}: not an h5store file (no {ATTR_FORMAT!r} attribute)")
    try:
        fmt = int(fmt)
    except (TypeError, ValueError):
        raise FormatError(f"{path}: malformed {ATTR_FORMAT!r} attribute {fmt!r}") from None
    if fmt > FORMAT_VERSION:
        raise FormatError(
            f"{path}: h5store format {fmt} is newer than this library reads ({FORMAT_VERSION});"
            " upgrade h5store"
        )
    if fmt < 1:
        raise FormatError(f"{path}: invalid h5store format version {fmt}")
    text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8", "surrogateescape")
    try:
        schema = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: malformed schema attribute ({e})") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("groups"), dict):
        raise FormatError(f"{path}: malformed schema attribute (no 'groups')")
    crc = f.attrs.get(ATTR_SCHEMA_CRC)
    if crc is not None and crc32(text.encode("utf-8", "surrogateescape")) != int(crc):
        raise FormatError(f"{path}: the schema attribute fails its CRC-32 (damaged file)")
    return schema


# --------------------------------------------------------------------------- readers
def _pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


class DirectReader:
    """Reads unfiltered rows with ``os.preadv`` at byte offsets HDF5 reported once.

    ``pieces`` maps row ranges to file offsets: ``starts`` (the first row of each piece,
    increasing) and ``offsets`` (its byte offset); a piece holds ``piece_rows`` rows
    (contiguous data is a single piece). The offsets stay right while a writer appends:
    an unfiltered chunk never moves, and committed rows are never rewritten with other
    bytes, so these reads need neither HDF5 nor the commit lock (``stable``).
    """

    stable = True

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype, starts: np.ndarray,
                 offsets: np.ndarray, piece_rows: int) -> None:
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.row_nbytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self.starts = starts
        self.offsets = offsets
        self.piece_rows = piece_rows
        self._fd: int | None = None
        self._pid = -1

    @classmethod
    def for_dataset(cls, ds: h5py.Dataset, path: str) -> DirectReader | None:
        """A direct reader when ``ds`` is plain numeric bytes in this file, else None."""
        if ds.dtype.kind not in "biufc" or ds.dtype.hasobject:
            return None
        if ds.compression or ds.shuffle or ds.fletcher32 or ds.scaleoffset:
            return None
        if ds.external or ds.is_virtual:
            return None
        n = ds.shape[0] if ds.shape else 0
        if ds.chunks is None:
            off = ds.id.get_offset()
            if off is None:
                return None if n else cls(path, ds.shape, ds.dtype, np.zeros(1, np.int64), np.zeros(1, np.int64), 1)
            return cls(path, ds.shape, ds.dtype, np.zeros(1, np.int64), np.array([off], np.int64), max(n, 1))
        if tuple(ds.chunks[1:]) != tuple(ds.shape[1:]):
            return None  # chunks split rows: not worth a direct path
        rows = int(ds.chunks[0])
        found: list[tuple[int, int]] = []
        if n:
            ds.id.chunk_iter(lambda info: found.append((info.chunk_offset[0], info.byte_offset)))
        found.sort()
        starts = np.array([c for c, _ in found], dtype=np.int64)
        offsets = np.array([o for _, o in found], dtype=np.int64)
        if len(found) != -(-n // rows):
            return None  # unallocated chunks (fill values) are left to HDF5
        expected = np.arange(0, n, rows, dtype=np.int64)
        if np.any(starts != expected):
            return None  # unallocated chunks (fill values) are left to HDF5
        row_nbytes = int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize
        if starts.size > 1 and np.all(np.diff(offsets) == rows * row_nbytes):
            # Chunks laid end to end (as a single writer allocates them): one piece.
            return cls(path, ds.shape, ds.dtype, starts[:1], offsets[:1], max(n, 1))
        return cls(path, ds.shape, ds.dtype, starts, offsets, rows)

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
            # Closed with the reader (or when it is garbage): never one descriptor per open leaked.
            self._closer = weakref.finalize(self, _close_fd, self._fd, self._pid)
        return self._fd

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fd"], state["_pid"] = None, -1
        state.pop("_closer", None)
        return state

    def close(self) -> None:
        closer = self.__dict__.get("_closer")
        if closer is not None and self._pid == os.getpid():
            closer()
        self._fd = None

    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        out = np.empty((plan.total, *self.shape[1:]), dtype=self.dtype)
        fd = self._file()
        rb = self.row_nbytes
        o = 0
        for a, b in plan.runs.tolist():
            if b > self.shape[0]:
                raise CorruptRecordError(f"{self.path}: read of rows [{a}, {b}) past the end ({self.shape[0]})")
            while a < b:
                p = int(self.starts.searchsorted(a, side="right")) - 1
                base = int(self.starts[p])
                end = min(b, base + self.piece_rows)
                want = (end - a) * rb
                got = _pread_into(fd, out[o : o + end - a], int(self.offsets[p]) + (a - base) * rb)
                if got != want:
                    raise CorruptRecordError(
                        f"{self.path}: short read ({got} of {want} bytes): the file is truncated"
                    )
                o += end - a
                a = end
        return out


def _close_fd(fd: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child's copy of the reader must not close anything
        try:
            os.close(fd)
        except OSError:
            pass


class H5Reader:
    """Reads through h5py, one ``read_direct`` per coalesced run."""

    stable = False  # HDF5 reads chunk addresses: under the commit lock, rebound after a commit

    def __init__(self, ds: h5py.Dataset) -> None:
        self.ds = ds

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


class MemoryReader:
    """Reads from an array already in memory (shared with forked or spawned workers)."""

    stable = True

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        if len(plan.runs) == 1:
            a, b = plan.runs[0]
            return self.array[a:b]
        return np.concatenate([self.array[a:b] for a, b in plan.runs.tolist()]) if len(plan.runs) else self.array[:0]


# --------------------------------------------------------------------------- bounded chunk decoding
#: HDF5 filter ids the chunk reader decodes itself (h5py's numbering).
_DEFLATE, _SHUFFLE, _FLETCHER32, _LZF = 1, 2, 3, 32000


class _TooLarge(Exception):
    """A chunk's stream would decode to more bytes than the chunk declares."""


def _stored_limit(chunk_bytes: int) -> int:
    """Most bytes a valid filtered chunk of ``chunk_bytes`` stores.

    zlib's worst case is ``compressBound`` (n + n/4096 + n/16384 + n/2^25 + 13); h5py's lzf
    filter stores at most ``n`` bytes (it leaves a chunk uncompressed otherwise);
    fletcher32 adds 4. A margin above those covers every pipeline h5store writes.
    """
    return chunk_bytes + chunk_bytes // 16 + 1024


def _inflate(data: bytes, limit: int) -> bytes:
    """A zlib stream decoded into at most ``limit`` bytes; :class:`_TooLarge` past that."""
    z = zlib.decompressobj()
    out = z.decompress(data, limit + 1)  # one byte more than allowed says "too large"
    if len(out) > limit:
        raise _TooLarge
    if not z.eof:  # all input used, and no end of stream
        raise zlib.error("incomplete or truncated stream")
    return out


_LIBLZF: list[Any] = []  # [liblzf's lzf_decompress, or None], found on first use


def _liblzf() -> Any:
    """``lzf_decompress`` of the liblzf that h5py bundles (in ``h5py.h5z``), or None."""
    if not _LIBLZF:
        fn = None
        try:
            import ctypes

            from h5py import h5z

            fn = ctypes.CDLL(h5z.__file__, use_errno=True).lzf_decompress
            fn.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
            fn.restype = ctypes.c_uint
        except (OSError, AttributeError, ImportError):
            fn = None
        _LIBLZF.append(fn)
    return _LIBLZF[0]


def _lzf(data: bytes, limit: int) -> bytes | np.ndarray:
    """An LZF chunk decoded into at most ``limit`` bytes: liblzf's ``lzf_decompress`` (given
    an output buffer of ``limit`` bytes, it stops there), else :func:`_lzf_decode`."""
    fn = _liblzf()
    if fn is None or not data or limit >= 1 << 32:
        return _lzf_decode(data, limit)
    import ctypes

    out = np.empty(limit, np.uint8)
    n = fn(data, len(data), out.ctypes.data, limit)  # ctypes releases the GIL
    if n == 0:
        if ctypes.get_errno() == errno.E2BIG:
            raise _TooLarge
        raise zlib.error("invalid lzf stream")
    return out[:n]


def _lzf_decode(data: bytes, limit: int) -> bytes:
    """LZF (liblzf's format, h5py's filter 32000) decoded into at most ``limit`` bytes.

    h5py's own filter grows its output buffer until the stream ends; this decoder stops
    at ``limit`` (:class:`_TooLarge`) and refuses references before the start. Pure
    Python (~40x slower than liblzf): used where h5py's liblzf cannot be found.
    """
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        ctrl = data[i]
        i += 1
        if ctrl < 32:  # a literal run of ctrl + 1 bytes
            ln = ctrl + 1
            if i + ln > n:
                raise zlib.error("lzf literal run past the end of the stream")
            if len(out) + ln > limit:
                raise _TooLarge
            out += data[i : i + ln]
            i += ln
            continue
        ln = ctrl >> 5  # a back reference: length - 2, then the distance - 1
        if ln == 7:
            if i >= n:
                raise zlib.error("lzf stream ends inside a back reference")
            ln += data[i]
            i += 1
        if i >= n:
            raise zlib.error("lzf stream ends inside a back reference")
        off = ((ctrl & 0x1F) << 8) + data[i] + 1
        i += 1
        ln += 2
        if off > len(out):
            raise zlib.error("lzf back reference before the start of the chunk")
        if len(out) + ln > limit:
            raise _TooLarge
        start = len(out) - off
        if off >= ln:
            out += out[start : start + ln]
        else:  # overlapping: the last `off` bytes repeat
            out += (out[start:] * (ln // off + 1))[:ln]
    return bytes(out)


def _fletcher32(data: bytes) -> int:
    """HDF5's ``H5_checksum_fletcher32`` (big-endian 16-bit words, sums folded mod 65535)."""
    if len(data) % 2:
        data = data + b"\0"
    words = np.frombuffer(data, ">u2").astype(np.int64)
    if not words.any():
        return 0
    n = len(words)
    s1 = int(words.sum()) % 65535
    weights = (np.arange(n, 0, -1, dtype=np.int64) % 65535)
    s2 = int(((words * weights) % 65535).sum()) % 65535
    # HDF5 folds a non-zero sum to 1..65535, never 0.
    return ((s2 or 65535) << 16) | (s1 or 65535)


def _check_fletcher32(data: bytes) -> bytes:
    if len(data) < 4:
        raise zlib.error("fletcher32: chunk shorter than its checksum")
    body, stored = data[:-4], int.from_bytes(data[-4:], "little")
    got = _fletcher32(body)
    # HDF5 also accepts the byte order written by releases before 1.6.3.
    swapped = ((got & 0x00FF00FF) << 8) | ((got >> 8) & 0x00FF00FF)
    if stored not in (got, swapped):
        raise zlib.error(f"fletcher32 checksum mismatch (stored {stored:#010x}, computed {got:#010x})")
    return body


def _unshuffle(data: bytes | np.ndarray, itemsize: int) -> np.ndarray:
    """Undo HDF5's byte shuffle: byte 0 of every element, then byte 1, ..."""
    raw = np.frombuffer(data, np.uint8)
    whole = len(raw) // itemsize * itemsize
    planes = raw[:whole].reshape(itemsize, -1)
    out = np.empty(len(raw), np.uint8)
    grid = out[:whole].reshape(-1, itemsize)
    for j in range(itemsize):  # one strided copy per byte plane: ~5x faster than planes.T.copy()
        grid[:, j] = planes[j]
    out[whole:] = raw[whole:]  # a tail shorter than one element is stored as is
    return out


class ChunkReader:
    """Reads filtered chunked data (gzip, lzf, shuffle, fletcher32) itself, never past a chunk's size.

    HDF5's deflate filter (and h5py's lzf filter) grow their output until the stream
    ends, so a chunk declaring 64 KiB can inflate to gigabytes before HDF5 looks at its
    size: a 1.8 MB file made a read take a minute and a gigabyte. This reader asks HDF5
    once for the address of every chunk (``chunk_iter``), reads a chunk's stored bytes
    with ``os.pread`` (bounded by the size a valid chunk can store), and undoes the
    filters with :mod:`zlib`, liblzf (the copy h5py bundles; a pure-Python decoder where
    it cannot be found) and numpy, each stopped at the chunk's declared size: a chunk that would decode to more, to less, or does not decode at all
    raises :class:`~h5store.errors.CorruptRecordError` naming the file, the dataset and the
    chunk. Unallocated chunks read as the fill value, as through HDF5.

    ``pread`` and ``zlib`` release the GIL and take no HDF5 lock, so threads decode in
    parallel. The chunks last read are kept (``cache_bytes``, like HDF5's chunk cache of
    an h5store file), shared by the threads. A writer's reader (``via_hdf5``) asks HDF5 for
    each chunk instead (``read_direct_chunk``): its chunks move as it writes, and HDF5
    holds what it has not yet written to the file.

    Examples
    --------
    >>> r = ChunkReader.for_dataset(f.h5["mel/data"], f.path)  # doctest: +SKIP
    >>> r.read_runs(plan_reads(np.array([0]), np.array([10])))  # doctest: +SKIP
    """

    stable = False  # a compressed chunk rewritten by a commit moves: rebound after commits

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
        if not filters or any(f not in (_DEFLATE, _SHUFFLE, _FLETCHER32, _LZF) for f in filters):
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

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
            self._closer = weakref.finalize(self, _close_fd, self._fd, self._pid)
        return self._fd

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fd"], state["_pid"], state["_lock"], state["_cache"] = None, -1, None, OrderedDict()
        state.pop("_closer", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        closer = self.__dict__.get("_closer")
        if closer is not None and self._pid == os.getpid():
            closer()
        self._fd = None

    def _raw(self, c: int, cell: int) -> tuple[bytes, int] | None:
        """The stored bytes of chunk ``(c, cell)`` and its filter mask; None when unallocated."""
        limit = _stored_limit(self.chunk_bytes)
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

    def chunk(self, c: int, cell: int = 0) -> np.ndarray:
        """Chunk ``c`` (of cell ``cell`` across a row) decoded: an array of the chunk shape."""
        key = (c, cell)
        if self.cache_chunks:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return hit
        got = self._raw(c, cell)
        if got is None:
            return np.broadcast_to(self.fill, self.chunks)
        data: bytes | np.ndarray = got[0]
        mask = got[1]
        limit = self.chunk_bytes
        try:
            for i in reversed(range(len(self.filters))):
                if mask & (1 << i):
                    continue  # this filter was skipped when the chunk was written
                code = self.filters[i]
                if code == _FLETCHER32:
                    data = _check_fletcher32(bytes(data))
                elif code == _DEFLATE:
                    data = _inflate(bytes(data), limit)
                elif code == _LZF:
                    data = _lzf(bytes(data), limit)
                else:
                    data = _unshuffle(data, self.dtype.itemsize)
        except _TooLarge:
            raise self._refuse(c, f"decodes to more than its {limit} bytes (a decompression bomb, or damage)") from None
        except (zlib.error, ValueError) as e:
            raise self._refuse(c, f"does not decode ({e})") from None
        nbytes = len(data) if isinstance(data, bytes) else int(data.nbytes)
        if nbytes != limit:
            raise self._refuse(c, f"decodes to {nbytes} bytes, not its {limit} bytes")
        values = np.frombuffer(data, self.dtype).reshape(self.chunks)
        if self.cache_chunks:
            with self._lock:
                self._cache[key] = values
                while len(self._cache) > self.cache_chunks:
                    self._cache.popitem(last=False)
        return values

    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        out = np.empty((plan.total, *self.shape[1:]), dtype=self.dtype)
        rows = self.chunk_rows
        whole = self.ncell == 1 and self.chunks[1:] == self.shape[1:]
        o = 0
        for a, b in plan.runs.tolist():
            if b > self.shape[0]:
                raise CorruptRecordError(f"{self.where}: read of rows [{a}, {b}) past the end ({self.shape[0]})")
            while a < b:
                c = a // rows
                base = c * rows
                end = min(b, base + rows)
                if whole:
                    out[o : o + end - a] = self.chunk(c)[a - base : end - base]
                else:
                    for k in range(self.ncell):
                        box = tuple(slice(i, min(i + ch, s))
                                    for i, ch, s in zip(self._cell_offset(k), self.chunks[1:], self.shape[1:]))
                        part = tuple(slice(0, s.stop - s.start) for s in box)
                        out[(slice(o, o + end - a), *box)] = self.chunk(c, k)[(slice(a - base, end - base), *part)]
                o += end - a
                a = end
        return out


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
    reader = ChunkReader.for_dataset(ds, path, where, cache_bytes=0, via_hdf5=via_hdf5)
    if reader is None:
        return ds[...] if rows is None else ds[:rows]
    try:
        return reader.read_runs(plan_reads(np.array([0], np.int64), np.array([n], np.int64)))
    finally:
        reader.close()


Reader = DirectReader | H5Reader | MemoryReader | ChunkReader



# --------------------------------------------------------------------------- columns
def _chunk_rows(spec: ColumnSpec) -> int:
    if spec.chunk_rows:
        return spec.chunk_rows
    # Narrow rows (scalars, log values) get at most 16k rows per chunk: HDF5 rewrites the whole
    # last chunk on every append commit, so a 512 KiB chunk of scalars would cost 512 KiB each.
    # Compressed chunks are decompressed whole on every read that touches them: keep them
    # small (64 KiB) so a random window does not decompress half a megabyte.
    target = (64 << 10) if spec.filtered else _CHUNK_BYTES
    return max(1, min(target // max(spec.row_nbytes, 1), 1 << 14))


def _open_table(g: h5py.Group, name: str) -> h5py.Dataset:
    """Open an index-like dataset without HDF5's chunk cache.

    Tables are read whole, once, into numpy: a chunk cache (``rdcc_nbytes`` per dataset)
    would only keep a second copy, ~19 MB per process for the ids of a million items.
    """
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(0, 0, 1.0)
    return h5py.Dataset(h5py.h5d.open(g.id, name.encode("utf-8"), dapl=dapl))


def create_column(parent: h5py.Group, name: str, spec: ColumnSpec, n_items: int) -> h5py.Group:
    """Create an empty column in ``parent`` for a group that already holds ``n_items`` ids."""
    g = parent.create_group(name)
    g.attrs["h5store_column"] = json.dumps(spec.to_dict(), sort_keys=True)
    filters: dict[str, Any] = {}
    if spec.compression:
        filters["compression"] = spec.compression
        if spec.compression_opts is not None:
            filters["compression_opts"] = spec.compression_opts
    if spec.shuffle:
        filters["shuffle"] = True
    if spec.fletcher32:
        filters["fletcher32"] = True
    inner = spec.inner
    g.create_dataset("data", shape=(0, *inner), maxshape=(None, *inner), dtype=spec.np_dtype,
                     chunks=(_chunk_rows(spec), *inner), **filters)
    index = np.full((n_items, 2), ABSENT, dtype=np.int64)
    g.create_dataset("index", data=index, maxshape=(None, 2), chunks=(_INDEX_CHUNK, 2))
    g.create_dataset("checksum", data=np.zeros(n_items, np.uint32), maxshape=(None,), chunks=(_INDEX_CHUNK,))
    if spec.layout == "blobs":
        g.create_dataset("frames", shape=(0, 2), maxshape=(None, 2), dtype=np.int64, chunks=(_INDEX_CHUNK, 2))
    return g


class Column:
    """One column of a group: reads, appends and overwrites of its items.

    ``where`` names the file, group and column in error messages.
    """

    def __init__(self, g: h5py.Group, spec: ColumnSpec, where: str, writable: bool, path: str,
                 handle: FileHandle | None = None) -> None:
        self.g = g
        self.spec = spec
        self.where = where
        self.writable = writable
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
            self.data: h5py.Dataset = g["data"]
            self._index_ds: h5py.Dataset = _open_table(g, "index")
            self._checksum_ds: h5py.Dataset = _open_table(g, "checksum")
            self._frames_ds: h5py.Dataset | None = _open_table(g, "frames") if self.spec.layout == "blobs" else None
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
                self._bind(_subgroup(f, self._gpath, self.where))
                rebind = getattr(self._reader, "rebind", None)
                if rebind is not None:
                    rebind(self.data)
                self._gen = h.generation
            yield

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
        """``(N, 2)`` int64 ``[start, stop)`` per item, validated once when first read."""
        if self._index is None:
            idx = self._read_table("_index_ds", "index", self._items)
            self._validate_index(idx)
            self._index = idx
        return self._index

    @property
    def checksums(self) -> np.ndarray:
        if self._checksum is None:
            c = self._read_table("_checksum_ds", "checksum", self._items)
            if len(c) != len(self.index):
                raise CorruptRecordError(f"{self.where}: checksum has {len(c)} rows, index {len(self.index)}")
            self._checksum = c
        return self._checksum

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
        # Column views and boolean masks only: fancy-indexed copies would cost 16 bytes per
        # row of transient memory (the allocator keeps much of it after the check).
        s, e = r[:, 0], r[:, 1]
        absent = (s == ABSENT) & (e == ABSENT)
        bad = (s < 0) | (e < s) | (e > limit)
        if self.spec.layout == "fixed" and what == "index":
            bad |= e - s != 1
        bad &= ~absent
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
        if self._reader is None or (self._reader_pid != os.getpid() and not isinstance(self._reader, MemoryReader)):
            self._reader = None
            with self._h5():
                try:
                    if not self.writable:
                        self._reader = DirectReader.for_dataset(self.data, self.path)
                    if self._reader is None:
                        # Compressed chunks are decoded here, never past their declared size
                        # (HDF5's filters inflate without bound); a writer's through HDF5.
                        self._reader = ChunkReader.for_dataset(self.data, self.path, self.where,
                                                               via_hdf5=self.writable)
                except (RuntimeError, OSError) as e:  # h5py's text for a damaged chunk B-tree
                    raise CorruptRecordError(f"{self.where}: unreadable chunk table ({e})") from None
                if self._reader is None:
                    self._reader = H5Reader(self.data)
            self._reader_pid = os.getpid()
        return self._reader

    def use_memory(self, array: np.ndarray) -> None:
        """Serve reads from ``array`` (this column's whole ``data``, e.g. in shared memory)."""
        if array.shape != self.data.shape or array.dtype != self.data.dtype:
            raise ValueError(f"{self.where}: in-memory copy is {array.dtype}{array.shape}, data is {self.data.dtype}{self.data.shape}")
        self._reader = MemoryReader(array)

    def _missing(self, rows: np.ndarray) -> None:
        absent = self.index[rows, 0] == ABSENT
        if absent.any():
            raise KeyError(int(rows[np.argmax(absent)]))

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray, max_gap: int = 0) -> list[np.ndarray]:
        """Rows ``[start, stop)`` of ``data`` for each pair, one planned read for all."""
        self.flush_pending()
        plan = plan_reads(starts, stops, max_gap=max_gap)
        reader = self.reader()
        if self._handle is not None and not getattr(reader, "stable", False):
            # Its chunk addresses come from HDF5 and may change at a commit (a rewritten
            # compressed chunk moves): read under the commit lock, rebound after a commit.
            with self._h5():
                return gather(plan, self.reader().read_runs(plan))
        return gather(plan, reader.read_runs(plan))

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
            return self._read_blob_items(idx, rows, verify)
        parts = self.read_ranges(idx[:, 0], idx[:, 1], max_gap=self._gap())
        if self.spec.layout == "fixed":
            parts = [p[0] for p in parts]
        if verify:
            self.verify(rows, parts)
        return parts

    def _gap(self) -> int:
        # Through HDF5 each call costs ~20 us: merge runs separated by < 64 KiB of rows.
        if isinstance(self.reader(), H5Reader):
            return max(0, (64 << 10) // max(self.spec.row_nbytes, 1))
        return 0

    def _read_blob_items(self, idx: np.ndarray, rows: np.ndarray, verify: bool) -> list[Any]:
        fr = self.frames
        out = []
        spans = [fr[a:b] for a, b in idx.tolist()]
        starts = np.array([s[0, 0] if len(s) else 0 for s in spans], dtype=np.int64)
        stops = np.array([s[-1, 1] if len(s) else 0 for s in spans], dtype=np.int64)
        for r, s in zip(rows.tolist(), spans):
            self._check_contiguous(r, s)
        blocks = self.read_ranges(starts, stops)
        if verify:
            self.verify(rows, blocks)
        for s, block, base in zip(spans, blocks, starts.tolist()):
            out.append([block[a - base : b - base] for a, b in s.tolist()])
        return out

    def read_blobs(self, row: int, first: int, stop: int) -> list[np.ndarray]:
        """Blobs ``first..stop-1`` of the item at ``row`` (only their bytes are read)."""
        self.flush_pending()
        self._missing(np.array([row]))
        a, b = self.index[row]
        n = b - a
        if not (0 <= first <= stop <= n):
            raise IndexError(f"{self.where}: blobs [{first}, {stop}) out of range for an item of {n}")
        span = self.frames[a + first : a + stop]
        if not len(span):
            return []
        self._check_contiguous(row, self.frames[a:b])
        base = int(span[0, 0])
        block = self.read_ranges(np.array([base]), np.array([span[-1, 1]]))[0]
        if first == 0 and stop == n:
            # The whole item: its CRC-32 can be checked (a part of it cannot).
            self.verify(np.array([row]), [block])
        return [block[s - base : e - base] for s, e in span.tolist()]

    def _check_contiguous(self, row: int, span: np.ndarray) -> None:
        # The CRC-32 covers the item's bytes, not where its blobs split them: frames must join.
        if len(span) > 1 and not np.array_equal(span[1:, 0], span[:-1, 1]):
            raise CorruptRecordError(f"{self.where}: the blob frames of the item at row {row} are not contiguous")

    def verify(self, rows: np.ndarray, parts: Sequence[np.ndarray]) -> None:
        """Raise :class:`CorruptRecordError` unless each part matches its stored CRC-32."""
        expect = self.checksums[rows]
        for r, p, c in zip(rows.tolist(), parts, expect.tolist()):
            if crc32(np.ascontiguousarray(p)) != c:
                raise CorruptRecordError(f"{self.where}: item at row {r} fails its checksum")

    # ---------------------------------------------------------------- writing
    def _need_writable(self) -> None:
        if not self.writable:
            raise ReadOnlyError(f"{self.where}: file is open read-only (mode 'r'); reopen with mode 'a'")

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
            self.data.resize(grow_capacity(self.data.shape[0], self._size, minimum=_chunk_rows(self.spec)), axis=0)
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


# --------------------------------------------------------------------------- groups
IDS = "ids"
_IDS_SPEC = ColumnSpec(dtype="uint8", shape=(None,), layout="ragged", chunk_rows=1 << 16)


@dataclass(frozen=True)
class Tables:
    """The in-memory tables of a read-only :class:`GroupStore`, handed to a forked child."""

    refs: Refs | None
    ids_size: int
    columns: dict[str, tuple[ColumnSpec, int, np.ndarray | None, np.ndarray | None, np.ndarray | None]]


def _subgroup(g: h5py.Group, name: str, where: str) -> h5py.Group:
    try:
        return g[name]
    except (KeyError, OSError) as e:  # h5py: "Unable to open object (incorrect metadata checksum ...)"
        raise FormatError(f"{where}: unreadable ({e})") from None


class GroupStore:
    """A group's refs table and its columns, as stored under one HDF5 group.

    Parameters
    ----------
    g : h5py.Group
        The HDF5 group (``/`` for the root group).
    specs : dict
        Column name -> :class:`ColumnSpec`; missing columns are created when writable. None
        for a feature whose storage the first item will fix: it has no column yet (see
        :meth:`add_column`).
    where : str
        ``"file.h5:/group"``, for messages.
    """

    def __init__(self, g: h5py.Group, specs: dict[str, ColumnSpec | None], where: str, writable: bool, path: str,
                 handle: FileHandle | None = None) -> None:
        self.g = g
        self.where = where
        self.writable = writable
        if IDS not in g:
            if not writable:
                raise FormatError(f"{where}: group has no ids table")
            create_column(g, IDS, _IDS_SPEC, 0)
        base = where.rstrip("/")
        self._ids = Column(_subgroup(g, IDS, f"{base}/ids"), _IDS_SPEC, f"{base}/ids", writable, path, handle)
        self._refs: Refs | None = None
        self.columns: dict[str, Column] = {}
        self._path, self._handle = path, handle
        n = int(g[IDS]["index"].shape[0])
        for name, spec in specs.items():
            if spec is None:
                continue  # not fixed yet: no item stored, no column
            if name not in g:
                if not writable:
                    raise FormatError(f"{where}: no column {name!r} in the file")
                create_column(g, name, spec, n)
            self.columns[name] = Column(_subgroup(g, name, f"{base}/{name}"), spec, f"{base}/{name}", writable, path, handle)
            if self.columns[name]._index_ds.shape[0] != n:
                raise CorruptRecordError(f"{base}/{name}: index has {self.columns[name]._index_ds.shape[0]} rows for {n} ids")
        if not writable:
            for col in (self._ids, *self.columns.values()):
                col._items = n  # the snapshot this reader sees until refresh()

    def tables(self) -> Tables | None:
        """The tables this read-only store has loaded (numpy only, no h5py object), or None."""
        if self.writable:
            return None
        columns = {n: (c.spec, c._size, c._index, c._checksum, c._frames) for n, c in self.columns.items()}
        return Tables(self._refs, self._ids._size, columns)

    def adopt(self, tables: Tables) -> None:
        """Take over tables loaded by this process's parent, where they still describe the file.

        A forked reader then shares them copy-on-write instead of reading them again: ~27 MB
        per worker for the ids of a million items, plus 20 MB per feature's index. A table
        whose dataset changed size since (a writer appended) is read afresh.
        """
        if self.writable:
            return
        n = int(self._ids._index_ds.shape[0])
        refs = tables.refs
        if refs is not None and tables.ids_size == self._ids._size and refs.merged == len(refs) == n:
            self._refs = refs
        for name, (spec, size, index, checksum, frames) in tables.columns.items():
            col = self.columns.get(name)
            if col is None or col.spec != spec or col._size != size:
                continue
            if index is not None and len(index) == col._index_ds.shape[0] == n:
                col._index = index
                if checksum is not None and len(checksum) == n:
                    col._checksum = checksum
            if frames is not None and col._frames_ds is not None and len(frames) == col._frames_ds.shape[0]:
                col._frames = frames

    @property
    def refs(self) -> Refs:
        if self._refs is None:
            ids = self._ids
            data = ids.read_ranges(np.array([0]), np.array([ids._size]))[0] if ids._size else np.zeros(0, np.uint8)
            self._refs = Refs(ids.index, data, ids.checksums, where=self.where)
            if not self.writable:
                ids._index = None  # the (N, 2) table: Refs keeps the same in N + 1 offsets
        return self._refs

    def __len__(self) -> int:
        return len(self.refs)

    def add(self, ids: Sequence[str], items: dict[str, Sequence[Any]]) -> np.ndarray:
        """Append new ids with their items (each list as long as ``ids``); returns their rows."""
        if not self.writable:
            raise ReadOnlyError(f"{self.where}: file is open read-only (mode 'r'); reopen with mode 'a'")
        for name in items:
            if name not in self.columns:
                raise SchemaError(f"{self.where}: no feature {name!r} (features: {sorted(self.columns)})")
        rows = self.refs.add(ids)
        n = len(self.refs)
        for name, col in self.columns.items():
            col.grow_items(n)
            if name in items and len(items[name]):
                col.append(rows, items[name])
        return rows

    def add_column(self, name: str, spec: ColumnSpec) -> Column:
        """Create the column of a feature that its first item just fixed (writable stores only).

        Its index covers every id of the group, pending ones included, all absent.

        Examples
        --------
        >>> store.add_column("x", ColumnSpec(dtype="float64", shape=(None, 7), layout="ragged"))  # doctest: +SKIP
        """
        if not self.writable:
            raise ReadOnlyError(f"{self.where}: file is open read-only (mode 'r'); reopen with mode 'a'")
        if name in self.columns:
            raise SchemaError(f"{self.where}: feature {name!r} has a column already")
        base = self.where.rstrip("/")
        if name in self.g:
            raise FormatError(f"{base}/{name}: the schema lists no storage for it, yet the file holds an object "
                              "of that name; check the file with `h5store verify`")
        create_column(self.g, name, spec, int(self._ids._index_ds.shape[0]))
        col = self.columns[name] = Column(self.g[name], spec, f"{base}/{name}", True, self._path, self._handle)
        col.grow_items(len(self.refs))
        return col

    def put(self, name: str, row: int, item: Any) -> None:
        """Store the item of feature ``name`` for an existing row (append if absent, else overwrite)."""
        col = self.columns[name]
        if col.index[row, 0] == ABSENT:
            col.append(np.array([row]), [item])
        else:
            col.overwrite(row, item)

    def close_readers(self) -> None:
        """Close the descriptors of this process's direct readers (the file is being closed)."""
        for col in (self._ids, *self.columns.values()):
            if isinstance(col._reader, DirectReader):
                col._reader.close()
            if not isinstance(col._reader, MemoryReader):
                col._reader = None

    def flush(self) -> None:
        if not self.writable:
            return
        refs = self.refs
        if refs._pending_list:
            start = refs.merged
            lengths, data, crc = refs.take_pending()
            ids = self._ids
            ids.grow_items(len(refs))
            # Rows of the ids column are the refs rows themselves.
            stops = ids._size + np.cumsum(lengths)
            ids.index[start:] = np.stack([stops - lengths, stops], axis=1)
            ids.checksums[start:] = crc
            ids._mark(start)
            ids._stage_block(data)
        self._ids.flush()
        for col in self.columns.values():
            col.flush()
