"""Every built-in feature passes the conformance kit h5store.testing.FeatureTests."""

from __future__ import annotations

import io
import pickle
from typing import Any

import librosa
import numpy as np
import soundfile as sf
from PIL import Image

import h5store as h5s
from h5store import Source
from h5store.testing import FeatureTests

from .signals import SR, picture, write_audio, write_image


class Pickled(FeatureTests):
    """The kit, with a byte-level pickle round trip (h5store/ itself never imports pickle)."""

    def roundtrip(self, obj: Any) -> Any:
        return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class WavTests(Pickled):
    def make_source(self, tmp_path):
        write_audio(tmp_path / "wavs" / "a.wav", seconds=0.5, subtype="PCM_16")
        return Source(str(tmp_path / "wavs" / "a.wav"), id="wavs/a", root=str(tmp_path))

    def signal(self, source):
        return sf.read(str(source), dtype="float32")[0]


class TestAudio(WavTests):
    def make_feature(self):
        return h5s.Audio()  # sr learned by prepare()

    def expected(self, source):
        return self.signal(source)


class TestAudioStereoResampled(WavTests):
    rtol = 1e-5

    def make_feature(self):
        return h5s.Audio(sr=8000, mono=False, channels=2)

    def make_source(self, tmp_path):
        write_audio(tmp_path / "st.flac", seconds=0.5, channels=2)
        return str(tmp_path / "st.flac")

    def expected(self, source):
        return librosa.resample(self.signal(source), orig_sr=SR, target_sr=8000, axis=0)


class TestMagSpectrogram(WavTests):
    rtol = 1e-5

    def make_feature(self):
        return h5s.MagSpectrogram(sr=SR, n_fft=256, hop_length=128)

    def expected(self, source):
        return np.abs(librosa.stft(self.signal(source), n_fft=256, hop_length=128)).T


class TestMelSpectrogram(WavTests):
    rtol = 1e-5

    def make_feature(self):
        return h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=160, n_mels=40, log="log")

    def expected(self, source):
        m = librosa.feature.melspectrogram(y=self.signal(source), sr=SR, n_fft=512, hop_length=160, n_mels=40)
        return np.log(np.maximum(m, 1e-5)).T


class TestMFCC(WavTests):
    rtol = 1e-4

    def make_feature(self):
        return h5s.MFCC(sr=SR, n_mfcc=13, n_fft=512, hop_length=160, n_mels=40)

    def expected(self, source):
        return librosa.feature.mfcc(y=self.signal(source), sr=SR, n_mfcc=13, n_fft=512, hop_length=160, n_mels=40).T


class TestDirLabel(WavTests):
    def make_feature(self):
        return h5s.DirLabel()

    def expected(self, source):
        return 0  # the only folder, "wavs", is class 0

    def test_vocabulary_is_stored(self, tmp_path):
        cls, feature, src, path = self.write(tmp_path)
        assert feature.classes == ("wavs",)
        with h5s.open(path) as f:
            assert f.features[self.name].label_name(f.feat[0]) == "wavs"


class TestCSVColumn(WavTests):
    def make_feature(self):
        return h5s.CSVColumn("metadata.csv", column=2)

    def make_source(self, tmp_path):
        (tmp_path / "metadata.csv").write_text('a|x|"Quoted" naïve text — ok\nb|y|other\n', encoding="utf-8")
        return super().make_source(tmp_path)

    def expected(self, source):
        return '"Quoted" naïve text — ok'


class TestCSVColumnNumeric(WavTests):
    def make_feature(self):
        return h5s.CSVColumn(column="speaker", dtype="int32")

    def make_source(self, tmp_path):
        src = super().make_source(tmp_path)
        return Source(str(src), id=src.id, root=src.root, meta={"speaker": "42"})

    def expected(self, source):
        return np.int32(42)


class TestEncodedImage(Pickled):
    def make_feature(self):
        return h5s.EncodedImage()

    def make_source(self, tmp_path):
        write_image(tmp_path / "img.jpg", quality=85)
        return str(tmp_path / "img.jpg")

    def expected(self, source):
        return np.asarray(Image.open(source))


class TestEncodedImagePNG(TestEncodedImage):
    def make_feature(self):
        return h5s.EncodedImage(format="PNG")

    def make_source(self, tmp_path):
        write_image(tmp_path / "img.bmp")
        return str(tmp_path / "img.bmp")

    def expected(self, source):
        return picture()  # BMP re-encoded as PNG: lossless


class TestEncodedFrames(Pickled):
    def make_feature(self):
        return h5s.EncodedFrames()

    def make_source(self, tmp_path):
        for k in range(3):
            write_image(tmp_path / "clip" / f"{k:03d}.jpg", picture(12, 20, seed=k))
        return str(tmp_path / "clip")

    def expected(self, source):
        return np.stack([np.asarray(Image.open(f"{source}/{k:03d}.jpg")) for k in range(3)])


class Added(Pickled):
    """Features filled with add(): the "source" is only an id."""

    def make_source(self, tmp_path):
        return Source(str(tmp_path / "item"), id="item-0", root=str(tmp_path))


class TestArray(Added):
    value = np.arange(12, dtype=np.float32).reshape(4, 3)

    def make_feature(self):
        return h5s.Array(dtype="float32", shape=(None, 3), compression="gzip")

    def make_value(self, feature, source):
        return self.value

    def expected(self, source):
        return self.value


class TestText(Added):
    def make_feature(self):
        return h5s.Text()

    def make_value(self, feature, source):
        return "héllo wörld ✓"

    def expected(self, source):
        return "héllo wörld ✓"


class TestScalar(Added):
    def make_feature(self):
        return h5s.Scalar(dtype="float64")

    def make_value(self, feature, source):
        return 2.5

    def expected(self, source):
        return np.float64(2.5)


def test_kit_default_roundtrip_needs_no_pickle(tmp_path):
    """The kit's own roundtrip (copy.deepcopy) works too, for projects that use it as is."""

    class Plain(FeatureTests):
        def make_feature(self):
            return h5s.Text()

        def make_source(self, tmp_path):
            return Source("x", id="x")

        def make_value(self, feature, source):
            return "x"

        def expected(self, source):
            return "x"

    Plain().test_pickle(tmp_path)


def test_encoded_image_expected_matches_bytes_decode(tmp_path):
    # The JPEG case compares with PIL on the very bytes stored.
    write_image(tmp_path / "i.jpg")
    data = (tmp_path / "i.jpg").read_bytes()
    np.testing.assert_array_equal(h5s.EncodedImage().decode(np.frombuffer(data, np.uint8)),
                                  np.asarray(Image.open(io.BytesIO(data))))
