"""``serve``: a PyTorch DataLoader over h5store files (the one module here that imports torch)."""

from __future__ import annotations

import math
import os
import secrets
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from h5store.pio import pid_alive
from h5store.serving.buffers import BatchPool
from h5store.serving.collate import to_torch
from h5store.serving.dataset import FileDataset
from h5store.serving.getters import Getter
from h5store.serving.samplers import _EpochBatches, make_sampler
from h5store.serving.shared import SharedParams

__all__ = ["Loader", "RingBatch", "SharedBatches", "serve"]


_ALIGN = 64
_NUMERIC = "biuf"
_PAGE = 4096


def _nbytes(dtype: Any, shape: Sequence[int]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize  # (np.prod: ~15 us per batch more, in the main process)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _release(ring: np.ndarray, slot: int) -> None:
    ring[8 * (slot + 1) : 8 * (slot + 2)].view(np.int64)[0] = 0


# The rings this (main) process has mapped, by (worker pid, random token): a ring travels
# once; later batches name it. Sending the shared block with every batch cost a descriptor
# transfer (a socket connect + recvmsg to the worker's resource sharer) and a fresh mapping,
# faulted in again, per batch. Each ring is kept with its numpy view (``Tensor.numpy()``
# costs ~1 us a call, several per batch). The token is drawn per ring, never a counter:
# forked workers would inherit the same counter, and a later worker given a dead one's pid
# would then name the dead worker's ring.
_RINGS: dict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = {}
_DTYPES: dict[str, np.dtype] = {}


def _dtype(code: str) -> np.dtype:
    dt = _DTYPES.get(code)
    if dt is None:
        dt = _DTYPES[code] = np.dtype(code)
    return dt



def _ring_token() -> int:
    """A ring's token: random, so no two processes (forked from one parent) draw the same."""
    return secrets.randbits(63)


def _adopt(key: tuple[int, int], ring: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """Keep ``ring`` mapped here under ``key`` (and tell its worker so: header word 0); drop
    the rings of exited workers and the other rings of this pid: the replaced rings of this
    worker (its batches arrive in order: none of them follows), or of an exited worker whose
    pid it was given."""
    known = _RINGS.get(key)
    if known is not None:
        return known
    pid = key[0]
    for old in [k for k in _RINGS if k[0] == pid or not pid_alive(k[0])]:
        del _RINGS[old]
    entry = _RINGS[key] = (ring, ring.numpy())
    entry[1][:8].view(np.int64)[0] = 1
    return entry


def _received(ring: torch.Tensor | None, key: tuple[int, int], slot: int, start: int, layout: tuple[Any, ...],
              other: dict[str, Any], order: tuple[str, ...]) -> RingBatch:
    """A :class:`RingBatch` arriving in the main process (what its pickle rebuilds)."""
    if ring is None:
        entry = _RINGS.get(key)
        if entry is None:
            raise RuntimeError(f"serve: a batch names shared-memory ring {key} that this process never "
                               "received; a RingBatch can only be unpickled by the process serve() runs in")
    else:
        entry = _adopt(key, ring)
    rb = RingBatch.__new__(RingBatch)
    rb.ring, rb._np = entry
    rb.key, rb.slot, rb.start, rb.layout, rb.other, rb.order = key, slot, start, layout, other, order
    rb._owner = True
    return rb


class RingBatch:
    """A batch that a DataLoader worker wrote into a slot of its shared-memory ring.

    Sending a tensor from a worker costs a fresh shared-memory block (measured here:
    ~4 ms per 3 MB batch to allocate and fault in new pages) and one file-descriptor
    transfer per tensor. A worker instead keeps a ring of slots in one shared block that
    the main process maps once, writes each batch into a free slot and sends the block
    (already shared: no copy, one descriptor) with the slot's layout. The main process
    cuts it into tensors without copying; the slot is handed back to the worker when
    the last of those tensors is freed (or at once when ``pin_memory`` copies them).
    """

    def __init__(self, ring: torch.Tensor, slot: int, start: int, layout: tuple[tuple[str, int, str, tuple[int, ...], int], ...],
                 other: dict[str, Any], order: tuple[str, ...], key: tuple[int, int] = (0, 0),
                 ring_np: np.ndarray | None = None) -> None:
        self.ring = ring
        self._np = ring.numpy() if ring_np is None else ring_np
        self.key = key
        self.slot = slot
        self.start = start
        # (key, offset in the slot's region, dtype code, shape, nbytes) per array
        self.layout = layout
        self.other = other
        self.order = order
        self._owner = False  # True in the process that received it: it hands the slot back

    def __reduce__(self) -> tuple[Any, ...]:
        # One flat tuple (pickled and rebuilt ~2x faster than the instance's dict). The ring
        # travels until the main process maps it (it then sets word 0 of the header).
        ring = None if self._np[:8].view(np.int64)[0] else self.ring
        return (_received, (ring, self.key, self.slot, self.start, self.layout, self.other, self.order))

    def _give_back(self) -> None:
        if self._owner:
            self._owner = False
            _release(self._np, self.slot)

    def __del__(self) -> None:
        # Received but never unpacked (a prefetched batch of an abandoned epoch).
        try:
            self._give_back()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to give back to
            pass

    def _used(self) -> int:
        return max((off + n for _, off, _, _, n in self.layout), default=0)

    def _cut(self, region: np.ndarray) -> dict[str, Any]:
        arrays = {key: torch.from_numpy(region[off : off + n].view(_dtype(dt)).reshape(shape))
                  for key, off, dt, shape, n in self.layout}
        return {key: arrays[key] if key in arrays else self.other[key] for key in self.order}

    def unpack(self) -> dict[str, Any]:
        """The batch as tensors viewing the slot; the slot is freed with the last of them."""
        ring = self._np
        used = self._used()
        if not used or not self._owner:
            region = np.array(ring[self.start : self.start + used])  # not ours to hold: copy
            self._give_back()
            return self._cut(region)
        self._owner = False
        region = np.frombuffer(memoryview(ring)[self.start : self.start + used], dtype=np.uint8)
        weakref.finalize(region, _release, ring, self.slot)
        return self._cut(region)

    def pin_memory(self) -> dict[str, Any]:
        """Pinned copies of the batch's tensors (the slot is freed at once)."""
        ring = self._np
        used = self._used()
        region = torch.from_numpy(ring[self.start : self.start + used]).pin_memory().numpy()
        self._give_back()
        out = self._cut(region)
        return {k: v.pin_memory() if isinstance(v, torch.Tensor) and not v.is_pinned() else v for k, v in out.items()}


class _Ring:
    """``slots`` regions of ``slot_bytes`` in one shared block, behind a header of int64 words:
    word 0 is 1 once the main process maps the ring, then one flag per slot (1 = in use)."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.key = (os.getpid(), _ring_token())
        self.header = -(-8 * (slots + 1) // _PAGE) * _PAGE
        total = self.header + slots * slot_bytes
        storage = torch.UntypedStorage._new_shared(total)
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (total,))
        self.np = self.tensor.numpy()
        self.address = self.np.__array_interface__["data"][0]
        self.np[:8].view(np.int64)[0] = 0
        self.flags = self.np[8 : 8 * (slots + 1)].view(np.int64)
        self.flags[:] = 0

    def take(self) -> int:
        free = self.flags.argmin()  # the first free slot (flags are 0 or 1)
        if self.flags[free]:
            return -1
        slot = int(free)
        self.flags[slot] = 1
        return slot

    def start(self, slot: int) -> int:
        return self.header + slot * self.slot_bytes


class SharedBatches:
    """Batch buffers in a DataLoader worker, carved from a ring of reused shared-memory slots.

    Getters fill arrays from this allocator, so a batch is born in shared memory and is
    sent without a copy (see :class:`RingBatch`). When every slot is still held by the
    main process (it keeps many batches alive), arrays come from ordinary memory and
    travel the usual way. The slot size follows the largest batch seen.
    """

    def __init__(self, slots: int = 8) -> None:
        self.slots = slots
        self.ring: _Ring | None = None
        self.slot = -1
        self.used = 0
        self.sent = True

    def reset(self) -> None:
        ring = self.ring
        if ring is not None and self.slot >= 0 and not self.sent:
            ring.flags[self.slot] = 0
        self.used = 0
        self.sent = False
        self.slot = ring.take() if ring is not None else -1

    def _carve(self, nbytes: int) -> int | None:
        if self.ring is None or self.slot < 0:
            return None
        off = -(-self.used // _ALIGN) * _ALIGN
        if off + nbytes > self.ring.slot_bytes:
            return None
        self.used = off + nbytes
        return off

    def __call__(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        n = _nbytes(dtype, shape)
        off = self._carve(n) if n and dtype.kind in _NUMERIC and dtype.isnative else None
        if off is None:
            return np.empty(shape, dtype)
        assert self.ring is not None
        start = self.ring.start(self.slot) + off
        a = self.ring.np[start : start + n].view(dtype).reshape(shape)
        return a

    def _placed(self, v: np.ndarray) -> int | None:
        """Offset of ``v`` in this batch's slot when it was carved there (its bytes, not its id), else None."""
        ring = self.ring
        if ring is None or self.slot < 0 or not v.flags.c_contiguous:
            return None
        off = v.__array_interface__["data"][0] - (ring.address + ring.start(self.slot))  # (.ctypes: ~5x slower)
        return off if 0 <= off and off + v.nbytes <= self.used else None

    def _layout(self, ring: _Ring, arrays: Mapping[str, np.ndarray],
                placed: Mapping[str, int | None]) -> tuple[tuple[str, int, str, tuple[int, ...], int], ...]:
        layout = []
        base = ring.start(self.slot)
        for key, v in arrays.items():
            off = placed[key]
            n = v.nbytes
            if off is None:
                off = self._carve(n)
                assert off is not None  # room was checked by pack()
                ring.np[base + off : base + off + n].view(v.dtype).reshape(v.shape)[...] = v
            layout.append((key, off, v.dtype.str, v.shape, n))
        return tuple(layout)

    def pack(self, batch: Mapping[str, Any]) -> RingBatch | dict[str, Any]:
        """The batch as a :class:`RingBatch` (or plain tensors when no slot is free)."""
        arrays = {k: v for k, v in batch.items()
                  if isinstance(v, np.ndarray) and v.dtype.kind in _NUMERIC and v.dtype.isnative and v.nbytes}
        need = sum(-(-v.nbytes // _ALIGN) * _ALIGN for v in arrays.values())
        if self.ring is None or need > self.ring.slot_bytes:
            if self.ring is not None and self.slot >= 0:
                self.ring.flags[self.slot] = 0
            self.ring = _Ring(self.slots, max(1 << 20, -(-2 * need // _PAGE) * _PAGE))
            self.used = 0
            self.slot = self.ring.take()
        ring = self.ring
        if self.slot < 0:
            self.sent = True
            return to_torch(batch)
        placed = {k: self._placed(v) for k, v in arrays.items()}
        fresh = sum(-(-v.nbytes // _ALIGN) * _ALIGN for k, v in arrays.items() if placed[k] is None)
        if -(-self.used // _ALIGN) * _ALIGN + fresh > ring.slot_bytes:
            # A transform replaced arrays that were carved here: lay the whole batch out
            # afresh in another slot (this one is freed once the batch is copied out of it).
            old = self.slot
            self.slot = ring.take()
            if self.slot < 0:  # copies: the freed slot may be refilled before the batch is sent
                self.sent = True
                out_batch = to_torch({k: np.array(v) if k in arrays else v for k, v in batch.items()})
                ring.flags[old] = 0
                return out_batch
            self.used = 0
            placed = dict.fromkeys(arrays)
            out = self._layout(ring, arrays, placed)
            ring.flags[old] = 0
        else:
            out = self._layout(ring, arrays, placed)
        base = ring.start(self.slot)
        other = to_torch({k: v for k, v in batch.items() if k not in arrays}) if len(arrays) < len(batch) else {}
        self.sent = True
        return RingBatch(ring.tensor, self.slot, base, out, other, tuple(batch), ring.key, ring.np)


class _WorkerInit:
    """Installs the shared-memory batch ring in each worker, then runs the user's init."""

    def __init__(self, user: Callable[[int], Any] | None, slots: int) -> None:
        self.user = user
        self.slots = slots

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        ds = info.dataset if info is not None else None
        if isinstance(ds, FileDataset):
            ds.files.alloc = SharedBatches(self.slots)
        if self.user is not None:
            self.user(worker_id)


class _LoaderIter:
    """The DataLoader's iterator: unpacks worker batches and counts those the loop received."""

    def __init__(self, it: Any, sampler: _EpochBatches | None) -> None:
        self._it = it
        self._sampler = sampler

    def __iter__(self) -> _LoaderIter:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        if self._sampler is not None:
            self._sampler._delivered += 1
        return batch.unpack() if isinstance(batch, RingBatch) else batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class Loader(DataLoader):
    """The DataLoader :func:`serve` returns: a plain DataLoader whose batch sampler knows
    how many batches the training loop has received (for exact mid-epoch resume).

    ``loader.sampler`` and ``loader.batch_sampler`` are the same h5store sampler, so
    ``loader.sampler.set_epoch(e)`` works as with torch's DistributedSampler.
    """

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        bs = self.batch_sampler
        if isinstance(bs, _EpochBatches):
            bs._counted = True
            if isinstance(dataset, FileDataset) and self.num_workers:
                bs.follow(dataset, 2 * self.num_workers)  # a new transform reaches every worker
            # DataLoader forbids setting `sampler` after __init__; it is unused when a
            # batch_sampler is given, so it may name the same object.
            object.__setattr__(self, "sampler", bs)

    def __iter__(self) -> Any:
        bs = self.batch_sampler
        return _LoaderIter(super().__iter__(), bs if isinstance(bs, _EpochBatches) else None)

    @property
    def transform(self) -> Any:
        """The batch transform the workers apply (see :attr:`FileDataset.transform`).

        ``loader.transform = new`` in the training loop reaches every worker, persistent
        or not, under fork, spawn and forkserver: it travels with the indices of the next
        batches the sampler hands out (DataLoader's own index queue, at least one batch per
        worker), so every batch dispatched after the assignment uses ``new``. The batches
        already dispatched (at most ``prefetch_factor * num_workers``) keep the old one.
        """
        return self.dataset.transform

    @transform.setter
    def transform(self, fn: Any) -> None:
        self.dataset.transform = fn

    @property
    def skipped(self) -> list[str]:
        """Ids left out as damaged so far, by any worker (``verify="skip"``); see :class:`FileDataset`."""
        return self.dataset.skipped

    def state_dict(self) -> dict[str, Any]:
        """The batch sampler's state (epoch, batches consumed): see ``load_state_dict``."""
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration yields the batches not yet consumed."""
        self.batch_sampler.load_state_dict(state)


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
        if (rank is not None and rank != r) or (world_size is not None and world_size != w):
            raise ValueError(f"serve: rank={rank}, world_size={world_size} disagree with torch.distributed ({r}, {w})")
        return r, w
    if rank is None or world_size is None:
        raise RuntimeError(
            "serve(distributed=True): torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() first, or pass rank= and world_size="
        )
    return int(rank), int(world_size)


def serve(file: Any, batch: Mapping[str, Getter], batch_size: int | None = 1, *, shuffle: bool = False,
          drop_last: bool = False, seed: int = 0, verify: bool | str = True, num_workers: int = 0,
          in_memory: bool | Sequence[str] = False, distributed: bool = False, rank: int | None = None,
          world_size: int | None = None, mask: bool = False, bucket: bool | int | None = None,
          params: Mapping[str, Any] | SharedParams | None = None, items: Sequence[int] | np.ndarray | None = None,
          transform: Any = None, max_frames: int | None = None, padded: bool = False, by_shard: bool = False,
          **loader_kwargs: Any) -> Loader:
    """A PyTorch DataLoader over an h5store file (or a :func:`~h5store.concat` of files).

    The implementation of ``f.serve(...)`` (:func:`h5store.serving.api.serve`, which checks
    the arguments first).

    Parameters
    ----------
    file : TypedFile or MultiFile
    batch : dict
        Key -> getter (``h5s.Item``, ``h5s.Window``, ``h5s.Frames``, ``h5s.Label``,
        ``h5s.Position``, ``h5s.Id`` or your own :class:`~h5store.serving.Getter`).
    batch_size : int or None
        Examples per batch (default 1, as ``DataLoader``); None: unbatched examples.
    shuffle : bool
        A new order each epoch from ``(seed, epoch)`` (default False, as ``DataLoader``).
    drop_last : bool
        Drop the last incomplete batch.
    num_workers : int
        DataLoader worker processes.
    in_memory : bool or list of str
        Load the served features (or the named ones) into shared memory once; workers
        map it, one copy in RAM (see :class:`~h5store.serving.FileDataset`).
    distributed : bool
        Shard across ranks: rank and world size from ``torch.distributed`` when it is
        initialised, else from ``rank`` and ``world_size``. Every rank gets the same
        number of batches (``drop_last=False`` repeats the first indices to even out,
        ``drop_last=True`` drops the tail). Call ``loader.sampler.set_epoch(e)`` each epoch.
    rank, world_size : int, optional
        This process's place (passing them implies ``distributed``).
    by_shard : bool
        With ranks, give each rank whole files of a sharded dataset or concat, the same ones
        every epoch (locality: a rank reads and caches only its shards), still equal steps
        per rank (:class:`~h5store.serving.samplers.ShardBatchSampler`: unequal shares are
        padded by repeating a rank's own examples, or cut with ``drop_last=True``).
    seed : int
        Seed of the shuffle and of random crops; the order of an epoch depends only on
        ``(seed, epoch)``.
    mask : bool
        Also return ``{key}_mask`` for padded values.
    bucket : bool or int
        Batch examples of similar length (:class:`~h5store.serving.BucketBatchSampler`),
        by the first variable-length ``Item``; an int is the bucket size in examples.
    params : dict, optional
        Shared parameters: ``loader.dataset.params.crop = 128`` reaches every worker.
    items : array of int, optional
        Serve only these item positions.
    transform : callable, optional
        Applied to each batch in the worker that reads it, before the transfer (see
        :mod:`h5store.serving.transforms`); ``loader.transform = other`` reaches every worker.
    max_frames : int, optional
        Batches sized by duration: each batch holds as many examples as fit in
        ``max_frames`` frames of the first variable-length ``Item``
        (:class:`~h5store.serving.DurationBatchSampler`, length-bucketed); ``batch_size``
        is then ignored. ``bucket=N`` sets the number of length buckets.
    padded : bool
        With ``max_frames``: count padded frames (``examples x longest``), not real ones.
    verify : {True, False, "always", "skip"}
        Check each served item against its stored CRC-32 in the worker that reads it,
        the first time the loader serves it (any worker; default): a damaged item raises
        :class:`~h5store.errors.CorruptRecordError` naming file, feature and id;
        ``"always"`` re-checks whole items at every read; ``"skip"`` leaves a damaged
        item out of its batch, warns and lists it in ``loader.skipped``; False serves
        items unchecked (see :class:`~h5store.serving.FileDataset`).
    **loader_kwargs
        Passed to :class:`torch.utils.data.DataLoader`: ``pin_memory``, ``persistent_workers``,
        ``prefetch_factor``, ``multiprocessing_context``, ``generator``, ``worker_init_fn``,
        ``collate_fn`` (it receives the batch already collated, a dict of numpy arrays),
        ``sampler`` / ``batch_sampler`` (your own; then ``distributed`` and ``bucket`` are off).

    Returns
    -------
    Loader
        A :class:`torch.utils.data.DataLoader`; each batch is a dict of tensors (text
        values are lists of str). ``loader.dataset`` is the :class:`~h5store.serving.FileDataset`.

    Notes
    -----
    BEWARE: the loader prefetches ``prefetch_factor * num_workers`` batches, so a change
    of ``loader.dataset.params`` reaches the batches fetched after it, a few batches
    later than the loop sees it. Workers open the file read-only, lazily, in each
    process: fork, spawn and forkserver all work, also while this process has the file
    open for writing (appending logs to another group, say).

    Examples
    --------
    >>> import h5store as h5s
    >>> loader = f.serve(dict(x=h5s.Window("mel", 64), y=h5s.Label("label")),  # doctest: +SKIP
    ...                  batch_size=32, shuffle=True, num_workers=2)
    >>> for batch in loader:  # doctest: +SKIP
    ...     batch["x"].shape, batch["y"].dtype
    (torch.Size([32, 64, 80]), torch.int64)
    """
    kw = dict(loader_kwargs, num_workers=num_workers)
    if rank is not None or world_size is not None:
        distributed = True
    dataset = FileDataset(file, batch, params=params, seed=seed, mask=mask, in_memory=in_memory, items=items,
                          verify=verify, transform=transform)
    own = kw.get("sampler") is not None or kw.get("batch_sampler") is not None
    if own and (distributed or bucket or max_frames or by_shard):
        raise ValueError("serve: distributed=, bucket=, max_frames= and by_shard= make their own batch sampler; do "
                         "not pass sampler/batch_sampler")
    if max_frames is not None and batch_size is None:
        batch_size = 1  # sized by max_frames
    r, w = _rank_world(rank, world_size) if distributed else (0, 1)
    if not own and batch_size is not None:
        batch_size = int(batch_size)
        kw["batch_sampler"] = make_sampler(dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                           bucket=bucket, rank=r, world_size=w, max_frames=max_frames, padded=padded,
                                           by_shard=by_shard)
    elif distributed or bucket or by_shard:
        raise ValueError("serve: distributed=, bucket= and by_shard= need a batch_size")
    else:  # the user's sampler, or unbatched examples: DataLoader's own rules
        kw.update(batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
    kw.setdefault("collate_fn", dataset.collate)
    # In this process, batch buffers are reused once the loop drops them (no page faults per
    # batch); workers write theirs into a shared-memory ring instead (_WorkerInit).
    dataset.files.alloc = BatchPool()
    if kw.get("num_workers", 0):
        # Slots: the batches a worker has queued, plus those the loop may still hold.
        slots = 2 * (kw.get("prefetch_factor") or 2) + 4
        kw["worker_init_fn"] = _WorkerInit(kw.get("worker_init_fn"), slots)
    return Loader(dataset, **kw)
