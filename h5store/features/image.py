"""Image features: encoded images and videos as sequences of JPEG frames.

Images stay compressed in the file (a JPEG is ~10x smaller than its pixels) and are
decoded on read, in the DataLoader workers or reader threads, by :mod:`h5store.jpeg`
(libjpeg-turbo through simplejpeg, the GIL released; PIL without it). pillow and simplejpeg
are the ``image`` extra (``pip install h5store[image]``), imported only when an image is
encoded or decoded.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from h5store import jpeg
from h5store.errors import SchemaError, SourceError
from h5store.features.audio_file import check_file
from h5store.schema import Feature

__all__ = ["FRAME_PATTERN", "IMAGE_PATTERN", "EncodedFrames", "EncodedImage"]

IMAGE_PATTERN = r"(?i)\.(jpe?g|png|bmp|gif|tiff?|webp|ppm|pgm|pbm)$"
FRAME_PATTERN = r"(?i)\.(jpe?g|png)$"
_KEPT = ("JPEG", "PNG")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("h5store's image features need pillow: pip install h5store[image]") from None
    return Image


class _Encoded(bytes):
    """Encoded image bytes already checked to decode, with their decoded ``shape``."""

    shape: tuple[int, int, int]


def _channels(mode: str) -> int:
    return {"1": 1, "L": 1, "LA": 2, "I;16": 1, "I;16B": 1, "I;16L": 1, "RGBA": 4, "PA": 4}.get(mode, 3)


def _open(data: bytes, what: str, error: type[Exception]) -> Any:
    """The fully decoded PIL image of ``data``; ``error`` naming ``what`` if it is corrupt."""
    Image = _pil()
    try:
        im = Image.open(io.BytesIO(data))
        im.load()
    except Exception as e:  # noqa: BLE001 - PIL reports corrupt data as OSError, SyntaxError, ValueError...
        raise error(f"{what}: not a decodable image ({type(e).__name__}: {e})") from None
    return im


def _save(im: Any, fmt: str, quality: int) -> _Encoded:
    if fmt == "JPEG" and im.mode not in ("L", "RGB"):
        im = im.convert("RGB")
    buf = io.BytesIO()
    im.save(buf, format=fmt, quality=quality) if fmt == "JPEG" else im.save(buf, format=fmt)
    out = _Encoded(buf.getvalue())
    out.shape = (im.height, im.width, _channels(im.mode))
    return out


def _from_array(a: np.ndarray, what: str) -> Any:
    if a.dtype != np.uint8:
        raise SchemaError(f"{what}: pixels must be uint8, got {a.dtype}")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
        raise SchemaError(f"{what}: expected an HxW, HxWx1, HxWx3 or HxWx4 array, got shape {a.shape}")
    return _pil().fromarray(np.ascontiguousarray(a))


def _to_array(im: Any) -> np.ndarray:
    """An ``(H, W, C)`` uint8 array of a PIL image (grey is ``C=1``, 16-bit grey scaled to 8)."""
    mode = im.mode
    if mode.startswith("I;16"):
        return (np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8)[..., None]
    if mode in ("P", "PA"):
        im = im.convert("RGBA" if mode == "PA" or "transparency" in im.info else "RGB")
    elif mode == "1":
        im = im.convert("L")
    elif mode not in ("L", "LA", "RGB", "RGBA"):
        im = im.convert("RGB")
    a = np.array(im)  # a writable copy: torch.from_numpy warns on read-only arrays
    return a[..., None] if a.ndim == 2 else a


def _bytes(raw: Any) -> bytes:
    """Stored bytes as ``bytes`` (a uint8 array read from the file, or bytes as encoded)."""
    if isinstance(raw, bytes):
        return raw
    if isinstance(raw, (bytearray, memoryview)):
        return bytes(raw)
    return np.asarray(raw, dtype=np.uint8).tobytes()


def _check_quality(out: list[str], q: Any) -> None:
    if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= 100:
        out.append(f"quality must be an int in [1, 100], got {q!r}")


def _read(path: str) -> bytes:
    check_file(path)
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror or e})") from None


class EncodedImage(Feature):
    """An image file, stored encoded (JPEG/PNG bytes) and decoded to ``(H, W, C)`` uint8 on read.

    Parameters
    ----------
    format : {None, "JPEG", "PNG"}
        None: JPEG and PNG files are stored byte for byte (after checking that they
        decode: corrupt files are refused); other formats (BMP, TIFF, GIF...) are
        re-encoded as PNG. "JPEG"/"PNG": everything is stored in that format (files
        already in it are kept as they are).
    quality : int
        JPEG quality when encoding.

    Notes
    -----
    Items are ragged uint8 (the encoded bytes): ``f.image.data`` holds them back to back.
    ``encode`` also takes bytes, a PIL image or an ``(H, W[, C])`` uint8 array (encoded
    as ``format``, PNG when None). Decoding returns grey images as ``(H, W, 1)``.

    Examples
    --------
    >>> import h5store as h5s, numpy as np
    >>> img = h5s.EncodedImage(format="PNG")
    >>> x = np.zeros((4, 6, 3), np.uint8)
    >>> img.decode(img.encode(x)).shape
    (4, 6, 3)
    """

    type_name = "h5store.EncodedImage"
    format: str | None = None
    quality: int = 95
    dtype: str = "uint8"
    shape: tuple[int | None, ...] = (None,)
    pattern: str | None = IMAGE_PATTERN

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.format, str):
            object.__setattr__(self, "format", {"JPG": "JPEG"}.get(self.format.upper(), self.format.upper()))

    def problems(self) -> list[str]:
        out = super().problems()
        if self.format not in (None, *_KEPT):
            out.append(f"format must be None, 'JPEG' or 'PNG', got {self.format!r}")
        _check_quality(out, self.quality)
        if self.dtype != "uint8" or tuple(self.shape) != (None,):
            out.append("EncodedImage is stored as dtype uint8, shape (None,): do not override them")
        return out

    def _encoded(self, data: bytes, what: str, error: type[Exception]) -> _Encoded:
        im = _open(data, what, error)
        target = self.format or (im.format if im.format in _KEPT else "PNG")
        if im.format == target:
            out = _Encoded(data)
            out.shape = (im.height, im.width, _channels(im.mode))
            return out
        return _save(im, target, self.quality)

    def load(self, source: Any) -> _Encoded:
        path = str(source)
        return self._encoded(_read(path), path, SourceError)

    def encode(self, value: Any) -> np.ndarray:
        if not isinstance(value, _Encoded):
            if isinstance(value, np.ndarray) and value.ndim >= 2:
                value = _save(_from_array(value, "image"), self.format or "PNG", self.quality)
            elif isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
                value = self._encoded(bytes(memoryview(value).cast("B")), "image bytes", SchemaError)
            elif hasattr(value, "im") and hasattr(value, "mode"):  # a PIL image
                value = _save(value, self.format or "PNG", self.quality)
            else:
                raise SchemaError(f"expected image bytes, a PIL image or a uint8 array, got {type(value).__name__}")
        return np.frombuffer(value, dtype=np.uint8)

    def decode(self, raw: Any) -> np.ndarray:
        return _fast(raw, "stored image")

    def image_size(self, raw: Any) -> tuple[int, int]:
        """``(height, width)`` of a stored image, from its header (nothing decoded)."""
        shape = jpeg.header(raw)
        if shape is not None:
            return shape[0], shape[1]
        Image = _pil()
        try:
            with Image.open(io.BytesIO(_bytes(raw))) as im:
                return im.height, im.width
        except Exception as e:  # noqa: BLE001 - as _open
            raise SchemaError(f"stored image: not a decodable image ({type(e).__name__}: {e})") from None

    def crop_into(self, raw: Any, box: tuple[int, int, int, int], out: np.ndarray, flip: bool = False) -> np.ndarray:
        """Crop ``box`` = ``(top, left, height, width)`` of a stored image, resized into ``out``.

        ``out`` is an ``(h, w, 3)`` uint8 slot of a batch. The JPEG is decoded at the smallest
        1/1, 1/2, 1/4, 1/8 scale that keeps the box at least ``(h, w)`` pixels (in the IDCT),
        then resized (PIL bilinear with antialiasing, over the box scaled alike) and
        flipped left-right when ``flip``. Grey images are repeated to three channels; alpha
        is dropped.
        """
        top, left, ch, cw = (int(v) for v in box)
        oh, ow = out.shape[:2]
        h, w = self.image_size(raw)
        s = next(s for s in (8, 4, 2, 1) if s == 1 or (ch >= s * oh and cw >= s * ow))
        a = _fast(raw, "stored image", (-(-h // s), -(-w // s)) if s > 1 else None)
        if a.shape[2] in (1, 2):  # grey (with alpha)
            a = np.repeat(a[..., :1], 3, axis=2)
        elif a.shape[2] != 3:
            a = np.ascontiguousarray(a[..., :3])
        fy, fx = a.shape[0] / h, a.shape[1] / w
        Image = _pil()
        im = Image.fromarray(a).resize((ow, oh), Image.BILINEAR,
                                       box=(left * fx, top * fy, (left + cw) * fx, (top + ch) * fy))
        if flip:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        out[...] = np.asarray(im)
        return out

    def display_kind(self) -> str:
        return "image"


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class EncodedFrames(Feature):
    """A video as a sequence of JPEG frames, read a few frames at a time.

    A source is a folder of frame files (names matching ``frame_pattern``, in natural
    name order: ``2.jpg`` before ``10.jpg``). JPEG frames are stored byte for byte after
    checking that they decode; PNG frames are encoded as JPEG at ``quality``. Every frame
    of a video must have the same size and colour mode (grey or RGB).

    The "blobs" layout keeps each frame a separate byte string: ``f.video[id]`` decodes
    the whole video to ``(K, H, W, C)`` uint8, ``f.video.blobs(id, k, k + n)`` reads and
    decodes only frames ``k..k+n-1`` (a training clip), ``(n, H, W, C)`` after stacking.

    Parameters
    ----------
    quality : int
        JPEG quality for frames that are encoded here (PNG files, arrays).
    frame_pattern : str
        Regex (``re.search``) on file names selecting the frames of a folder.
    pattern : str
        Regex a folder's path must match (default: any folder holding frames).

    Notes
    -----
    ``encode`` also takes a list of ``(H, W[, 3])`` uint8 arrays or of encoded bytes,
    or a ``(K, H, W[, 3])`` array.

    Examples
    --------
    >>> import h5store as h5s, numpy as np
    >>> video = h5s.EncodedFrames()
    >>> frames = video.encode(np.zeros((5, 8, 8, 3), np.uint8))
    >>> len(frames), video.decode(frames).shape
    (5, (5, 8, 8, 3))
    """

    type_name = "h5store.EncodedFrames"
    takes_dirs = True
    quality: int = 95
    frame_pattern: str = FRAME_PATTERN
    dtype: str = "uint8"
    shape: tuple[int | None, ...] = (None,)
    layout: str | None = "blobs"
    pattern: str | None = r"."

    def problems(self) -> list[str]:
        out = super().problems()
        _check_quality(out, self.quality)
        try:
            re.compile(self.frame_pattern)
        except (re.error, TypeError) as e:
            out.append(f"frame_pattern {self.frame_pattern!r} is not a valid regex ({e})")
        if self.dtype != "uint8" or tuple(self.shape) != (None,) or self.layout != "blobs":
            out.append("EncodedFrames is stored as uint8 blobs: do not override dtype, shape or layout")
        return out

    def frame_files(self, folder: str) -> list[str]:
        """The frame files of ``folder``, in natural name order."""
        rx = re.compile(self.frame_pattern)
        with os.scandir(folder) as it:
            names = [e.name for e in it if rx.search(e.name) and e.is_file()]
        return [os.path.join(folder, n) for n in sorted(names, key=_natural_key)]

    def accepts(self, source: str) -> bool:
        """True for a folder (matching ``pattern``) that holds frame files."""
        path = str(source)
        if not os.path.isdir(path) or (self.pattern is not None and re.search(self.pattern, path) is None):
            return False
        rx = re.compile(self.frame_pattern)
        with os.scandir(path) as it:
            return any(rx.search(e.name) and e.is_file() for e in it)

    def load(self, source: Any) -> list[_Encoded]:
        path = str(source)
        if not os.path.isdir(path):
            raise SourceError(f"{path}: not a folder of frames")
        files = self.frame_files(path)
        if not files:
            raise SourceError(f"{path}: no frame files matching {self.frame_pattern!r}")
        return [self._frame(_read(p), p, SourceError) for p in files]

    def _frame(self, data: bytes, what: str, error: type[Exception]) -> _Encoded:
        im = _open(data, what, error)
        if im.format == "JPEG" and im.mode in ("L", "RGB"):
            out = _Encoded(data)
            out.shape = (im.height, im.width, _channels(im.mode))
            return out
        return _save(im, "JPEG", self.quality)

    def encode(self, value: Any) -> list[bytes]:
        if isinstance(value, np.ndarray) and value.ndim in (3, 4) and value.dtype == np.uint8:
            value = list(value)
        if isinstance(value, (bytes, str)) or not isinstance(value, Sequence | np.ndarray):
            raise SchemaError(f"expected a sequence of frames (arrays or JPEG bytes), got {type(value).__name__}")
        if not len(value):
            raise SchemaError("a video needs at least one frame")
        out: list[bytes] = []
        first: tuple[int, int, int] | None = None
        for k, frame in enumerate(value):
            what = f"frame {k}"
            if isinstance(frame, _Encoded):
                enc = frame
            elif isinstance(frame, np.ndarray) and frame.ndim >= 2:
                im = _from_array(frame, what)
                if im.mode == "RGBA":
                    raise SchemaError(f"{what}: JPEG frames have no alpha channel: pass HxWx3")
                enc = _save(im, "JPEG", self.quality)
            elif isinstance(frame, (bytes, bytearray, memoryview, np.ndarray)):
                enc = self._frame(bytes(memoryview(frame).cast("B")), what, SchemaError)
            else:
                raise SchemaError(f"{what}: expected an array or JPEG bytes, got {type(frame).__name__}")
            if first is None:
                first = enc.shape
            elif enc.shape != first:
                raise SchemaError(f"{what} is {_fmt(enc.shape)}, frame 0 is {_fmt(first)}: a video's frames must agree")
            out.append(bytes(enc))
        return out

    def decode_blob(self, blob: Any) -> np.ndarray:
        """One stored frame as an ``(H, W, C)`` uint8 array (:mod:`h5store.jpeg`: GIL released)."""
        return _fast(blob, "stored frame")

    def frame_shape(self, blob: Any, min_size: tuple[int, int] | None = None) -> tuple[int, int, int]:
        """``(H, W, C)`` of a stored frame once decoded (from its header when it can)."""
        shape = jpeg.header(blob, min_size)
        return shape if shape is not None else tuple(_fast(blob, "stored frame", min_size).shape)  # type: ignore[return-value]

    def decode_into(self, blob: Any, out: np.ndarray, min_size: tuple[int, int] | None = None) -> np.ndarray:
        """Decode one stored frame into ``out`` (a C-contiguous ``(H, W, C)`` uint8 slot of a batch)."""
        try:
            return jpeg.decode(blob, out=out, min_size=min_size)
        except ValueError as e:
            raise SchemaError(f"stored frame: not a decodable image ({e})") from None

    def decode_frames_into(self, blobs: Any, out: np.ndarray, min_size: tuple[int, int] | None = None) -> None:
        """Decode a clip's stored frames into ``out[k]`` (a ``(K, H, W, C)`` slot of a batch; :func:`jpeg.decode_many`).

        A subclass that overrides :meth:`decode_into` (its own colour conversion, another
        codec) has its frames decoded by it, one by one.
        """
        if type(self).decode_into is not EncodedFrames.decode_into:
            for k, blob in enumerate(blobs):
                self.decode_into(blob, out[k], min_size)
            return
        try:
            jpeg.decode_many(blobs, out, min_size)
        except ValueError as e:
            raise SchemaError(f"stored frame: not a decodable image ({e})") from None

    def decode(self, raw: Any) -> np.ndarray:
        if not len(raw):
            return np.zeros((0, 0, 0, 3), np.uint8)
        first = self.decode_blob(raw[0])
        out = np.empty((len(raw), *first.shape), np.uint8)
        out[0] = first
        for k in range(1, len(raw)):
            self.decode_into(raw[k], out[k])
        return out

    def display_kind(self) -> str:
        return "frames"


def _fast(data: Any, what: str, min_size: tuple[int, int] | None = None) -> np.ndarray:
    """A stored JPEG (or PNG) decoded by :mod:`h5store.jpeg`; corrupt data raises SchemaError naming ``what``."""
    if not jpeg.is_jpeg(data):
        return _to_array(_open(_bytes(data), what, SchemaError))
    try:
        return jpeg.decode(data, min_size=min_size)
    except ValueError as e:
        raise SchemaError(f"{what}: not a decodable image ({e})") from None


def _fmt(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))
