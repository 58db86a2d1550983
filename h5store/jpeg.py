"""JPEG decoding at the speed of the machine: libjpeg-turbo through simplejpeg, the GIL released.

Every image and video path of h5store decodes JPEG here (``EncodedImage``,
``EncodedFrames``, the clip getters), in the thread or process that reads the batch.

Why simplejpeg: measured in ``benchmarks/bench_video.py`` (decoders table, RESULTS.md) for
128x96 frames, simplejpeg takes 2.3-2.4x less CPU than PIL (whose per-call ``Image.open`` +
``load`` + array conversion costs more than the decode itself), less than OpenCV's
``imdecode`` (a 50 MB wheel that decodes to BGR, one more pass, and cannot decode into a given
buffer); PyTurboJPEG needs a system libturbojpeg that pip does not install. simplejpeg (a
1 MB wheel, ``image`` extra) releases the GIL around libjpeg-turbo, so reader threads decode
in parallel (two-thread scaling could not be shown on the project's loaded 2-core machine),
decodes straight into a batch buffer (no stack copy), reads headers without decoding, and
scales by 1/2, 1/4, 1/8 inside the IDCT (``min_size``: much cheaper than decoding full size,
then resizing). Its output equals PIL's decoding of the same file (both run libjpeg-turbo's
default accurate IDCT and fancy upsampling; the tests check max abs difference 0, frame by
frame against the source files).

Without simplejpeg (or for what it does not decode: CMYK JPEGs, PNG), PIL decodes.
``H5STORE_JPEG=pil`` in the environment forces PIL (for comparisons).
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

__all__ = ["available", "decode", "decode_many", "decoder", "header", "is_jpeg"]

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


def _scale(h: int, w: int, min_size: tuple[int, int] | None) -> int:
    """The largest of 1, 2, 4, 8 dividing ``(h, w)`` (rounded up) to at least ``min_size``."""
    if min_size is None:
        return 1
    mh, mw = int(min_size[0]), int(min_size[1])
    return next(s for s in (8, 4, 2, 1) if s == 1 or (-(-h // s) >= mh and -(-w // s) >= mw))


def _full_header(buf: Any) -> tuple[int, int, int] | None:
    sj = _simplejpeg()
    if sj is None:
        return None
    try:
        h, w, space, _ = sj.decode_jpeg_header(buf)
    except ValueError:
        return None
    if space == "Gray":
        return h, w, 1
    if space in ("YCbCr", "RGB"):
        return h, w, 3
    return None  # CMYK / YCCK: PIL's conversion


def header(data: Any, min_size: tuple[int, int] | None = None) -> tuple[int, int, int] | None:
    """``(H, W, C)`` that :func:`decode` will return, read from the JPEG header only.

    None when the fast decoder is not in use or does not decode this image (the caller
    then decodes with PIL). ``C`` is 1 for grey, 3 for colour.

    Examples
    --------
    >>> header(b"not a jpeg") is None
    True
    """
    full = _full_header(_buffer(data))
    if full is None:
        return None
    h, w, c = full
    s = _scale(h, w, min_size)
    return -(-h // s), -(-w // s), c


def decode(data: Any, out: np.ndarray | None = None, min_size: tuple[int, int] | None = None) -> np.ndarray:
    """One JPEG as an ``(H, W, C)`` uint8 array (grey ``C=1``), decoded by :func:`decoder`.

    Parameters
    ----------
    data : bytes or uint8 array
        The JPEG file's bytes.
    out : ndarray, optional
        A C-contiguous uint8 array of the decoded shape to decode into (a slot of a batch).
    min_size : (int, int), optional
        Decode at the smallest of 1/1, 1/2, 1/4, 1/8 of the size (rounded up) whose height and
        width are at least these: scaled in the IDCT, cheaper than decoding then resizing.
        simplejpeg and PIL's ``draft`` give the same pixels.

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
    full = _full_header(buf)
    if full is None:
        a = _pil_decode(buf, min_size)
        if out is not None:
            out[...] = a
            return out
        return a
    h, w, c = full
    s = _scale(h, w, min_size)
    shape = (-(-h // s), -(-w // s), c)
    space = "GRAY" if c == 1 else "RGB"
    args = {"min_height": shape[0], "min_width": shape[1]} if s > 1 else {}
    if out is not None:
        if out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"decode: out is {out.dtype} {out.shape}, the image decodes to uint8 {shape}")
        _simplejpeg().decode_jpeg(buf, colorspace=space, buffer=out, **args)
        return out
    a = _simplejpeg().decode_jpeg(buf, colorspace=space, **args)
    return a if a.ndim == 3 else a[..., None]


def decode_many(blobs: Any, out: np.ndarray, min_size: tuple[int, int] | None = None) -> None:
    """Decode ``blobs[k]`` into ``out[k]`` for every ``k`` (a clip's frames into its batch slot).

    The same pixels as :func:`decode` frame by frame, with less Python per frame: the scale and
    colour space come from the slot, and each frame's header is still read and compared with
    it (a frame of another size is refused, never decoded into part of the slot). A reader
    thread then holds the GIL for a few microseconds between two GIL-free decodes, so reader
    threads decode in parallel instead of queueing for the GIL.

    Raises
    ------
    ValueError
        A frame is not a decodable JPEG or does not decode to ``out[k]``'s shape.

    Examples
    --------
    >>> import io, numpy as np
    >>> from PIL import Image
    >>> buf = io.BytesIO(); Image.fromarray(np.full((16, 24, 3), 90, np.uint8)).save(buf, "JPEG")
    >>> out = np.empty((2, 16, 24, 3), np.uint8); decode_many([buf.getvalue()] * 2, out)
    >>> bool((out == decode(buf.getvalue())).all())
    True
    """
    sj = _simplejpeg()
    if sj is None or out.ndim != 4 or out.dtype != np.uint8 or not out.flags.c_contiguous or out.shape[3] not in (1, 3):
        for k, blob in enumerate(blobs):
            decode(blob, out=out[k], min_size=min_size)
        return
    oh, ow, oc = out.shape[1:]
    space = "GRAY" if oc == 1 else "RGB"
    spaces = ("Gray",) if oc == 1 else ("YCbCr", "RGB")
    header = sj.decode_jpeg_header
    dec = sj.decode_jpeg
    args: dict[str, int] | None = None
    full: tuple[int, int] | None = None
    for k, blob in enumerate(blobs):
        buf = blob if isinstance(blob, (bytes, bytearray)) else _buffer(blob)
        try:
            h, w, sp, _ = header(buf)
        except ValueError:
            h, w, sp = -1, -1, ""
        if sp not in spaces:  # not a JPEG simplejpeg decodes to this slot (CMYK, PNG, corrupt): the slow path
            decode(buf, out=out[k], min_size=min_size)
            continue
        if full != (h, w):
            full = (h, w)
            s = _scale(h, w, min_size)
            if (-(-h // s), -(-w // s)) != (oh, ow):
                raise ValueError(f"decode: out is uint8 {out.shape[1:]}, the image decodes to uint8 "
                                 f"{(-(-h // s), -(-w // s), oc)}")
            args = {"min_height": oh, "min_width": ow} if s > 1 else {}
        dec(buf, colorspace=space, buffer=out[k], **args)  # type: ignore[arg-type]


def _pil_decode(data: Any, min_size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(bytes(memoryview(data).cast("B"))))
        if min_size is not None and im.format == "JPEG":
            s = _scale(im.height, im.width, min_size)
            if s > 1:
                im.draft(im.mode, (im.width // s, im.height // s))  # PIL picks 1/s when the sizes divide by s
        im.load()
    except Exception as e:  # noqa: BLE001 - PIL reports corrupt data as OSError, SyntaxError, ValueError...
        raise ValueError(f"not a decodable JPEG ({type(e).__name__}: {e})") from None
    if im.mode not in ("L", "RGB"):
        im = im.convert("RGB")
    a = np.array(im)
    return a[..., None] if a.ndim == 2 else a
