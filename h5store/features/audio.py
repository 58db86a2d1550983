"""Audio features: waveforms and spectrograms computed from audio files.

Every feature here decodes its source the same way (:func:`read_audio`): soundfile
reads it (every format libsndfile knows: 8/16/24/32-bit integer and float WAV, FLAC,
OGG/Vorbis, AIFF...), the file is refused with a :class:`~h5store.errors.SourceError`
naming the reason when it is empty, undecodable, truncated, or holds NaN/inf, channels
are averaged to mono, and the signal is resampled with :func:`librosa.resample` when the
file's rate differs from the feature's ``sr``.

soundfile and librosa are imported inside the functions that use them: ``import
h5store`` stays light.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import struct
from typing import Any

import numpy as np

from h5store.errors import SchemaError, SourceError
from h5store.schema import Feature

__all__ = [
    "AUDIO_PATTERN",
    "MFCC",
    "Audio",
    "MagSpectrogram",
    "MelSpectrogram",
    "check_file",
    "read_audio",
]

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


def read_audio(source: str, sr: int | None = None, mono: bool = True, dtype: str = "float32",
               channels: int | None = None) -> tuple[np.ndarray, int]:
    """Decode an audio file as every h5store audio feature does.

    Parameters
    ----------
    source : str
        Path of the file (an :class:`~h5store.Source` is a str).
    sr : int or None
        Resample to this rate with :func:`librosa.resample` when the file's rate differs;
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
        import librosa

        y = librosa.resample(y, orig_sr=native, target_sr=sr, axis=0)
        out_sr = sr
        if len(y) == 0:
            raise SourceError(f"{path}: decoded length is 0 after resampling {native} -> {sr} Hz")
    return np.ascontiguousarray(y, dtype=dtype), out_sr


# --------------------------------------------------------------------------- helpers
def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _positive(out: list[str], name: str, v: Any, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not _is_int(v) or v <= 0:
        out.append(f"{name} must be an int > 0{' or None' if optional else ''}, got {v!r}")


def _same_params(new: Feature, existing: Feature | None, names: tuple[str, ...]) -> None:
    """Refuse appending with parameters that would make the stored items disagree."""
    if existing is None or type(existing) is not type(new):
        return
    diff = [f"{n}={getattr(existing, n)!r} stored, {getattr(new, n)!r} declared"
            for n in names if getattr(existing, n) != getattr(new, n)]
    if diff:
        raise SchemaError(f"{type(new).__name__}: the file was filled with other parameters: {'; '.join(diff)}")


class Audio(Feature):
    """The waveform of an audio file, resampled to ``sr``, as float samples.

    Parameters
    ----------
    sr : int or None
        Sample rate to store. None learns it in :meth:`prepare` from the first source
        (or the file being appended to), and resamples every other source to it, so the
        stored rate is always known and uniform.
    mono : bool
        Average channels: items are ``(T,)``. With ``mono=False`` items are ``(T, channels)``.
    channels : int or None
        Required with ``mono=False``: files with another channel count are refused.
    dtype : str
        float32 (default) or float64.

    The stored ``shape`` is derived from ``mono``/``channels``. Sources are refused with a
    :class:`~h5store.errors.SourceError` naming the reason (see :func:`read_audio`).

    Examples
    --------
    >>> import h5store as h5s
    >>> class Clips(h5s.TypedFile):
    ...     audio = h5s.Audio(sr=16000)
    >>> Clips.audio.spec().shape
    (None,)
    >>> h5s.Audio(mono=False, channels=2).spec().shape
    (None, 2)
    """

    type_name = "h5store.Audio"
    sr: int | None = None
    mono: bool = True
    channels: int | None = None
    pattern: str | None = AUDIO_PATTERN
    finite: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        shape = (None, self.channels) if not self.mono and _is_int(self.channels) else (None,)
        object.__setattr__(self, "shape", shape)

    def problems(self) -> list[str]:
        out = super().problems()
        _positive(out, "sr", self.sr, optional=True)
        if not isinstance(self.mono, bool):
            out.append(f"mono must be a bool, got {self.mono!r}")
        _positive(out, "channels", self.channels, optional=True)
        if self.mono is False and self.channels is None:
            out.append("mono=False needs channels=<number of channels>")
        if self.mono is True and self.channels is not None:
            out.append("channels applies only with mono=False")
        if self.dtype not in ("float32", "float64"):
            out.append(f"dtype must be float32 or float64, got {self.dtype!r}")
        return out

    def prepare(self, sources: list[Any], existing: Feature | None = None) -> Audio:
        _same_params(self, existing, ("mono", "channels") + (("sr",) if self.sr is not None else ()))
        if self.sr is not None:
            return self
        sr = getattr(existing, "sr", None)
        if sr is None:
            sr = _first_rate(sources)
        return self if sr is None else dataclasses.replace(self, sr=sr)

    def load(self, source: Any) -> np.ndarray:
        return read_audio(source, sr=self.sr, mono=self.mono, dtype=self.dtype, channels=self.channels)[0]


def _first_rate(sources: list[Any]) -> int | None:
    """The sample rate of the first source soundfile can open (None if none can)."""
    import soundfile as sf

    for s in sources:
        try:
            return int(sf.info(str(s)).samplerate)
        except (RuntimeError, ValueError, TypeError, OSError):
            continue  # a bad source is reported when it is loaded
    return None


# --------------------------------------------------------------------------- spectrograms
class _Spectral(Feature):
    """Shared parameters and decoding of the STFT-based features (not used directly)."""

    type_name = "h5store._Spectral"
    sr: int
    n_fft: int = 1024
    hop_length: int = 256
    win_length: int | None = None
    window: Any = "hann"
    center: bool = True
    pattern: str | None = AUDIO_PATTERN
    finite: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.window, list):
            object.__setattr__(self, "window", tuple(self.window))
        n = self._bins()
        object.__setattr__(self, "shape", (None, n) if _is_int(n) and n >= 0 else (None,))

    def _bins(self) -> Any:
        return 1 + self.n_fft // 2 if _is_int(self.n_fft) else None

    def problems(self) -> list[str]:
        out = super().problems()
        _positive(out, "sr", self.sr)
        _positive(out, "n_fft", self.n_fft)
        _positive(out, "hop_length", self.hop_length)
        _positive(out, "win_length", self.win_length, optional=True)
        if _is_int(self.win_length) and _is_int(self.n_fft) and self.win_length > self.n_fft:
            out.append(f"win_length must be <= n_fft ({self.n_fft}), got {self.win_length}")
        w = self.window
        if not (isinstance(w, str) or (isinstance(w, tuple) and w and isinstance(w[0], str))):
            out.append(f"window must be a window name (or [name, param...]), got {w!r}")
        if not isinstance(self.center, bool):
            out.append(f"center must be a bool, got {self.center!r}")
        if _valid_dtype(self.dtype) and np.dtype(self.dtype).kind != "f":
            out.append(f"dtype must be a float dtype, got {self.dtype!r}")
        return out

    def prepare(self, sources: list[Any], existing: Feature | None = None) -> Feature:
        from scipy.signal import get_window

        try:
            get_window(self.window, self.win_length or self.n_fft)
        except (ValueError, TypeError) as e:
            raise SchemaError(f"{type(self).__name__}: window {self.window!r} is not usable ({e})") from None
        _same_params(self, existing, _DATA_PARAMS + self._data_params())
        return self

    def _data_params(self) -> tuple[str, ...]:
        return ()

    def audio(self, source: Any) -> np.ndarray:
        """The mono float32 signal at ``sr`` that this feature transforms."""
        return read_audio(source, sr=self.sr, mono=True, dtype="float32")[0]

    def magnitude(self, source: Any) -> np.ndarray:
        """``|STFT|`` of the source's audio, shared by the spectral features of one source.

        A worker loads every feature of a source in turn: mel, magnitude and MFCC with the
        same ``sr`` and STFT parameters decode the file and run the STFT once. The last result
        is kept (one entry, keyed by path, size, mtime and parameters), never more.
        """
        import librosa

        try:
            st = os.stat(str(source))
        except OSError:
            check_file(str(source))  # raises the SourceError naming the reason
            raise
        key = (str(source), st.st_size, st.st_mtime_ns, self.sr, tuple(sorted(self._stft_kwargs().items())))
        if _LAST_STFT.get("key") != key:
            _LAST_STFT.clear()
            _LAST_STFT["value"] = np.abs(librosa.stft(self.audio(source), **self._stft_kwargs()))
            _LAST_STFT["key"] = key
        return _LAST_STFT["value"]

    def _stft_kwargs(self) -> dict[str, Any]:
        return dict(n_fft=self.n_fft, hop_length=self.hop_length, win_length=self.win_length,
                    window=self.window, center=self.center)

    @property
    def frames_per_second(self) -> float:
        """Rows of an item per second of audio (``sr / hop_length``)."""
        return self.sr / self.hop_length

    def _store(self, s: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(s.T, dtype=self.dtype)


_DATA_PARAMS = ("sr", "n_fft", "hop_length", "win_length", "window", "center")
_LAST_STFT: dict[str, Any] = {}  # the last |STFT| computed in this process (see _Spectral.magnitude)
_LOGS = (False, True, "db", "log")


def _valid_dtype(d: Any) -> bool:
    try:
        np.dtype(d)
    except TypeError:
        return False
    return True


def _log(s: np.ndarray, log: Any, power: float) -> np.ndarray:
    if log is False:
        return s
    if log == "db":
        import librosa

        if power == 2.0:
            return librosa.power_to_db(s, ref=1.0)
        if power == 1.0:
            return librosa.amplitude_to_db(s, ref=1.0)
        return librosa.power_to_db(s ** (2.0 / power), ref=1.0)
    return np.log(np.maximum(s, 1e-5))


def _check_log(out: list[str], log: Any, power: Any) -> None:
    if not any(log is v or (isinstance(log, str) and log == v) for v in _LOGS):
        out.append(f"log must be False, 'db' or 'log' (True means 'log'), got {log!r}")
    if not _is_num(power) or power <= 0:
        out.append(f"power must be a number > 0, got {power!r}")


class MagSpectrogram(_Spectral):
    """``|STFT|**power`` of the audio at ``sr``, time on the first axis.

    Items are ``(frames, 1 + n_fft // 2)`` float32, computed with :func:`librosa.stft` on
    the signal :func:`read_audio` returns (mono, resampled to ``sr``).

    Parameters
    ----------
    sr : int
        Sample rate the audio is resampled to first.
    n_fft, hop_length, win_length, window, center
        As :func:`librosa.stft`.
    power : float
        1 for magnitude, 2 for power.
    log : {False, "db", "log"}
        "db": :func:`librosa.amplitude_to_db` (power 1) or :func:`librosa.power_to_db`
        (power 2) with ``ref=1.0``; "log" (or True): ``log(max(S, 1e-5))``.

    Notes
    -----
    Spectral features with the same ``sr`` and STFT parameters share one decode and one
    STFT per source (see :meth:`magnitude`): a mel and a magnitude spectrogram of the same
    files cost little more than one of them.

    Examples
    --------
    >>> import h5store as h5s
    >>> h5s.MagSpectrogram(sr=22050, n_fft=1024).spec().shape
    (None, 513)
    """

    type_name = "h5store.MagSpectrogram"
    power: float = 1.0
    log: Any = False

    def problems(self) -> list[str]:
        out = super().problems()
        _check_log(out, self.log, self.power)
        return out

    def _data_params(self) -> tuple[str, ...]:
        return ("power", "log")

    def load(self, source: Any) -> np.ndarray:
        s = self.magnitude(source)
        if self.power != 1.0:
            s = s**self.power
        return self._store(_log(s, self.log, self.power))


class MelSpectrogram(_Spectral):
    """A mel spectrogram (:func:`librosa.feature.melspectrogram`), time on the first axis.

    Items are ``(frames, n_mels)`` float32.

    Parameters
    ----------
    sr : int
        Sample rate the audio is resampled to first.
    n_fft, hop_length, win_length, window, center
        As :func:`librosa.stft`.
    n_mels, fmin, fmax
        The mel filter bank (``fmax=None`` is ``sr / 2``).
    power : float
        Exponent of the magnitude before the filter bank (2: power, 1: energy).
    log : {False, "db", "log"}
        "db": :func:`librosa.power_to_db` (``ref=1.0``); "log" (or True):
        ``log(max(S, 1e-5))``, the usual TTS (Tacotron/HiFi-GAN) log-mel.

    Notes
    -----
    Spectral features with the same ``sr`` and STFT parameters share one decode and one
    STFT per source (see :meth:`magnitude`): a mel and a magnitude spectrogram of the same
    files cost little more than one of them.

    Examples
    --------
    >>> import h5store as h5s
    >>> class Speech(h5s.TypedFile):
    ...     mel = h5s.MelSpectrogram(sr=22050, n_fft=1024, hop_length=256, n_mels=80, log="log")
    >>> Speech.mel.spec().shape, Speech.mel.frames_per_second
    ((None, 80), 86.1328125)
    """

    type_name = "h5store.MelSpectrogram"
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = None
    power: float = 2.0
    log: Any = False

    def _bins(self) -> Any:
        return self.n_mels

    def problems(self) -> list[str]:
        out = super().problems()
        _check_mel(out, self)
        _check_log(out, self.log, self.power)
        return out

    def _data_params(self) -> tuple[str, ...]:
        return ("n_mels", "fmin", "fmax", "power", "log")

    def load(self, source: Any) -> np.ndarray:
        import librosa

        # The same values as melspectrogram(y=...): librosa computes |STFT|**power first too.
        s = librosa.feature.melspectrogram(
            S=self.magnitude(source) ** self.power, sr=self.sr, n_fft=self.n_fft,
            n_mels=self.n_mels, fmin=self.fmin, fmax=self.fmax,
        )
        return self._store(_log(s, self.log, self.power))


def _check_mel(out: list[str], f: Any) -> None:
    _positive(out, "n_mels", f.n_mels)
    if not _is_num(f.fmin) or f.fmin < 0:
        out.append(f"fmin must be a number >= 0, got {f.fmin!r}")
    if f.fmax is not None:
        if not _is_num(f.fmax) or (_is_num(f.fmin) and f.fmax <= f.fmin):
            out.append(f"fmax must be None or a number > fmin ({f.fmin!r}), got {f.fmax!r}")
        elif _is_int(f.sr) and f.fmax > f.sr / 2:
            out.append(f"fmax must be <= sr / 2 ({f.sr / 2}), got {f.fmax!r}")


class MFCC(_Spectral):
    """Mel-frequency cepstral coefficients (:func:`librosa.feature.mfcc`), time first.

    Items are ``(frames, n_mfcc)`` float32: the DCT-II (orthonormal) of the dB mel power
    spectrogram.

    Parameters
    ----------
    sr : int
        Sample rate the audio is resampled to first.
    n_mfcc : int
        Coefficients kept (at most ``n_mels``).
    n_fft, hop_length, win_length, window, center
        As :func:`librosa.stft`.
    n_mels, fmin, fmax
        The mel filter bank.

    Examples
    --------
    >>> import h5store as h5s
    >>> h5s.MFCC(sr=16000, n_mfcc=13).spec().shape
    (None, 13)
    """

    type_name = "h5store.MFCC"
    n_mfcc: int = 20
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = None

    def _bins(self) -> Any:
        return self.n_mfcc

    def problems(self) -> list[str]:
        out = super().problems()
        _positive(out, "n_mfcc", self.n_mfcc)
        _check_mel(out, self)
        if _is_int(self.n_mfcc) and _is_int(self.n_mels) and self.n_mfcc > self.n_mels:
            out.append(f"n_mfcc must be <= n_mels ({self.n_mels}), got {self.n_mfcc}")
        return out

    def _data_params(self) -> tuple[str, ...]:
        return ("n_mfcc", "n_mels", "fmin", "fmax")

    def load(self, source: Any) -> np.ndarray:
        import librosa

        # mfcc(y=...) is the DCT of power_to_db(melspectrogram(y, power=2)): the same from |STFT|.
        mel = librosa.feature.melspectrogram(
            S=self.magnitude(source) ** 2.0, sr=self.sr, n_fft=self.n_fft,
            n_mels=self.n_mels, fmin=self.fmin, fmax=self.fmax,
        )
        m = librosa.feature.mfcc(S=librosa.power_to_db(mel), n_mfcc=self.n_mfcc)
        return self._store(m)
