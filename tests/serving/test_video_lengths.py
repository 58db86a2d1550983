"""Lengths on every ragged path: a whole video served by ``Item`` comes with ``{key}_lengths``
by default, in PyTorch (fork and spawn workers), tf.data and the numpy iterator alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from tests.serving.videos import Clips, make_files

pytest.importorskip("PIL")

LENGTHS = [[3, 7, 5, 2], [6, 4]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_files(tmp_path_factory.mktemp("lengths"), LENGTHS)


def check(batches: list[dict], f: Clips) -> None:
    seen = 0
    for b in batches:
        x, n, pos = np.asarray(b["x"]), np.asarray(b["x_lengths"]), np.asarray(b["pos"])
        assert x.shape[0] == n.shape[0] == pos.shape[0] and x.shape[1] == n.max()
        for j, p in enumerate(pos.tolist()):
            whole = f.video[int(p)]
            assert n[j] == len(whole)
            np.testing.assert_array_equal(x[j, : n[j]], whole)
            assert not x[j, n[j]:].any()  # padding is zeros, and the lengths say where it starts
        seen += len(pos)
    assert seen == len(f)


BATCH = dict(x=h5s.Item("video"), pos=h5s.Position())


@pytest.mark.parametrize("context", [None, "fork", "spawn"])
def test_torch_item_video_has_lengths(paths: list[Path], context: str | None) -> None:
    f = Clips(paths[0])
    kw = dict(num_workers=2, multiprocessing_context=context) if context else {}
    batches = list(f.serve(BATCH, batch_size=3, **kw))
    check(batches, f)
    f.close()


def test_numpy_item_video_has_lengths(paths: list[Path]) -> None:
    f = Clips(paths[0])
    check(list(f.iter_batches(BATCH, batch_size=3, threads=2)), f)
    f.close()


def test_tf_item_video_has_lengths(paths: list[Path]) -> None:
    pytest.importorskip("tensorflow")
    f = Clips(paths[0])
    ds = f.to_tf_dataset(BATCH, batch_size=3)
    assert "x_lengths" in ds.element_spec
    check([{k: v.numpy() for k, v in b.items()} for b in ds], f)
    f.close()


def test_lengths_false_still_turns_them_off(paths: list[Path]) -> None:
    f = Clips(paths[0])
    b = next(iter(f.iter_batches(dict(x=h5s.Item("video", lengths=False)), batch_size=2, threads=0)))
    assert set(b) == {"x"}
    f.close()


def test_concat_takes_paths_and_open_files(paths: list[Path]) -> None:
    a = Clips(paths[0])
    m = h5s.concat([str(paths[1]), a, paths[1]])
    assert len(m) == 4 + 2 + 2
    b = next(iter(m.iter_batches(dict(x=h5s.Item("video"), id=h5s.Id()), batch_size=8, threads=0)))
    assert b["x_lengths"].tolist() == [6, 4, 3, 5, 7, 2, 6, 4]  # sorted ids: c0/v0_0, c0/v0_2, c1/v0_1...
    assert b["id"][2] == f"{a.path}::{a.ids[0]}"
    a.close()
