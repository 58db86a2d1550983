"""Collate: padding, lengths, masks, tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h5store.serving.collate import lengths_mask, pad, pad_collate, pad_collate_numpy, to_torch


def test_pad_pads_with_zeros_and_reports_lengths() -> None:
    a = [np.ones((2, 3), "float32"), np.full((5, 3), 2, "float32"), np.zeros((0, 3), "float32")]
    x, n = pad(a)
    assert x.shape == (3, 5, 3) and x.dtype == np.float32
    assert n.tolist() == [2, 5, 0]
    assert x[0, :2].sum() == 6 and not x[0, 2:].any() and not x[2].any()
    x, n = pad(a, width=3, value=-1)
    assert x.shape == (3, 3, 3) and n.tolist() == [2, 3, 0] and (x[0, 2:] == -1).all()
    with pytest.raises(ValueError, match="cannot pad"):
        pad([np.ones((2, 3)), np.ones((2, 4))])


def test_lengths_mask() -> None:
    assert lengths_mask(np.array([0, 2, 3]), 3).tolist() == [[False] * 3, [True, True, False], [True] * 3]


def test_pad_collate_numpy_rules() -> None:
    samples = [dict(x=np.ones((2, 4)), img=np.zeros((3, 3)), y=1, s="a"),
               dict(x=np.ones((5, 4)), img=np.ones((3, 3)), y=0, s="b")]
    b = pad_collate_numpy(samples, mask=True)
    assert b["x"].shape == (2, 5, 4) and b["x_lengths"].tolist() == [2, 5]
    assert b["x_mask"].sum() == 7
    assert b["img"].shape == (2, 3, 3) and "img_lengths" not in b
    assert b["y"].tolist() == [1, 0] and b["s"] == ["a", "b"]
    same = [dict(x=np.ones((2, 4))), dict(x=np.ones((2, 4)))]
    assert "x_lengths" not in pad_collate_numpy(same)
    assert pad_collate_numpy(same, ragged=["x"])["x_lengths"].tolist() == [2, 2]
    assert pad_collate_numpy([]) == {}


def test_to_torch_and_pad_collate() -> None:
    ro = np.arange(4.0)
    ro.flags.writeable = False
    t = to_torch(dict(a=np.arange(3, dtype="int32"), b=ro, s=["x"], m=np.array([True, False]), g=np.float32(2)))
    assert t["a"].dtype == torch.int32 and t["b"].tolist() == [0, 1, 2, 3] and t["s"] == ["x"]
    assert t["m"].dtype == torch.bool and t["g"].item() == 2
    b = pad_collate([dict(x=np.ones((1, 2), "float32")), dict(x=np.ones((3, 2), "float32"))])
    assert b["x"].shape == (2, 3, 2) and b["x_lengths"].tolist() == [1, 3]
