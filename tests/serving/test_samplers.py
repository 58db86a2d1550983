"""Batch samplers: epochs, ranks, resumable state, length bucketing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from h5store.serving import BatchSampler, BucketBatchSampler, EpochIndices, ShardBatchSampler


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_batches_cover_the_epoch_in_order_or_shuffled() -> None:
    s = BatchSampler(10, 4)
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and len(s) == 3
    assert len(BatchSampler(10, 4, drop_last=True)) == 2 == len(list(BatchSampler(10, 4, drop_last=True)))
    sh = BatchSampler(10, 4, shuffle=True, seed=3)
    e0, e1 = list(sh), list(sh)  # each iteration starts the next epoch
    assert sorted(_flat(e0)) == sorted(_flat(e1)) == list(range(10))
    assert _flat(e0) != _flat(e1)
    assert [b.epoch for b in e0] == [0, 0, 0] and [b.epoch for b in e1] == [1, 1, 1]
    sh.set_epoch(0)
    assert list(sh) == e0  # deterministic from (seed, epoch)
    assert list(BatchSampler(10, 4, shuffle=True, seed=3)) == e0
    assert _flat(list(BatchSampler(10, 4, shuffle=True, seed=4))) != _flat(e0)


def test_epoch_indices_pickle_with_their_epoch() -> None:
    b = pickle.loads(pickle.dumps(EpochIndices([3, 1], 7)))
    assert b == [3, 1] and b.epoch == 7 and isinstance(b, EpochIndices)


@pytest.mark.parametrize("n", [20, 23])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_shares_of_every_index(n: int, drop_last: bool) -> None:
    ranks = [BatchSampler(n, 3, shuffle=True, seed=1, drop_last=drop_last, rank=r, world_size=2) for r in range(2)]
    for epoch in (0, 1):
        for s in ranks:
            s.set_epoch(epoch)
        got = [list(s) for s in ranks]
        assert len(got[0]) == len(got[1]) == len(ranks[0])
        union = _flat(got[0]) + _flat(got[1])
        if n % 2 == 0 and not drop_last:
            assert sorted(union) == list(range(n))  # every index exactly once
        elif drop_last:
            assert len(set(union)) == len(union)  # nothing twice, the tail dropped
        else:
            assert set(union) == set(range(n))  # padded by repeating: everything at least once
    with pytest.raises(ValueError, match="rank"):
        BatchSampler(10, 2, rank=2, world_size=2)


def test_state_dict_resumes_mid_epoch() -> None:
    a = BatchSampler(50, 4, shuffle=True, seed=5)
    list(a)  # epoch 0 done
    it = iter(a)  # epoch 1
    seen = [next(it) for _ in range(3)]
    state = a.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 3
    b = BatchSampler(50, 4, shuffle=True, seed=5)
    b.load_state_dict(state)
    rest = list(b)
    a.set_epoch(1)
    assert seen + rest == list(a)
    assert list(b)[0].epoch == 2  # then the next epoch, as usual
    with pytest.raises(ValueError, match="seed"):
        BatchSampler(50, 4, seed=6).load_state_dict(state)
    done = BatchSampler(8, 4)
    list(done)
    assert done.state_dict()["epoch"] == 1 and done.state_dict()["batches"] == 0


def _padding(lengths: np.ndarray, batches: list[list[int]]) -> float:
    real = sum(int(lengths[b].sum()) for b in batches)
    total = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1 - real / total


def test_bucketing_cuts_padding() -> None:
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(5, 50, 900), rng.integers(500, 2000, 100)])  # skewed
    bucket = BucketBatchSampler(lengths, 16, shuffle=True, seed=0)
    plain = BatchSampler(len(lengths), 16, shuffle=True, seed=0)
    b, p = list(bucket), list(plain)
    assert sorted(_flat(b)) == list(range(len(lengths)))
    assert len(b) == len(bucket)
    assert _padding(lengths, b) < 0.5 * _padding(lengths, p)
    assert _flat(list(bucket)) != _flat(b)  # next epoch, other buckets


@pytest.mark.parametrize("drop_last", [False, True])
def test_bucketing_across_ranks(drop_last: bool) -> None:
    lengths = np.arange(1, 101)
    ranks = [BucketBatchSampler(lengths, 8, bucket_size=32, seed=2, drop_last=drop_last, rank=r, world_size=2)
             for r in range(2)]
    got = [list(s) for s in ranks]
    assert len(got[0]) == len(got[1]) == len(ranks[0])
    union = _flat(got[0]) + _flat(got[1])
    if drop_last:
        assert len(set(union)) == len(union)
    else:
        assert set(union) == set(range(100))


@pytest.mark.parametrize("sizes", [[0, 0, 0, 0, 0, 2, 3, 0, 2], [4, 0, 1, 0, 0, 3, 0, 2, 5, 0], [0, 3, 3, 3, 0]])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_sampler_deals_only_non_empty_shards(sizes: list[int], world_size: int, drop_last: bool) -> None:
    # Empty shards (ids absent from shard_of) among non-empty ones: every rank gets a
    # non-empty shard, the same number of steps as the others, and those steps hold data.
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    per_rank, steps = [], []
    for rank in range(world_size):
        s = ShardBatchSampler(shard_of, 2, shuffle=True, drop_last=drop_last, seed=3, rank=rank,
                              world_size=world_size)
        assert s.shards and all(sizes[k] for k in s.shards), s.shards
        batches = [b.tolist() for b in s.batches(0)]
        assert len(batches) == len(s) > 0
        steps.append(len(s))
        per_rank.append(_flat(batches))
    assert len(set(steps)) == 1, steps
    if not drop_last:
        assert set(_flat(per_rank)) == set(range(len(shard_of)))  # every example served


@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_sampler_refuses_fewer_non_empty_shards_than_ranks(drop_last: bool) -> None:
    for rank in range(3):
        with pytest.raises(ValueError, match=r"2 non-empty shards \(of 6\) for 3 ranks"):
            ShardBatchSampler([0, 0, 0, 0, 0, 5], 2, drop_last=drop_last, rank=rank, world_size=3)
