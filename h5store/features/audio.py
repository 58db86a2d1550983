"""Audio features: waveforms and spectrograms computed from audio files.

Every feature here decodes its source the same way (:func:`read_audio`, in
:mod:`h5store.features.audio_file`, re-exported here): soundfile
reads it (every format libsndfile knows: 8/16/24/32-bit integer and float WAV, FLAC,
OGG/Vorbis, AIFF...), the file is refused with a :class:`~h5store.errors.SourceError`
naming the reason when it is empty, undecodable, truncated, or holds NaN/inf, channels
are averaged to mono, and the signal is resampled (the values of :func:`librosa.resample`,
computed with soxr) when the file's rate differs from the feature's ``sr``.

The spectral features compute librosa's values in plain numpy (:mod:`h5store.spectral`:
bit-identical STFT magnitudes and mel filter banks, tested against librosa), so neither
``import h5store`` nor a create's workers import librosa (seconds of imports and numba
compilation per process); soundfile and soxr are imported inside the functions that use them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from h5store.errors import SchemaError
from h5store.features.audio_file import AUDIO_PATTERN, check_file, read_audio
from h5store.schema import Feature
from h5store.spectral import amplitude_to_db, mel_filterbank, power_to_db, stft_magnitude, window

__all__ = [
    "AUDIO_PATTERN",
    "MFCC",
    "Audio",
    "MagSpectrogram",
    "MelSpectrogram",
    "check_file",
    "read_audio",
]


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

    def display_kind(self) -> str:
        return "waveform"

    def sound(self, item: Any) -> tuple[np.ndarray, int, str] | None:
        x = np.asarray(item)
        return (x if x.ndim == 1 else x.mean(axis=1), int(self.sr), "stored audio") if self.sr else None

    def rows_per_second(self) -> float | None:
        return float(self.sr) if self.sr else None


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
        try:
            window(self.window, self.win_length or self.n_fft)
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
        """``|STFT|`` of the source's audio, time on the first axis, shared by the spectral
        features of one source: ``np.abs(librosa.stft(y, ...)).T``, computed in plain numpy
        (:func:`h5store.spectral.stft_magnitude`, bit-identical to librosa's).

        A worker loads every feature of a source in turn: mel, magnitude and MFCC with the
        same ``sr`` and STFT parameters decode the file and run the STFT once. The last result
        is kept (one entry, keyed by path, size, mtime and parameters), never more.
        """
        try:
            st = os.stat(str(source))
        except OSError:
            check_file(str(source))  # raises the SourceError naming the reason
            raise
        key = (str(source), st.st_size, st.st_mtime_ns, self.sr, tuple(sorted(self._stft_kwargs().items())))
        if _LAST_STFT.get("key") != key:
            _LAST_STFT.clear()
            value = stft_magnitude(self.audio(source), self.n_fft, self.hop_length, self.win_length, self.window,
                                   self.center)
            value.flags.writeable = False  # shared by the features of the source: none may change it
            _LAST_STFT["value"] = value
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
        out = np.ascontiguousarray(s, dtype=self.dtype)
        # The shared |STFT| itself (power 1, no log): the item is the caller's, a copy.
        return out.copy() if out is _LAST_STFT.get("value") else out

    def display_kind(self) -> str:
        return "spectrogram"

    def rows_per_second(self) -> float | None:
        return self.frames_per_second


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
        if power == 2.0:
            return power_to_db(s, ref=1.0)
        if power == 1.0:
            return amplitude_to_db(s, ref=1.0)
        return power_to_db(s ** (2.0 / power), ref=1.0)
    return np.log(np.maximum(s, 1e-5))


def _check_log(out: list[str], log: Any, power: Any) -> None:
    if not any(log is v or (isinstance(log, str) and log == v) for v in _LOGS):
        out.append(f"log must be False, 'db' or 'log' (True means 'log'), got {log!r}")
    if not _is_num(power) or power <= 0:
        out.append(f"power must be a number > 0, got {power!r}")


class MagSpectrogram(_Spectral):
    """``|STFT|**power`` of the audio at ``sr``, time on the first axis.

    Items are ``(frames, 1 + n_fft // 2)`` float32: the values of :func:`librosa.stft`
    (computed by :func:`h5store.spectral.stft_magnitude`) on the signal :func:`read_audio` returns (mono, resampled to ``sr``).

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

    def sound(self, item: Any) -> tuple[np.ndarray, int, str]:
        """The item as audio: Griffin-Lim phases for the stored magnitudes (rougher than the source)."""
        import librosa

        v = np.asarray(item, dtype=np.float64).T
        mag = 10.0 ** (v / 20.0) if self.log == "db" else _unlog(v, self.log) ** (1.0 / self.power)
        y = librosa.griffinlim(mag, n_iter=32, hop_length=self.hop_length, win_length=self.win_length,
                               window=self.window, center=self.center, n_fft=self.n_fft, random_state=0)
        return y, self.sr, "Griffin-Lim from the stored magnitudes (approximate)"


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
    The filter bank is applied to the ``|STFT|`` that spectral features with the same
    ``sr`` and STFT parameters share (one decode and one STFT per source, see
    :meth:`magnitude`): storing a magnitude spectrogram too costs little more.

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
        # The same values as melspectrogram(y=...): librosa computes |STFT|**power first too.
        return self._store(_log(_mel(self, source, self.power), self.log, self.power))

    def sound(self, item: Any) -> tuple[np.ndarray, int, str]:
        """The item as audio: the mel bands back to magnitudes, then Griffin-Lim (rough)."""
        import librosa

        v = np.asarray(item, dtype=np.float64).T
        mel = 10.0 ** (v * self.power / 20.0) if self.log == "db" else _unlog(v, self.log)
        mag = librosa.feature.inverse.mel_to_stft(mel, sr=self.sr, n_fft=self.n_fft, power=self.power,
                                                  fmin=self.fmin, fmax=self.fmax)
        y = librosa.griffinlim(mag, n_iter=32, hop_length=self.hop_length, win_length=self.win_length,
                               window=self.window, center=self.center, n_fft=self.n_fft, random_state=0)
        return y, self.sr, "Griffin-Lim from the mel spectrogram (approximate)"


def _mel(f: Any, source: Any, power: float) -> np.ndarray:
    """The mel filter bank of ``f`` (n_mels, fmin, fmax) applied to ``|STFT|**power`` of ``source``,
    time first: ``librosa.feature.melspectrogram(S=|STFT|**power, ...).T`` (the same filter bank,
    :func:`h5store.spectral.mel_filterbank`; one float32 matrix product)."""
    fb = mel_filterbank(f.sr, f.n_fft, f.n_mels, float(f.fmin), None if f.fmax is None else float(f.fmax))
    return (f.magnitude(source) ** power) @ fb.T


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
        from scipy.fft import dct  # scipy.fft alone: light, unlike scipy.signal or librosa

        # mfcc(y=...) is the orthonormal DCT-II of power_to_db(melspectrogram(y, power=2)) over mels.
        m = dct(power_to_db(_mel(self, source, 2.0)), axis=-1, type=2, norm="ortho")[:, : self.n_mfcc]
        return self._store(m)


def _unlog(v: np.ndarray, log: Any) -> np.ndarray:
    """Undo :func:`_log`'s natural log ("log", True); linear values (False) as they are."""
    return v if log is False else np.exp(v)
