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

Quasi-random order (``shuffle="chunks"``, :class:`QuasiRandomBatchSampler`): the order
FFCV calls ``QUASI_RANDOM`` and MosaicML's streaming ``py1e``. Consecutive examples are
grouped into blocks of a few MB of stored data, the blocks are shuffled, and the examples
are shuffled within windows of a few consecutive (shuffled) blocks. A batch then reads
from a few MB-sized regions of the file instead of from anywhere: what a cold page cache,
a spinning disk or a network file system need to read at their sequential speed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["BatchSampler", "BucketBatchSampler", "DurationBatchSampler", "EpochIndices", "QuasiRandomBatchSampler",
           "ShardBatchSampler", "block_sizes", "check_shuffle", "make_sampler", "shard_of_examples"]

#: ``shuffle=`` values every serving path takes: in order, a permutation, or quasi-random.
SHUFFLES = (False, True, "chunks")
BLOCK_BYTES = 4 << 20  # stored bytes per block of the quasi-random order
WINDOW_BLOCKS = 8  # blocks whose examples are shuffled together
FALLBACK_BLOCK = 256  # examples per block when the dataset says nothing of its bytes

_I64 = np.int64


class EpochIndices(list):  # type: ignore[type-arg]
    """A batch's indices (a list of int) with the ``epoch`` they were drawn in and the
    ``batch`` number within it (what seeds a batch's augmentation; -1 when unknown)."""

    epoch: int
    batch: int
    #: ``(version, transform)`` when a new batch transform rides with these indices to the
    #: worker that reads them (see :meth:`_EpochBatches.follow`), else None.
    transform: tuple[int, Any] | None = None

    def __init__(self, indices: Any, epoch: int, batch: int = -1) -> None:
        super().__init__(indices)
        self.epoch = epoch
        self.batch = batch

    def __reduce__(self) -> tuple[Any, ...]:
        return (EpochIndices, (list(self), self.epoch, self.batch), {"transform": self.transform})


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
        self._followed: Any = None  # a dataset whose transform rides with the indices
        self._carry_seen = 0
        self._carry_left = 0
        self._spread = 1

    def follow(self, dataset: Any, spread: int) -> None:
        """Carry ``dataset``'s transform with the indices once it changes: the next ``spread``
        batches handed out (at least one per DataLoader worker, which torch serves round
        robin) take ``(version, transform)`` along, through the DataLoader's own index queue."""
        self._followed, self._spread = dataset, max(1, int(spread))
        self._carry_seen = dataset.transform_version

    def _carry(self, out: EpochIndices) -> None:
        d = self._followed
        if d is None:
            return
        if d.transform_version != self._carry_seen:
            self._carry_seen, self._carry_left = d.transform_version, self._spread
        if self._carry_left:
            self._carry_left -= 1
            out.transform = (d.transform_version, d.transform)

    # -- subclass hooks ----------------------------------------------------------------
    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch``, in order."""
        raise TypeError(f"{type(self).__name__} must define batches(epoch)")

    def _in_batches(self, order: np.ndarray) -> list[np.ndarray]:
        """``order`` cut into batches of ``batch_size`` (a short last one dropped with ``drop_last``)."""
        bs = self.batch_size
        stop = len(order) // bs * bs if self.drop_last else len(order)
        return [order[a : a + bs] for a in range(0, stop, bs)]

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
            out = EpochIndices(b.tolist(), epoch, k)
            self._carry(out)
            yield out

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

    def order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order (every rank computes the same one)."""
        return self._rng(epoch).permutation(self.n) if self.shuffle else np.arange(self.n, dtype=_I64)

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's indices of ``epoch``, in order."""
        order = self.order(epoch)
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
        return self._in_batches(self.indices(epoch))

    def __len__(self) -> int:
        ws = self.world_size
        per = self.n // ws if self.drop_last else math.ceil(self.n / ws)
        return per // self.batch_size if self.drop_last else math.ceil(per / self.batch_size)


class QuasiRandomBatchSampler(BatchSampler):
    """Batches in a chunk-aware quasi-random order: shuffled blocks, shuffled within windows.

    Each epoch (from ``(seed, epoch)``): the blocks of consecutive examples are permuted;
    the permuted blocks are taken ``window`` at a time and the examples of each window
    are permuted; the result is cut into batches (and dealt to the ranks as by
    :class:`BatchSampler`: equal steps per rank). Every example is served exactly once
    per epoch (with one rank, or when the ranks divide it evenly).

    Why: a uniform shuffle makes every batch read from anywhere in the file. From the page
    cache that costs nothing; from a cold disk or a network file system each item is a
    random read. Here a window of ``window`` blocks (a few tens of MB) is read while its
    batches are served, so reads stay large and nearly sequential. The price: less
    randomness. Examples of one batch come from ``window`` blocks, not from the whole
    dataset, and neighbours on disk (often neighbours in the source, e.g. one speaker)
    meet more often than in a uniform shuffle. Keep ``window * block`` well above the
    batch size.

    Parameters
    ----------
    blocks : array of int
        Examples per block, in dataset order (they sum to the dataset size); see
        :func:`block_sizes`.
    batch_size : int
    window : int
        Blocks whose examples are shuffled together (default 8).
    drop_last, seed, rank, world_size
        As for :class:`BatchSampler`.

    Examples
    --------
    >>> s = QuasiRandomBatchSampler([4, 4, 4, 3], 5, window=2, seed=1)
    >>> sorted(i for b in s for i in b) == list(range(15))
    True
    >>> len(s)
    3
    """

    def __init__(self, blocks: Any, batch_size: int, window: int = WINDOW_BLOCKS, drop_last: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        sizes = np.asarray(blocks, dtype=_I64).reshape(-1)
        if sizes.size and sizes.min() <= 0:
            raise ValueError("blocks must be positive numbers of examples per block")
        if isinstance(window, bool) or int(window) < 1:
            raise ValueError(f"window must be an int >= 1 (blocks shuffled together), got {window!r}")
        super().__init__(int(sizes.sum()), batch_size, shuffle=True, drop_last=drop_last, seed=seed, rank=rank,
                         world_size=world_size)
        self.window = int(window)
        self._starts = np.zeros(len(sizes) + 1, _I64)  # one int per block, not per example
        np.cumsum(sizes, out=self._starts[1:])

    @property
    def blocks(self) -> np.ndarray:
        """Examples per block."""
        return np.diff(self._starts)

    def order(self, epoch: int) -> np.ndarray:
        rng = self._rng(epoch, salt=2)
        starts, sizes = self._starts[:-1], np.diff(self._starts)
        perm = rng.permutation(len(sizes))
        # Examples of the permuted blocks, block after block (vectorised: no Python loop per block).
        sz = sizes[perm]
        out_starts = np.zeros(len(sz) + 1, _I64)
        np.cumsum(sz, out=out_starts[1:])
        order = np.arange(self.n, dtype=_I64) - np.repeat(out_starts[:-1] - starts[perm], sz)
        # Shuffle within each window: sort by (window, random key).
        cuts = out_starts[:: self.window]
        win = np.repeat(np.arange(len(cuts), dtype=_I64), np.diff(np.append(cuts, self.n)))
        key = rng.random(self.n)
        return order[np.lexsort((key, win))]


class ShardBatchSampler(_EpochBatches):
    """Whole shards per rank (locality), equal steps per rank: ``serve(..., by_shard=True)``.

    Each rank reads only its own shards, every epoch: a rank's page cache (or its
    ``cache_dir=`` of a remote dataset) holds its shards, never the others'. Shards are
    dealt largest first to the rank holding the fewest examples so far (ties: the lowest
    rank), so the ranks' shares are as even as whole shards allow. Within a rank the
    examples are shuffled per epoch from ``(seed, epoch, rank)``.

    Equal steps: when the shares differ (unequal shards, or shards that do not divide
    among the ranks), ``drop_last=False`` pads each smaller share by repeating its own
    first examples (of this epoch's order) up to the largest share, ``drop_last=True``
    cuts each share to the smallest one, so an epoch leaves some examples unserved; the
    last incomplete batch is dropped as usual. Needs at least as many non-empty shards as
    ranks (empty shards are dealt to nobody).

    Parameters
    ----------
    shard_of : array of int
        The shard of every example (0, 1, ...), in example order.
    batch_size, shuffle, drop_last, seed, rank, world_size
        As for :class:`BatchSampler`.

    Examples
    --------
    >>> s = ShardBatchSampler([0, 0, 0, 0, 1, 1, 2], 2, rank=1, world_size=2)
    >>> s.shards, [b.tolist() for b in s.batches(0)]  # rank 0 has shard 0: 4 examples
    ([1, 2], [[4, 5], [6, 4]])
    """

    def __init__(self, shard_of: Any, batch_size: int, shuffle: bool = False, drop_last: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(seed, rank, world_size, drop_last)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        shard_of = np.asarray(shard_of, dtype=_I64)
        sizes = np.bincount(shard_of) if shard_of.size else np.zeros(0, dtype=_I64)
        # Only non-empty shards are dealt: an empty shard would leave its rank no examples
        # (zero steps while the others run theirs: a DDP hang, or an empty epoch with drop_last).
        full = int(np.count_nonzero(sizes))
        if full < world_size:
            raise ValueError(f"by_shard: {full} non-empty shards (of {len(sizes)}) for {world_size} ranks; every "
                             "rank needs a non-empty shard of its own (make more, smaller shards: shard_size=), "
                             "or serve without by_shard")
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        owner = np.full(len(sizes), -1, dtype=_I64)  # -1: empty, nobody's
        load = np.zeros(world_size, dtype=_I64)
        for k in np.argsort(-sizes, kind="stable")[:full].tolist():
            r = int(np.argmin(load))
            owner[k] = r
            load[r] += sizes[k]
        self.shards = np.flatnonzero(owner == rank).tolist()
        self.mine = np.flatnonzero(owner[shard_of] == rank).astype(_I64)
        self.share = int(load.min() if drop_last else load.max())  # examples per rank per epoch

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's examples of ``epoch``, padded (repeated) or cut to the common share."""
        order = self._rng(epoch, 1 + self.rank).permutation(self.mine) if self.shuffle else self.mine
        if len(order) > self.share:
            return order[: self.share]
        return np.resize(order, self.share) if len(order) else order

    def batches(self, epoch: int) -> list[np.ndarray]:
        return self._in_batches(self.indices(epoch))

    def __len__(self) -> int:
        return self.share // self.batch_size if self.drop_last else math.ceil(self.share / self.batch_size)


def shard_of_examples(dataset: Any) -> np.ndarray:
    """The file (shard) of each example of a :class:`~h5store.serving.FileDataset` over a
    concat or a sharded dataset: what :class:`ShardBatchSampler` deals to the ranks."""
    starts = dataset.files.starts
    return (np.searchsorted(starts, dataset.example_items(), "right") - 1).astype(_I64)


def block_sizes(dataset: Any, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """Examples per block of consecutive examples holding about ``block_bytes`` of stored data.

    Block ``k`` holds the examples whose data starts in bytes ``[k, k + 1) * block_bytes``
    of the served features laid end to end (as their chunks are on disk): blocks follow
    the file's layout, and an example larger than a block is a block of its own.
    ``dataset`` is a :class:`~h5store.serving.FileDataset` (the bytes are those of its
    served features, each item counted once however many examples it makes), or anything
    with ``len()``: then blocks of 256 examples.

    Examples
    --------
    >>> block_sizes(range(600)).tolist()
    [256, 256, 88]
    """
    n = len(dataset)
    weights = _example_bytes(dataset)
    if weights is None or n == 0:
        full, rest = divmod(n, FALLBACK_BLOCK)
        return np.array([FALLBACK_BLOCK] * full + ([rest] if rest else []), _I64)
    ends = np.cumsum(weights)
    # Block k holds the examples whose cumulative bytes fall in [k, k + 1) * block_bytes
    # (an example larger than a block is a block of its own).
    block = np.floor((ends - weights) / max(int(block_bytes), 1)).astype(_I64)
    change = np.flatnonzero(np.diff(block)) + 1
    bounds = np.concatenate([[0], change, [n]])
    return np.diff(bounds).astype(_I64)


def _example_bytes(dataset: Any) -> np.ndarray | None:
    """Stored bytes per example of a FileDataset's served features (None for other datasets)."""
    files = getattr(dataset, "files", None)
    features = getattr(dataset, "features", None)
    example_items = getattr(dataset, "example_items", None)
    if files is None or features is None or example_items is None:
        return None
    items = np.asarray(example_items(), dtype=_I64)
    per_item = np.zeros(len(files), np.float64)
    for name in features:
        spec = files.spec(name)
        row = np.dtype(spec.dtype).itemsize * int(np.prod([d for d in spec.shape[1:] if d is not None], dtype=_I64))
        if spec.layout == "fixed":
            per_item += np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape, dtype=_I64))
        else:  # ragged rows (blobs: one row per blob; its bytes are unknown here, counted as 1 KiB)
            per_item += files.lengths(name) * (row if spec.layout != "blobs" else 1024)
    if not items.size:
        return np.zeros(0, np.float64)
    shares = np.bincount(items, minlength=len(files))[items]  # examples made of each example's item
    return np.maximum(per_item[items] / shares, 1.0)


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


def check_shuffle(shuffle: Any) -> bool | str:
    """``shuffle`` as False, True or ``"chunks"``, else ValueError saying what to pass.

    Examples
    --------
    >>> check_shuffle(1), check_shuffle("chunks")
    (True, 'chunks')
    """
    if isinstance(shuffle, str):
        if shuffle == "chunks":
            return shuffle
        raise ValueError(f"shuffle must be True, False or 'chunks' (quasi-random, chunk-aware), got {shuffle!r}")
    if isinstance(shuffle, (bool, np.bool_)) or shuffle in (0, 1):
        return bool(shuffle)
    raise ValueError(f"shuffle must be True, False or 'chunks' (quasi-random, chunk-aware), got {shuffle!r}")


def make_sampler(dataset: Any, batch_size: int, *, shuffle: bool | str = False, seed: int = 0,
                 drop_last: bool = False, bucket: bool | int | None = None, rank: int = 0,
                 world_size: int = 1, block_bytes: int = BLOCK_BYTES, window: int = WINDOW_BLOCKS,
                 max_frames: int | None = None, padded: bool = False, by_shard: bool = False) -> _EpochBatches:
    """The batch sampler of every serving path (DataLoader, tf.data, :func:`~h5store.iter_batches`).

    ``dataset`` is anything with ``len()`` and, for ``bucket``, ``lengths()`` (a
    :class:`~h5store.serving.FileDataset`). The same sampler gives the same batches of
    indices for the same ``(seed, epoch)``, whichever loader then reads them.
    ``shuffle="chunks"`` is the quasi-random order of :class:`QuasiRandomBatchSampler`,
    with blocks of about ``block_bytes`` of stored data (:func:`block_sizes`) shuffled
    ``window`` blocks at a time. ``max_frames`` sizes batches by duration
    (:class:`DurationBatchSampler`, ``bucket`` length buckets; ``batch_size`` is ignored).
    ``by_shard`` gives each rank whole files of a concat or sharded dataset
    (:class:`ShardBatchSampler`).

    Examples
    --------
    >>> s = make_sampler(range(10), 4, shuffle=True, seed=1)
    >>> sorted(i for b in s.batches(0) for i in b) == list(range(10))
    True
    >>> q = make_sampler(range(1000), 32, shuffle="chunks", seed=1)
    >>> sorted(i for b in q.batches(0) for i in b) == list(range(1000))
    True
    """
    if by_shard:
        if max_frames is not None or bucket or shuffle == "chunks":
            raise ValueError("by_shard=True takes shuffle=True/False, not bucket=, max_frames= or shuffle='chunks'")
        if isinstance(batch_size, bool) or int(batch_size) <= 0:
            raise ValueError(f"batch_size must be an int > 0, got {batch_size!r}")
        return ShardBatchSampler(shard_of_examples(dataset), int(batch_size), shuffle=bool(shuffle),
                                 drop_last=drop_last, seed=seed, rank=rank, world_size=world_size)
    if max_frames is not None:
        buckets = 10 if bucket is None or bucket is True or bucket is False else int(bucket)
        return DurationBatchSampler(dataset.lengths(), max_frames, padded=padded, num_buckets=buckets,
                                    shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size)
    shuffle = check_shuffle(shuffle)
    if max_frames is not None:
        if shuffle == "chunks":
            raise ValueError("shuffle='chunks' and max_frames= are two different orders; choose one")
        buckets = 10 if bucket is None or isinstance(bucket, bool) else int(bucket)
        return DurationBatchSampler(dataset.lengths(), max_frames, padded=padded, num_buckets=buckets,
                                    shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size)
    if isinstance(batch_size, bool) or int(batch_size) <= 0:
        raise ValueError(f"batch_size must be an int > 0, got {batch_size!r}")
    if shuffle == "chunks":
        if bucket:
            raise ValueError("shuffle='chunks' and bucket= are two different orders; choose one")
        return QuasiRandomBatchSampler(block_sizes(dataset, block_bytes), int(batch_size), window=window,
                                       drop_last=drop_last, seed=seed, rank=rank, world_size=world_size)
    if bucket:
        size = None if bucket is True else int(bucket)
        return BucketBatchSampler(dataset.lengths(), int(batch_size), bucket_size=size, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last, rank=rank, world_size=world_size)
    return BatchSampler(len(dataset), int(batch_size), shuffle=shuffle, drop_last=drop_last, seed=seed, rank=rank,
                        world_size=world_size)
