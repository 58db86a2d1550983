"""Spectral features in plain numpy, equal to librosa's: STFT magnitude, mel filter bank, dB.

librosa computes these through numba-compiled helpers and imports ~3 s of modules (scipy.signal,
numba, its own submodules) in every process that touches it; in a fresh create that was most of
a worker's start-up. The functions here compute the same values with numpy alone:

* :func:`stft_magnitude` is ``np.abs(librosa.stft(y, ...))`` with time on the *first* axis. It
  frames the padded signal as librosa does (centre padding with zeros, ``pad_mode="constant"``),
  multiplies by the same float64 window (``scipy.signal.get_window(window, win_length,
  fftbins=True)`` centred in ``n_fft``), runs the same float64 ``numpy.fft.rfft`` and casts to
  complex64 before the magnitude, as librosa does: the values are bit-identical.
* :func:`mel_filterbank` is ``librosa.filters.mel`` (Slaney mel scale and norm, or HTK),
  reimplemented with the same formulas and the same order of float64 operations.
* :func:`power_to_db` and :func:`amplitude_to_db` are librosa's, same defaults.

Nothing here imports scipy or librosa, except :func:`window` for window names other than
``hann``/``hamming``/``boxcar`` (scipy.signal's ``get_window``, imported only then).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np

__all__ = ["amplitude_to_db", "mel_filterbank", "power_to_db", "stft_magnitude", "window"]

# Frames per rfft call: bounds the float64 scratch (frames x n_fft x 8 bytes, ~4 MiB at
# n_fft=1024) whatever the length of the signal.
_BLOCK_FRAMES = 512


def _general_cosine(m: int, a: tuple[float, ...]) -> np.ndarray:
    """scipy.signal.windows.general_cosine(m, a, sym=False), the same float64 operations."""
    if m <= 1:
        return np.ones(m)
    fac = np.linspace(-np.pi, np.pi, m + 1)
    w = np.zeros(m + 1)
    for k, ak in enumerate(a):
        w += ak * np.cos(k * fac)
    return w[:-1]


_COSINE = {"hann": (0.5, 0.5), "hanning": (0.5, 0.5), "hamming": (0.54, 1.0 - 0.54)}  # scipy: general_hamming(m, alpha)


@functools.lru_cache(maxsize=16)
def window(name: Any, length: int) -> np.ndarray:
    """The periodic (DFT-even) window ``scipy.signal.get_window(name, length, fftbins=True)``.

    ``hann``, ``hamming`` and ``boxcar`` (the common ones) are computed here with scipy's own
    formula; any other name, or a ``(name, parameter...)`` tuple, is asked of scipy.signal.
    The result is cached and read-only.

    Examples
    --------
    >>> w = window("hann", 8)
    >>> w.round(3).tolist()
    [0.0, 0.146, 0.5, 0.854, 1.0, 0.854, 0.5, 0.146]
    """
    if isinstance(name, str) and name in _COSINE:
        w = _general_cosine(length, _COSINE[name])
    elif isinstance(name, str) and name in ("boxcar", "box", "ones", "rect", "rectangular"):
        w = np.ones(length)
    else:
        from scipy.signal import get_window

        w = np.asarray(get_window(name, length, fftbins=True), dtype=np.float64)
    w.flags.writeable = False
    return w


@functools.lru_cache(maxsize=16)
def _fft_window(name: Any, win_length: int, n_fft: int) -> np.ndarray:
    """``window(name, win_length)`` centred in ``n_fft`` zeros (librosa's ``pad_center``)."""
    w = window(name, win_length)
    left = (n_fft - win_length) // 2
    out = np.zeros(n_fft)
    out[left : left + win_length] = w
    out.flags.writeable = False
    return out


def stft_magnitude(y: np.ndarray, n_fft: int = 2048, hop_length: int | None = None,
                   win_length: int | None = None, window_name: Any = "hann", center: bool = True) -> np.ndarray:
    """``|STFT|`` of a mono signal, time on the first axis: ``np.abs(librosa.stft(y, ...)).T``.

    Parameters
    ----------
    y : ndarray, shape (samples,)
        float32 (the result is float32, as librosa's) or float64 (float64).
    n_fft, hop_length, win_length, window_name, center
        As :func:`librosa.stft` (``window_name`` is its ``window``; padding is zeros).

    Returns
    -------
    ndarray, shape (frames, 1 + n_fft // 2)
        C-contiguous: ``1 + len(y) // hop_length`` frames when centred.

    Raises
    ------
    ValueError
        Without ``center``, when the signal is shorter than ``n_fft``.

    Examples
    --------
    >>> y = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000).astype(np.float32)
    >>> s = stft_magnitude(y, n_fft=512, hop_length=128)
    >>> s.shape, s.dtype, int(s[60].argmax())  # 440 Hz is bin 440 / (16000 / 512) = 14
    ((126, 257), dtype('float32'), 14)
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"stft_magnitude takes a mono signal (1-D), got shape {y.shape}")
    win_length = n_fft if win_length is None else win_length
    hop_length = win_length // 4 if hop_length is None else hop_length
    w = _fft_window(window_name, win_length, n_fft)
    if center:
        if n_fft > len(y):
            # librosa's warning, word for word: create reports it once per run
            warnings.warn(f"n_fft={n_fft} is too large for input signal of length={len(y)}", stacklevel=2)
        half = n_fft // 2
        padded = np.zeros(len(y) + 2 * half, dtype=y.dtype)
        padded[half : half + len(y)] = y
        y = padded
    elif len(y) < n_fft:
        raise ValueError(f"n_fft={n_fft} is too large for uncentered analysis of a signal of length {len(y)}")
    # (n_fft, frames) views: numpy's pocketfft runs transforms along a strided axis several at
    # a time (SIMD lanes), ~1.5x faster here than one contiguous row at a time.
    frames = np.lib.stride_tricks.sliding_window_view(y, n_fft)[::hop_length].T
    complex_t = np.complex64 if y.dtype == np.float32 else np.complex128
    out = np.empty((frames.shape[1], 1 + n_fft // 2), dtype=np.float32 if complex_t is np.complex64 else np.float64)
    col = w[:, None]
    for a in range(0, frames.shape[1], _BLOCK_FRAMES):
        b = min(a + _BLOCK_FRAMES, frames.shape[1])
        # float64 window product and rfft, stored as complex64, then the magnitude: librosa's steps.
        z = np.fft.rfft(col * frames[:, a:b], axis=0).astype(complex_t)
        np.abs(z, out=out[a:b].T)
    return out


def _hz_to_mel(f: np.ndarray, htk: bool) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    if htk:
        return 2595.0 * np.log10(1.0 + f / 700.0)
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_mel = 1000.0 / f_sp
    logstep = np.log(6.4) / 27.0
    if mels.ndim:
        high = f >= 1000.0
        mels[high] = min_log_mel + np.log(f[high] / 1000.0) / logstep
    elif f >= 1000.0:
        mels = min_log_mel + np.log(f / 1000.0) / logstep
    return mels


def _mel_to_hz(m: np.ndarray, htk: bool) -> np.ndarray:
    if htk:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    f_sp = 200.0 / 3
    freqs = f_sp * m
    min_log_mel = 1000.0 / f_sp
    logstep = np.log(6.4) / 27.0
    high = m >= min_log_mel
    freqs[high] = 1000.0 * np.exp(logstep * (m[high] - min_log_mel))
    return freqs


@functools.lru_cache(maxsize=16)
def mel_filterbank(sr: int, n_fft: int, n_mels: int = 128, fmin: float = 0.0, fmax: float | None = None,
                   htk: bool = False, dtype: str = "float32") -> np.ndarray:
    """The mel filter bank ``librosa.filters.mel(sr=..., n_fft=..., ...)`` (Slaney norm).

    Same formulas and order of operations as librosa (float64, cast to ``dtype`` at the end of
    each row), so the weights agree to the last bit. Cached per parameters, read-only.

    Returns
    -------
    ndarray, shape (n_mels, 1 + n_fft // 2)

    Examples
    --------
    >>> fb = mel_filterbank(16000, 512, n_mels=40)
    >>> fb.shape, fb.dtype, bool((fb >= 0).all())
    ((40, 257), dtype('float32'), True)
    """
    fmax = float(sr) / 2 if fmax is None else fmax
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=dtype)
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin, htk), _hz_to_mel(fmax, htk), n_mels + 2), htk)
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fftfreqs)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, np.newaxis]
    weights.flags.writeable = False
    return weights


def power_to_db(s: np.ndarray, ref: float = 1.0, amin: float = 1e-10, top_db: float | None = 80.0) -> np.ndarray:
    """``librosa.power_to_db(s, ref=ref, amin=amin, top_db=top_db)`` (a float ``ref``).

    Examples
    --------
    >>> power_to_db(np.array([1.0, 100.0, 0.0])).tolist()
    [0.0, 20.0, -60.0]
    """
    s = np.asarray(s)
    log_spec = 10.0 * np.log10(np.maximum(amin, s))
    log_spec -= 10.0 * np.log10(np.maximum(amin, abs(ref)))
    if top_db is not None:
        log_spec = np.maximum(log_spec, log_spec.max() - top_db)
    return log_spec


def amplitude_to_db(s: np.ndarray, ref: float = 1.0, amin: float = 1e-5, top_db: float | None = 80.0) -> np.ndarray:
    """``librosa.amplitude_to_db(s, ref=ref, amin=amin, top_db=top_db)`` (a float ``ref``).

    Examples
    --------
    >>> amplitude_to_db(np.array([1.0, 10.0])).tolist()
    [0.0, 20.0]
    """
    magnitude = np.abs(s)
    power = np.square(magnitude, out=magnitude)
    return power_to_db(power, ref=abs(ref) ** 2, amin=amin**2, top_db=top_db)
