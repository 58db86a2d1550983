"""``h5s.interleave`` mixes the files within every batch by default (tf.data's ``block_length=1``).

The order is checked against tf.data's own ``Dataset.interleave`` over the same per-file
example lists, and every value against plain reads of the files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.serving.tf import interleave_order
from tests.serving.videos import Clips, make_files

tf = pytest.importorskip("tensorflow")
pytest.importorskip("PIL")

LENGTHS = [[3, 4, 2], [5, 2, 3, 4], [2, 6], [3, 3, 2, 2, 4]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_files(tmp_path_factory.mktemp("interleave"), LENGTHS)


@pytest.mark.parametrize("cycle_length,block_length", [(1, 1), (2, 1), (3, 2), (4, 1), (6, 3)])
def test_order_is_tf_data_interleave(cycle_length: int, block_length: int) -> None:
    sizes = [3, 5, 1, 4, 2]
    file_of = np.repeat(np.arange(len(sizes)), sizes)
    got = interleave_order(file_of, len(sizes), cycle_length, block_length, shuffle=False, seed=0, epoch=0)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ref = tf.data.Dataset.range(len(sizes)).interleave(
        lambda k: tf.data.Dataset.range(tf.gather(starts, k), tf.gather(starts, k + 1)),
        cycle_length=cycle_length, block_length=block_length)
    assert got.tolist() == [int(x) for x in ref]


def test_shuffled_order_is_a_permutation_and_changes_per_epoch() -> None:
    file_of = np.repeat(np.arange(4), [5, 1, 7, 3])
    a = interleave_order(file_of, 4, 2, 1, shuffle=True, seed=3, epoch=0)
    b = interleave_order(file_of, 4, 2, 1, shuffle=True, seed=3, epoch=1)
    assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(16))
    assert a.tolist() != b.tolist()
    np.testing.assert_array_equal(a, interleave_order(file_of, 4, 2, 1, shuffle=True, seed=3, epoch=0))


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_mix_files_and_serve_everything_once(paths: list[Path], shuffle: bool) -> None:
    files = [Clips(p) for p in paths]
    ds = h5s.interleave([str(p) for p in paths], dict(x=h5s.Item("video"), id=h5s.Id(), y=h5s.Label("label")),
                        batch_size=4, cycle_length=4, file_key="file", shuffle=shuffle, seed=2)
    seen = []
    mixed = 0
    for b in ds:
        ks = b["file"].numpy().tolist()
        mixed += len(set(ks)) > 1
        for j, (k, ident) in enumerate(zip(ks, b["id"].numpy().tolist())):
            path, _, i = ident.decode().rpartition("::")
            assert path == str(paths[k])
            n = int(b["x_lengths"][j])
            np.testing.assert_array_equal(b["x"][j, :n].numpy(), files[k].video[i])
            assert int(b["y"][j]) == files[k].label[i]
            seen.append((k, i))
    assert sorted(seen) == sorted((k, i) for k, f in enumerate(files) for i in f.ids)
    assert mixed == len(seen) // 4  # every full batch holds examples of several files
    for f in files:
        f.close()


def test_clips_mixed_and_drop_last(paths: list[Path]) -> None:
    ds = h5s.interleave(paths, dict(x=h5s.Window("video", 2)), batch_size=3, cycle_length=2, file_key="f",
                        drop_last=True, num_parallel_calls=2)
    assert ds.element_spec["x"].shape.as_list() == [3, 2, 24, 32, 3]
    got = [b["f"].numpy().tolist() for b in ds]
    assert len(got) == sum(map(len, LENGTHS)) // 3
    assert got[0] == [0, 1, 0]  # cycle of two files, one example each in turn


def test_bad_mix_is_refused(paths: list[Path]) -> None:
    with pytest.raises(ValueError, match="mix must be"):
        h5s.interleave(paths, dict(x=h5s.Item("video")), 2, mix="files")
    with pytest.raises(ValueError, match="bucket needs mix='batches'"):
        h5s.interleave(paths, dict(x=h5s.Item("video")), 2, bucket=True)
