"""JPEG decoding at the speed of the machine: libjpeg-turbo through simplejpeg, the GIL released.

Every image and video path of h5store decodes JPEG here (``EncodedImage``,
``EncodedFrames``, the clip getters), in the thread or process that reads the batch.

Why simplejpeg: measured on this machine (``benchmarks/bench_video.py``, decoders table)
for 128x96 frames, simplejpeg and OpenCV's ``imdecode`` decode 2.2-2.6x faster than PIL
(whose per-call ``Image.open`` + ``load`` + array conversion costs more than the decode);
OpenCV is a little faster per frame but a 50 MB wheel that decodes to BGR (one more pass)
and cannot decode into a given buffer; PyTurboJPEG needs a system libturbojpeg that pip does
not install. simplejpeg (a 1 MB wheel, ``image`` extra) releases the GIL while it decodes,
so reader threads decode in parallel, decodes straight into a batch buffer (no stack copy),
reads headers without decoding, and scales by 1/2, 1/4, 1/8 inside the IDCT (``min_size``:
DCT-domain downscale, much cheaper than decoding full size and resizing). Its output
equals PIL's decoding of the same file (both run libjpeg-turbo's default islow IDCT and
fancy upsampling; the tests check max abs difference 0).

Without simplejpeg (or for what it does not decode: CMYK JPEGs, PNG), PIL decodes.
``H5STORE_JPEG=pil`` in the environment forces PIL (for comparisons).
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

__all__ = ["available", "decode", "decoder", "header", "is_jpeg"]

_SOI = b"\xff\xd8"
_sj: Any = None
_tried = False


def _simplejpeg() -> Any:
    global _sj, _tried
    if not _tried:
        _tried = True
        if os.environ.get("H5STORE_JPEG", "").lower() != "pil":
            try:
                import simplejpeg

                _sj = simplejpeg
            except ImportError:
                _sj = None
    return _sj


def available() -> list[str]:
    """The JPEG decoders importable here, fastest first.

    Examples
    --------
    >>> "pil" in available() or available() == ["simplejpeg"]
    True
    """
    out = []
    if _simplejpeg() is not None:
        out.append("simplejpeg")
    try:
        import PIL  # noqa: F401

        out.append("pil")
    except ImportError:
        pass
    return out


def decoder() -> str:
    """The decoder JPEG frames and images go through: ``"simplejpeg"`` or ``"pil"``.

    Examples
    --------
    >>> decoder() in ("simplejpeg", "pil")
    True
    """
    return "simplejpeg" if _simplejpeg() is not None else "pil"


def is_jpeg(data: Any) -> bool:
    """True when ``data`` starts like a JPEG (SOI marker).

    Examples
    --------
    >>> is_jpeg(b"\\xff\\xd8\\xff\\xe0"), is_jpeg(b"\\x89PNG")
    (True, False)
    """
    return bytes(memoryview(data)[:2]) == _SOI


def _buffer(data: Any) -> Any:
    if isinstance(data, (bytes, bytearray)):
        return data
    if isinstance(data, np.ndarray):
        return data if data.flags.c_contiguous else np.ascontiguousarray(data)
    return bytes(memoryview(data).cast("B"))


def _min_args(min_size: tuple[int, int] | None) -> dict[str, int]:
    if min_size is None:
        return {}
    h, w = (int(v) for v in min_size)
    return {"min_height": h, "min_width": w}


def header(data: Any, min_size: tuple[int, int] | None = None) -> tuple[int, int, int] | None:
    """``(H, W, C)`` that :func:`decode` will return, read from the JPEG header only.

    None when the fast decoder is not in use or does not decode this image (the caller
    then decodes with PIL). ``C`` is 1 for grey, 3 for colour.

    Examples
    --------
    >>> header(b"not a jpeg") is None
    True
    """
    sj = _simplejpeg()
    if sj is None:
        return None
    try:
        h, w, space, _ = sj.decode_jpeg_header(_buffer(data), **_min_args(min_size))
    except ValueError:
        return None
    if space == "Gray":
        return h, w, 1
    if space in ("YCbCr", "RGB"):
        return h, w, 3
    return None  # CMYK / YCCK: PIL's conversion


def decode(data: Any, out: np.ndarray | None = None, min_size: tuple[int, int] | None = None) -> np.ndarray:
    """One JPEG as an ``(H, W, C)`` uint8 array (grey ``C=1``), decoded by :func:`decoder`.

    Parameters
    ----------
    data : bytes or uint8 array
        The JPEG file's bytes.
    out : ndarray, optional
        A C-contiguous uint8 array of the decoded shape to decode into (a slot of a batch).
    min_size : (int, int), optional
        Decode at the smallest of 1/1, 1/2, 1/4, 1/8 of the size whose height and width are at
        least these (scaled in the IDCT: cheaper than decoding, then resizing).

    Raises
    ------
    ValueError
        ``data`` is not a decodable JPEG (the caller names the file and item).

    Examples
    --------
    >>> import io, numpy as np
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.fromarray(np.zeros((16, 24, 3), np.uint8)).save(buf, "JPEG")
    >>> decode(buf.getvalue()).shape, decode(buf.getvalue(), min_size=(8, 8)).shape
    ((16, 24, 3), (8, 12, 3))
    """
    buf = _buffer(data)
    shape = header(buf, min_size)
    if shape is None:
        a = _pil_decode(buf, min_size)
        if out is not None:
            out[...] = a
            return out
        return a
    space = "GRAY" if shape[2] == 1 else "RGB"
    args = _min_args(min_size)
    if out is not None:
        if out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"decode: out is {out.dtype} {out.shape}, the image decodes to uint8 {shape}")
        _simplejpeg().decode_jpeg(buf, colorspace=space, buffer=out, **args)
        return out
    a = _simplejpeg().decode_jpeg(buf, colorspace=space, **args)
    return a if a.ndim == 3 else a[..., None]


def _pil_decode(data: Any, min_size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(bytes(memoryview(data).cast("B"))))
        if min_size is not None:
            im.draft(im.mode, (int(min_size[1]), int(min_size[0])))
        im.load()
    except Exception as e:  # noqa: BLE001 - PIL reports corrupt data as OSError, SyntaxError, ValueError...
        raise ValueError(f"not a decodable JPEG ({type(e).__name__}: {e})") from None
    if im.mode not in ("L", "RGB"):
        im = im.convert("RGB")
    a = np.array(im)
    return a[..., None] if a.ndim == 2 else a
