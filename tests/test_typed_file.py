"""TypedFile end to end: round-trips of every dtype and shape, groups, absent items,
reopening without the class, inheritance, declaration errors and the write API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.errors import DuplicateIdError, NotFound, ReadOnlyError, SchemaError

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool"]


def random_values(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt) * 100
    info = np.iinfo(dt)
    out = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if out.size >= 2:  # the extremes must survive too
        out.flat[0], out.flat[-1] = info.min, info.max
    return out


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, str):
        assert isinstance(b, str) and a == b
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def every_item(f: h5s.TypedFile) -> dict[tuple[str, str, str], Any]:
    """(group, feature, id) -> item, for every present item of every group."""
    out = {}
    for g in f.file_schema.groups:
        view = f.group(g)
        ids = list(view.ids)
        for name in view.features:
            fv = view.feature(name)
            for row in np.flatnonzero(fv.present).tolist():
                out[(g, name, ids[row])] = fv[row]
    return out


# ----------------------------------------------------------------------------- round-trips
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_and_shape(tmp_h5: Path, dtype: str) -> None:
    class Typed(h5s.TypedFile):
        rag = h5s.Array(dtype=dtype, shape=(None, 3))
        fix = h5s.Array(dtype=dtype, shape=(2, 2))
        one = h5s.Scalar(dtype=dtype)

    rng = np.random.default_rng(DTYPES.index(dtype))
    expect: dict[str, dict[str, np.ndarray]] = {}
    with Typed(tmp_h5, "w") as f:
        for i, t in enumerate([4, 0, 1, 7]):  # T = 0 is an empty item, not an absent one
            vals = {"rag": random_values(dtype, (t, 3), rng), "fix": random_values(dtype, (2, 2), rng),
                    "one": random_values(dtype, (), rng)}
            f.add(f"id{i}", vals)
            expect[f"id{i}"] = vals
        assert_same(f.rag["id0"], expect["id0"]["rag"])  # readable before the flush, too
    for opened in (Typed(tmp_h5), h5s.open(tmp_h5)):
        with opened as f:
            assert list(f.ids) == list(expect)
            for id, vals in expect.items():
                for name, v in vals.items():
                    assert_same(f.feature(name)[id], v)
            assert f.rag["id1"].shape == (0, 3)
            assert f.rag.lengths.tolist() == [4, 0, 1, 7]
            got = f.rag.read_many(["id3", "id0", "id3"])
            for g, id in zip(got, ["id3", "id0", "id3"]):
                assert_same(g, expect[id]["rag"])


def test_round_trip_images_text_blobs_groups_and_absent_items(tmp_h5: Path) -> None:
    class Media(h5s.TypedFile):
        mel = h5s.Array(dtype="float32", shape=(None, 80))
        video = h5s.Array(dtype="uint8", shape=(None, 6, 5, 3))
        raw = h5s.Array(dtype="uint8")
        text = h5s.Text()
        label = h5s.Scalar(dtype="int64")
        frames = h5s.Feature(dtype="uint8", shape=(None,), layout="blobs")
        logs = h5s.Group(loss=h5s.Array(dtype="float32"), step=h5s.Scalar(dtype="int32"))

    rng = np.random.default_rng(1)
    blobs = [b"\xff\xd8jpeg-0", b"", b"frame-two" * 50, b"\x00\x01\x02"]
    with Media(tmp_h5, "w") as f:
        f.add("a", dict(mel=rng.random((5, 80)), video=rng.integers(0, 256, (3, 6, 5, 3), dtype=np.uint8),
                        raw=np.frombuffer(b"\x00bytes\xff", np.uint8), text="h\u00e9llo \U0001f600", label=3, frames=blobs))
        f.add("b", dict(text="", frames=[]))  # empty text, an item of zero blobs; the rest absent
        f.add("c", dict(mel=np.zeros((0, 80), np.float32), label=-1))
        f.logs.add("a", dict(loss=np.array([0.5, 0.25]), step=10))  # same id, another group: independent
        f.logs.extend(["run-2", "run-3"], dict(loss=[np.array([1.0]), np.zeros(0)]))
        with pytest.raises(NotFound, match="no id 'x'"):
            f.logs.loss["x"]
    with h5s.open(tmp_h5) as f:
        assert list(f.ids) == ["a", "b", "c"] and list(f.logs.ids) == ["a", "run-2", "run-3"]
        assert f.groups == ["logs"] and len(f.logs) == 3 and "run-2" in f.logs and "run-2" not in f
        assert f.mel["a"].dtype == np.float32 and f.mel["a"].shape == (5, 80)
        assert f.video["a"].shape == (3, 6, 5, 3) and f.video["a"].dtype == np.uint8
        assert f.raw["a"].tobytes() == b"\x00bytes\xff"
        assert f.text["a"] == "h\u00e9llo \U0001f600" and f.text["b"] == ""
        assert [b.tobytes() for b in f.frames["a"]] == blobs and f.frames["b"] == []
        assert [b.tobytes() for b in f.frames.blobs("a", 1, 3)] == blobs[1:3]
        assert [b.tobytes() for b in f.frames.blobs("a", 2)] == blobs[2:]
        assert f.frames.blobs("a", 2, 2) == []
        assert [b.tobytes() for b in f.frames.blobs("a", 0, 5)] == blobs  # bounds clamp like a slice
        assert [b.tobytes() for b in f.frames.blobs("a", -2)] == blobs[-2:]
        assert f.frames.lengths.tolist() == [4, 0, 0]
        assert f.label["c"] == -1 and f.mel["c"].shape == (0, 80)
        assert f.logs.loss["a"].tolist() == [0.5, 0.25] and f.logs.step["a"] == 10
        assert f.logs.loss["run-3"].shape == (0,)
        # Items absent for some features: NotFound (a KeyError) naming file, feature and id.
        for feature, id in [("mel", "b"), ("video", "c"), ("label", "b"), ("text", "c"), ("frames", "c")]:
            with pytest.raises(NotFound) as e:
                f.feature(feature)[id]
            assert isinstance(e.value, KeyError)
            assert str(e.value) == f"{tmp_h5}:/{feature}: id {id!r} has no {feature!r} item"
        with pytest.raises(NotFound, match="'step'"):
            f.logs.step["run-2"]
        assert f.mel.present.tolist() == [True, False, True]
        assert set(f.get("b")) == {"text", "frames"} and f.get("zzz") is None
    # The same values through the class and without it.
    with Media(tmp_h5) as g, h5s.open(tmp_h5) as f:
        a, b = every_item(g), every_item(f)
        assert a.keys() == b.keys() and len(a) == 14  # 10 root items + 4 in logs
        for k in a:
            assert_same(a[k], b[k])


def test_positions_slices_and_iteration(tmp_h5: Path) -> None:
    class P(h5s.TypedFile):
        x = h5s.Scalar(dtype="int32")

    with P(tmp_h5, "w") as f:
        f.extend([f"i{k}" for k in range(10)], dict(x=list(range(10))))
        assert f.x[-1] == 9 and f.x[np.int64(3)] == 3
        assert [int(v) for v in f.x[2:5]] == [2, 3, 4]
        assert [int(v) for v in f.x[[9, "i0", 4]]] == [9, 0, 4]
        assert [int(v) for v in f.x] == list(range(10))
        assert f.ids[2:4] == ["i2", "i3"] and f.ids[-1] == "i9" and f.ids.index("i7") == 7
        assert f.ids.positions(["i5", "i1"]).tolist() == [5, 1]
        with pytest.raises(IndexError):
            f.x[10]
        with pytest.raises(TypeError):
            f.x[True]
        with pytest.raises(NotFound):
            f.ids.index("nope")


# ----------------------------------------------------------------------------- schema classes
def test_inheritance_collects_over_the_mro(tmp_h5: Path) -> None:
    class Base(h5s.TypedFile):
        mel = h5s.Array(dtype="float32", shape=(None, 80))
        text = h5s.Text()
        extra = h5s.Scalar()
        logs = h5s.Group(loss=h5s.Array())

    class Mixin:
        tag = h5s.Scalar(dtype="int8")

    class Derived(Base, Mixin):
        mel = h5s.Array(dtype="float16", shape=(None, 40))  # overrides Base.mel
        extra = None  # a non-feature removes the inherited feature
        logs = h5s.Group(loss=h5s.Array(), lr=h5s.Array())

    assert set(Base.schema.groups[""]) == {"mel", "text", "extra"}
    root = Derived.schema.groups[""]
    assert set(root) == {"mel", "text", "tag"}
    assert root["mel"].dtype == "float16" and root["mel"].shape == (None, 40)
    assert set(Derived.schema.groups["logs"]) == {"loss", "lr"}
    assert Derived.mel is root["mel"] and Base.mel.shape == (None, 80)  # class access: the Feature
    with Derived(tmp_h5, "w") as f:
        f.add("a", dict(mel=np.ones((2, 40)), text="t", tag=1))
        f.logs.add("r", dict(lr=np.array([0.1])))
    with Derived(tmp_h5) as f:
        assert f.mel["a"].dtype == np.float16 and f.tag["a"] == 1 and f.logs.lr["r"].tolist() == [np.float32(0.1)]
    with pytest.raises(SchemaError, match=r"stored as float16 \(None, 40\) \(ragged\), but Base declares float32"):
        Base(tmp_h5)


@pytest.mark.parametrize(("feature", "message"), [
    (lambda: h5s.Array(dtype="floaty"), "Speech.mel: unknown dtype 'floaty'"),
    (lambda: h5s.Array(dtype="U8"), "Speech.mel: dtype must be numeric or bool"),
    (lambda: h5s.Array(shape=(None, None)), "Speech.mel: only the first axis may be variable"),
    (lambda: h5s.Array(shape=(3, -1)), "Speech.mel: shape dims must be ints >= 0"),
    (lambda: h5s.Array(pattern="([a-z]"), "Speech.mel: pattern '([a-z]' is not a valid regex"),
    (lambda: h5s.Array(compression="brotli"), "Speech.mel: compression must be one of"),
    (lambda: h5s.Text(dtype="int8"), "Speech.mel: Text is stored as dtype uint8"),
])
def test_declaration_errors_name_class_and_attribute(feature: Any, message: str) -> None:
    with pytest.raises(SchemaError) as e:
        type("Speech", (h5s.TypedFile,), {"mel": feature(), "ok": h5s.Array()})
    assert message in str(e.value)


def test_reserved_and_invalid_names() -> None:
    with pytest.raises(SchemaError, match=r"Speech\.ids: invalid feature name"):
        type("Speech", (h5s.TypedFile,), {"ids": h5s.Array()})
    with pytest.raises(SchemaError, match=r"Speech\.logs\.ids: invalid feature name"):
        type("Speech", (h5s.TypedFile,), {"logs": h5s.Group(ids=h5s.Array())})
    with pytest.raises(SchemaError, match=r"Speech\.ids: invalid group name"):
        type("Speech", (h5s.TypedFile,), {"ids": h5s.Group(x=h5s.Array())})
    with pytest.raises(SchemaError, match="expected a Feature"):
        h5s.Group(x=np.zeros(3))


def test_creating_needs_a_schema(tmp_h5: Path) -> None:
    with pytest.raises(SchemaError, match="creating a file needs a schema"):
        h5s.TypedFile(tmp_h5, "w")
    with pytest.raises(FileNotFoundError):
        h5s.open(tmp_h5.with_name("absent.h5"))


# ----------------------------------------------------------------------------- write API
class Speech(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 4))
    vec = h5s.Array(dtype="float32", shape=(3,), finite=True)
    n = h5s.Scalar(dtype="int8")
    text = h5s.Text()
    logs = h5s.Group(loss=h5s.Array(dtype="float32"))


def mel(t: int, v: float = 1.0) -> np.ndarray:
    return np.full((t, 4), v, np.float32)


def test_add_and_both_extend_forms(tmp_h5: Path) -> None:
    with Speech(tmp_h5, "w") as f:
        assert f.add("a", dict(mel=mel(2), n=1)) == 0
        rows = f.extend([("b", dict(mel=mel(3), text="bee")), ("c", {})])
        assert rows.tolist() == [1, 2]
        rows = f.extend(["d", "e"], dict(mel=[mel(1, 4.0), mel(0)], n=[4, 5]))
        assert rows.tolist() == [3, 4]
        assert f.logs.add("run", dict(loss=np.arange(3))) == 0
        with pytest.raises(ValueError, match="1 items for 2 ids"):
            f.extend(["f", "g"], dict(n=[1]))
    with h5s.open(tmp_h5) as f:
        assert list(f.ids) == ["a", "b", "c", "d", "e"]
        assert f.mel["d"].tolist() == [[4.0] * 4] and f.n["e"] == 5 and f.text["b"] == "bee"
        assert f.mel.present.tolist() == [True, True, False, True, True]
        assert f.logs.loss["run"].dtype == np.float32


def test_overwrite_same_shape(tmp_h5: Path) -> None:
    with Speech(tmp_h5, "w") as f:
        f.add("a", dict(mel=mel(2), vec=np.zeros(3)))
        f.add("b", dict(mel=mel(1)))
        f.mel["a"] = mel(2, 9.0)
        f.vec["a"] = [1, 2, 3]
        f.vec["b"] = [4, 5, 6]  # absent until now: stored
        with pytest.raises(SchemaError) as e:
            f.mel["a"] = mel(3)
        assert "overwrite needs shape (2, 4), got (3, 4)" in str(e.value) and "'a'" in str(e.value)
        with pytest.raises(SchemaError, match="mel: id 'a': expected shape"):
            f.mel["a"] = np.ones((2, 5))
        with pytest.raises(NotFound):
            f.mel["zzz"] = mel(1)
        with pytest.raises(AttributeError, match=r"use f\.mel\[id\] = array"):
            f.mel = mel(1)
    with Speech(tmp_h5) as f:
        assert f.mel.read_many(["a"], verify=True)[0].tolist() == mel(2, 9.0).tolist()
        assert f.vec.read_many(["a", "b"], verify=True)[1].tolist() == [4, 5, 6]


@pytest.mark.parametrize(("values", "message"), [
    (dict(n=1.5), "n: id 'x': dtype float64 cannot be stored as int8"),
    (dict(n=300), "n: id 'x': values in [300, 300] do not fit int8"),
    (dict(n=-129), "n: id 'x': values in [-129, -129] do not fit int8"),
    (dict(mel=np.ones(4)), "mel: id 'x': expected 2 dims (T, 4), got shape (4,)"),
    (dict(mel=np.ones((2, 5))), "mel: id 'x': expected shape (T, 4), got (2, 5)"),
    (dict(vec=[np.nan, 0, 0]), "vec: id 'x': holds NaN or inf"),
    (dict(vec=[np.inf, 0, 0]), "vec: id 'x': holds NaN or inf"),
    (dict(vec=[1, 2]), "vec: id 'x': expected shape (3,), got (2,)"),
    (dict(text=b"\xff\xfe"), "text: id 'x': bytes are not valid utf-8"),
    (dict(text=3), "text: id 'x': expected a str"),
    (dict(nope=1), "no feature 'nope'"),
])
def test_values_that_do_not_fit(tmp_h5: Path, values: dict, message: str) -> None:
    with Speech(tmp_h5, "w") as f:
        f.add("a", dict(n=1))
        with pytest.raises(SchemaError) as e:
            f.add("x", values)
        assert message in str(e.value) and str(tmp_h5) in str(e.value)
        with pytest.raises(SchemaError):  # the same through extend: the good records are not stored either
            f.extend([("ok", dict(n=2)), ("x", values)])
        assert list(f.ids) == ["a"] and f.n.present.tolist() == [True]


def test_duplicates_store_nothing(tmp_h5: Path) -> None:
    with Speech(tmp_h5, "w") as f:
        f.add("a", dict(n=1))
        with pytest.raises(DuplicateIdError, match="id 'a' is already stored") as e:
            f.add("a", dict(n=2))
        assert isinstance(e.value, ValueError) and str(tmp_h5) in str(e.value)
        with pytest.raises(DuplicateIdError, match="'b' given twice"):
            f.extend([("b", dict(mel=mel(1))), ("c", dict(n=3)), ("b", dict(n=4))])
        with pytest.raises(DuplicateIdError, match="'a' is already stored"):
            f.extend(["d", "a"], dict(n=[1, 2]))
        assert list(f.ids) == ["a"] and f.n["a"] == 1
        f.add("b", dict(n=5))  # the refused calls left nothing behind
    with h5s.open(tmp_h5) as f:
        assert list(f.ids) == ["a", "b"] and f.mel.present.tolist() == [False, False]
        assert f.h5["n/data"].shape == (2,)


def test_modes(tmp_h5: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Speech(tmp_h5, "r")
    with pytest.raises(FileNotFoundError):
        Speech(tmp_h5, "r+")
    with Speech(tmp_h5, "a") as f:  # "a" creates
        f.add("a", dict(n=1))
    with Speech(tmp_h5, "a") as f:  # and appends
        f.add("b", dict(n=2))
    for mode in ("w-", "x"):
        with pytest.raises(FileExistsError):
            Speech(tmp_h5, mode)
    with Speech(tmp_h5, "r+") as f:
        f.add("c", dict(n=3))
        assert list(f.ids) == ["a", "b", "c"]
    with Speech(tmp_h5, "r") as f:
        assert list(f.ids) == ["a", "b", "c"] and not f.writable
        for write in (lambda: f.add("d", dict(n=4)), lambda: f.extend(["d"], dict(n=[4])),
                      lambda: f.logs.add("r", dict(loss=np.ones(1))), lambda: f.n.__setitem__("a", 7),
                      lambda: f.vec.__setitem__("a", [1, 2, 3])):
            with pytest.raises(ReadOnlyError) as e:
                write()
            assert isinstance(e.value, PermissionError) and str(tmp_h5) in str(e.value)
        assert f.n["a"] == 1
    with Speech(tmp_h5, "w") as f:  # "w" truncates
        assert len(f) == 0
    other = tmp_h5.with_name("x.h5")
    with Speech(other, "x") as f:
        f.add("a", {})
    assert h5s.open(other).ids[0] == "a"
    with pytest.raises(ValueError, match="mode must be one of"):
        Speech(tmp_h5, "rw")


def test_adding_a_feature_to_an_existing_file(tmp_h5: Path) -> None:
    class V1(h5s.TypedFile):
        n = h5s.Scalar(dtype="int8")

    class V2(V1):
        extra = h5s.Array(dtype="float32")

    with V1(tmp_h5, "w") as f:
        f.extend(["a", "b"], dict(n=[1, 2]))
    with pytest.raises(SchemaError, match="declared by V2 but not in the file; open with mode='a'"):
        V2(tmp_h5)
    with V2(tmp_h5, "a") as f:
        assert f.extra.present.tolist() == [False, False]
        f.extra["b"] = np.ones(2)
        f.add("c", dict(n=3, extra=np.zeros(1)))
    with h5s.open(tmp_h5) as f:
        assert set(f.features) == {"n", "extra"} and f.extra.present.tolist() == [False, True, True]
        assert f.n["c"] == 3


ON_DISK = """
import json, sys, h5py
with h5py.File(sys.argv[1], "r", locking=False) as f:  # docs/format.md: a writer holds the file
    out = {k: f[k][...].tolist() for k in ("ids/index", "ids/checksum", "mel/index", "mel/checksum", "n/index", "logs/ids/index", "logs/loss/index")}
    out["ids"] = bytes(f["ids/data"][...]).decode()
    out["mel_rows"] = f["mel/data"].shape[0]
print(json.dumps(out))
"""


def on_disk(path: Path) -> dict:
    """What another process sees on disk, through plain h5py."""
    out = subprocess.run([sys.executable, "-c", ON_DISK, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_flush_makes_ids_and_index_consistent_on_disk(tmp_h5: Path) -> None:
    f = Speech(tmp_h5, "w")
    try:
        f.add("a", dict(mel=mel(2), n=1))
        f.extend(["bb", "c"], dict(mel=[mel(3), mel(0)]))
        f.logs.add("r", dict(loss=np.ones(2)))
        f.flush()
        disk = on_disk(tmp_h5)
        assert disk["ids"] == "abbc" and disk["ids/index"] == [[0, 1], [1, 3], [3, 4]]
        assert disk["mel/index"] == [[0, 2], [2, 5], [5, 5]] and disk["mel_rows"] == 5
        assert disk["n/index"] == [[0, 1], [-1, -1], [-1, -1]]
        assert disk["logs/ids/index"] == [[0, 1]] and disk["logs/loss/index"] == [[0, 2]]
        f.add("d", dict(mel=mel(1)))
        f.mel["a"] = mel(2, 5.0)
        f.close()
        disk = on_disk(tmp_h5)
        assert disk["ids"] == "abbcd" and len(disk["mel/index"]) == 4 == len(disk["n/index"])
        assert disk["mel/index"][3] == [5, 6] and disk["mel_rows"] == 6
    finally:
        f.close()
    with Speech(tmp_h5) as g:
        assert g.mel.read_many(["a", "d"], verify=True)[0].tolist() == mel(2, 5.0).tolist()


def test_geometric_growth_counts_resizes(tmp_h5: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_resize = h5py.Dataset.resize

    def counting_resize(self: h5py.Dataset, size: Any, axis: int | None = None) -> None:
        calls.append(self.name)
        real_resize(self, size, axis)

    monkeypatch.setattr(h5py.Dataset, "resize", counting_resize)
    n = 5000
    with Speech(tmp_h5, "w") as f:
        for i in range(n):
            f.add(f"id{i}", dict(mel=mel(i % 3 + 1, float(i)), n=i % 100))
            if i % 10 == 0:
                assert f.mel[f"id{i}"][0, 0] == float(i)  # a read writes pending rows first
        f.flush()
    assert 0 < len(calls) < 60, f"{len(calls)} resizes for {n} items"
    monkeypatch.undo()
    with h5s.open(tmp_h5) as f:
        assert len(f) == n and f.mel.data.shape[0] == sum(i % 3 + 1 for i in range(n))
        last = f.mel.read_many(range(n - 3, n), verify=True)
        assert [x[0, 0] for x in last] == [n - 3, n - 2, n - 1]
        assert f.n[n - 1] == (n - 1) % 100


# ----------------------------------------------------------------------------- errors
def test_error_tree_and_messages(tmp_h5: Path) -> None:
    for cls, builtin in [(h5s.NotFound, KeyError), (h5s.ReadOnlyError, PermissionError), (h5s.FormatError, ValueError),
                         (h5s.SchemaError, TypeError), (h5s.DuplicateIdError, ValueError),
                         (h5s.LockedError, BlockingIOError), (h5s.CorruptRecordError, h5s.FormatError)]:
        assert issubclass(cls, builtin) and issubclass(cls, h5s.H5StoreError), cls
    assert str(h5s.NotFound("f.h5:/mel: no id 'x'")) == "f.h5:/mel: no id 'x'"  # a sentence, not a repr
    assert str(h5s.NotFound()) == ""
    with Speech(tmp_h5, "w") as f:
        f.add("a", dict(n=1))
        f.logs.add("r", {})
        caught: dict[str, BaseException] = {}
        for name, action in [("id", lambda: f.mel["zzz"]), ("item", lambda: f.mel["a"]),
                             ("group item", lambda: f.logs.loss["r"]), ("feature", lambda: f.feature("nope")),
                             ("group", lambda: f.group("nope")), ("value", lambda: f.add("b", dict(n="x")))]:
            with pytest.raises(h5s.H5StoreError) as e:
                action()
            caught[name] = e.value
        assert str(caught["id"]) == f"{tmp_h5}:/: no id 'zzz'"
        assert str(caught["item"]) == f"{tmp_h5}:/mel: id 'a' has no 'mel' item"
        assert str(caught["group item"]) == f"{tmp_h5}:/logs/loss: id 'r' has no 'loss' item"
        assert str(tmp_h5) in str(caught["feature"]) and "no feature 'nope'" in str(caught["feature"])
        assert "no group 'nope'" in str(caught["group"]) and "logs" in str(caught["group"])
        assert str(caught["value"]).startswith(f"{tmp_h5}:/n: id 'b': ")
        with pytest.raises(KeyError):  # the builtin a caller would naturally catch
            f.mel["zzz"]
