"""FileDataset in one process: lookup, errors, single examples, many files, in-memory."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import h5store as h5s
from h5store.errors import NotFound, SchemaError
from h5store.serving import FileDataset, MultiFile
from tests.serving.conftest import N, reference
from tests.serving.schemas import Other, ReaderKind, Speech, make_speech

REPO = Path(__file__).resolve().parents[2]


def test_import_h5store_stays_light() -> None:
    code = ("import sys, h5store as h5s; h5s.Item, h5s.Window, h5s.concat, h5s.serving.FileDataset; "
            "bad = [m for m in ('torch', 'tensorflow', 'librosa', 'joblib') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_locate_and_items_subset(speech: Speech) -> None:
    ds = FileDataset(speech, dict(pos=h5s.Position(), ex=h5s.Position(of="example")), items=[7, 3, 3, 20])
    assert len(ds) == 4
    b = ds.fetch([0, 3, -1, 1])
    assert b["pos"].tolist() == [7, 20, 20, 3] and b["ex"].tolist() == [0, 3, 3, 1]
    with pytest.raises(IndexError, match="example 4 out of range"):
        ds.fetch([4])
    with pytest.raises(IndexError, match="positions in"):
        FileDataset(speech, dict(pos=h5s.Position()), items=[N])


def test_single_examples_and_list_collate(speech: Speech) -> None:
    mel = reference(speech, "mel")
    ds = FileDataset(speech, dict(x=h5s.Item("mel"), w=h5s.Window("mel", 4), y=h5s.Label("label"),
                                  t=h5s.Item("text")))
    ex = ds[6]
    np.testing.assert_array_equal(ex["x"], mel[6])
    assert ex["w"].shape == (4, 8) and ex["y"] == 1 and ex["t"] == "item 6 é"
    via_list = ds.collate([ds[i] for i in (6, 2)])
    via_batch = ds.collate(ds.__getitems__([6, 2]))
    assert via_list.keys() == via_batch.keys()
    for k, v in via_batch.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, via_list[k]), k
        else:
            assert v == via_list[k]
    assert via_batch["x"].dtype == torch.float32 and via_batch["y"].dtype == torch.int64
    one = ds.collate(ds[6])
    assert torch.equal(one["x"], torch.from_numpy(mel[6]))


def test_absent_items_are_refused_with_a_hint(tmp_path: Path) -> None:
    with Speech(tmp_path / "holes.h5", mode="w") as f:
        f.add("a", dict(mel=np.ones((3, 8), "float32"), label=1))
        f.add("b", dict(label=2))
    f = Speech(tmp_path / "holes.h5")
    with pytest.raises(NotFound, match=r"1 of 2 served items have no 'mel' \(first: id 'b'\).*items="):
        FileDataset(f, dict(x=h5s.Item("mel")))
    ds = FileDataset(f, dict(x=h5s.Item("mel")), items=np.flatnonzero(f.mel.present))
    assert len(ds) == 1 and ds.fetch([0])["x"].shape == (1, 3, 8)
    f.close()


def test_batch_declaration_errors(speech: Speech) -> None:
    with pytest.raises(TypeError, match="getter"):
        FileDataset(speech, dict(x="mel"))  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="non-empty dict"):
        FileDataset(speech, {})
    with pytest.raises(SchemaError, match="collides"):
        FileDataset(speech, dict(x=h5s.Item("mel"), x_lengths=h5s.Item("label")))
    with pytest.raises(SchemaError, match="several groups"):
        FileDataset(speech, dict(x=h5s.Item("mel"), loss=h5s.Item("logs/loss")))
    with pytest.raises(NotFound, match="no feature 'nope'"):
        FileDataset(speech, dict(x=h5s.Item("nope")))


def test_group_features(tmp_path: Path) -> None:
    make_speech(tmp_path / "g.h5", 3)
    with Speech(tmp_path / "g.h5", mode="a") as w:
        w.logs.add("run-1", dict(loss=np.array([3.0, 2.0, 1.0])))
        w.logs.add("run-2", dict(loss=np.array([5.0])))
    f = Speech(tmp_path / "g.h5")
    b = FileDataset(f, dict(loss=h5s.Item("logs/loss"))).fetch([1, 0])
    assert b["loss"].tolist() == [[5, 0, 0], [3, 2, 1]] and b["loss_lengths"].tolist() == [1, 3]
    f.close()


def test_concat_of_three_files(shard_paths: list[Path]) -> None:
    files = [Speech(p) for p in shard_paths]
    multi = h5s.concat(files)
    assert isinstance(multi, MultiFile) and len(multi) == 23 and multi.paths == [str(p) for p in shard_paths]
    assert len(h5s.concat([multi, files[0]]).files) == 4
    ds = FileDataset(multi, dict(x=h5s.Item("mel"), y=h5s.Label("label"), pos=h5s.Position()))
    truth = [(f, i) for f in files for i in range(len(f))]
    idx = np.random.default_rng(0).permutation(23)
    b = ds.fetch(idx)
    assert b["pos"].tolist() == idx.tolist()
    for j, g in enumerate(idx.tolist()):
        f, i = truth[g]
        want = f.mel[i]
        np.testing.assert_array_equal(b["x"][j, : len(want)], want)
        assert b["x_lengths"][j] == len(want) and b["y"][j] == f.label[i]
    w = FileDataset(multi, dict(x=h5s.Window("mel", 3, random=False))).fetch(idx)
    for j, g in enumerate(idx.tolist()):
        f, i = truth[g]
        np.testing.assert_array_equal(w["x"][j, : min(3, len(f.mel[i]))], f.mel[i][:3])
    for f in files:
        f.close()


def test_concat_refuses_disagreeing_schemas(shard_paths: list[Path], tmp_path: Path) -> None:
    with Other(tmp_path / "other.h5", mode="w") as o:
        o.add("z", dict(mel=np.ones((2, 4), "float32")))
    with pytest.raises(SchemaError, match="other.h5 lacks the feature 'label'"):  # when made, not when served
        h5s.concat([Speech(shard_paths[0]), h5s.open(tmp_path / "other.h5")])
    assert len(h5s.concat([str(shard_paths[0])])) == len(Speech(shard_paths[0]))  # paths are accepted
    with pytest.raises(ValueError, match="at least one"):
        h5s.concat([])


def test_in_memory_copies_once_and_cleans_up(speech: Speech) -> None:
    mel = reference(speech, "mel")
    ds = FileDataset(speech, dict(x=h5s.Item("mel"), kind=ReaderKind("mel")), in_memory=True)
    shared = list(ds.files._shared.values())
    assert len(shared) == 1 and ds.files.shared_bytes == sum(m.nbytes for m in mel)
    b = ds.fetch([3, 1])
    assert (b["kind"] == 2).all()
    np.testing.assert_array_equal(b["x"][0, : len(mel[3])], mel[3])
    path = shared[0].path
    assert os.path.exists(path)
    del ds, shared
    gc.collect()
    assert not os.path.exists(path)
    only = FileDataset(speech, dict(x=h5s.Item("mel"), m=h5s.Item("mag")), in_memory=["mag"])
    assert [name for _, name in only.files._shared] == ["mag"]
