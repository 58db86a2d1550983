"""Batch samplers with epochs, ranks and resumable state (numpy only; any loader can use them).

Each batch of indices is an :class:`EpochIndices` (a ``list`` of int) that carries its
epoch, so a dataset reading it in a DataLoader worker draws its random crops from the
right epoch, whatever the prefetching, without any shared state.

Epochs: every ``iter(sampler)`` starts the next epoch (0, 1, 2...), unless
``set_epoch(e)`` was called, which makes the next iteration epoch ``e``. The order of an
epoch depends only on ``(seed, epoch)``, so every rank computes the same permutation and
takes its own share.

Ranks (``world_size > 1``): every rank yields the same number of batches. The plain
sampler deals the epoch's indices round-robin to the ranks; with ``drop_last=False`` the
order is padded by repeating its first indices until it divides evenly (every index is
served at least once per epoch), with ``drop_last=True`` the tail is dropped. The bucket
sampler deals whole batches and pads (repeats) or drops batches the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["BatchSampler", "BucketBatchSampler", "DurationBatchSampler", "EpochIndices", "make_sampler"]

_I64 = np.int64


class EpochIndices(list):  # type: ignore[type-arg]
    """A batch's indices (a list of int) with the ``epoch`` they were drawn in and the
    ``batch`` number within it (what seeds a batch's augmentation; -1 when unknown)."""

    epoch: int
    batch: int

    def __init__(self, indices: Any, epoch: int, batch: int = -1) -> None:
        super().__init__(indices)
        self.epoch = epoch
        self.batch = batch

    def __reduce__(self) -> tuple[Any, ...]:
        return (EpochIndices, (list(self), self.epoch, self.batch))


class _EpochBatches:
    """Shared machinery: epochs, ranks, and state for mid-epoch resume."""

    def __init__(self, seed: int, rank: int, world_size: int, drop_last: bool) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.drop_last = bool(drop_last)
        self._next_epoch = 0
        self._skip = 0
        self.epoch = 0  # the epoch being (or last) iterated
        self._yielded = 0
        self._delivered = 0
        self._counted = False  # True when a loader reports delivered batches (see loader.py)

    # -- subclass hooks ----------------------------------------------------------------
    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch``, in order."""
        raise TypeError(f"{type(self).__name__} must define batches(epoch)")

    # -- epochs ------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (reshuffles deterministically from ``(seed, epoch)``)."""
        self._next_epoch = int(epoch)
        self._skip = 0

    def __iter__(self) -> Iterator[EpochIndices]:
        epoch = self._next_epoch
        self._next_epoch = epoch + 1
        skip, self._skip = self._skip, 0
        self.epoch = epoch
        batches = self.batches(epoch)
        self._yielded = self._delivered = skip
        for k, b in enumerate(batches[skip:], start=skip):
            self._yielded += 1
            yield EpochIndices(b.tolist(), epoch, k)

    def __len__(self) -> int:
        return len(self.batches(0))

    def _rng(self, epoch: int, salt: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed & (2**63 - 1), epoch, salt])

    # -- resumable state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where training is: the epoch and the batches of it already consumed.

        With :func:`~h5store.serving.serve`'s loader the count is of batches the loop
        received (prefetched ones excluded); a loader of your own counts what the sampler
        handed out, exact with ``num_workers=0``.
        """
        done = self._delivered if self._counted else self._yielded
        epoch = self.epoch
        if done >= len(self):
            epoch, done = epoch + 1, 0
        return {"epoch": int(epoch), "batches": int(done), "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "num_batches": len(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration is ``state['epoch']`` without its first ``state['batches']`` batches."""
        for key in ("seed", "world_size", "num_batches"):
            if key in state and state[key] != self.state_dict()[key]:
                raise ValueError(f"state was saved with {key}={state[key]}, this sampler has {self.state_dict()[key]}")
        self._next_epoch = int(state["epoch"])
        self._skip = int(state["batches"])
        self.epoch = self._next_epoch

    def _split(self, batches: list[np.ndarray]) -> list[np.ndarray]:
        """Deal whole batches to the ranks, equal counts (pad by repeating, or drop)."""
        ws = self.world_size
        if ws == 1:
            return batches
        if self.drop_last:
            n = len(batches) // ws * ws
            batches = batches[:n]
        elif batches:
            n = math.ceil(len(batches) / ws) * ws
            batches = [batches[i % len(batches)] for i in range(n)]
        return batches[self.rank :: ws]


class BatchSampler(_EpochBatches):
    """Batches of ``batch_size`` indices, shuffled per epoch or in order, sharded across ranks.

    Parameters
    ----------
    n : int
        Dataset size.
    batch_size : int
    shuffle : bool
        A new permutation each epoch, from ``(seed, epoch)``.
    drop_last : bool
        Drop the last incomplete batch (and, across ranks, the indices that do not divide).
    seed : int
    rank, world_size : int
        This process's share of the epoch (distributed training).

    Examples
    --------
    >>> s = BatchSampler(10, 4, shuffle=True, seed=1)
    >>> [len(b) for b in s], len(s)
    ([4, 4, 2], 3)
    >>> sorted(i for b in s for i in b) == list(range(10))
    True
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool = False, drop_last: bool = False, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(seed, rank, world_size, drop_last)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.n = int(n)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's indices of ``epoch``, in order."""
        order = self._rng(epoch).permutation(self.n) if self.shuffle else np.arange(self.n, dtype=_I64)
        ws = self.world_size
        if ws > 1:
            if self.drop_last:
                order = order[: self.n // ws * ws]
            elif self.n % ws:
                extra = ws - self.n % ws
                order = np.concatenate([order, np.resize(order, extra)]) if self.n else order
            order = order[self.rank :: ws]
        return order.astype(_I64, copy=False)

    def batches(self, epoch: int) -> list[np.ndarray]:
        order = self.indices(epoch)
        bs = self.batch_size
        stop = len(order) // bs * bs if self.drop_last else len(order)
        return [order[a : a + bs] for a in range(0, stop, bs)]

    def __len__(self) -> int:
        ws = self.world_size
        per = self.n // ws if self.drop_last else math.ceil(self.n / ws)
        return per // self.batch_size if self.drop_last else math.ceil(per / self.batch_size)


class BucketBatchSampler(_EpochBatches):
    """Batches of examples of similar length: much less padding than random batches.

    Each epoch the indices are shuffled and cut into buckets of ``bucket_size``
    examples; each bucket is sorted by length and cut into batches; the batches are
    shuffled. Randomness stays (buckets differ every epoch), padding drops.

    Parameters
    ----------
    lengths : array of int
        Length of every example (``dataset.lengths()``).
    batch_size : int
    bucket_size : int or None
        Examples per bucket (default ``100 * batch_size``). Larger: less padding, less
        randomness in which examples share a batch.
    shuffle : bool
        Shuffle before bucketing and the batches after (else: sorted by length).
    seed : int
    drop_last : bool
        Drop each bucket's incomplete batch (and, across ranks, the batches that do not divide).
    rank, world_size : int
        This process's share: whole batches dealt round-robin, equal counts per rank.

    Examples
    --------
    >>> lengths = np.random.default_rng(0).integers(10, 1000, 500)
    >>> s = BucketBatchSampler(lengths, 16, shuffle=True)
    >>> sorted(i for b in s for i in b) == list(range(500))
    True
    """

    def __init__(self, lengths: Any, batch_size: int, bucket_size: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(seed, rank, world_size, drop_last)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.lengths = np.asarray(lengths, dtype=_I64).reshape(-1)
        self.batch_size = int(batch_size)
        self.bucket_size = int(bucket_size) if bucket_size else 100 * self.batch_size
        if self.bucket_size < self.batch_size:
            raise ValueError(f"bucket_size ({self.bucket_size}) must be >= batch_size ({self.batch_size})")
        self.shuffle = bool(shuffle)

    def batches(self, epoch: int) -> list[np.ndarray]:
        n = len(self.lengths)
        rng = self._rng(epoch)
        order = rng.permutation(n) if self.shuffle else np.arange(n, dtype=_I64)
        bs = self.batch_size
        out: list[np.ndarray] = []
        for a in range(0, n, self.bucket_size):
            bucket = order[a : a + self.bucket_size]
            bucket = bucket[np.argsort(self.lengths[bucket], kind="stable")]
            stop = len(bucket) // bs * bs if self.drop_last else len(bucket)
            out.extend(bucket[b : b + bs] for b in range(0, stop, bs))
        if self.shuffle:
            out = [out[i] for i in rng.permutation(len(out))]
        return self._split(out)

    def __len__(self) -> int:
        n, bs, size = len(self.lengths), self.batch_size, self.bucket_size
        full, rest = divmod(n, size)
        per = size // bs if self.drop_last else math.ceil(size / bs)
        last = (rest // bs if self.drop_last else math.ceil(rest / bs)) if rest else 0
        total = full * per + last
        ws = self.world_size
        return total // ws if self.drop_last else math.ceil(total / ws)


class DurationBatchSampler(_EpochBatches):
    """Batches filled up to a budget of frames, from buckets of similar lengths (lhotse's dynamic batches).

    Speech items run from 1 to 10 s: a fixed number of items per batch wastes memory on
    long batches and time on short ones. This sampler fills each batch up to
    ``max_frames``: the total of its items' lengths (``padded=False``), or the padded size
    the batch will have, ``items x longest`` (``padded=True``: what the GPU holds). Items
    are first sorted into ``num_buckets`` buckets of similar length (quantiles of the
    lengths), so a batch's items are alike and padding stays small.

    Every epoch: the items are shuffled from ``(seed, epoch)``, each bucket is cut into
    batches in that order, and the batches are shuffled. Every item appears exactly once
    per epoch (per rank: batches are dealt round-robin, with equal counts per rank, see
    the module notes). The number of batches may differ slightly between epochs.

    Parameters
    ----------
    lengths : array of int
        Length (frames) of every example (``dataset.lengths()``).
    max_frames : int
        Budget per batch; an item longer than it is refused (crop it with ``h5s.Window``
        or raise the budget).
    padded : bool
        Count padded frames (``len(batch) * longest``) rather than real ones.
    num_buckets : int
        Length buckets (more: less padding, batches of less varied lengths).
    shuffle, seed, drop_last, rank, world_size
        As :class:`BatchSampler`.

    Examples
    --------
    >>> lengths = np.random.default_rng(0).integers(100, 1000, 500)
    >>> s = DurationBatchSampler(lengths, max_frames=4000, shuffle=True)
    >>> all(lengths[b].sum() <= 4000 for b in s.batches(0))
    True
    >>> sorted(i for b in s.batches(0) for i in b) == list(range(500))
    True
    """

    def __init__(self, lengths: Any, max_frames: int, padded: bool = False, num_buckets: int = 10,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__(seed, rank, world_size, drop_last)
        self.lengths = np.asarray(lengths, dtype=_I64).reshape(-1)
        if isinstance(max_frames, bool) or int(max_frames) <= 0:
            raise ValueError(f"max_frames must be an int > 0, got {max_frames!r}")
        self.max_frames = int(max_frames)
        self.padded = bool(padded)
        self.shuffle = bool(shuffle)
        if int(num_buckets) < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        too_long = np.flatnonzero(self.lengths > self.max_frames)
        if too_long.size:
            raise ValueError(
                f"{too_long.size} example(s) are longer than max_frames={self.max_frames} (the longest: "
                f"{int(self.lengths.max())} frames, example {int(too_long[np.argmax(self.lengths[too_long])])}): "
                "raise max_frames, crop with h5s.Window, or leave them out with items="
            )
        if self.lengths.size:
            qs = np.quantile(self.lengths, np.linspace(0, 1, int(num_buckets) + 1)[1:-1])
            self.edges = np.unique(qs.astype(_I64))
        else:
            self.edges = np.zeros(0, _I64)
        self.num_buckets = int(num_buckets)
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def _pack(self, members: np.ndarray) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        lengths = self.lengths[members].tolist()
        budget, padded = self.max_frames, self.padded
        start, total, longest = 0, 0, 0
        for j, n in enumerate(lengths):
            longest2 = max(longest, n)
            cost = (j - start + 1) * longest2 if padded else total + n
            if cost > budget and j > start:
                out.append(members[start:j])
                start, total, longest2 = j, 0, n
            total += n
            longest = longest2
        if start < len(lengths):
            out.append(members[start:])
        return out

    def _all(self, epoch: int) -> list[np.ndarray]:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n = len(self.lengths)
        rng = self._rng(epoch)
        order = rng.permutation(n) if self.shuffle else np.argsort(self.lengths, kind="stable")
        bucket = np.searchsorted(self.edges, self.lengths[order], side="right")
        out: list[np.ndarray] = []
        for k in range(len(self.edges) + 1):
            members = order[bucket == k]
            if members.size:
                out.extend(self._pack(members.astype(_I64, copy=False)))
        if self.shuffle:
            out = [out[i] for i in rng.permutation(len(out))]
        out = self._split(out)
        self._cached = (epoch, out)
        return out

    def batches(self, epoch: int) -> list[np.ndarray]:
        return self._all(epoch)

    def __len__(self) -> int:
        return len(self._all(self.epoch))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["num_batches"] = len(self._all(state["epoch"]))
        state["max_frames"], state["padded"] = self.max_frames, self.padded
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("seed", self.seed), ("world_size", self.world_size), ("max_frames", self.max_frames),
                          ("padded", self.padded)):
            if key in state and state[key] != mine:
                raise ValueError(f"state was saved with {key}={state[key]}, this sampler has {mine}")
        if "num_batches" in state and state["num_batches"] != len(self._all(int(state["epoch"]))):
            raise ValueError("state was saved with other lengths (a different number of batches in its epoch): "
                             "resume with the same dataset and settings")
        self._next_epoch = int(state["epoch"])
        self._skip = int(state["batches"])
        self.epoch = self._next_epoch


def make_sampler(dataset: Any, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, bucket: bool | int | None = None, rank: int = 0,
                 world_size: int = 1, max_frames: int | None = None, padded: bool = False) -> _EpochBatches:
    """The batch sampler of every serving path (DataLoader, tf.data, :func:`~h5store.iter_batches`).

    ``dataset`` is anything with ``len()`` and, for ``bucket``, ``lengths()`` (a
    :class:`~h5store.serving.FileDataset`). The same sampler gives the same batches of
    indices for the same ``(seed, epoch)``, whichever loader then reads them.

    Examples
    --------
    >>> s = make_sampler(range(10), 4, shuffle=True, seed=1)
    >>> sorted(i for b in s.batches(0) for i in b) == list(range(10))
    True
    """
    if max_frames is not None:
        buckets = 10 if bucket is None or bucket is True or bucket is False else int(bucket)
        return DurationBatchSampler(dataset.lengths(), max_frames, padded=padded, num_buckets=buckets,
                                    shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size)
    if isinstance(batch_size, bool) or int(batch_size) <= 0:
        raise ValueError(f"batch_size must be an int > 0, got {batch_size!r}")
    if bucket:
        size = None if bucket is True else int(bucket)
        return BucketBatchSampler(dataset.lengths(), int(batch_size), bucket_size=size, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last, rank=rank, world_size=world_size)
    return BatchSampler(len(dataset), int(batch_size), shuffle=shuffle, drop_last=drop_last, seed=seed, rank=rank,
                        world_size=world_size)
