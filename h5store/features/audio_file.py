"""Reading audio files as every h5store audio feature does: :func:`read_audio`.

soundfile decodes the file (every format libsndfile knows: 8/16/24/32-bit integer and
float WAV, FLAC, OGG/Vorbis, AIFF...); the file is refused with a
:class:`~h5store.errors.SourceError` naming the reason when it is missing, not a regular
file, empty, undecodable, truncated (:func:`check_file` and the container checks compare
what a header declares with what the file holds), or holds NaN/inf; channels are averaged
to mono, and the signal is resampled (:func:`resample`: the values of :func:`librosa.resample`,
computed with soxr alone) when the file's rate differs from the one asked for.

soundfile and soxr are imported inside the functions: ``import h5store`` stays light, and a
create's workers never import librosa (seconds of imports and numba compilation per process).
"""

from __future__ import annotations

import os
import stat
import struct
from typing import Any

import numpy as np

from h5store.errors import SourceError

__all__ = ["AUDIO_PATTERN", "check_file", "read_audio", "resample"]

AUDIO_PATTERN = r"(?i)\.(wav|flac|ogg|oga|mp3|aiff?)$"

# WAVE format tags whose block_align is exactly one frame (PCM, IEEE float, A-law, mu-law,
# and WAVE_FORMAT_EXTENSIBLE, which libsndfile writes for PCM/float only).
_FRAME_ALIGNED = {0x0001, 0x0003, 0x0006, 0x0007, 0xFFFE}
# A data chunk size a streaming writer leaves when it never learned the length.
_UNKNOWN_SIZES = {0, 0xFFFFFFFF}


# --------------------------------------------------------------------------- decoding
def check_file(path: str) -> int:
    """The size of ``path``; :class:`~h5store.errors.SourceError` unless it is a non-empty regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot stat ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(f"{path}: not a regular file")
    if st.st_size == 0:
        raise SourceError(f"{path}: empty file (0 bytes)")
    return int(st.st_size)


def _chunks(fh: Any, pos: int, size: int, end: str) -> Any:
    """Yield ``(id, body offset, declared size)`` of the IFF/RIFF chunks from ``pos``."""
    while pos + 8 <= size:
        fh.seek(pos)
        hdr = fh.read(8)
        if len(hdr) < 8:
            return
        csize = struct.unpack(end + "I", hdr[4:])[0]
        yield hdr[:4], pos + 8, csize
        pos += 8 + csize + (csize & 1)  # chunks are padded to an even size


def _truncated(path: str, declared: int, held: int, frame_bytes: int | None) -> None:
    if held >= declared:
        return
    if frame_bytes:
        raise SourceError(
            f"{path}: truncated: header declares {declared // frame_bytes} frames, file holds {held // frame_bytes}"
        )
    raise SourceError(f"{path}: truncated: header declares {declared} bytes of audio data, file holds {held}")


def _check_declared_length(path: str, size: int) -> None:
    """Refuse a WAV (RIFF, RIFX, RF64), AIFF or Ogg file that holds less audio than it declares.

    libsndfile (and Python's ``wave``) silently decode a truncated file, returning the
    frames present: the header's declared length is the only witness of what is missing.
    Streamed WAVs (data size 0 or 0xFFFFFFFF, no ds64) and other containers are left to
    soundfile.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(12)
            if len(head) < 12:
                return
            if head[:4] in (b"RIFF", b"RIFX", b"RF64", b"BW64") and head[8:12] == b"WAVE":
                _check_wav(path, fh, size, "<" if head[:4] != b"RIFX" else ">")
            elif head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
                _check_aiff(path, fh, size)
            elif head[:4] == b"OggS":
                _check_ogg(path, fh, size)
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror or e})") from None


def _check_wav(path: str, fh: Any, size: int, end: str) -> None:
    tag = align = big = None
    for cid, body, csize in _chunks(fh, 12, size, end):
        if cid == b"ds64":  # RF64: the real 64-bit data size
            ds = fh.read(16)
            big = struct.unpack("<Q", ds[8:16])[0] if len(ds) == 16 else None
        elif cid == b"fmt ":
            fmt = fh.read(min(csize, 16))
            if len(fmt) >= 14:
                tag, align = struct.unpack(end + "H", fmt[:2])[0], struct.unpack(end + "H", fmt[12:14])[0]
        elif cid == b"data":
            if csize == 0xFFFFFFFF and big is not None:
                csize = big
            elif csize in _UNKNOWN_SIZES:
                return
            _truncated(path, csize, max(size - body, 0), align if tag in _FRAME_ALIGNED else None)
            return


def _check_aiff(path: str, fh: Any, size: int) -> None:
    frames = None
    for cid, body, csize in _chunks(fh, 12, size, ">"):
        if cid == b"COMM":
            comm = fh.read(6)
            frames = struct.unpack(">I", comm[2:6])[0] if len(comm) == 6 else None
        elif cid == b"SSND":
            declared = csize - 8  # after the chunk's offset and block size fields
            if declared <= 0:
                return
            frame_bytes = declared // frames if frames and declared % frames == 0 else None
            _truncated(path, declared, max(size - body - 8, 0), frame_bytes)
            return


def _check_ogg(path: str, fh: Any, size: int) -> None:
    """Refuse an Ogg file whose last page is cut, or that ends without an end-of-stream page.

    An Ogg stream declares no length up front: libsndfile takes the last page's granule
    position as the length and silently decodes a truncated file to the frames present.
    """
    start = max(0, size - (1 << 16))  # a page is at most 65,307 bytes
    fh.seek(start)
    tail = fh.read()
    i = len(tail)
    while True:
        i = tail.rfind(b"OggS", 0, i)
        if i < 0:
            return  # no page header in the last 64 KiB: not ours to judge
        if i + 5 < len(tail) and tail[i + 4] == 0:  # stream structure version 0
            break
    cut = f"{path}: truncated: the last Ogg page (at byte {start + i}) is cut"
    if i + 27 > len(tail) or i + 27 + tail[i + 26] > len(tail):
        raise SourceError(cut)
    nseg = tail[i + 26]
    if i + 27 + nseg + sum(tail[i + 27 : i + 27 + nseg]) > len(tail):
        raise SourceError(cut)
    if not tail[i + 5] & 0x04:
        raise SourceError(f"{path}: truncated: the Ogg stream ends without its end-of-stream page")


def resample(y: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """``librosa.resample(y, orig_sr=orig_sr, target_sr=target_sr, axis=0)`` (its default,
    ``res_type="soxr_hq"``), with soxr alone: the same values without importing librosa.

    Each channel (column) is resampled by soxr at "HQ" quality, then cut or zero-padded to
    ``ceil(len(y) * target_sr / orig_sr)`` samples, as librosa's ``fix=True`` does.

    Examples
    --------
    >>> resample(np.zeros(1600, np.float32), 16000, 8000).shape
    (800,)
    """
    import soxr

    if orig_sr == target_sr:
        return y
    n = int(np.ceil(y.shape[0] * (float(target_sr) / orig_sr)))
    cols = y[:, None] if y.ndim == 1 else y
    out = np.zeros((n, cols.shape[1]), dtype=y.dtype)
    for c in range(cols.shape[1]):
        r = soxr.resample(np.ascontiguousarray(cols[:, c]), orig_sr, target_sr, quality="soxr_hq")
        out[: min(n, len(r)), c] = r[:n]
    return out[:, 0] if y.ndim == 1 else out


def read_audio(source: str, sr: int | None = None, mono: bool = True, dtype: str = "float32",
               channels: int | None = None) -> tuple[np.ndarray, int]:
    """Decode an audio file as every h5store audio feature does.

    Parameters
    ----------
    source : str
        Path of the file (an :class:`~h5store.Source` is a str).
    sr : int or None
        Resample to this rate (:func:`resample`, librosa's values) when the file's rate differs;
        None keeps the file's rate.
    mono : bool
        Average the channels: the result is ``(T,)``. Else ``(T, C)``.
    dtype : str
        A float dtype for the samples (in [-1, 1] for integer formats).
    channels : int or None
        With ``mono=False``, refuse files with a different number of channels.

    Returns
    -------
    (samples, sr)
        The signal and its sample rate.

    Raises
    ------
    SourceError
        With the reason: no such file, not a regular file, empty file, cannot decode,
        truncated (a WAV/AIFF header or FLAC stream info declares more frames than the
        file holds; an Ogg stream's last page is cut or missing), decoded length is 0,
        non-finite samples, or a channel count other than ``channels``.

    Examples
    --------
    >>> import numpy as np, soundfile as sf, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "tone.wav")
    >>> sf.write(path, np.zeros((1600, 2)), 16000)
    >>> y, sr = read_audio(path, sr=8000)
    >>> y.shape, sr
    ((800,), 8000)
    """
    import soundfile as sf

    path = str(source)
    size = check_file(path)
    _check_declared_length(path, size)
    try:
        with sf.SoundFile(path) as f:
            declared, native = int(f.frames), int(f.samplerate)
            data = f.read(dtype="float64" if np.dtype(dtype).itemsize > 4 else "float32", always_2d=True)
    except (RuntimeError, ValueError, TypeError) as e:  # LibsndfileError is a RuntimeError
        raise SourceError(f"{path}: cannot decode ({e})") from None
    if len(data) == 0:
        raise SourceError(f"{path}: decoded length is 0")
    if len(data) < declared:
        raise SourceError(f"{path}: truncated: header declares {declared} frames, decoded {len(data)}")
    # A sum is finite iff every sample is (or it overflowed): the exact scan runs only then.
    if not np.isfinite(data.sum()):
        bad = ~np.isfinite(data).all(axis=1)
        if bad.any():
            raise SourceError(f"{path}: non-finite samples (NaN or inf), first at frame {int(np.argmax(bad))}")
    if mono:
        y = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=data.dtype)
    else:
        if channels is not None and data.shape[1] != channels:
            raise SourceError(f"{path}: has {data.shape[1]} channels, expected {channels}")
        y = data
    out_sr = native
    if sr is not None and sr != native:
        y = resample(y, native, sr)
        out_sr = sr
        if len(y) == 0:
            raise SourceError(f"{path}: decoded length is 0 after resampling {native} -> {sr} Hz")
    return np.ascontiguousarray(y, dtype=dtype), out_sr
