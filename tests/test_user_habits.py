"""First-day code, written the way h5py, h5mapper and PyTorch users write it (issue 12)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.errors import NotFound, SchemaError


# -- plain class attributes override a Feature's parameters -------------------------------
def test_plain_class_attribute_sets_a_parameter(tmp_path):
    # h5mapper users write ``__re__ = ...``; Python users write ``pattern = ...`` without
    # an annotation. A dataclass would silently keep the inherited default.
    class Npy(h5s.Array):
        pattern = r"\.npy$"
        dtype = "float64"
        shape = [None, 3]  # a list, as users write it

    feat = Npy()
    assert feat.pattern == r"\.npy$"
    assert feat.dtype == "float64" and feat.shape == (None, 3)
    assert Npy(pattern=r"\.bin$").pattern == r"\.bin$"  # the constructor still wins

    def load(self, source):
        return np.load(source)

    Npy.load = load  # a loader attached later, as a user might
    (tmp_path / "src").mkdir()
    for i in range(3):
        np.save(tmp_path / "src" / f"a{i}.npy", np.full((i + 1, 3), i, np.float64))

    class Store(h5s.TypedFile):
        x = Npy()

    f = Store.create(tmp_path / "out.h5", sources=tmp_path / "src", n_workers=1, progress=False)
    assert sorted(f.ids) == ["a0", "a1", "a2"]
    np.testing.assert_array_equal(f.x["a2"], np.full((3, 3), 2.0))


def test_plain_class_attribute_dict_default_is_not_shared():
    class Tagged(h5s.Array):
        attrs = {"unit": "dB"}

    a, b = Tagged(), Tagged()
    assert a.attrs == {"unit": "dB"} and a.attrs is not b.attrs


def test_plain_override_on_a_spectral_feature_changes_storage():
    class Mel40(h5s.MelSpectrogram):
        sr = 16000
        n_mels = 40

    assert Mel40().spec().shape == (None, 40)


def test_a_property_cannot_replace_a_parameter():
    with pytest.raises(SchemaError, match=r"Bad\.pattern: 'pattern' is a feature parameter"):
        class Bad(h5s.Array):
            @property
            def pattern(self):
                return r"\.npy$"


# -- names that would hide TypedFile members ------------------------------------------------
@pytest.mark.parametrize("name", ["path", "close", "mode", "extend", "serve", "report", "h5", "get"])
def test_feature_named_like_a_file_member_is_refused(name):
    with pytest.raises(SchemaError, match=rf"Speech\.{name}: the feature name hides TypedFile\.{name}"):
        type("Speech", (h5s.TypedFile,), {name: h5s.Array()})


def test_group_named_like_a_file_member_is_refused():
    with pytest.raises(SchemaError, match=r"Run\.ids: invalid group name|Run\.flush: the group name hides"):
        type("Run", (h5s.TypedFile,), {"flush": h5s.Group(loss=h5s.Array())})


def test_group_feature_named_like_a_view_member_is_refused():
    with pytest.raises(SchemaError, match=r"Run\.logs\.describe: the feature name hides the group view's 'describe'"):
        type("Run", (h5s.TypedFile,), {"logs": h5s.Group(describe=h5s.Array())})


def test_a_getter_declared_as_a_schema_attribute_is_refused_saying_what_to_write():
    # ``label = h5s.Label("label")`` in a schema read as a stored label; it was ignored without a
    # word, and the file stored no label.
    with pytest.raises(SchemaError, match=r"Utt\.spk = Label\(feature='spk'\) is a getter.*"
                                          r"spk = h5s\.Scalar\(dtype='int64'\).*h5s\.DirLabel\(\)"):
        class Utt(h5s.TypedFile):
            mel = h5s.Array(dtype="float32", shape=(None, 8))
            spk = h5s.Label("spk")
    with pytest.raises(SchemaError, match=r"Clip\.x = Item.* is a getter"):
        class Clip(h5s.TypedFile):
            x = h5s.Item("x")
    # ``h5s.Label()`` with no feature, as a feature type would be written, says the same.
    with pytest.raises(TypeError, match=r"h5s\.Label\('label'\).*label = h5s\.Scalar\(dtype='int64'\)"):
        h5s.Label()


def test_ordinary_names_are_fine():
    cls = type("Speech", (h5s.TypedFile,), {"mel": h5s.Array(), "label": h5s.Scalar(), "name": h5s.Text(),
                                            "logs": h5s.Group(loss=h5s.Array(), step=h5s.Scalar())})
    assert set(cls.schema.groups[""]) == {"mel", "label", "name"}


# -- f[id] and f[i] give the whole item -----------------------------------------------------
class Pairs(h5s.TypedFile):
    x = h5s.Array(shape=(None, 2))
    y = h5s.Scalar()


def test_indexing_the_file_gives_every_feature(tmp_path):
    path = tmp_path / "pairs.h5"
    with Pairs(path, "w") as f:
        f.add("a", dict(x=np.ones((3, 2)), y=4))
        f.add("b", dict(x=np.zeros((1, 2))))  # y absent for this one
    with Pairs(path) as f:
        a = f["a"]
        assert set(a) == {"x", "y"} and int(a["y"]) == 4
        np.testing.assert_array_equal(a["x"], np.ones((3, 2)))
        assert set(f[1]) == {"x"} and set(f[-1]) == {"x"}
        for key in ["a", "b", 0, 1, -2]:
            got, want = f[key], f.get(key)
            assert got.keys() == want.keys()
            for k in got:
                np.testing.assert_array_equal(got[k], want[k])
        with pytest.raises(NotFound, match="no id 'zz'"):
            f["zz"]
        with pytest.raises(IndexError, match="position 2 out of range for 2 items"):
            f[2]
        with pytest.raises(NotFound, match=r"'x' is not an id; the feature or group is f\.x"):
            f["x"]


# -- extend takes a mapping -----------------------------------------------------------------
def test_extend_takes_a_dict_of_ids(tmp_path):
    path = tmp_path / "pairs.h5"
    with Pairs(path, "w") as f:
        rows = f.extend({"a": {"x": np.ones((2, 2)), "y": 1}, "b": {"x": np.zeros((5, 2)), "y": 2}})
        assert rows.tolist() == [0, 1]
        f.extend([("c", {"x": np.ones((1, 2))})])  # the pair form still works
        f.extend(["d", "e"], {"y": [7, 8]})  # and ids + columns
    with Pairs(path) as f:
        assert list(f.ids) == ["a", "b", "c", "d", "e"]
        assert f.x["b"].shape == (5, 2) and int(f.y["e"]) == 8


@pytest.mark.parametrize("bad, says", [
    ({"x": [np.ones((1, 2))]}, "a dict whose values are not dicts ('x': list)"),
    ([{"x": np.ones((1, 2))}], "a record must be (id, {feature: value}), got {'x'"),
    ([(0, {"x": np.ones((1, 2))})], "a record must be (id, {feature: value}), got (0,"),
    ("abc", "got str"),
    (42, "got int"),
])
def test_extend_with_another_shape_lists_the_accepted_forms(tmp_path, bad, says):
    with Pairs(tmp_path / "p.h5", "w") as f:
        with pytest.raises(SchemaError) as e:
            f.extend(bad)
        text = str(e.value)
        assert says in text
        assert "f.extend({id: {feature: value, ...}, ...})" in text and "with ids as str" in text
        assert len(f) == 0


def test_extend_ids_must_be_str_with_columns(tmp_path):
    with Pairs(tmp_path / "p.h5", "w") as f:
        with pytest.raises(SchemaError, match="an id must be a str, got 3"):
            f.extend([3], {"y": [1]})


# -- corpus layouts users already have --------------------------------------------------------
def _ljspeech(root, n=4):
    import soundfile as sf

    (root / "wavs").mkdir(parents=True)
    rows = []
    for i in range(n):
        t = np.arange(4000) / 16000
        sf.write(root / "wavs" / f"LJ001-{i:04d}.wav", (0.1 * np.sin(2 * np.pi * 220 * (i + 1) * t)).astype("float32"), 16000)
        rows.append(f"LJ001-{i:04d}|Text {i}.|text {i}")
    (root / "metadata.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


class LJ(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=16000, n_fft=512, hop_length=128, n_mels=40)
    text = h5s.CSVColumn("metadata.csv", column=2)


@pytest.mark.parametrize("named", ["LJSpeech-1.1", "LJSpeech-1.1/wavs"])
def test_ljspeech_layout_finds_metadata_csv_beside_the_wavs(tmp_path, named):
    _ljspeech(tmp_path / "LJSpeech-1.1")
    f = LJ.create(tmp_path / "lj.h5", sources=tmp_path / named, n_workers=1, progress=False)
    assert f.report.ok and len(f) == 4
    assert [f.text[i] for i in range(4)] == [f"text {i}" for i in range(4)]


def test_missing_csv_table_is_one_clear_error(tmp_path):
    _ljspeech(tmp_path / "LJSpeech-1.1")

    class Wrong(h5s.TypedFile):
        mel = h5s.MelSpectrogram(sr=16000, n_fft=512, hop_length=128, n_mels=40)
        text = h5s.CSVColumn("meta.csv", column=2)

    with pytest.raises(h5s.SourceError, match=r"meta\.csv: no such file: CSVColumn\('meta\.csv'\) is looked up in .*wavs and the folder above it"):
        Wrong.create(tmp_path / "lj.h5", sources=tmp_path / "LJSpeech-1.1" / "wavs", n_workers=1, progress=False)
    assert not (tmp_path / "lj.h5").exists()


def test_ljspeech_metadata_given_as_sources_is_one_clear_error(tmp_path):
    _ljspeech(tmp_path / "LJSpeech-1.1")
    with pytest.raises(h5s.SourceError, match=r"metadata\.csv: read as a manifest, its first column .* none of them "
                                              r"exists .*CSVColumn\('metadata\.csv', column=\.\.\.\)"):
        LJ.create(tmp_path / "lj.h5", sources=tmp_path / "LJSpeech-1.1" / "metadata.csv", n_workers=1, progress=False)


def test_csv_manifest_with_a_path_column_relative_to_itself(tmp_path):
    _ljspeech(tmp_path / "corpus")
    rows = ["path,speaker"] + [f"wavs/LJ001-{i:04d}.wav,spk{i % 2}" for i in range(4)]
    (tmp_path / "corpus" / "manifest.csv").write_text("\n".join(rows) + "\n")

    class Manifest(h5s.TypedFile):
        mel = h5s.MelSpectrogram(sr=16000, n_fft=512, hop_length=128, n_mels=40)
        speaker = h5s.CSVColumn(column="speaker")  # path=None: the manifest row's column

    f = Manifest.create(tmp_path / "m.h5", sources=tmp_path / "corpus" / "manifest.csv", n_workers=1, progress=False)
    assert f.report.ok and len(f) == 4
    assert [f.speaker[i] for i in range(4)] == ["spk0", "spk1", "spk0", "spk1"]


def test_image_folder_per_class(tmp_path):
    from PIL import Image

    for cls, color in [("cat", 30), ("dog", 200)]:
        (tmp_path / "train" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 6), (color, i, 0)).save(tmp_path / "train" / cls / f"{i}.jpg")

    class Pets(h5s.TypedFile):
        image = h5s.EncodedImage()
        label = h5s.DirLabel()

    f = Pets.create(tmp_path / "pets.h5", sources=tmp_path / "train", n_workers=1, progress=False)
    assert f.report.ok and len(f) == 6
    assert f.features["label"].classes == ("cat", "dog")
    assert [f.features["label"].label_name(f.label[i]) for i in f.ids] == ["cat"] * 3 + ["dog"] * 3


def test_a_missing_source_folder_says_so(tmp_path):
    with pytest.raises(h5s.SourceError, match=r"^no such file or folder: .*wavz$"):
        LJ.create(tmp_path / "x.h5", sources=str(tmp_path / "wavz"), n_workers=1, progress=False)
    _ljspeech(tmp_path / "LJSpeech-1.1")
    with pytest.raises(h5s.SourceError, match=r"^no such file or folder: .*more_wavs$"):
        LJ.create(tmp_path / "x.h5", sources=[tmp_path / "LJSpeech-1.1", tmp_path / "more_wavs"], n_workers=1,
                  progress=False)
    with pytest.raises(h5s.SourceError, match=r"^no file or folder matches .*\*\.flac$"):
        LJ.create(tmp_path / "x.h5", sources=str(tmp_path / "LJSpeech-1.1" / "wavs" / "*.flac"), n_workers=1,
                  progress=False)
    assert not (tmp_path / "x.h5").exists()


def test_values_in_memory_given_as_sources_point_to_extend(tmp_path):
    """h5mapper users hand create() the data they hold: the message says to extend() instead."""
    items = {"a": {"x": np.ones((2, 2)), "y": 1}}
    for sources, says in ((items, "sources is a dict of 1 entries"), ([np.ones(3)], "a source is a ndarray")):
        with pytest.raises(h5s.SourceError, match=says + r".*f\.extend\(\{id: \{feature: value"):
            Pairs.create(tmp_path / "x.h5", sources, n_workers=1, progress=False)
    assert not (tmp_path / "x.h5").exists()


def test_cli_missing_folder_is_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "h5store.cli", "create", "audio-mel", "o.h5", "no_such_dir", "-q"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr == "h5store: error: no such file or folder: no_such_dir\n"


# -- failures per source, warnings once ------------------------------------------------------
@pytest.mark.parametrize("n_workers", [1, 2])
def test_worker_warnings_are_collected_once(tmp_path, capfd, n_workers):
    from tests.ingest_schemas import WarnNums

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"w{i}.txt").write_text("warn " + " ".join(["1"] * (i + 1)))
    (src / "ok.txt").write_text("1 2 3")
    (src / "bad.txt").write_text("boom")
    f = WarnNums.create(tmp_path / "w.h5", sources=src, n_workers=n_workers, progress=False)
    r = f.report
    assert r.n_stored == 7 and r.n_failed == 1
    assert len(r.warnings) == 1  # the six messages differ only by their numbers
    category, message, count, example = r.warnings[0]
    assert (category, count, example) == ("UserWarning", 6, "w0")
    assert message == "n_fft=1024 is too large for input signal of length=1"
    assert "1 of 8 sources failed" in r.summary() and "1 distinct warning(s)" in r.summary()
    lines = r.lines()
    assert lines[1].endswith("bad.txt (id bad)") and lines[2].startswith("    nums: RuntimeError: boom")
    assert lines[3].startswith("  warning (6 sources, e.g. w0): UserWarning: n_fft=1024")
    assert "too large" not in capfd.readouterr().err  # no worker printed it


# -- the command line ---------------------------------------------------------------------------
def test_cli_output_into_a_closed_pipe_exits_quietly(tmp_path):
    import os
    import subprocess
    import sys

    path = tmp_path / "pairs.h5"
    with Pairs(path, "w") as f:
        f.extend({f"id{i}": {"x": np.ones((2, 2))} for i in range(50)})
    read, write = os.pipe()
    os.close(read)  # like `| head` that has already exited
    try:
        r = subprocess.run([sys.executable, "-m", "h5store.cli", "info", str(path)], stdout=write,
                           stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert r.stderr == "" and r.returncode == 141


def test_create_progress_says_what_it_does_before_the_first_result(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"n{i}.txt").write_text("1 2 3")
    code = ("from tests.ingest_schemas import Nums; "
            f"Nums.create({str(tmp_path / 'n.h5')!r}, sources={str(src)!r}, n_workers=2)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(Path(__file__).parent.parent))
    assert r.returncode == 0, r.stderr
    # The workers are forked when the call starts: the bar says so at once, not a silent 0%
    # (joblib's workers, fresh interpreters, say "starting 2 workers": tests/test_ingest_pool.py).
    assert "scanning sources" in r.stderr, r.stderr
    assert r.stderr.rstrip().splitlines()[-1].count("8/8")
