"""h5store.spectral (and the audio features built on it) against librosa, on speech-like audio.

The spectral features no longer call librosa (its imports and numba compilation cost seconds
in every create worker); these tests hold them to librosa's values: STFT magnitudes, mel
filter banks, windows and resampling bit for bit, mel spectrograms (a different but equally
exact float32 matrix product) within 1e-5 relative, element by element.

The audio is made to look like speech to a spectrogram: voiced segments (a glottal pulse
train with a gliding pitch through three formant resonators), unvoiced fricative noise,
plosive bursts and digital silence, written as 16-bit PCM and read back (real quantisation).
"""

from __future__ import annotations

import librosa
import numpy as np
import pytest
import scipy.signal
import soundfile as sf

import h5store as h5s
from h5store import spectral
from h5store.features.audio_file import resample

SR = 16000


def speech_like(seconds: float = 2.5, sr: int = SR, seed: int = 0) -> np.ndarray:
    """Voiced vowels (pulse train + formants), fricatives, bursts and silence, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    total = int(seconds * sr)
    while sum(map(len, out)) < total:
        kind = rng.choice(["vowel", "vowel", "fricative", "burst", "silence"])
        n = int(rng.uniform(0.05, 0.3) * sr)
        if kind == "vowel":
            f0 = np.linspace(rng.uniform(90, 140), rng.uniform(150, 260), n)  # gliding pitch
            phase = np.cumsum(f0 / sr)
            pulses = (np.diff(np.floor(phase), prepend=0.0) > 0).astype(np.float64)
            x = pulses
            for formant, bw in zip(rng.uniform([300, 900, 2200], [800, 2000, 3200]), (80, 120, 180)):
                r = np.exp(-np.pi * bw / sr)
                x = scipy.signal.lfilter([1 - r], [1, -2 * r * np.cos(2 * np.pi * formant / sr), r * r], x)
            seg = x / (np.abs(x).max() + 1e-9) * rng.uniform(0.2, 0.8)
        elif kind == "fricative":
            b, a = scipy.signal.butter(4, rng.uniform(2500, 5000) / (sr / 2), "high")
            seg = scipy.signal.lfilter(b, a, rng.standard_normal(n)) * rng.uniform(0.02, 0.1)
        elif kind == "burst":
            seg = rng.standard_normal(n // 5) * np.exp(-np.arange(n // 5) / (0.004 * sr)) * 0.5
        else:
            seg = np.zeros(n)
        out.append(seg)
    return np.clip(np.concatenate(out)[:total], -1, 1)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """Two utterances as 16-bit wavs: (path, the float32 signal soundfile reads back)."""
    folder = tmp_path_factory.mktemp("speech")
    out = []
    for seed in (0, 1):
        path = folder / f"utt{seed}.wav"
        sf.write(str(path), speech_like(seed=seed), SR, subtype="PCM_16")
        out.append((str(path), sf.read(str(path), dtype="float32")[0]))
    return out


STFT_PARAMS = [
    dict(n_fft=1024, hop_length=256),
    dict(n_fft=512, hop_length=128, win_length=400),
    dict(n_fft=400, hop_length=160, window="hamming"),
    dict(n_fft=511, hop_length=100),  # odd n_fft
    dict(n_fft=256, hop_length=64, center=False),
    dict(n_fft=2048, hop_length=512, window=("kaiser", 8.0)),  # a window scipy computes
]


@pytest.mark.parametrize("kw", STFT_PARAMS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_stft_magnitude_is_librosa_bit_for_bit(speech, kw):
    for _, y in speech:
        ref = np.abs(librosa.stft(y, **kw)).T
        got = spectral.stft_magnitude(y, kw["n_fft"], kw["hop_length"], kw.get("win_length"),
                                      kw.get("window", "hann"), kw.get("center", True))
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, ref)


def test_stft_magnitude_float64_and_short_signals():
    y = speech_like(0.3).astype(np.float64)
    np.testing.assert_array_equal(spectral.stft_magnitude(y, 512, 128), np.abs(librosa.stft(y, n_fft=512, hop_length=128)).T)
    short = y[:300]  # shorter than n_fft: librosa warns and pads; so do we
    with pytest.warns(UserWarning, match="n_fft=512 is too large for input signal of length=300"):
        got = spectral.stft_magnitude(short, 512, 128)
    with pytest.warns(UserWarning):
        ref = np.abs(librosa.stft(short, n_fft=512, hop_length=128)).T
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(ValueError, match="too large for uncentered analysis"):
        spectral.stft_magnitude(short, 512, 128, center=False)
    with pytest.raises(ValueError, match="mono signal"):
        spectral.stft_magnitude(np.zeros((10, 2)), 8, 2)


@pytest.mark.parametrize("name", ["hann", "hamming", "boxcar", ("kaiser", 4.0), "blackman"])
@pytest.mark.parametrize("length", [1, 2, 255, 400, 1024])
def test_windows_are_scipys(name, length):
    np.testing.assert_array_equal(spectral.window(name, length), scipy.signal.get_window(name, length, fftbins=True))


@pytest.mark.parametrize("sr,n_fft,n_mels,fmin,fmax,htk", [
    (16000, 1024, 80, 0.0, None, False), (22050, 1024, 80, 0.0, 8000.0, False), (16000, 512, 40, 50.0, 7000.0, False),
    (44100, 2048, 128, 20.0, None, False), (16000, 400, 64, 0.0, None, True), (8000, 256, 32, 100.0, 3800.0, False),
])
def test_mel_filterbank_is_librosas(sr, n_fft, n_mels, fmin, fmax, htk):
    ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax, htk=htk)
    np.testing.assert_array_equal(spectral.mel_filterbank(sr, n_fft, n_mels, fmin, fmax, htk), ref)


def test_db_conversions_are_librosas(speech):
    _, y = speech[0]
    s = np.abs(librosa.stft(y, n_fft=512, hop_length=128))
    np.testing.assert_array_equal(spectral.amplitude_to_db(s), librosa.amplitude_to_db(s, ref=1.0))
    np.testing.assert_array_equal(spectral.power_to_db(s**2), librosa.power_to_db(s**2, ref=1.0))
    np.testing.assert_array_equal(spectral.power_to_db(s**2, top_db=None), librosa.power_to_db(s**2, ref=1.0, top_db=None))


MEL_PARAMS = [
    dict(n_fft=1024, hop_length=256, n_mels=80),
    dict(n_fft=512, hop_length=128, n_mels=40, fmax=7000.0, power=1.0),
    dict(n_fft=400, hop_length=160, n_mels=64, fmin=50.0, win_length=320, window="hamming"),
    dict(n_fft=2048, hop_length=300, n_mels=128, power=1.5),
]


@pytest.mark.parametrize("kw", MEL_PARAMS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("log", [False, "db", "log"])
def test_mel_feature_equals_librosa_within_1e_5(speech, kw, log):
    feat = h5s.MelSpectrogram(sr=SR, log=log, **kw)
    stft = {k: kw[k] for k in ("n_fft", "hop_length", "win_length", "window") if k in kw}
    for path, y in speech:
        ref = librosa.feature.melspectrogram(y=y, sr=SR, n_mels=kw["n_mels"], fmin=kw.get("fmin", 0.0),
                                             fmax=kw.get("fmax"), power=kw.get("power", 2.0), **stft).T
        if log == "db":
            p = kw.get("power", 2.0)
            ref = librosa.power_to_db(ref ** (2.0 / p), ref=1.0) if p != 1.0 else librosa.amplitude_to_db(ref, ref=1.0)
        elif log == "log":
            ref = np.log(np.maximum(ref, 1e-5))
        got = feat.load(h5s.Source(path))
        assert got.dtype == np.float32 and got.shape == ref.shape
        assert (ref == 0).any() or log  # the silences reach the comparison as exact zeros
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("power,log", [(1.0, False), (2.0, False), (1.0, "db"), (2.0, "db"), (1.0, "log")])
def test_magnitude_feature_equals_librosa(speech, power, log):
    feat = h5s.MagSpectrogram(sr=SR, n_fft=512, hop_length=128, power=power, log=log)
    for path, y in speech:
        ref = np.abs(librosa.stft(y, n_fft=512, hop_length=128)) ** power
        if log == "db":
            ref = librosa.amplitude_to_db(ref, ref=1.0) if power == 1.0 else librosa.power_to_db(ref, ref=1.0)
        elif log == "log":
            ref = np.log(np.maximum(ref, 1e-5))
        got = feat.load(h5s.Source(path))
        np.testing.assert_allclose(got, ref.T, rtol=1e-6, atol=0)
        got[0, 0] = -1.0  # the item is the caller's: the |STFT| shared with other features is not
        assert feat.load(h5s.Source(path))[0, 0] != -1.0


def test_mfcc_feature_equals_librosa(speech):
    feat = h5s.MFCC(sr=SR, n_mfcc=20, n_fft=512, hop_length=160, n_mels=40)
    for path, y in speech:
        ref = librosa.feature.mfcc(y=y, sr=SR, n_mfcc=20, n_fft=512, hop_length=160, n_mels=40).T
        got = feat.load(h5s.Source(path))
        # dB values around 0 make a relative bound meaningless; relative to the item's scale:
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("orig,target", [(16000, 22050), (44100, 16000), (16000, 8000), (22050, 16000)])
@pytest.mark.parametrize("channels", [1, 2])
def test_resample_is_librosas(orig, target, channels):
    y = np.stack([speech_like(0.7, orig, seed=c) for c in range(channels)], axis=1).astype(np.float32)
    y = y[:, 0] if channels == 1 else y
    np.testing.assert_array_equal(resample(y, orig, target), librosa.resample(y, orig_sr=orig, target_sr=target, axis=0))


def test_spectral_features_load_without_librosa(speech, tmp_path):
    """A create's worker computes mel, magnitude and resampled audio without importing librosa."""
    import subprocess
    import sys

    path = speech[0][0]
    code = (
        "import sys, h5store as h5s\n"
        f"h5s.MelSpectrogram(sr=16000).prepare([]).load({path!r})\n"
        f"h5s.MagSpectrogram(sr=22050, log='db').load({path!r})\n"
        "bad = [m for m in ('librosa', 'numba', 'scipy.signal') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
