"""The quasi-random, chunk-aware order: ``shuffle="chunks"`` (issue 13, point 6).

Blocks of consecutive examples are shuffled, then the examples within windows of blocks:
every example once per epoch, seeded by ``(seed, epoch)``, equal steps on every rank, and
each batch drawn from a few blocks only (what makes cold reads nearly sequential). Served
end to end through the three entry points (DataLoader workers under fork and spawn too),
with values equal to plain h5py reads of the served items.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.errors import ArgumentError
from h5store.serving import FileDataset, QuasiRandomBatchSampler
from h5store.serving.samplers import BatchSampler, block_sizes, make_sampler
from tests.serving.schemas import Speech, make_speech


def _flat(batches) -> list[int]:
    return [int(i) for b in batches for i in b]


def _block_of(blocks: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(blocks)), blocks)


BLOCKS = np.array([7, 3, 10, 1, 9, 12, 5, 8, 6, 4, 11, 2])  # 78 examples, uneven blocks


def test_every_example_once_per_epoch_seeded_and_epochs_differ() -> None:
    s = QuasiRandomBatchSampler(BLOCKS, 5, window=3, seed=7)
    e0, e1 = list(s), list(s)
    assert sorted(_flat(e0)) == sorted(_flat(e1)) == list(range(78))
    assert len(e0) == len(s) == 16 and [len(b) for b in e0[:-1]] == [5] * 15 and len(e0[-1]) == 3
    assert _flat(e0) != _flat(e1) and [b.epoch for b in e1] == [1] * 16
    assert _flat(e0) != list(range(78))  # shuffled, not in order
    s.set_epoch(0)
    assert list(s) == e0
    assert list(QuasiRandomBatchSampler(BLOCKS, 5, window=3, seed=7)) == e0  # from (seed, epoch) alone
    assert _flat(QuasiRandomBatchSampler(BLOCKS, 5, window=3, seed=8)) != _flat(e0)


def test_order_is_blockwise_windows_of_shuffled_blocks() -> None:
    s = QuasiRandomBatchSampler(BLOCKS, 4, window=3, seed=1)
    block = _block_of(BLOCKS)
    for epoch in range(5):
        order = s.order(epoch)
        # Window i holds exactly the examples of blocks 3i..3i+2, in the order blocks first appear.
        starts = 0
        windows = []
        blocks_in_order = []
        for i in order:
            b = int(block[i])
            if b not in blocks_in_order:
                blocks_in_order.append(b)
        for w in range(0, len(blocks_in_order), 3):
            members = blocks_in_order[w:w + 3]
            size = int(BLOCKS[members].sum())
            window = order[starts:starts + size]
            assert set(block[window].tolist()) == set(members)  # a window is whole blocks, nothing else
            windows.append(window)
            starts += size
        assert starts == len(order) == 78
    # The windows are not sorted inside (examples are shuffled within a window).
    assert any(not np.all(np.diff(w) > 0) for w in windows)


def test_batches_touch_few_blocks_and_uniform_shuffle_many() -> None:
    blocks = np.full(100, 50)  # 5000 examples in 100 blocks
    block = _block_of(blocks)
    quasi = QuasiRandomBatchSampler(blocks, 32, window=4, seed=0)
    uniform = BatchSampler(5000, 32, shuffle=True, seed=0, drop_last=True)
    q = max(len(set(block[b].tolist())) for b in quasi.batches(0))
    u = min(len(set(block[b].tolist())) for b in uniform.batches(0))
    assert q <= 2 * 4  # a batch spans at most two windows
    assert u > 2 * 4  # a uniform shuffle's full batches: ~27 blocks each


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n_blocks", [12, 11])
def test_ranks_equal_steps_disjoint(drop_last: bool, n_blocks: int) -> None:
    blocks = BLOCKS[:n_blocks]
    n = int(blocks.sum())
    ranks = [QuasiRandomBatchSampler(blocks, 4, window=2, seed=3, drop_last=drop_last, rank=r, world_size=3)
             for r in range(3)]
    for epoch in (0, 1):
        got = [s.batches(epoch) for s in ranks]
        assert len({len(g) for g in got}) == 1 and len(got[0]) == len(ranks[0])
        flat = [_flat(g) for g in got]
        union = sum(flat, [])
        if drop_last:  # nothing twice; only the indices that do not divide, and incomplete batches, dropped
            assert len(set(union)) == len(union) == 3 * len(ranks[0]) * 4 >= n - 3 - 3 * 3
        else:  # everything; padded by repeating the first indices when the ranks do not divide it
            assert set(union) == set(range(n)) and len(union) == n + (-n) % 3
            if n % 3 == 0:
                assert sorted(union) == list(range(n))  # disjoint and complete


def test_state_dict_resumes_mid_epoch() -> None:
    a = QuasiRandomBatchSampler(BLOCKS, 4, window=3, seed=5)
    list(a)
    it = iter(a)  # epoch 1
    first = [next(it) for _ in range(6)]
    state = a.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 6
    rest = list(it)
    b = QuasiRandomBatchSampler(BLOCKS, 4, window=3, seed=5)
    b.load_state_dict(state)
    assert list(b) == rest
    assert _flat(first + rest) != _flat(list(a))  # epoch 2 is another order
    with pytest.raises(ValueError, match="seed"):
        QuasiRandomBatchSampler(BLOCKS, 4, window=3, seed=6).load_state_dict(state)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="window"):
        QuasiRandomBatchSampler(BLOCKS, 4, window=0)
    with pytest.raises(ValueError, match="positive"):
        QuasiRandomBatchSampler([3, 0, 2], 4)
    with pytest.raises(ValueError, match="choose one"):
        make_sampler(range(10), 2, shuffle="chunks", bucket=True)
    with pytest.raises(ValueError, match="'chunks'"):
        make_sampler(range(10), 2, shuffle="blocks")


def test_block_sizes_follow_stored_bytes(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    lengths = make_speech(path, 60, seed=2)
    with Speech(path) as f:
        ds = FileDataset(f, dict(x=h5s.Item("mel")))
        row = 8 * 4  # mel rows: 8 float32
        block_bytes = 1024
        sizes = block_sizes(ds, block_bytes)
        assert sizes.sum() == 60 and sizes.min() >= 1
        # Block k: the examples whose data starts in the same block_bytes-sized stretch of the
        # feature's bytes (as chunks of a file are laid out), so blocks follow the layout.
        starts = np.concatenate([[0], np.cumsum(lengths * row)[:-1]]) // block_bytes
        np.testing.assert_array_equal(_block_of(sizes), np.unique(starts, return_inverse=True)[1])
        assert len(sizes) >= int(lengths.sum() * row // block_bytes) // 2
        # Two features served: about twice the bytes per example, so about twice the blocks.
        both = block_sizes(FileDataset(f, dict(x=h5s.Item("mel"), m=h5s.Item("mag"))), block_bytes)
        assert len(both) > len(sizes)
        # Frames: many examples per item, each counted with its share of the item's bytes.
        frames = FileDataset(f, dict(x=h5s.Frames("mel", 2)))
        fs = block_sizes(frames, block_bytes)
        assert fs.sum() == len(frames) and abs(len(fs) - len(sizes)) <= 2
    assert block_sizes(range(600)).tolist() == [256, 256, 88]
    assert block_sizes(range(0)).tolist() == []


def _plain_h5py(path: Path, positions: list[int]) -> list[np.ndarray]:
    with h5py.File(path, "r", locking=False) as h:
        data, index = h["mel/data"], h["mel/index"][:]
        return [data[int(index[p, 0]):int(index[p, 1])] for p in positions]


def _check_batches(path: Path, batches, expected_order: list[int]) -> None:
    positions, values = [], []
    for b in batches:
        x, n, lens = (np.asarray(b[k].numpy() if hasattr(b[k], "numpy") else b[k]) for k in ("x", "n", "x_lengths"))
        positions += n.tolist()
        values += [x[i, : lens[i]] for i in range(len(n))]
    assert positions == expected_order
    for got, want in zip(values, _plain_h5py(path, positions)):
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("how", ["numpy", "tf", "torch-0", "torch-fork", "torch-spawn"])
def test_served_end_to_end_matches_the_sampler_and_h5py(tmp_path: Path, how: str) -> None:
    path = tmp_path / "s.h5"
    make_speech(path, 90, seed=4, lengths=(20, 60))
    batch = dict(x=h5s.Item("mel"), n=h5s.Position())
    kw = dict(batch_size=8, shuffle="chunks", seed=9)
    with Speech(path) as f:
        ds = FileDataset(f, batch)
        expected = _flat(make_sampler(ds, 8, shuffle="chunks", seed=9).batches(0))
        assert sorted(expected) == list(range(90)) and expected != list(range(90))
        if how == "numpy":
            got = list(f.iter_batches(batch, **kw, threads=2))
        elif how == "tf":
            pytest.importorskip("tensorflow")
            got = list(f.to_tf_dataset(batch, **kw))
        else:
            workers = 0 if how == "torch-0" else 2
            extra = {} if not workers else dict(multiprocessing_context=how.split("-")[1])
            got = list(f.serve(batch, **kw, num_workers=workers, **extra))
        _check_batches(path, got, expected)


def test_small_blocks_mean_the_dataset_is_really_shuffled(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    make_speech(path, 90, seed=4, lengths=(20, 60))
    with Speech(path) as f:
        ds = FileDataset(f, dict(x=h5s.Item("mel")))
        s = make_sampler(ds, 8, shuffle="chunks", block_bytes=1024, window=2)
        assert len(s.blocks) > 20  # ~1,300 bytes per item: one or two items per block
        assert _flat(s.batches(0)) != _flat(s.batches(1))


def test_entry_points_check_the_option(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    make_speech(path, 10, seed=1)
    with Speech(path) as f:
        for call in (f.serve, f.iter_batches, f.to_tf_dataset):
            with pytest.raises(ArgumentError, match="'chunks'"):
                call(dict(x=h5s.Item("mel")), 4, shuffle="random")
        with pytest.raises(ArgumentError, match="batch_size"):
            f.serve(dict(x=h5s.Item("mel")), None, shuffle="chunks")
