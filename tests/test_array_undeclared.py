"""``h5s.Array()`` without dtype or shape: the first item stored fixes them (issue 12, point 1)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.cli import main
from h5store.errors import NotFound, SchemaError
from h5store.integrity import verify
from h5store.safety import H5StoreSecurityWarning


class Logs(h5s.TypedFile):
    x = h5s.Array()


class Npy(h5s.Array):
    pattern = r"\.npy$"

    def load(self, source):
        return np.load(source)


class FromNpy(h5s.TypedFile):
    x = Npy()


def _stored(path, name="x", group=""):
    with h5py.File(path, "r", locking=False) as f:
        return json.loads(f.attrs["h5store_schema"])["groups"][group][name]["params"]


# -- the first item fixes dtype and trailing dims ---------------------------------------------
def test_undeclared_array_takes_the_first_items_shape_and_dtype(tmp_h5):
    a, b = np.random.default_rng(0).random((42, 7)), np.ones((3, 7))
    with Logs(tmp_h5, "w") as f:
        f.add("a", dict(x=a))
        f.add("b", dict(x=b))
        np.testing.assert_array_equal(f.x["a"], a)
    params = _stored(tmp_h5)
    assert params["dtype"] == "float64" and params["shape"] == [None, 7]  # stored concrete
    for f in (Logs(tmp_h5), h5s.open(tmp_h5)):
        with f:
            spec = f.file_schema.feature("", "x").spec()
            assert (spec.dtype, spec.shape, spec.layout) == ("float64", (None, 7), "ragged")
            assert f.x["a"].dtype == np.float64 and f.x["a"].shape == (42, 7)
            np.testing.assert_array_equal(f.x["b"], b)
            np.testing.assert_array_equal(f.x.data[42:45], b)  # plain h5py sees (rows, 7) float64
    with Logs(tmp_h5) as f:
        [batch] = f.iter_batches(dict(x=h5s.Window("x", 3)), batch_size=2)
        assert batch["x"].shape == (2, 3, 7) and batch["x"].dtype == np.float64


def test_a_later_item_with_other_trailing_dims_is_refused_with_both_shapes(tmp_h5):
    with Logs(tmp_h5, "w") as f:
        f.add("a", dict(x=np.zeros((42, 7))))
        with pytest.raises(SchemaError, match=re.escape(
                "x: id 'b': expected shape (T, 7) (fixed by the first item stored), got (3, 8)")):
            f.add("b", dict(x=np.zeros((3, 8))))
        with pytest.raises(SchemaError, match=r"expected shape \(T, 7\) \(fixed by the first item stored\), got \(7,\)"):
            f.add("c", dict(x=np.zeros(7)))
        assert list(f.ids) == ["a"]
    # After a reopen with the class too, and from plain h5s.open.
    with Logs(tmp_h5, "a") as f:
        with pytest.raises(SchemaError, match=r"x: id 'b': expected shape \(T, 7\) \(fixed by the first item stored\), "
                           r"got \(3, 8\)"):
            f.add("b", dict(x=np.zeros((3, 8))))
        f.add("b", dict(x=np.zeros((0, 7), np.float32)))  # same kind, safe cast: fine
    with h5s.open(tmp_h5, "a") as f:
        with pytest.raises(SchemaError, match=r"x: id 'c': expected shape \(T, 7\).*got \(3, 8\)"):
            f.add("c", dict(x=np.zeros((3, 8))))
    with h5s.open(tmp_h5) as f:
        assert list(f.ids) == ["a", "b"] and f.x["b"].dtype == np.float64


def test_a_later_item_of_another_kind_is_refused(tmp_h5):
    with Logs(tmp_h5, "w") as f:
        f.add("a", dict(x=np.arange(5)))  # int64, (T,)
        f.add("b", dict(x=np.arange(3, dtype=np.int8)))  # a safe cast within the kind
        with pytest.raises(SchemaError, match=r"x: id 'c': dtype float64 cannot be stored as int64 "
                           r"\(the dtype fixed by the first item stored\) without loss"):
            f.add("c", dict(x=np.ones(3)))
    with h5s.open(tmp_h5) as f:
        assert f.x["b"].dtype == np.int64 and list(f.ids) == ["a", "b"]


def test_one_batch_is_checked_against_its_own_first_item(tmp_h5):
    with Logs(tmp_h5, "w") as f:
        with pytest.raises(SchemaError, match=r"x: id 'b': expected shape \(T, 7\).*got \(3, 8\)"):
            f.extend({"a": {"x": np.zeros((2, 7))}, "b": {"x": np.zeros((3, 8))}})
        assert len(f) == 0  # nothing stored, nothing fixed
        f.add("c", dict(x=np.zeros((3, 8))))  # the bad batch fixed nothing
    assert _stored(tmp_h5)["shape"] == [None, 8]


@pytest.mark.parametrize(("value", "message"), [
    ("hello", r"x: id 'a': got str data \(dtype <U5\); an Array stores numeric or bool arrays: use h5s\.Text\(\) for text"),
    (b"raw", r"x: id 'a': got bytes data \(dtype \|S3\); an Array stores numeric or bool arrays: use h5s\.Text\(\) for text"),
    ([[1, 2], [3]], r"x: id 'a': cannot be made into one numeric array \("),
    (None, r"x: id 'a': got object data \(dtype object\); an Array stores numeric or bool arrays"),
])
def test_a_first_item_that_is_not_numeric_is_refused(tmp_h5, value, message):
    with Logs(tmp_h5, "w") as f:
        with pytest.raises(SchemaError, match=message):
            f.add("a", dict(x=value))
        assert len(f) == 0
        f.add("b", dict(x=np.ones(2, np.float32)))
    assert _stored(tmp_h5)["dtype"] == "float32"


def test_a_scalar_first_item_fixes_one_scalar_per_item(tmp_h5):
    with Logs(tmp_h5, "w") as f:
        f.add("a", dict(x=0.5))
        f.add("b", dict(x=np.float32(2)))
        with pytest.raises(SchemaError, match=r"x: id 'c': expected shape \(\) \(fixed by the first item stored\), "
                           r"got \(2,\)"):
            f.add("c", dict(x=[1.0, 2.0]))
    with h5s.open(tmp_h5) as f:
        assert f.file_schema.feature("", "x").spec().layout == "fixed"
        assert f.x["a"] == 0.5 and f.x["b"].shape == () and f.x.data.shape == (2,)


# -- declared parts stay binding ---------------------------------------------------------------
def test_a_declared_dtype_stays_binding_and_the_shape_is_learned(tmp_h5):
    class Half(h5s.TypedFile):
        x = h5s.Array(dtype="float32")

    with Half(tmp_h5, "w") as f:
        f.add("a", dict(x=np.ones((4, 7))))  # float64 -> float32, as a declared dtype does
        with pytest.raises(SchemaError, match=r"dtype int64 cannot be stored|expected shape \(T, 7\)"):
            f.add("b", dict(x=np.ones((4, 6), np.int64)))
        with pytest.raises(SchemaError, match=r"dtype complex128 cannot be stored as float32 without loss"):
            f.add("b", dict(x=np.ones((4, 7), complex)))
    assert _stored(tmp_h5)["dtype"] == "float32" and _stored(tmp_h5)["shape"] == [None, 7]
    with h5s.open(tmp_h5) as f:
        assert f.x["a"].dtype == np.float32


def test_a_declared_shape_stays_binding_and_the_dtype_is_learned(tmp_h5):
    class Mel(h5s.TypedFile):
        x = h5s.Array(shape=(None, 80))

    with Mel(tmp_h5, "w") as f:
        with pytest.raises(SchemaError, match=r"x: id 'a': expected shape \(T, 80\), got \(3, 7\)"):
            f.add("a", dict(x=np.ones((3, 7), np.float16)))
        f.add("a", dict(x=np.ones((3, 80), np.float16)))
    assert _stored(tmp_h5)["dtype"] == "float16"


def test_declared_dtype_and_shape_behave_as_before(tmp_h5):
    class Old(h5s.TypedFile):
        x = h5s.Array(dtype="float32", shape=(None, 2))

    with Old(tmp_h5, "w") as f:
        f.add("a", dict(x=np.ones((3, 2))))
        with pytest.raises(SchemaError, match=r"expected 2 dims \(T, 2\), got shape \(3,\)"):
            f.add("b", dict(x=np.ones(3)))
    assert _stored(tmp_h5)["dtype"] == "float32"


def test_a_class_declaring_other_storage_is_refused_and_an_undeclared_one_fits(tmp_h5):
    with Logs(tmp_h5, "w") as f:
        f.add("a", dict(x=np.zeros((2, 7))))

    class Other(h5s.TypedFile):
        x = h5s.Array(dtype="float32", shape=(None, 7))

    class OtherShape(h5s.TypedFile):
        x = h5s.Array(shape=(None, 8))

    for cls in (Other, OtherShape):
        with pytest.raises(SchemaError, match=r"stored as float64 \(None, 7\) \(ragged\), but Other"):
            cls(tmp_h5)

    class Same(h5s.TypedFile):
        x = h5s.Array(dtype="float64")

    with Same(tmp_h5) as f:
        assert f.x["a"].shape == (2, 7)


# -- before the first item ---------------------------------------------------------------------
def test_a_file_without_an_item_yet_reads_as_an_empty_feature(tmp_h5, capsys):
    class Two(h5s.TypedFile):
        x = h5s.Array()
        y = h5s.Scalar()

    with Two(tmp_h5, "w") as f:
        f.add("a", dict(y=1))  # x holds nothing yet
        assert not f.x.present.any()
    assert _stored(tmp_h5)["dtype"] is None
    with h5py.File(tmp_h5, "r") as plain:
        assert "x" not in plain  # no column until the first item (docs/format.md)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", H5StoreSecurityWarning)
        h5s.open(tmp_h5, untrusted=True).close()  # the untrusted checks accept it
    for f in (Two(tmp_h5), h5s.open(tmp_h5)):
        with f:
            assert len(f) == 1 and f.x.present.tolist() == [False] and f.get("a") == {"y": 1}
            with pytest.raises(NotFound, match=r"id 'a' has no 'x' item"):
                f.x["a"]
            with pytest.raises(NotFound, match=r"no id 'zz'|'zz'"):
                f.x["zz"]
            with pytest.raises(SchemaError, match=r"feature 'x' holds no item yet"):
                f.iter_batches(dict(x=h5s.Item("x")), batch_size=1)
    assert verify(tmp_h5).ok
    assert main(["info", str(tmp_h5)]) == 0
    assert re.search(r"\nx +h5store\.Array +0 1st item 1st item ", capsys.readouterr().out)
    with Two(tmp_h5, "a") as f:
        f.add("b", dict(x=np.ones((2, 3), np.int16), y=2))
    with h5s.open(tmp_h5) as f:
        assert f.x["b"].dtype == np.int16 and f.x.present.tolist() == [False, True]
        assert f.file_schema.feature("", "x").spec().shape == (None, 3)
    assert verify(tmp_h5).ok


def test_a_reader_sees_the_fixed_feature_after_refresh(tmp_h5):
    with Logs(tmp_h5, "w"):
        pass
    with Logs(tmp_h5) as r:
        assert len(r) == 0
        with Logs(tmp_h5, "a") as w:
            w.add("a", dict(x=np.ones((2, 5))))
        r.refresh()
        assert r.x["a"].shape == (2, 5)


# -- groups ------------------------------------------------------------------------------------
def test_an_undeclared_array_in_a_group(tmp_h5):
    class Run(h5s.TypedFile):
        logs = h5s.Group(loss=h5s.Array(), step=h5s.Scalar())

    with Run(tmp_h5, "w") as f:
        f.logs.add("run-1", dict(loss=np.array([0.9, 0.5]), step=3))
        f.logs.extend(["run-2", "run-3"], {"loss": [np.array([0.4]), np.array([0.3, 0.2, 0.1])]})
        with pytest.raises(SchemaError, match=r"/logs/loss: id 'run-4': expected shape \(T,\) "
                           r"\(fixed by the first item stored\), got \(2, 2\)"):
            f.logs.add("run-4", dict(loss=np.zeros((2, 2))))
    assert _stored(tmp_h5, "loss", "logs")["shape"] == [None]
    for f in (Run(tmp_h5), h5s.open(tmp_h5)):
        with f:
            assert f.logs.loss["run-1"].tolist() == [0.9, 0.5] and f.logs.loss["run-1"].dtype == np.float64
            assert len(f.logs) == 3


# -- create() from sources ---------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [1, 2])
def test_create_fixes_the_spec_from_the_first_loaded_item(tmp_path, n_workers):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        np.save(src / f"a{i}.npy", np.full((i + 1, 7), i, np.float64))
    np.save(src / "bad.npy", np.zeros((2, 8)))  # sorts after a0..a5: refused, the others stored
    np.save(src / "i.npy", np.arange(14, dtype=np.int32).reshape(2, 7))  # int into float64: fine
    f = FromNpy.create(tmp_path / "out.h5", sources=src, n_workers=n_workers, progress=False)
    with f:
        assert sorted(f.ids) == ["a0", "a1", "a2", "a3", "a4", "a5", "i"]
        np.testing.assert_array_equal(f.x["a5"], np.full((6, 7), 5.0))
        assert f.x["i"].dtype == np.float64 and f.x["i"][1, 0] == 7
        [bad] = f.report.failures
        assert bad.id == "bad" and bad.feature == "x" and bad.error == "SchemaError"
        assert "expected shape (T, 7) (fixed by the first item stored), got (2, 8)" in bad.message
    assert _stored(tmp_path / "out.h5")["shape"] == [None, 7]
    assert verify(tmp_path / "out.h5").ok
    # Appending with the same undeclared class: the stored spec holds, a misfit is refused.
    np.save(src / "z.npy", np.ones((1, 7), np.float32))
    with FromNpy.create(tmp_path / "out.h5", sources=src, mode="a", n_workers=n_workers, progress=False) as f:
        assert "z" in f.ids and f.x["z"].dtype == np.float64
        assert [x.id for x in f.report.failures] == ["bad"]


def test_create_refuses_a_text_source_for_an_undeclared_array(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "a.npy", np.array(["x", "y"]))
    np.save(src / "b.npy", np.ones(3, np.uint8))
    with FromNpy.create(tmp_path / "out.h5", sources=src, n_workers=1, progress=False) as f:
        assert list(f.ids) == ["b"] and f.x["b"].dtype == np.uint8
        [bad] = f.report.failures
        assert bad.id == "a" and "use h5s.Text() for text" in bad.message


def test_setting_the_first_item_of_an_existing_id_fixes_the_feature(tmp_h5):
    class Two(h5s.TypedFile):
        x = h5s.Array()
        y = h5s.Scalar()

    with Two(tmp_h5, "w") as f:
        f.add("a", dict(y=1))
        f.add("b", dict(y=2))
        f.x["b"] = np.arange(6, dtype=np.uint16).reshape(3, 2)  # h5py habit: assign an item
        with pytest.raises(SchemaError, match=r"x: id 'a': expected shape \(T, 2\) \(fixed by the first item stored\)"):
            f.x["a"] = np.zeros((3, 3), np.uint16)
    with h5s.open(tmp_h5) as f:
        assert f.x["b"].dtype == np.uint16 and f.x.present.tolist() == [False, True]


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import h5store as h5s

    class Logs(h5s.TypedFile):
        x = h5s.Array()
        y = h5s.Scalar()

    f = Logs(sys.argv[1], "a")
    f.add("b", dict(x=np.ones((5, 3)), y=2))  # fixes x: its column and the schema, not committed
    f.group().store.flush()
    f.h5.flush()  # HDF5 wrote the new column past the committed end; rewritten pages wait for a commit
    print("written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_kill_before_the_commit_leaves_the_feature_unfixed(tmp_h5):
    # The column and the schema that a first item fixes are committed with it, or not at all.
    class Logs(h5s.TypedFile):
        x = h5s.Array()
        y = h5s.Scalar()

    with Logs(tmp_h5, "w") as f:
        f.add("a", dict(y=1))
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_h5)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == -signal.SIGKILL and "written" in proc.stdout, proc.stderr
    with Logs(tmp_h5, "a") as f:  # rolls the journal back
        assert list(f.ids) == ["a"] and not f.x.present.any()
        assert f.file_schema.feature("", "x").dtype is None
        f.add("c", dict(x=np.ones((2, 4), np.int8)))  # a different first item fixes it now
    assert verify(tmp_h5).ok
    with h5s.open(tmp_h5) as f:
        assert f.x["c"].dtype == np.int8 and f.file_schema.feature("", "x").shape == (None, 4)


@pytest.mark.parametrize(("feature", "message"), [
    (lambda: h5s.Array(layout="blobs"), r"Bad\.x: a blobs layout stores bytes: declare dtype='uint8', shape=\(None,\)"),
    (lambda: h5s.Array(dtype="U8"), r"Bad\.x: dtype must be numeric or bool, got 'U8'"),
    (lambda: h5s.Array(shape=(None, None)), r"Bad\.x: only the first axis may be variable"),
])
def test_wrong_declarations_are_refused_when_the_class_is_defined(feature, message):
    with pytest.raises(SchemaError, match=message):
        type("Bad", (h5s.TypedFile,), {"x": feature()})


def test_a_scalar_first_item_for_a_declared_ragged_layout_is_refused(tmp_h5):
    class Rag(h5s.TypedFile):
        x = h5s.Array(layout="ragged")

    with Rag(tmp_h5, "w") as f:
        with pytest.raises(SchemaError, match=r"x: id 'a': a ragged layout needs items of 1 dim or more, got a scalar"):
            f.add("a", dict(x=1.5))
        f.add("a", dict(x=[1.5]))
    assert _stored(tmp_h5)["shape"] == [None]


def test_dataloader_workers_serve_a_fixed_undeclared_array(tmp_h5):
    with Logs(tmp_h5, "w") as f:
        for i in range(4):
            f.add(f"r{i}", dict(x=np.full((3 + i, 7), i, np.float32)))
    with Logs(tmp_h5) as f:  # the workers reopen it with the class, whose x is undeclared
        loader = f.serve(dict(x=h5s.Window("x", 3)), batch_size=2, num_workers=2)
        batches = list(loader)
    assert [tuple(b["x"].shape) for b in batches] == [(2, 3, 7), (2, 3, 7)]
    assert sorted(float(b["x"][j, 0, 0]) for b in batches for j in range(2)) == [0.0, 1.0, 2.0, 3.0]
    assert str(batches[0]["x"].dtype) == "torch.float32"
