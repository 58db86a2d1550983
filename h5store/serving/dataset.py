"""FileDataset: a map-style dataset over h5store files that reads whole batches at once.

It is torch-free (numpy in, numpy out) so the same engine can feed PyTorch, tf.data and
numpy/JAX loops. PyTorch's fetcher (torch >= 2.1) calls :meth:`FileDataset.__getitems__`
with the batch's indices: every getter then does one planned read per feature for the
batch, and the result comes back already collated (padded, with lengths).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from h5store.errors import SchemaError
from h5store.serving.collate import Batch, lengths_mask, pad_collate_numpy, to_torch
from h5store.serving.files import FileSet, split_name
from h5store.serving.getters import Getter, Item, Padded, Request, Window
from h5store.serving.shared import _EPOCH, SharedFlags, SharedParams
from h5store.serving.transforms import apply_transform, batch_rng

__all__ = ["CorruptRecordWarning", "FileDataset"]

_I64 = np.int64


class CorruptRecordWarning(UserWarning):
    """A damaged item was left out of a batch (serving with ``verify="skip"``)."""


def _check_transform(fn: Any) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"transform must be a callable taking a batch (a dict of arrays) and returning one, got {fn!r}")


#: h5store's getters whose values are buffers made for each batch (not a user's subclass).
_FRESH = ("Item", "Window", "Frames", "Clips", "ImageCrop")


def _builtin(getter: Any) -> bool:
    """Whether ``getter``'s values are fresh buffers of the batch (one of :data:`_FRESH`, exactly)."""
    t = type(getter)
    return getter is not None and t.__module__ == "h5store.serving.getters" and t.__name__ in _FRESH


def _indices_key(idx: np.ndarray) -> int:
    """A batch number for indices from a sampler of the user's: a hash of the indices."""
    import zlib

    return zlib.crc32(np.ascontiguousarray(idx, dtype=_I64).tobytes())


class FileDataset:
    """Examples drawn from one h5store file (or a :func:`~h5store.concat` of files).

    Parameters
    ----------
    file : TypedFile or MultiFile
        What to serve. The dataset keeps a read-only copy that reopens lazily in every
        process (DataLoader workers under fork, spawn and forkserver).
    batch : dict
        Key -> :class:`~h5store.serving.getters.Getter`: what each example is made of.
        All getters read features of one group.
    params : dict or SharedParams, optional
        Shared parameters (int, float or bool) that getters may name (``Window("mel",
        "crop")``). ``dataset.params.crop = 128`` in the main process reaches every
        worker from the next batch it fetches.
    seed : int
        Seed of the random crops (shuffling is the sampler's).
    mask : bool
        Also return ``{key}_mask`` (bool, True on real rows) for padded values.
    in_memory : bool or list of str
        Copy the data of the served features (True) or of the named ones into shared
        memory once, in this process; every worker maps the same pages (one copy in RAM
        however many workers).
    items : array of int, optional
        Serve only these item positions (a train/validation split), in this order.
    verify : {True, False, "always", "skip"}
        Check every served item against its stored CRC-32 (default), once: the first
        time the dataset serves an item (the whole item, or any part of it) its bytes are
        checked and the item is flagged, one flag per item and feature in shared memory
        seen by every worker (and by the workers of later epochs); later reads are not
        checked again (the file is read-only while served; a byte flipped on disk after
        the first check goes unnoticed, see docs/reliability.md). True raises
        :class:`~h5store.errors.CorruptRecordError` naming the file, feature and id;
        ``"always"`` raises too, and re-checks whole items every time they are served
        (in-process, whole items are then served 10-30% slower); ``"skip"`` leaves the
        item out of the batch (the batch is one item shorter), warns with
        :class:`CorruptRecordWarning` and adds it to :attr:`skipped` (seen by every
        worker: it is not read again); False delivers items unchecked. Whole items are
        checked over the bytes read for the batch; a part of an item (a ``Window``,
        ``Frames``) by reading the whole item.
    transform : callable, optional
        Applied to every batch after it is read and collated, in the process that reads
        it (a DataLoader worker): ``fn(batch) -> batch``, or a
        :class:`~h5store.serving.transforms.Transform`, whose randomness is seeded from
        ``(seed, epoch, batch number)``. Assigning :attr:`transform` later reaches every
        worker from the next batch it builds.

    Examples
    --------
    >>> import h5store as h5s
    >>> from h5store.serving import FileDataset
    >>> ds = FileDataset(f, dict(x=h5s.Item("mel"), y=h5s.Label("label")))  # doctest: +SKIP
    >>> b = ds.fetch([3, 0, 7])  # numpy, collated  # doctest: +SKIP
    >>> b["x"].shape, b["x_lengths"], b["y"]  # doctest: +SKIP
    ((3, 412, 80), array([412, 97, 230]), array([1, 0, 4]))
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=16, collate_fn=ds.collate)  # doctest: +SKIP
    """

    def __init__(self, file: Any, batch: Mapping[str, Getter], *, params: Mapping[str, Any] | SharedParams | None = None,
                 seed: int = 0, mask: bool = False, in_memory: bool | Sequence[str] = False,
                 items: Sequence[int] | np.ndarray | None = None, verify: bool | str = True,
                 transform: Any = None) -> None:
        if not isinstance(batch, Mapping) or not batch:
            raise SchemaError(f"batch must be a non-empty dict of key -> getter, e.g. dict(x=h5s.Item('mel'), "
                              f"y=h5s.Label('label')), got {batch!r}")
        for key, g in batch.items():
            if not isinstance(g, Getter):
                name = g if isinstance(g, str) else "mel"
                raise SchemaError(f"batch[{key!r}] must be a getter, e.g. h5s.Item({name!r}) (or h5s.Window, "
                                  f"h5s.Frames, h5s.Label, h5s.Position, h5s.Id), got {g!r}")
        self.getters: dict[str, Getter] = dict(batch)
        self._check_keys()
        if not (isinstance(verify, bool) or verify in ("skip", "always")):
            raise ValueError(f"verify must be True, False, 'always' or 'skip', got {verify!r}")
        group = self._group()
        self.files = FileSet(file, group)
        self.files.verify = verify
        self.verify = verify
        for g in self.getters.values():
            g.check(self.files)
        self.params = params if isinstance(params, SharedParams) else SharedParams(dict(params or {}))
        _check_transform(transform)
        self._transform = transform
        self._transform_version = 0
        self.seed = int(seed)
        self.mask = bool(mask)
        self.features = sorted({split_name(n)[1] for g in self.getters.values() for n in g.features})
        # Every table of the snapshot served, loaded here: workers inherit or receive them.
        self.files.pin(self.features)
        self._skipped = SharedFlags(len(self.files)) if verify == "skip" else None
        self._build_examples(items)
        if in_memory:
            names = self.features if in_memory is True else [split_name(n)[1] for n in in_memory]  # type: ignore[union-attr]
            for name in names:
                self.files.feature(name)
                self.files.load_shared(name)

    # -- construction ------------------------------------------------------------
    def _check_keys(self) -> None:
        keys = set(self.getters)
        for key in keys:
            for suffix in ("_lengths", "_mask"):
                if key.endswith(suffix) and key[: -len(suffix)] in keys:
                    raise SchemaError(f"batch key {key!r} collides with the {suffix[1:]} of {key[:-len(suffix)]!r}")

    def _group(self) -> str:
        groups = {split_name(n)[0] for g in self.getters.values() for n in g.features}
        if len(groups) > 1:
            raise SchemaError(f"the getters read features of several groups {sorted(groups)}; one batch serves one group")
        return groups.pop() if groups else ""

    def _build_examples(self, items: Sequence[int] | np.ndarray | None) -> None:
        n_items = len(self.files)
        if items is None:
            base = None
        else:
            base = np.asarray(items, dtype=_I64).reshape(-1)
            if base.size and (base.min() < 0 or base.max() >= n_items):
                raise IndexError(f"{self.files.where()}: items must be positions in [0, {n_items})")
        counts = None
        expanding = None
        by_length: list[tuple[Getter, np.ndarray]] = []
        for key, g in self.getters.items():
            c = g.counts(self.files, self.params)
            if c is None:
                continue
            c = np.asarray(c, dtype=_I64)
            if c.shape != (n_items,):
                raise SchemaError(f"batch[{key!r}]: counts() returned shape {c.shape}, expected ({n_items},)")
            if _builtin(g):  # Window, Frames, Clips: items too short for them make no example
                by_length.append((g, c))
            if c.size and c.max() > 1:
                if expanding is not None and not np.array_equal(c, expanding[1]):
                    raise SchemaError(
                        f"batch[{expanding[0]!r}] and batch[{key!r}] both split items into several examples, "
                        "differently; only one split per dataset"
                    )
                expanding = (key, c)
            counts = c if counts is None else np.where(counts > 0, np.maximum(counts, c), 0) * (c > 0)
        all_items = base if base is not None else np.arange(n_items, dtype=_I64)
        if self.verify:
            self._check_left_out(all_items, by_length)
        if counts is not None:
            c = counts[all_items]
            if expanding is None:  # only filters: keep the items with one example
                base, ends, per = all_items[c > 0], None, None
            else:
                keep = c > 0
                base, per = all_items[keep], c[keep]
                ends = np.cumsum(per)
        else:
            ends, per = None, None
        self._base: np.ndarray | None = base
        self._ends: np.ndarray | None = ends
        self._per: np.ndarray | None = per
        served = base if base is not None else np.arange(n_items, dtype=_I64)
        self.files.check_present(self.features, served)

    def _check_left_out(self, items: np.ndarray, by_length: list[tuple[Getter, np.ndarray]]) -> None:
        """Check the whole of the ``items`` a getter leaves out for their length: an index damaged
        into a shorter item would otherwise drop it from every epoch without any check."""
        for g, c in by_length:
            out = items[c[items] == 0]
            for ref in g.features:
                name = split_name(ref)[1]
                self.files.check_whole(name, out[self.files.present(name)[out]])
        if self._skipped is not None:
            self._leave_out(self.files.failed)
            self.files.failed = []

    def _leave_out(self, failed: list[tuple[int, str]]) -> None:
        """verify="skip": flag items found damaged (shared with every worker), warning once each."""
        assert self._skipped is not None
        flags = self._skipped.array
        for position, name in failed:
            if not flags[position]:
                self._skipped.set(position)
                warnings.warn(
                    f"{self.files.files[0].path if len(self.files.files) == 1 else self.files.where()}: "
                    f"left out item {self.files.id(position)!r} (position {position}): its {name!r} fails "
                    "its CRC-32 check (verify='skip'; see dataset.skipped)",
                    CorruptRecordWarning, stacklevel=5,
                )

    # -- size and lookup ---------------------------------------------------------------
    def __len__(self) -> int:
        if self._ends is not None:
            return int(self._ends[-1]) if len(self._ends) else 0
        return len(self._base) if self._base is not None else len(self.files)

    def locate(self, indices: Iterable[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(items, subs)`` of dataset indices: each example's item position and its number within the item."""
        idx = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices), dtype=_I64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[np.argmax((idx < -n) | (idx >= n))])
            raise IndexError(f"{self.files.where()}: example {bad} out of range for a dataset of {n}")
        if idx.size and idx.min() < 0:
            idx = np.where(idx < 0, idx + n, idx)
        if self._ends is None:
            items = idx if self._base is None else self._base[idx]
            return items, np.zeros(len(idx), _I64)
        assert self._per is not None and self._base is not None
        j = np.searchsorted(self._ends, idx, side="right")
        subs = idx - (self._ends[j] - self._per[j])
        return self._base[j], subs

    def example_items(self) -> np.ndarray:
        """Item position of every example, in dataset order."""
        if self._ends is not None:
            assert self._base is not None and self._per is not None
            return np.repeat(self._base, self._per)
        return self._base if self._base is not None else np.arange(len(self.files), dtype=_I64)

    def lengths(self, key: str | None = None) -> np.ndarray:
        """Length (rows) of every example's value for ``key``: what length-bucketing sorts by.

        ``key`` defaults to the first :class:`~h5store.serving.getters.Item` of a
        variable-length feature, else the first :class:`~h5store.serving.getters.Window`
        (its length, or the item's when shorter).
        """
        if key is None:
            key = next((k for k, g in self.getters.items() if isinstance(g, Item)
                        and self.files.spec(split_name(g.feature)[1]).layout != "fixed"), None)
            if key is None:
                key = next((k for k, g in self.getters.items() if isinstance(g, Window)), None)
            if key is None:
                raise SchemaError("no variable-length Item or Window in the batch to take lengths from; name a key")
        g = self.getters[key]
        if not g.features:
            raise SchemaError(f"batch[{key!r}] reads no feature: it has no lengths")
        lengths = self.files.lengths(split_name(g.features[0])[1])[self.example_items()]
        if isinstance(g, Window):
            size = g.length if isinstance(g.length, int) else int(self.params[g.length])
            lengths = np.minimum(lengths, size)
        return lengths

    # -- epochs and parameters ---------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch used by batches whose indices do not carry their own (see :meth:`set_epoch`)."""
        return int(self.params[_EPOCH])

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of random crops, in every worker (shared memory).

        The samplers of :func:`~h5store.serving.serve` send the epoch with each batch's
        indices, which takes precedence; this is for samplers of your own.
        """
        self.params._write(_EPOCH, int(epoch))

    @property
    def transform(self) -> Any:
        """The batch transform (None: none). Assign it through the loader of
        :func:`~h5store.serving.serve` (``loader.transform = fn``) to reach running workers:
        the new transform travels with the indices of the next batches its sampler hands out
        (see :meth:`~h5store.serving.samplers.EpochIndices`); nothing is read from a file.
        """
        return self._transform

    @transform.setter
    def transform(self, fn: Any) -> None:
        _check_transform(fn)
        self._transform = fn
        self._transform_version += 1

    @property
    def transform_version(self) -> int:
        """Counts the assignments of :attr:`transform` (what a sampler compares to carry a new one)."""
        return self._transform_version

    # -- reading -----------------------------------------------------------------------
    def fetch(self, indices: Iterable[int] | np.ndarray, epoch: int | None = None, number: int | None = None) -> Batch:
        """The examples at ``indices``, collated: a :class:`~h5store.serving.collate.Batch` of numpy arrays.

        Padded values come with ``{key}_lengths`` (and ``{key}_mask`` when ``mask``);
        one planned read per feature and file for the whole batch. ``number`` is the batch's
        number in its epoch (it seeds the :attr:`transform`'s randomness; by default the
        indices' own ``batch``, as the samplers of :func:`~h5store.serving.serve` give).

        Examples
        --------
        >>> b = ds.fetch(np.arange(16))  # doctest: +SKIP
        >>> {k: v.shape for k, v in b.items()}  # doctest: +SKIP
        {'x': (16, 64, 80), 'y': (16,)}
        """
        return self._fetch(indices, epoch, number)[0]

    def _fetch(self, indices: Iterable[int] | np.ndarray, epoch: int | None,
               number: int | None = None) -> tuple[Batch, set[str]]:
        reset = getattr(self.files.alloc, "reset", None)
        if reset is not None:
            reset()
        if epoch is None:
            epoch = getattr(indices, "epoch", None)
        if epoch is None:
            epoch = self.epoch
        idx = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices), dtype=_I64).reshape(-1)
        items, subs = self.locate(idx)
        if idx.size and idx.min() < 0:
            idx = np.where(idx < 0, idx + len(self), idx)
        self.files.changed(items)  # a file changed on disk: its items are checked again
        for attempt in range(2):
            if self._skipped is not None:
                batch, ragged = self._fetch_skipping(idx, items, subs, int(epoch))
            else:
                batch, ragged = self._read(idx, items, subs, int(epoch))
            # Changed while the batch was read: read it once more, each item checked as it is read.
            if attempt or not self.files.changed(items):
                break
            if reset is not None:
                reset()
        carried = getattr(indices, "transform", None)  # (version, transform) sent with the indices
        if carried is not None and carried[0] > self._transform_version:
            self._transform_version, self._transform = carried
        transform = self._transform
        if transform is not None:
            if number is None:
                number = getattr(indices, "batch", -1)
            if number is None or number < 0:  # a sampler of your own: the batch is known by its indices
                number = _indices_key(idx)
            # Values of the built-in getters are buffers made for this batch: transforms may
            # change them in place (a getter of the user's may return arrays it keeps).
            batch.owned = frozenset(k for k in batch if _builtin(self.getters.get(k.removesuffix("_lengths")
                                                                                   .removesuffix("_mask"))))
            out = apply_transform(transform, batch, batch_rng(self.seed, int(epoch), int(number)))
            batch = out if isinstance(out, Batch) else Batch(out)
        return batch, ragged

    def _fetch_skipping(self, idx: np.ndarray, items: np.ndarray, subs: np.ndarray,
                        epoch: int) -> tuple[Batch, set[str]]:
        """verify="skip": leave out items found damaged (here or in another process), then read."""
        assert self._skipped is not None
        flags = self._skipped.array
        while True:
            keep = flags[items] == 0
            if not keep.all():
                idx, items, subs = idx[keep], items[keep], subs[keep]
            self.files.failed = []
            batch = self._read(idx, items, subs, epoch)
            failed = self.files.failed
            if not failed:
                return batch
            reset = getattr(self.files.alloc, "reset", None)
            if reset is not None:
                reset()  # the batch is read again, without them
            self._leave_out(failed)
            self.files.failed = []

    @property
    def skipped(self) -> list[str]:
        """Ids left out as damaged so far, by this process or any worker (``verify="skip"``)."""
        if self._skipped is None:
            return []
        return [self.files.id(int(p)) for p in self._skipped.positions()]

    def _read(self, idx: np.ndarray, items: np.ndarray, subs: np.ndarray, epoch: int) -> tuple[Batch, set[str]]:
        request = Request(items, subs, idx, epoch, self.seed, self.params)
        out = Batch()
        ragged: set[str] = set()
        for key, g in self.getters.items():
            value = g.fetch(self.files, request)
            if isinstance(value, Padded):
                out[key] = value.values
                if value.always:
                    ragged.add(key)
                if value.always or self.mask:
                    out[f"{key}_lengths"] = value.lengths
                if self.mask:
                    out[f"{key}_mask"] = lengths_mask(value.lengths, value.values.shape[1])
            else:
                out[key] = value
        return out, ragged

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        """A whole batch, collated (PyTorch's fetcher calls this with the sampler's indices)."""
        return self.fetch(indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One example: values unpadded, no batch axis."""
        batch, ragged = self._fetch([int(index)], None)
        out: dict[str, Any] = {}
        for key in self.getters:
            v = batch[key]
            if key in ragged:
                out[key] = v[0, : int(batch[f"{key}_lengths"][0])]
            else:
                out[key] = v[0]
        return out

    def collate(self, data: Any) -> Any:
        """``collate_fn`` for a DataLoader: the batch as torch tensors (text stays a list of str).

        Takes what :meth:`__getitems__` returns (already collated), a list of examples
        from :meth:`__getitem__` (padded here), or one example (``batch_size=None``).
        """
        if isinstance(data, Batch):
            pack = getattr(self.files.alloc, "pack", None)  # in serve()'s workers: one shared block
            return pack(data) if pack is not None else to_torch(data)
        if isinstance(data, Mapping):
            return to_torch(data)
        ragged = [k for k, g in self.getters.items() if isinstance(g, Item)
                  and self.files.spec(split_name(g.feature)[1]).layout == "ragged"]
        return to_torch(pad_collate_numpy(list(data), mask=self.mask, ragged=ragged))

    def signature(self) -> dict[str, tuple[np.dtype, tuple[int | None, ...]]]:
        """key -> (dtype, shape of one example) for each getter (``None`` for variable axes)."""
        return {key: g.signature(self.files) for key, g in self.getters.items()}

    def close(self) -> None:
        """Close this process's file handles (they reopen on the next read)."""
        self.files.close()

    def __repr__(self) -> str:
        return f"<FileDataset {self.files.where()}: {len(self)} examples, batch {self.getters}>"
