"""The on-disk format: plain h5py + numpy read every item by following docs/format.md, and
every file h5store refuses is refused with FormatError naming the path."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.errors import CorruptRecordError, FormatError

FORMAT_DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


def read_with_h5py_only(path: Path) -> dict[tuple[str, str, str], Any]:
    """Every item of an h5store file, read as docs/format.md says: h5py and numpy only."""
    out: dict[tuple[str, str, str], Any] = {}
    with h5py.File(path, "r") as f:
        assert int(f.attrs["h5store_format"]) <= 1, "written by a newer h5store"
        schema = json.loads(f.attrs["h5store_schema"])
        for gname, features in schema["groups"].items():
            g = f[gname] if gname else f
            ids_data = g["ids/data"][...]
            ids_index = g["ids/index"][...]
            ids = [bytes(ids_data[a:b]).decode("utf-8") for a, b in ids_index]
            assert g["ids/checksum"][...].tolist() == [zlib.crc32(i.encode("utf-8")) for i in ids]
            for name, entry in features.items():
                col = g[name]
                spec = json.loads(col.attrs["h5store_column"])
                index, checksum = col["index"][...], col["checksum"][...]
                assert index.shape == (len(ids), 2) and index.dtype == np.int64
                assert checksum.shape == (len(ids),) and checksum.dtype == np.uint32
                data = col["data"][...]
                frames = col["frames"][...] if spec["layout"] == "blobs" else None
                for i, (a, b) in enumerate(index):
                    if a == -1 and b == -1:
                        assert checksum[i] == 0
                        continue
                    if spec["layout"] == "fixed":
                        assert b == a + 1
                        item = data[a]
                    elif spec["layout"] == "ragged":
                        item = data[a:b]
                    else:
                        item = [data[s:e].tobytes() for s, e in frames[a:b]]
                    raw = b"".join(item) if isinstance(item, list) else np.ascontiguousarray(item).tobytes()
                    assert zlib.crc32(raw) == checksum[i], f"{ids[i]}: corrupt item"
                    if entry["type"] == "h5store.Text":
                        item = bytes(item).decode("utf-8")
                    out[(gname, name, ids[i])] = item
    return out


class Everything(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 8))
    half = h5s.Array(dtype="float16", shape=(None,), compression="gzip", shuffle=True)
    img = h5s.Array(dtype="uint8", shape=(None, 4, 4, 3), compression="lzf")
    vec = h5s.Array(dtype="int64", shape=(2, 3))
    big = h5s.Scalar(dtype="uint64")
    flag = h5s.Scalar(dtype="bool")
    text = h5s.Text()
    frames = h5s.Feature(dtype="uint8", shape=(None,), layout="blobs")
    logs = h5s.Group(loss=h5s.Array(dtype="float64"), note=h5s.Text())


@pytest.fixture
def full_file(tmp_h5: Path) -> Path:
    rng = np.random.default_rng(7)
    with Everything(tmp_h5, "w") as f:
        for i in range(12):
            values: dict[str, Any] = dict(mel=rng.standard_normal((i % 5, 8)), text="\u00e9t\u00e9 " * (i % 3))
            if i % 2:
                values.update(half=rng.standard_normal(i), img=rng.integers(0, 256, (i % 3, 4, 4, 3), dtype=np.uint8),
                              vec=rng.integers(-9, 9, (2, 3)), big=np.uint64(2**64 - 1 - i), flag=bool(i % 4 == 1),
                              frames=[bytes(rng.integers(0, 256, k, dtype=np.uint8)) for k in range(i % 4)])
            f.add(f"spk{i % 3}/utt-{i:03d}", values)
        f.logs.extend(["epoch-1", "epoch-2"], dict(loss=[np.array([2.0, 1.5]), np.zeros(0)], note=["ok", ""]))
        f.mel[f"spk1/utt-{1:03d}"] = np.ones((1, 8))  # an overwritten item reads back new
    return tmp_h5


def test_plain_h5py_reads_every_item_as_documented(full_file: Path) -> None:
    plain = read_with_h5py_only(full_file)
    with h5s.open(full_file) as f:
        expect = {}
        for g in f.file_schema.groups:
            view = f.group(g)
            ids = list(view.ids)
            for name in view.features:
                fv = view.feature(name)
                for row in np.flatnonzero(fv.present).tolist():
                    expect[(g, name, ids[row])] = fv[row]
    assert plain.keys() == expect.keys()
    assert len(plain) == 12 * 2 + 6 * 6 + 4  # mel, text for all; six features for odd ids; 2 x 2 in logs
    for key, item in expect.items():
        got = plain[key]
        if isinstance(item, str):
            assert got == item
        elif isinstance(item, list):
            assert got == [b.tobytes() for b in item]
        else:
            assert np.asarray(got).dtype == np.asarray(item).dtype
            np.testing.assert_array_equal(got, item)
    assert plain[("", "mel", "spk1/utt-001")].tolist() == [[1.0] * 8]
    assert plain[("logs", "note", "epoch-2")] == ""


def test_the_doc_states_what_the_test_checks() -> None:
    doc = FORMAT_DOC.read_text()
    for needle in ("version 1", "h5store_format", "h5store_version", "h5store_schema", "h5store_column",
                   "[-1, -1]", "zlib.crc32", "frames", "locking=False", "newer", "region references",
                   "HDF5 names", "one dataset per item"):
        assert needle in doc, needle


def test_unknown_feature_type_and_params_read_as_plain_arrays(full_file: Path) -> None:
    with h5py.File(full_file, "r+") as f:
        schema = json.loads(f.attrs["h5store_schema"])
        schema["groups"][""]["mel"]["type"] = "someone.elses.Feature"
        schema["groups"][""]["mel"]["params"]["added_in_a_later_version"] = 3
        text = json.dumps(schema)
        f.attrs["h5store_schema"] = text
        # The schema carries a CRC-32 (HDF5's global heap, where it lives, has none).
        f.attrs["h5store_schema_crc32"] = np.uint32(zlib.crc32(text.encode("utf-8")))
    with h5s.open(full_file) as f:
        assert type(f.features["mel"]) is h5s.Feature
        assert f.mel["spk1/utt-001"].tolist() == [[1.0] * 8]


# ----------------------------------------------------------------------------- refused files
def newer_version(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs["h5store_format"] = 2


def plain_hdf5(path: Path) -> None:
    path.unlink()
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)


def truncate_by(n: int) -> Callable[[Path], None]:
    def cut(path: Path) -> None:
        os.truncate(path, os.path.getsize(path) - n)
    return cut


def truncate_to(fraction: float | None = None, size: int | None = None) -> Callable[[Path], None]:
    def cut(path: Path) -> None:
        os.truncate(path, size if size is not None else int(os.path.getsize(path) * fraction))  # type: ignore[operator]
    return cut


def text_file(path: Path) -> None:
    path.write_text("id,label\nutt-1,cat\n" * 50)


def empty_file(path: Path) -> None:
    path.write_bytes(b"")


def bad_schema(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs["h5store_schema"] = "{truncated"


REFUSED = {
    "newer-format": (newer_version, "h5store format 2 is newer than this library reads"),
    "plain-hdf5": (plain_hdf5, "not an h5store file"),
    "truncated-1-byte": (truncate_by(1), "not a readable HDF5 file"),
    "truncated-half": (truncate_to(fraction=0.5), "not a readable HDF5 file"),
    "truncated-100-bytes": (truncate_to(size=100), "not a readable HDF5 file"),
    "text": (text_file, "not a readable HDF5 file"),
    "empty": (empty_file, "empty file (0 bytes)"),
    "bad-schema": (bad_schema, "malformed schema"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_files_raise_format_error_naming_the_path(full_file: Path, kind: str) -> None:
    damage, message = REFUSED[kind]
    damage(full_file)
    openers = {
        "h5store.open": lambda: h5s.open(full_file),
        "class": lambda: Everything(full_file),
        "r+": lambda: Everything(full_file, "r+"),
        "a": lambda: Everything(full_file, "a"),  # an empty file too: it may be a create that never committed
    }
    for how, opener in openers.items():
        with pytest.raises(FormatError) as e:
            opener()
        assert isinstance(e.value, ValueError), how
        assert str(full_file) in str(e.value), how
        assert message in str(e.value), how
        shown = e.value.__cause__ or (None if e.value.__suppress_context__ else e.value.__context__)
        assert shown is None, how  # no chained h5py/OSError traceback under the message
    assert not Path(f"{full_file}.writer").exists()  # the refused writers left no lock behind
    if kind == "plain-hdf5":
        with h5py.File(full_file, "r") as f:  # and did not touch the foreign file
            assert list(f) == ["x"] and not f.attrs


def test_zero_byte_file_in_mode_w_becomes_a_new_file(tmp_h5: Path) -> None:
    tmp_h5.write_bytes(b"")
    with Everything(tmp_h5, "w") as f:  # "w" asks for a new file, whatever was there
        f.add("a", dict(text="x"))
    with h5s.open(tmp_h5) as f:
        assert f.text["a"] == "x"


def test_a_refused_writer_releases_its_lock(full_file: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.h5"
    shutil.copy(full_file, good)
    newer_version(full_file)
    with pytest.raises(FormatError):
        Everything(full_file, "a")
    with pytest.raises(FormatError):  # again: not LockedError from the first attempt
        Everything(full_file, "a")
    with Everything(good, "a") as f:
        f.add("new", {})


def test_index_outside_data_is_a_corrupt_record(full_file: Path) -> None:
    with h5py.File(full_file, "r+") as f:
        f["mel/index"][0] = [0, 10**9]
    with h5s.open(full_file) as f, pytest.raises(CorruptRecordError, match="index row 0") as e:
        f.mel[1]
    assert isinstance(e.value, FormatError) and str(full_file) in str(e.value)


def test_missing_group_or_feature_in_the_file(full_file: Path) -> None:
    with h5py.File(full_file, "r+") as f:
        del f["logs/note"]
        del f["text"]
    with h5s.open(full_file) as f:
        with pytest.raises(FormatError, match="no column 'text'"):
            f.mel[0]
        with pytest.raises(FormatError, match="no column 'note'"):
            f.logs.loss[0]


# ----------------------------------------------------------------------------- h5store.format
def test_the_format_module_names_what_the_doc_names(full_file: Path) -> None:
    """Names and attributes come from h5store.format: a file h5store wrote uses exactly those."""
    from h5store import format as fmt

    doc = FORMAT_DOC.read_text()
    for name in (fmt.ATTR_FORMAT, fmt.ATTR_SCHEMA, fmt.ATTR_SCHEMA_CRC, fmt.ATTR_COLUMN, *fmt.COLUMN_DATASETS):
        assert name in doc, name
    with h5py.File(full_file, "r") as f:
        assert int(f.attrs[fmt.ATTR_FORMAT]) == fmt.FORMAT_VERSION
        assert fmt.check_root(f, str(full_file)) == json.loads(f.attrs[fmt.ATTR_SCHEMA])
        ids = f[fmt.IDS]
        assert set(ids) == {fmt.DATA, fmt.INDEX, fmt.CHECKSUM}
        assert fmt.ColumnSpec.from_dict(json.loads(ids.attrs[fmt.ATTR_COLUMN])) == fmt.IDS_SPEC
        assert ids[fmt.DATA].dtype == fmt.IDS_SPEC.np_dtype


@pytest.mark.parametrize("fixed", [False, True])
def test_bad_ranges_is_the_index_rule(fixed: bool) -> None:
    from h5store.format import ABSENT, bad_ranges

    rng = np.random.default_rng(3)
    limit = 20
    r = rng.integers(-3, 25, (500, 2))
    r[::7] = ABSENT
    r[1::11] = [ABSENT, 4]  # half absent: damage, not an absent item
    got = bad_ranges(r, limit, fixed=fixed)
    for (s, e), bad in zip(r.tolist(), got.tolist()):
        absent = s == e == ABSENT
        ok = absent or (0 <= s <= e <= limit and (not fixed or e - s == 1))
        assert bad == (not ok), (s, e)
    assert bad_ranges(np.zeros((0, 2), np.int64), 0).shape == (0,)


def test_check_root_version_rules(tmp_path: Path) -> None:
    from h5store.format import ATTR_FORMAT, FORMAT_VERSION, check_root, init_root

    path = tmp_path / "v.h5"
    with h5py.File(path, "w") as f:
        init_root(f, {"class": "T", "groups": {"": {}}}, "test")
        assert check_root(f, str(path)) == {"class": "T", "groups": {"": {}}}
        f.attrs[ATTR_FORMAT] = FORMAT_VERSION + 1
        with pytest.raises(FormatError, match="newer than this library reads"):
            check_root(f, str(path))
        f.attrs[ATTR_FORMAT] = 0
        with pytest.raises(FormatError, match="invalid h5store format version 0"):
            check_root(f, str(path))
        del f.attrs[ATTR_FORMAT]
        with pytest.raises(FormatError, match="not an h5store file"):
            check_root(f, str(path))
