"""Shared parameters and shared arrays (in one process; across workers in test_loader.py)."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest

from h5store.serving import SharedArray, SharedParams


def test_params_read_write_and_types() -> None:
    p = SharedParams(dict(crop=64, gain=0.5, on=True))
    assert (p.crop, p["gain"], p.on) == (64, 0.5, True)
    assert dict(p) == dict(crop=64, gain=0.5, on=True) and len(p) == 3 and "crop" in p and "_epoch" not in p
    v = p.version
    p.crop = 128
    p["gain"] = 2  # an int into a float slot is fine
    p.update(dict(on=False))
    assert (p.crop, p.gain, p.on) == (128, 2.0, False) and p.version == v + 6
    with pytest.raises(TypeError, match="holds int"):
        p.crop = 1.5
    with pytest.raises(AttributeError, match="no shared parameter 'nope'"):
        p.nope = 1
    with pytest.raises(AttributeError, match="no shared parameter 'nope'"):
        _ = p.nope
    with pytest.raises(TypeError, match="expected int, float or bool"):
        SharedParams(dict(name="x"))
    with pytest.raises(ValueError, match="identifier"):
        SharedParams({"_hidden": 1})


def test_params_copies_share_memory_and_file_goes_with_the_owner() -> None:
    p = SharedParams(dict(crop=1))
    q = pickle.loads(pickle.dumps(p))  # what a spawned worker gets: the path, mapped again
    p.crop = 9
    assert q.crop == 9
    path = p._path
    assert os.path.exists(path)
    del p, q
    gc.collect()
    assert not os.path.exists(path)


def test_shared_array_maps_one_copy() -> None:
    a = SharedArray((4, 3), "float32", lambda out: out.__setitem__(..., np.arange(12).reshape(4, 3)))
    b = pickle.loads(pickle.dumps(a))
    np.testing.assert_array_equal(b.array, np.arange(12).reshape(4, 3))
    assert not b.array.flags.writeable
    assert len(pickle.dumps(a)) < 300  # the path, not the data
    empty = SharedArray((0, 3), "int64", lambda out: None)
    assert empty.array.shape == (0, 3)
    path = a.path
    del a, b
    gc.collect()
    assert not os.path.exists(path)
