"""DirLabel vocabularies and CSVColumn joins on LJSpeech-style metadata."""

from __future__ import annotations

import numpy as np
import pytest

import h5store as h5s
from h5store import Source, SourceError


def _src(root, rel, **meta):
    """A Source as ingest makes it: id = path relative to root, without extension."""
    return Source(str(root / rel), id=rel.rsplit(".", 1)[0], root=str(root), meta=meta)


# --------------------------------------------------------------------------- DirLabel
def test_dirlabel_learns_sorted_folder_names(tmp_path):
    srcs = [_src(tmp_path, p) for p in ("dog/1.wav", "cat/2.wav", "dog/3.wav", "bird/x/4.wav")]
    lab = h5s.DirLabel().prepare(srcs)
    assert lab.classes == ("cat", "dog", "x")
    assert [int(lab.encode(lab.load(s))) for s in srcs] == [1, 0, 1, 2]
    assert lab.label_name(1) == "dog" and lab.decode(np.int64(2)) == 2
    with pytest.raises(IndexError, match="class 7 out of range for 3 classes"):
        lab.label_name(7)


def test_dirlabel_appending_keeps_old_numbers(tmp_path):
    old = h5s.DirLabel().prepare([_src(tmp_path, "dog/1.wav"), _src(tmp_path, "cat/1.wav")])
    # A fresh declaration appending new folders: stored classes first, new ones sorted after.
    new = h5s.DirLabel().prepare([_src(tmp_path, p) for p in ("ant/1.wav", "dog/2.wav", "bee/1.wav")], existing=old)
    assert new.classes == ("cat", "dog", "ant", "bee")
    assert int(new.load(_src(tmp_path, "dog/9.wav"))) == 1


def test_dirlabel_fixed_vocabulary(tmp_path):
    lab = h5s.DirLabel(classes=("yes", "no"))
    assert lab.prepare([_src(tmp_path, "maybe/1.wav")]) is lab
    assert int(lab.load(_src(tmp_path, "no/1.wav"))) == 1
    with pytest.raises(SourceError, match=r"folder 'maybe' is not one of the 2 classes \['yes', 'no'\]"):
        lab.load(_src(tmp_path, "maybe/1.wav"))
    # Appending with a declared vocabulary: the stored order wins, new names go last.
    merged = h5s.DirLabel(classes=("no", "yes", "stop")).prepare([], existing=lab)
    assert merged.classes == ("yes", "no", "stop")


def test_dirlabel_without_classes_says_so(tmp_path):
    with pytest.raises(SourceError, match="DirLabel has no classes"):
        h5s.DirLabel().load(_src(tmp_path, "dog/1.wav"))


def test_dirlabel_vocabulary_is_stored_and_rebuilt(tmp_path):
    lab = h5s.DirLabel().prepare([_src(tmp_path, "b/1.jpg"), _src(tmp_path, "a/1.jpg")])
    params = lab.params()
    assert params["classes"] == ["a", "b"]
    assert h5s.DirLabel.from_params(params).classes == ("a", "b")


@pytest.mark.parametrize(
    "feature,message",
    [
        (h5s.DirLabel(classes=("a", "a")), r"classes must be unique, \['a'\] repeat"),
        (h5s.DirLabel(classes=(1, 2)), "classes must be a tuple of str"),
        (h5s.DirLabel(dtype="float32"), "DirLabel is stored as an integer scalar"),
        (h5s.CSVColumn("m.csv", column="text"), "Bad.feat: column='text' is a name: set header=True"),
        (h5s.CSVColumn("m.csv", sep="||"), "sep must be one character"),
        (h5s.CSVColumn("m.csv", column=-1), "column must be an index >= 0 or a header name, got -1"),
    ],
)
def test_invalid_label_parameters(feature, message):
    with pytest.raises(h5s.SchemaError, match=message):
        type("Bad", (h5s.TypedFile,), {"feat": feature})


# --------------------------------------------------------------------------- CSVColumn
LJ = [
    "LJ001-0001|Printing, in the only sense|Printing, in the only sense",
    'LJ001-0002|"in being comparatively modern."|"in being comparatively modern."',
    "LJ001-0003|Mr. Müller's naïve café — 1850|Mister Müller's naïve café — eighteen fifty",
    "LJ001-0004|short row",
    "LJ001-0005|dup one|dup one",
    "LJ001-0005|dup two|dup two",
    "",
    'LJ001-0006|a "quoted|field|x',
]


@pytest.fixture
def ljspeech(tmp_path):
    (tmp_path / "wavs").mkdir()
    (tmp_path / "metadata.csv").write_text("\n".join(LJ) + "\n", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("column,expected", [(1, '"in being comparatively modern."'), (2, '"in being comparatively modern."')])
def test_csvcolumn_keeps_quotes_as_text(ljspeech, column, expected):
    col = h5s.CSVColumn("metadata.csv", column=column)
    assert col.load(_src(ljspeech, "wavs/LJ001-0002.wav")) == expected


def test_csvcolumn_unicode_round_trips_through_encode(ljspeech):
    col = h5s.CSVColumn("metadata.csv", column=2).prepare([_src(ljspeech, "wavs/LJ001-0003.wav")])
    text = col.load(_src(ljspeech, "wavs/LJ001-0003.wav"))
    assert text == "Mister Müller's naïve café — eighteen fifty"
    raw = col.encode(text)
    assert raw.dtype == np.uint8 and col.decode(raw) == text


def test_csvcolumn_matches_full_id_and_last_component(ljspeech):
    (ljspeech / "metadata.csv").write_text("LJ001-0001|short key\nwavs/LJ001-0007|full id\n", encoding="utf-8")
    col = h5s.CSVColumn("metadata.csv")
    assert col.load(_src(ljspeech, "wavs/LJ001-0001.wav")) == "short key"
    assert col.load(_src(ljspeech, "wavs/LJ001-0007.wav")) == "full id"
    # A plain path (no Source id) is keyed by its file stem, relative paths by the cwd.
    col = h5s.CSVColumn(str(ljspeech / "metadata.csv"))
    assert col.load(str(ljspeech / "wavs" / "LJ001-0001.wav")) == "short key"


@pytest.mark.parametrize(
    "rel,message",
    [
        ("wavs/LJ009-9999.wav", r"no row for id 'wavs/LJ009-9999' or 'LJ009-9999' in .*metadata.csv"),
        ("wavs/LJ001-0004.wav", r"line 4 has 2 fields, column 2 is missing"),
        ("wavs/LJ001-0005.wav", r"id 'LJ001-0005' has two rows \(lines 5 and 6\)"),
    ],
)
@pytest.mark.parametrize("prepared", [True, False])
def test_csvcolumn_refuses_bad_rows(ljspeech, rel, message, prepared):
    col = h5s.CSVColumn("metadata.csv", column=2)
    src = _src(ljspeech, rel)
    if prepared:
        col = col.prepare([src])
    with pytest.raises(SourceError, match=message):
        col.load(src)


def test_csvcolumn_prepare_keeps_only_the_sources_rows(ljspeech):
    srcs = [_src(ljspeech, "wavs/LJ001-0001.wav"), _src(ljspeech, "wavs/LJ001-0003.wav")]
    col = h5s.CSVColumn("metadata.csv", column=1).prepare(srcs)
    (table,) = col.__dict__["_tables"].values()
    assert sorted(table.values) == ["LJ001-0001", "LJ001-0003"]
    # A source prepare() did not see is still found: the full table is read on demand.
    assert col.load(_src(ljspeech, "wavs/LJ001-0002.wav")) == '"in being comparatively modern."'
    # The table travels with the prepared feature, so a worker never needs the file.
    (ljspeech / "metadata.csv").unlink()
    assert col.load(srcs[0]) == "Printing, in the only sense"


def test_csvcolumn_header_names_numeric_dtype_and_absolute_path(tmp_path):
    meta = tmp_path / "elsewhere" / "labels.tsv"
    meta.parent.mkdir()
    meta.write_text("duration\tfile\tspeaker\n1.5\ta\t3\n2.25\tb\t4\noops\tc\t5\n", encoding="utf-8")
    dur = h5s.CSVColumn(str(meta), column="duration", key_column="file", sep="\t", header=True, dtype="float32")
    spk = h5s.CSVColumn(str(meta), column=2, key_column=1, sep="\t", header=True, dtype="int16")
    assert dur.spec().shape == () and dur.spec().dtype == "float32"
    a = _src(tmp_path / "wavs", "a.wav")
    assert dur.encode(dur.load(a)) == np.float32(1.5) and dur.encode(dur.load(a)).dtype == np.float32
    assert spk.load(_src(tmp_path, "b.wav")) == 4 and spk.load(_src(tmp_path, "b.wav")).dtype == np.int16
    with pytest.raises(SourceError, match="value 'oops' of column 'duration' is not a float32"):
        dur.load(_src(tmp_path, "c.wav"))
    with pytest.raises(SourceError, match=r"no column 'nope' in the header \['duration', 'file', 'speaker'\]"):
        h5s.CSVColumn(str(meta), column="nope", key_column="file", sep="\t", header=True).load(a)


def test_csvcolumn_missing_table(tmp_path):
    with pytest.raises(SourceError, match=r"metadata.csv: no such file: CSVColumn\(.metadata.csv.\) is looked up in"):
        h5s.CSVColumn("metadata.csv").prepare([_src(tmp_path, "a.wav")])


def test_csvcolumn_from_the_manifest_row(tmp_path):
    text = h5s.CSVColumn(column="text", pattern=r"\.wav$")
    speaker = h5s.CSVColumn(column="speaker", dtype="int64")
    src = _src(tmp_path, "a.wav", text="héllo", speaker="12")
    assert text.prepare([src]) is text
    assert text.load(src) == "héllo" and speaker.load(src) == 12
    with pytest.raises(SourceError, match=r"manifest row of id 'a' has no column 'text' \(columns: \['x'\]\)"):
        text.load(_src(tmp_path, "a.wav", x="1"))
    # An int column also finds a manifest key spelled as that number.
    assert h5s.CSVColumn(column=1).load(_src(tmp_path, "a.wav", **{"1": "one"})) == "one"


def test_csvcolumn_path_is_positional_or_keyword():
    assert h5s.CSVColumn("m.csv").path == h5s.CSVColumn(path="m.csv").path == "m.csv"
    with pytest.raises(TypeError, match="both positionally and as a keyword"):
        h5s.CSVColumn("m.csv", path="n.csv")
