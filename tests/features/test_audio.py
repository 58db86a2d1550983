"""Audio features on real files written by soundfile: every format, every broken file, librosa values."""

from __future__ import annotations

import os
import subprocess
import sys

import librosa
import numpy as np
import pytest
import soundfile as sf

import h5store as h5s
from h5store import Source, SourceError
from h5store.features.audio import read_audio

from .signals import SR, write_audio

# --------------------------------------------------------------------------- formats
# (file name, soundfile subtype, worst-case quantisation error vs the float signal)
FORMATS = [
    ("u8.wav", "PCM_U8", 2 / 2**8),
    ("s16.wav", "PCM_16", 2 / 2**16),
    ("s24.wav", "PCM_24", 2 / 2**24),
    ("s32.wav", "PCM_32", 1e-7),
    ("f32.wav", "FLOAT", 0),
    ("f64.wav", "DOUBLE", 1e-7),
    ("a.flac", "PCM_16", 2 / 2**16),
    ("a.ogg", "VORBIS", None),  # lossy: compared with soundfile's decode only
]


@pytest.mark.parametrize("name,subtype,tol", FORMATS, ids=[f[1] + "-" + f[0] for f in FORMATS])
def test_every_format_decodes_as_soundfile(tmp_path, name, subtype, tol):
    path = tmp_path / name
    x = write_audio(path, subtype=subtype)
    y = h5s.Audio().load(Source(str(path)))
    assert y.dtype == np.float32 and y.ndim == 1
    np.testing.assert_array_equal(y, sf.read(str(path), dtype="float32")[0])
    if tol is not None:
        assert y.shape == x.shape
        assert np.abs(y - x).max() <= tol
    else:
        assert abs(len(y) - len(x)) <= 2048 and np.corrcoef(y[: len(x)], x[: len(y)])[0, 1] > 0.9


def test_stereo_is_mixed_down_by_mean(tmp_path):
    x = write_audio(tmp_path / "st.wav", channels=2, subtype="FLOAT")
    y = h5s.Audio().load(Source(str(tmp_path / "st.wav")))
    np.testing.assert_allclose(y, x.mean(axis=1), rtol=1e-6)


def test_multichannel_kept_with_declared_channels(tmp_path):
    x = write_audio(tmp_path / "st.wav", channels=2, subtype="FLOAT")
    feat = h5s.Audio(mono=False, channels=2)
    assert feat.spec().shape == (None, 2)
    y = feat.encode(feat.load(Source(str(tmp_path / "st.wav"))))
    np.testing.assert_array_equal(y, x)
    with pytest.raises(SourceError, match="has 2 channels, expected 3"):
        h5s.Audio(mono=False, channels=3).load(str(tmp_path / "st.wav"))


def test_resampling_16k_to_22050_matches_librosa(tmp_path):
    write_audio(tmp_path / "a.wav", subtype="PCM_16")
    y = h5s.Audio(sr=22050).load(Source(str(tmp_path / "a.wav")))
    ref = librosa.resample(sf.read(str(tmp_path / "a.wav"), dtype="float32")[0], orig_sr=SR, target_sr=22050)
    assert y.shape == (22050,)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-7)


def test_same_rate_is_not_resampled(tmp_path):
    write_audio(tmp_path / "a.wav", subtype="FLOAT")
    y, sr = read_audio(str(tmp_path / "a.wav"), sr=SR)
    np.testing.assert_array_equal(y, sf.read(str(tmp_path / "a.wav"), dtype="float32")[0])
    assert sr == SR


def test_prepare_learns_the_rate_from_the_first_source(tmp_path):
    write_audio(tmp_path / "a.wav", sr=8000, seconds=0.25)
    write_audio(tmp_path / "b.wav", sr=16000, seconds=0.25)
    (tmp_path / "broken.wav").write_text("no audio")
    feat = h5s.Audio().prepare([Source(str(tmp_path / p)) for p in ("broken.wav", "a.wav", "b.wav")])
    assert feat.sr == 8000
    assert feat.load(str(tmp_path / "b.wav")).shape == (2000,)
    # Appending: the stored rate wins over learning, and a different declared rate is refused.
    assert h5s.Audio().prepare([Source(str(tmp_path / "b.wav"))], existing=feat).sr == 8000
    with pytest.raises(h5s.SchemaError, match="sr=8000 stored, 16000 declared"):
        h5s.Audio(sr=16000).prepare([], existing=feat)


def test_float64_dtype(tmp_path):
    x = write_audio(tmp_path / "d.wav", subtype="DOUBLE")
    y = h5s.Audio(dtype="float64").load(str(tmp_path / "d.wav"))
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, x, rtol=1e-6)


# --------------------------------------------------------------------------- broken files
def _truncated(tmp_path):
    write_audio(tmp_path / "full.wav", subtype="PCM_16")  # 16000 frames of 2 bytes
    data = (tmp_path / "full.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(data[:-1000])
    return tmp_path / "cut.wav"


def _header_only(tmp_path):
    sf.write(str(tmp_path / "h.wav"), np.zeros(0, np.float32), SR)
    return tmp_path / "h.wav"


def _header_of_full_file(tmp_path):
    write_audio(tmp_path / "full.wav", subtype="PCM_16")
    (tmp_path / "h.wav").write_bytes((tmp_path / "full.wav").read_bytes()[:44])
    return tmp_path / "h.wav"


def _zero(tmp_path):
    (tmp_path / "z.wav").write_bytes(b"")
    return tmp_path / "z.wav"


def _text(tmp_path):
    (tmp_path / "t.wav").write_text("id|text\nthis is not audio\n")
    return tmp_path / "t.wav"


def _directory(tmp_path):
    (tmp_path / "d.wav").mkdir()
    return tmp_path / "d.wav"


def _missing(tmp_path):
    return tmp_path / "missing.wav"


def _nan(tmp_path):
    x = np.zeros(1000, np.float32)
    x[700] = np.nan
    sf.write(str(tmp_path / "nan.wav"), x, SR, subtype="FLOAT")
    return tmp_path / "nan.wav"


def _truncated_flac(tmp_path):
    write_audio(tmp_path / "a.flac")
    data = (tmp_path / "a.flac").read_bytes()
    (tmp_path / "cut.flac").write_bytes(data[: len(data) // 2])
    return tmp_path / "cut.flac"


def _truncated_ogg(tmp_path):
    write_audio(tmp_path / "a.ogg", subtype="VORBIS")
    data = (tmp_path / "a.ogg").read_bytes()
    (tmp_path / "cut.ogg").write_bytes(data[:-200])
    return tmp_path / "cut.ogg"


def _ogg_without_last_page(tmp_path):
    write_audio(tmp_path / "a.ogg", subtype="VORBIS")
    data = (tmp_path / "a.ogg").read_bytes()
    (tmp_path / "cut.ogg").write_bytes(data[: data.rfind(b"OggS")])  # cut on a page boundary
    return tmp_path / "cut.ogg"


BROKEN = [
    (_zero, r"empty file \(0 bytes\)"),
    (_header_only, "decoded length is 0"),
    (_header_of_full_file, "truncated: header declares 16000 frames, file holds 0"),
    (_truncated, "truncated: header declares 16000 frames, file holds 15500"),
    (_text, "cannot decode"),
    (_directory, "not a regular file"),
    (_missing, "no such file"),
    (_nan, r"non-finite samples \(NaN or inf\), first at frame 700"),
    (_truncated_flac, "cannot decode|truncated"),
    (_truncated_ogg, r"truncated: the last Ogg page \(at byte \d+\) is cut"),
    (_ogg_without_last_page, "truncated: the Ogg stream ends without its end-of-stream page"),
]


@pytest.mark.parametrize("make,reason", BROKEN, ids=[b[0].__name__.strip("_") for b in BROKEN])
@pytest.mark.parametrize("feature", [h5s.Audio(), h5s.MelSpectrogram(sr=SR)], ids=["Audio", "Mel"])
def test_broken_files_are_refused_with_the_reason(tmp_path, make, reason, feature):
    path = make(tmp_path)
    with pytest.raises(SourceError, match=reason) as e:
        feature.load(Source(str(path), id="x"))
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "fmt,subtype,frame",
    [("WAV", "FLOAT", 4), ("WAV", "PCM_U8", 1), ("WAVEX", "PCM_24", 3), ("RF64", "PCM_16", 2),
     ("AIFF", "PCM_16", 2), ("AIFF", "FLOAT", 4)],
)
def test_truncated_containers(tmp_path, fmt, subtype, frame):
    # FLOAT wavs carry fact and PEAK chunks before the data chunk; RF64 keeps its size in ds64;
    # AIFF is big-endian, its length in COMM and its samples in SSND.
    path = tmp_path / f"{fmt}-{subtype}.wav"
    write_audio(path, channels=2, subtype=subtype, format=fmt)
    data = path.read_bytes()
    assert h5s.Audio().load(str(path)).shape == (16000,)
    path.write_bytes(data[: len(data) - 10 * 2 * frame])
    with pytest.raises(SourceError, match="header declares 16000 frames, file holds 15990"):
        h5s.Audio().load(str(path))


def test_truncated_compressed_wav_counts_bytes(tmp_path):
    write_audio(tmp_path / "a.wav", subtype="IMA_ADPCM")
    data = (tmp_path / "a.wav").read_bytes()
    (tmp_path / "a.wav").write_bytes(data[:-1000])
    with pytest.raises(SourceError, match=r"truncated: header declares \d+ bytes of audio data, file holds \d+"):
        h5s.Audio().load(str(tmp_path / "a.wav"))


def test_a_complete_wav_with_trailing_chunks_is_accepted(tmp_path):
    x = write_audio(tmp_path / "a.wav", subtype="PCM_16")
    with open(tmp_path / "a.wav", "ab") as fh:  # a LIST chunk after the data, as editors write
        fh.write(b"LIST" + (6).to_bytes(4, "little") + b"INFOab")
    assert h5s.Audio().load(str(tmp_path / "a.wav")).shape == x.shape


# --------------------------------------------------------------------------- spectrograms
@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech") / "a.wav"
    write_audio(path, subtype="PCM_16")
    return str(path), sf.read(str(path), dtype="float32")[0]


@pytest.mark.parametrize("log", [False, "db", "log"])
def test_mel_equals_librosa(speech, log):
    path, y = speech
    got = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=40, fmax=7000.0, log=log).load(Source(path))
    ref = librosa.feature.melspectrogram(y=y, sr=SR, n_fft=512, hop_length=128, n_mels=40, fmax=7000.0)
    if log == "db":
        ref = librosa.power_to_db(ref, ref=1.0)
    elif log == "log":
        ref = np.log(np.maximum(ref, 1e-5))
    assert got.shape == (1 + SR // 128, 40) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("power,log", [(1.0, False), (2.0, False), (1.0, "db")])
def test_magnitude_equals_librosa(speech, power, log):
    path, y = speech
    got = h5s.MagSpectrogram(sr=SR, n_fft=256, hop_length=64, power=power, log=log).load(Source(path))
    ref = np.abs(librosa.stft(y, n_fft=256, hop_length=64)) ** power
    if log == "db":
        ref = librosa.amplitude_to_db(ref, ref=1.0)
    assert got.shape == (1 + SR // 64, 129)
    np.testing.assert_allclose(got, ref.T, rtol=1e-5, atol=1e-6)


def test_mfcc_equals_librosa(speech):
    path, y = speech
    got = h5s.MFCC(sr=SR, n_mfcc=13, n_fft=512, hop_length=160, n_mels=40).load(Source(path))
    ref = librosa.feature.mfcc(y=y, sr=SR, n_mfcc=13, n_fft=512, hop_length=160, n_mels=40)
    assert got.shape == (ref.shape[1], 13)
    np.testing.assert_allclose(got, ref.T, rtol=1e-5, atol=1e-4)


def test_spectrogram_resamples_first(tmp_path):
    write_audio(tmp_path / "a.wav", subtype="FLOAT")
    got = h5s.MelSpectrogram(sr=8000, n_fft=256, hop_length=80, n_mels=32).load(str(tmp_path / "a.wav"))
    y = librosa.resample(sf.read(str(tmp_path / "a.wav"), dtype="float32")[0], orig_sr=SR, target_sr=8000)
    ref = librosa.feature.melspectrogram(y=y, sr=8000, n_fft=256, hop_length=80, n_mels=32)
    np.testing.assert_allclose(got, ref.T, rtol=1e-5, atol=1e-6)
    assert got.shape[0] == 101


def test_spectral_prepare_refuses_other_parameters_when_appending():
    stored = h5s.MelSpectrogram(sr=SR, hop_length=256)
    with pytest.raises(h5s.SchemaError, match="hop_length=256 stored, 200 declared"):
        h5s.MelSpectrogram(sr=SR, hop_length=200).prepare([], existing=stored)
    assert h5s.MelSpectrogram(sr=SR, hop_length=256).prepare([], existing=stored).hop_length == 256
    with pytest.raises(h5s.SchemaError, match="window 'nope'"):
        h5s.MelSpectrogram(sr=SR, window="nope").prepare([])


# --------------------------------------------------------------------------- declaration
@pytest.mark.parametrize(
    "feature,message",
    [
        (h5s.MelSpectrogram(sr=SR, hop_length=0), "Bad.feat: hop_length must be an int > 0, got 0"),
        (h5s.MelSpectrogram(sr=0), "sr must be an int > 0, got 0"),
        (h5s.MelSpectrogram(sr=SR, fmax=9000.0), r"fmax must be <= sr / 2 \(8000.0\), got 9000.0"),
        (h5s.MelSpectrogram(sr=SR, log="ln"), "log must be False, 'db' or 'log'"),
        (h5s.MagSpectrogram(sr=SR, n_fft=256, win_length=512), r"win_length must be <= n_fft \(256\)"),
        (h5s.MFCC(sr=SR, n_mfcc=50, n_mels=40), r"n_mfcc must be <= n_mels \(40\), got 50"),
        (h5s.Audio(mono=False), "mono=False needs channels"),
        (h5s.Audio(sr=-1), "sr must be an int > 0 or None, got -1"),
        (h5s.Audio(dtype="int16"), "dtype must be float32 or float64"),
    ],
)
def test_invalid_parameters_name_the_attribute(feature, message):
    with pytest.raises(h5s.SchemaError, match=message):
        type("Bad", (h5s.TypedFile,), {"feat": feature})


def test_shapes_follow_parameters():
    assert h5s.MagSpectrogram(sr=SR, n_fft=512).spec().shape == (None, 257)
    assert h5s.MelSpectrogram(sr=SR, n_mels=64).spec().shape == (None, 64)
    assert h5s.MFCC(sr=SR, n_mfcc=13).spec().shape == (None, 13)
    assert h5s.MelSpectrogram(sr=22050, hop_length=256).frames_per_second == 22050 / 256
    assert h5s.MelSpectrogram(sr=SR).accepts("x/A.WAV") and not h5s.MelSpectrogram(sr=SR).accepts("x/a.txt")


def test_importing_features_stays_light():
    code = (
        "import sys, h5store, h5store.features\n"
        "heavy = [m for m in ('librosa', 'soundfile', 'PIL', 'scipy', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONWARNINGS": "error"})
