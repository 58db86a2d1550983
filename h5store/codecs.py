"""Bounded decoding of HDF5 chunk filters: gzip (deflate), lzf, zstd, blosc, shuffle, fletcher32.

HDF5's deflate filter (and h5py's lzf filter) grow their output until the stream ends,
so a chunk declaring 64 KiB can inflate to gigabytes before HDF5 looks at its size. Every
decoder here stops at the size the chunk declares (:class:`_TooLarge` past it).

Where a new codec goes: write ``decode(data, limit, itemsize) -> bytes | ndarray`` that never
produces more than ``limit`` bytes (raise :class:`_TooLarge`) and raises ``zlib.error`` or
``ValueError`` for a stream it cannot decode, and register it in :data:`DECODERS` under
its HDF5 filter id. :class:`~h5store.readers.ChunkReader` then reads datasets using it,
and :func:`decode_chunk` runs it in the pipeline's reverse order.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import struct
import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["DECODERS", "decode_chunk", "stored_limit"]

#: HDF5 filter ids the chunk reader decodes itself (h5py's numbering; zstd and blosc are the
#: registered plugin ids that ``hdf5plugin`` writes and reads).
_DEFLATE, _SHUFFLE, _FLETCHER32, _LZF, _BLOSC, _ZSTD = 1, 2, 3, 32000, 32001, 32015


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


class _PerThread(threading.local):
    """One decompression context per thread (zstd's and blosc's are not thread-safe)."""

    zstd: Any = None
    blosc: Any = None

    def __del__(self) -> None:
        lib = _LIBBLOSC2[0] if _LIBBLOSC2 else None
        if self.blosc is not None and lib is not None:
            lib.blosc2_free_ctx(self.blosc)


_LOCAL = _PerThread()


def _zstd(data: bytes, limit: int) -> bytes:
    """A zstd frame (HDF5 filter 32015) decoded into at most ``limit`` bytes.

    python-zstandard trusts the content size a frame's header declares and allocates it,
    so the header is read first: a frame declaring more than ``limit`` is refused before
    anything is allocated; one declaring nothing is decoded with ``limit`` as the cap.
    The decoding releases the GIL.
    """
    import zstandard

    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame ({e})") from None
    if declared > limit:
        raise _TooLarge
    d = _LOCAL.zstd
    if d is None:
        d = _LOCAL.zstd = zstandard.ZstdDecompressor()
    try:
        return d.decompress(data, max_output_size=limit)
    except zstandard.ZstdError as e:
        if declared < 0 and "did not decompress full frame" in str(e):
            raise _TooLarge from None  # no declared size: the cap was reached
        raise ValueError(f"zstd stream does not decode ({e})") from None


_LIBBLOSC2: list[Any] = []  # [the libblosc2 that python-blosc2 ships, through ctypes, or None]
_LIBBLOSC2_LOCK = threading.Lock()  # decoding threads may ask for it first at the same time


def _libblosc2() -> Any:
    """libblosc2 (the shared library python-blosc2 installs) through ctypes, or None.

    ctypes releases the GIL around every call, which python-blosc2's ``decompress`` does not:
    threads decode blosc chunks in parallel only this way. Found without importing blosc2
    (that import takes ~0.5 s).
    """
    if _LIBBLOSC2:
        return _LIBBLOSC2[0]
    with _LIBBLOSC2_LOCK:
        if not _LIBBLOSC2:
            _LIBBLOSC2.append(_load_libblosc2())
    return _LIBBLOSC2[0]


def _load_libblosc2() -> Any:
    """:func:`_libblosc2`'s loading: the library with its signatures declared, or None."""
    lib = None
    try:
        import ctypes

        spec = importlib.util.find_spec("blosc2")
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in roots:
            for name in ("libblosc2.so.9", "libblosc2.so", "libblosc2.dylib"):
                cand = os.path.join(root, "lib", name)
                if os.path.exists(cand):
                    lib = ctypes.CDLL(cand)
                    break
            if lib is not None:
                break
        if lib is not None:

            class DParams(ctypes.Structure):  # blosc2_dparams (blosc2.h)
                _fields_ = [("nthreads", ctypes.c_int16), ("schunk", ctypes.c_void_p),
                            ("postfilter", ctypes.c_void_p), ("postparams", ctypes.c_void_p),
                            ("typesize", ctypes.c_int32)]

            lib.blosc2_init.restype = None
            lib.blosc2_init()
            lib.blosc2_create_dctx.argtypes = [DParams]
            lib.blosc2_create_dctx.restype = ctypes.c_void_p
            lib.blosc2_free_ctx.argtypes = [ctypes.c_void_p]
            lib.blosc2_free_ctx.restype = None
            lib.blosc2_decompress_ctx.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                                  ctypes.c_void_p, ctypes.c_int32]
            lib.blosc2_decompress_ctx.restype = ctypes.c_int
            lib.blosc2_unshuffle.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
            lib.blosc2_unshuffle.restype = ctypes.c_int32
            lib.h5store_dparams = DParams(1, None, None, None, 8)
    except (OSError, AttributeError, ImportError):
        lib = None
    return lib


def _blosc(data: bytes, limit: int) -> np.ndarray:
    """A blosc chunk (HDF5 filter 32001, its own byte-shuffle inside) decoded into at most
    ``limit`` bytes.

    The 16-byte header declares the decoded and the stored size: a chunk declaring more
    than ``limit`` is refused before anything is allocated, one whose stored size is not the
    chunk's is refused as damaged. libblosc2 then decodes into a buffer of exactly the
    declared size (it never writes past it). One context per thread, one internal thread
    each: the chunk reader's threads are the parallelism.
    """
    lib = _libblosc2()
    if lib is None:
        raise ValueError("blosc chunks need python-blosc2 (pip install blosc2): its libblosc2 decodes them")
    n = len(data)
    if n < 16:
        raise ValueError(f"blosc chunk of {n} bytes is shorter than its 16-byte header")
    nbytes, _blocksize, cbytes = struct.unpack_from("<iii", data, 4)
    if cbytes != n or nbytes < 0:
        raise ValueError(f"blosc header declares {cbytes} stored bytes, the chunk has {n}")
    if nbytes > limit:
        raise _TooLarge
    ctx = _LOCAL.blosc
    if ctx is None:
        ctx = _LOCAL.blosc = lib.blosc2_create_dctx(lib.h5store_dparams)
    out = np.empty(nbytes, np.uint8)
    got = lib.blosc2_decompress_ctx(ctx, data, n, out.ctypes.data, nbytes) if nbytes else 0
    if got != nbytes:
        raise ValueError(f"blosc stream does not decode (libblosc2 returned {got})")
    return out


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
    """Undo HDF5's byte shuffle: byte 0 of every element, then byte 1, ...

    libblosc2's SIMD ``blosc2_unshuffle`` (same layout: a tail shorter than one element
    stays as is; ~3x numpy's strided copies, and the GIL released) where python-blosc2 is
    installed, else numpy.
    """
    raw = np.frombuffer(data, np.uint8)
    lib = _libblosc2() if 1 < itemsize < 256 and len(raw) >= itemsize and len(raw) < 1 << 31 else None
    if lib is not None:
        out = np.empty(len(raw), np.uint8)
        if lib.blosc2_unshuffle(itemsize, len(raw), raw.ctypes.data, out.ctypes.data) == len(raw):
            return out
    return _unshuffle_numpy(raw, itemsize)


def _unshuffle_numpy(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """:func:`_unshuffle` in numpy."""
    whole = len(raw) // itemsize * itemsize
    planes = raw[:whole].reshape(itemsize, -1)
    out = np.empty(len(raw), np.uint8)
    grid = out[:whole].reshape(-1, itemsize)
    for j in range(itemsize):  # one strided copy per byte plane: ~5x faster than planes.T.copy()
        grid[:, j] = planes[j]
    out[whole:] = raw[whole:]  # a tail shorter than one element is stored as is
    return out


def _fletcher32_filter(data: bytes | np.ndarray, limit: int, itemsize: int) -> bytes:
    return _check_fletcher32(bytes(data))


def _deflate_filter(data: bytes | np.ndarray, limit: int, itemsize: int) -> bytes:
    return _inflate(bytes(data), limit)


def _lzf_filter(data: bytes | np.ndarray, limit: int, itemsize: int) -> bytes | np.ndarray:
    return _lzf(bytes(data), limit)


def _zstd_filter(data: bytes | np.ndarray, limit: int, itemsize: int) -> bytes:
    return _zstd(bytes(data), limit)


def _blosc_filter(data: bytes | np.ndarray, limit: int, itemsize: int) -> np.ndarray:
    return _blosc(bytes(data), limit)


def _shuffle_filter(data: bytes | np.ndarray, limit: int, itemsize: int) -> np.ndarray:
    return _unshuffle(data, itemsize)


#: HDF5 filter id -> ``decode(data, limit, itemsize)``: the filters h5store decodes itself.
DECODERS: dict[int, Callable[[Any, int, int], bytes | np.ndarray]] = {
    _DEFLATE: _deflate_filter,
    _SHUFFLE: _shuffle_filter,
    _FLETCHER32: _fletcher32_filter,
    _LZF: _lzf_filter,
    _ZSTD: _zstd_filter,
    _BLOSC: _blosc_filter,
}

stored_limit = _stored_limit


def decode_chunk(data: bytes | np.ndarray, mask: int, filters: tuple[int, ...], itemsize: int,
                 limit: int) -> bytes | np.ndarray:
    """Undo a chunk's filter pipeline (``filters`` in the order they were applied).

    Filter ``i`` is skipped where bit ``i`` of ``mask`` is set (HDF5 skipped it when it wrote
    the chunk). Raises :class:`_TooLarge` when a stage would decode past ``limit`` bytes,
    ``zlib.error`` or ``ValueError`` when a stage does not decode.

    Examples
    --------
    >>> raw = zlib.compress(bytes(8))
    >>> bytes(decode_chunk(raw, 0, (_DEFLATE,), 1, 8))
    b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00'
    """
    for i in reversed(range(len(filters))):
        if mask & (1 << i):
            continue  # this filter was skipped when the chunk was written
        data = DECODERS[filters[i]](data, limit, itemsize)
    return data
