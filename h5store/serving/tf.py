"""tf.data over h5store files: whole batches per call, read by parallel threads (imports tensorflow).

What users write today (``tf.py_func`` / ``Dataset.from_generator`` reading one example
per Python call, reopening the file) pays the Python call, the HDF5 call and the tensor
conversion per example, and cannot read in parallel. Here:

* the index order comes from the same seeded samplers as the PyTorch path
  (:func:`~h5store.serving.numpy_iter.make_sampler`), so tf.data, the numpy iterator and
  ``serve()`` give the same batches for the same seed and epoch;
* each element of the dataset is ONE ``tf.numpy_function`` call that reads a whole batch
  through :meth:`FileDataset.fetch <h5store.serving.FileDataset.fetch>`: one planned read
  per feature, ``os.preadv`` straight into a 64-byte aligned batch buffer that tensorflow
  adopts without a copy;
* ``num_parallel_calls`` threads run those calls concurrently: the copy releases the GIL
  and takes no HDF5 lock (gzip chunks are inflated by :mod:`zlib` outside HDF5 too:
  :class:`~h5store.serving.numpy_iter.GzipChunkReader`);
* the ``output_signature`` (dtypes, inner shapes) comes from the getters'
  ``signature()``, checked against one example read when the dataset is made.

:func:`interleave` reads several files concurrently, each opened once per pass.
"""

from __future__ import annotations

import importlib
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from h5store.errors import SchemaError
from h5store.serving.dataset import FileDataset
from h5store.serving.files import MultiFile, reader_copy
from h5store.serving.getters import Getter, mix64
from h5store.serving.numpy_iter import close_dataset, make_sampler, prepare_for_threads
from h5store.serving.shared import SharedParams

__all__ = ["AUTOTUNE", "Layout", "interleave", "interleave_order", "output_signature", "to_tf_dataset"]

AUTOTUNE = tf.data.AUTOTUNE
_I64 = np.int64
_LENGTHS, _MASK = "_lengths", "_mask"


# --------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Key:
    name: str
    dtype: tf.DType
    shape: tuple[int | None, ...]  # one example's shape
    text: bool = False
    ragged: bool = False  # a padded value served as a RaggedTensor
    hidden: bool = False  # read, but not in the output (the lengths of a ragged value)


class Layout:
    """The keys of every batch of a dataset, their dtypes and per-example shapes.

    Built from the getters' ``signature()`` (dtype, shape with ``None`` for variable
    axes) and the keys one example actually produces (which values come with
    ``{key}_lengths`` or ``{key}_mask``). Every batch is checked against it.
    """

    def __init__(self, dataset: FileDataset, batch_size: int | None, ragged: bool = False,
                 extra: Sequence[str] = ()) -> None:
        if not len(dataset):
            raise ValueError(f"{dataset.files.where()}: the dataset has no example; nothing to serve")
        sig = dataset.signature()
        probe, padded = dataset._fetch(np.zeros(1, _I64), 0)
        self.batch_size = batch_size
        keys: list[_Key] = []
        transformed = dataset.transform is not None
        for name, value in probe.items():
            if transformed and isinstance(value, np.ndarray) and not _from_getter(name, value, sig):
                # A key the transform made or changed: typed from what the probe batch holds.
                keys.append(_Key(name, tf.as_dtype(value.dtype), (None,) * (value.ndim - 1),
                                 ragged=ragged and name in padded))
                continue
            if name in sig:
                keys.append(self._value_key(dataset, name, value, sig[name], ragged and name in padded))
                continue
            base, suffix = _split_suffix(name)
            if base is None or base not in sig:
                raise SchemaError(f"batch key {name!r}: not made by a getter of the batch")
            if suffix == _LENGTHS:
                keys.append(_Key(name, tf.int64, (), hidden=ragged and base in padded))
            else:
                keys.append(_Key(name, tf.bool, (sig[base][1][0] if sig[base][1] else None,),
                                 hidden=ragged and base in padded))
        for name in extra:
            if name in probe:
                raise SchemaError(f"key {name!r} is already a key of the batch; choose another file_key")
            keys.append(_Key(name, tf.int64, ()))
        self.keys = tuple(keys)
        self.extra = tuple(extra)

    @staticmethod
    def _value_key(dataset: FileDataset, name: str, value: Any, sig: tuple[np.dtype, tuple[int | None, ...]],
                   ragged: bool) -> _Key:
        dtype, shape = np.dtype(sig[0]), tuple(sig[1])
        who = f"batch[{name!r}] ({dataset.getters[name]!r})"
        if isinstance(value, list):
            if dtype.kind != "O" or not all(isinstance(v, (str, bytes)) for v in value):
                kinds = sorted({type(v).__name__ for v in value})
                raise SchemaError(f"{who}: gives a list of {kinds}; tf.data carries arrays and str (tf.string)")
            return _Key(name, tf.string, (), text=True)
        if not isinstance(value, np.ndarray):
            raise SchemaError(f"{who}: gives {type(value).__name__}, not an array")
        if value.dtype != dtype or value.ndim != len(shape) + 1:
            raise SchemaError(f"{who}: signature() says {dtype} {shape}, one example reads as {value.dtype} "
                              f"{value.shape[1:]}; fix the getter's signature()")
        for want, got in zip(shape, value.shape[1:]):
            if want is not None and want != got:
                raise SchemaError(f"{who}: signature() says {dtype} {shape}, one example reads as "
                                  f"{value.dtype} {value.shape[1:]}; fix the getter's signature()")
        return _Key(name, tf.as_dtype(dtype), shape, ragged=ragged)

    @property
    def tout(self) -> list[tf.DType]:
        return [k.dtype for k in self.keys]

    def flat_signature(self) -> tuple[tf.TensorSpec, ...]:
        """One TensorSpec per key, padded values as dense tensors (what a read returns)."""
        b = self.batch_size
        return tuple(tf.TensorSpec((b, *k.shape), k.dtype, name=k.name) for k in self.keys)

    def signature(self) -> dict[str, tf.TypeSpec]:
        """key -> TensorSpec or RaggedTensorSpec of the served dicts."""
        out: dict[str, tf.TypeSpec] = {}
        b = self.batch_size
        for k in self.keys:
            if k.hidden:
                continue
            if k.ragged:
                out[k.name] = tf.RaggedTensorSpec((b, None, *k.shape[1:]), k.dtype, ragged_rank=1,
                                                  row_splits_dtype=tf.int64)
            else:
                out[k.name] = tf.TensorSpec((b, *k.shape), k.dtype)
        return out

    def arrays(self, batch: Mapping[str, Any], extra: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """A fetched batch as the list of arrays ``tf.numpy_function`` returns (checked)."""
        out = []
        for k in self.keys:
            if extra is not None and k.name in extra:
                out.append(extra[k.name])
                continue
            try:
                v = batch[k.name]
            except KeyError:
                raise SchemaError(f"a batch lacks {k.name!r}, which the first example had: the getters must "
                                  "give the same keys for every batch") from None
            if k.text:
                v = np.array([s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in v], dtype=object)
            elif not isinstance(v, np.ndarray) or v.dtype != k.dtype.as_numpy_dtype or v.ndim != len(k.shape) + 1 \
                    or any(w is not None and w != g for w, g in zip(k.shape, v.shape[1:])):
                got = f"{v.dtype} {v.shape[1:]}" if isinstance(v, np.ndarray) else type(v).__name__
                raise SchemaError(f"batch[{k.name!r}]: expected {k.dtype.name} {k.shape} per example "
                                  f"(the output_signature), got {got}")
            out.append(v)
        return out

    def to_dict(self, tensors: Sequence[tf.Tensor]) -> dict[str, Any]:
        """Graph side: shapes set, ragged values built, lengths of ragged values dropped."""
        by_name = {}
        for k, t in zip(self.keys, tensors):
            t.set_shape((self.batch_size, *k.shape))
            by_name[k.name] = t
        out: dict[str, Any] = {}
        for k in self.keys:
            if k.hidden:
                continue
            t = by_name[k.name]
            if k.ragged:
                t = tf.RaggedTensor.from_tensor(t, lengths=by_name[k.name + _LENGTHS])
            out[k.name] = t
        return out


def _from_getter(name: str, value: np.ndarray, sig: Mapping[str, tuple[np.dtype, tuple[int | None, ...]]]) -> bool:
    """Whether ``value`` is what the getters' signatures say ``name`` holds (a suffix key of one, or its value)."""
    if name not in sig:
        base, _ = _split_suffix(name)
        return base is not None and base in sig
    dtype, shape = np.dtype(sig[name][0]), tuple(sig[name][1])
    return value.dtype == dtype and value.ndim == len(shape) + 1 and all(
        w is None or w == g for w, g in zip(shape, value.shape[1:]))


def _split_suffix(name: str) -> tuple[str | None, str]:
    for suffix in (_LENGTHS, _MASK):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return None, ""


def output_signature(dataset: FileDataset, batch_size: int | None = None, ragged: bool = False) -> dict[str, Any]:
    """The ``output_signature`` of batches of ``dataset``: key -> TensorSpec (or RaggedTensorSpec).

    ``batch_size`` is the static batch dimension (None when the last batch may be smaller).

    Examples
    --------
    >>> output_signature(FileDataset(f, dict(x=h5s.Item("mel"), y=h5s.Label("label"))))  # doctest: +SKIP
    {'x': TensorSpec(shape=(None, None, 80), dtype=tf.float32, name=None),
     'x_lengths': TensorSpec(shape=(None,), dtype=tf.int64, name=None),
     'y': TensorSpec(shape=(None,), dtype=tf.int64, name=None)}
    """
    return Layout(dataset, batch_size, ragged).signature()


# --------------------------------------------------------------------------- epochs
class _Epochs:
    """Each iteration of a dataset serves the next epoch (as iterating the torch samplers does)."""

    def __init__(self, first: int) -> None:
        self._next = int(first)
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            e = self._next
            self._next += 1
            return e


def _index_matrix(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    width = max((len(b) for b in batches), default=0)
    mat = np.zeros((len(batches), width), _I64)
    sizes = np.zeros(len(batches), _I64)
    for j, b in enumerate(batches):
        mat[j, : len(b)] = b
        sizes[j] = len(b)
    return mat, sizes


def _static_batch(batch_size: int, drop_last: bool) -> int | None:
    return int(batch_size) if drop_last else None


def _finish(ds: tf.data.Dataset, prefetch: int | None) -> tf.data.Dataset:
    if prefetch is None or prefetch == 0:
        return ds
    return ds.prefetch(prefetch)


# --------------------------------------------------------------------------- one file (or a concat)
def to_tf_dataset(file: Any, batch: Mapping[str, Getter], batch_size: int = 1, *, shuffle: bool = False,
                  drop_last: bool = False, seed: int = 0, verify: bool | str = True, epoch: int = 0,
                  num_parallel_calls: int | None = AUTOTUNE, ragged: bool = False, prefetch: int | None = AUTOTUNE,
                  deterministic: bool | None = None, params: Mapping[str, Any] | SharedParams | None = None,
                  mask: bool = False, bucket: bool | int | None = None,
                  items: Sequence[int] | np.ndarray | None = None, in_memory: bool | Sequence[str] = False,
                  rank: int = 0, world_size: int = 1, transform: Any = None, max_frames: int | None = None,
                  padded: bool = False, by_shard: bool = False) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of batches (dicts of tensors) of an h5store file or a concat of files.

    The implementation of ``f.to_tf_dataset(...)`` (:func:`h5store.serving.api.to_tf_dataset`,
    which checks the arguments first).

    Parameters
    ----------
    file : TypedFile or MultiFile
        What to serve (``h5s.concat([...])`` of several files too).
    batch : dict
        Key -> getter (``h5s.Item``, ``h5s.Window``, ``h5s.Frames``, ``h5s.Label``,
        ``h5s.Position``, ``h5s.Id`` (tf.string) or your own :class:`~h5store.serving.Getter`
        with a ``signature()``).
    batch_size : int
        Examples per batch (default 1, as PyTorch's ``DataLoader``).
    shuffle : bool
        A new order each epoch, from ``(seed, epoch)``: the order of
        :func:`~h5store.serving.serve` with the same seed (default False, as ``DataLoader``).
    seed : int
        Seed of the order and of random crops.
    num_parallel_calls : int
        Batches read at once, each by one tf.data thread (``tf.data.AUTOTUNE``: as many as
        tf.data sees fit, up to the number of cores).
    ragged : bool
        Whole variable-length items as ``tf.RaggedTensor`` ``(B, None, ...)`` instead of
        zero-padded tensors with ``{key}_lengths``.
    drop_last : bool
        Drop the last incomplete batch; the batch dimension is then static (``batch_size``).
    prefetch : int or None
        Batches tf.data keeps ready (``tf.data.AUTOTUNE``; None or 0: no prefetch).
    deterministic : bool or None
        False lets a fast batch overtake a slow one (order then varies); None: tf.data's
        default (deterministic).
    epoch : int
        The epoch of the first iteration; every further iteration of the dataset serves
        the next epoch, reshuffled (as iterating a PyTorch loader does).
    params, mask, bucket, items, in_memory, rank, world_size, max_frames, padded, by_shard
        As for :func:`~h5store.serving.serve` (``rank`` / ``world_size``: this worker's
        share of every epoch).
    transform : callable, optional
        Applied to each batch in the tf.data thread that reads it (see
        :mod:`h5store.serving.transforms`), seeded from ``(seed, epoch, batch number)`` as
        in :func:`~h5store.serving.serve`. Keys it adds or retypes are typed from a first
        batch read when the dataset is made (their shape then varies: give it with
        ``ensure_shape`` where a model needs it).
    verify : {True, False, "always", "skip"}
        Check each served item against its stored CRC-32, the first time it is served (default;
        ``"always"``: whole items at every read). A damaged item raises
        :class:`~h5store.errors.CorruptRecordError` naming file, feature and id, which
        tf.data re-raises as ``tf.errors.InvalidArgumentError`` whose message starts with
        ``CorruptRecordError:``. ``"skip"``: damaged items are left out (their batch is
        shorter, so the batch dimension is never static), warned with
        :class:`~h5store.serving.CorruptRecordWarning` and listed by
        ``ds.h5store_skipped()``; False: unchecked. See :class:`~h5store.serving.FileDataset`.

    Returns
    -------
    tf.data.Dataset
        Elements are dicts: each getter's key, plus ``{key}_lengths`` (int64) for padded
        variable-length values (and ``{key}_mask`` with ``mask=True``); text is tf.string.
        Dtypes and inner shapes are static; the cardinality is the number of batches.

    Notes
    -----
    BEWARE: the reads run Python (``tf.numpy_function``) in this process: the dataset
    cannot be serialised into a SavedModel or run by tf.data service workers, and
    ``Dataset.save`` / ``snapshot`` store the values, not the recipe.

    Examples
    --------
    >>> import h5store as h5s
    >>> ds = f.to_tf_dataset(dict(x=h5s.Item("mel"), y=h5s.Label("label")), batch_size=32)  # doctest: +SKIP
    >>> ds.element_spec["x"]  # doctest: +SKIP
    TensorSpec(shape=(None, None, 80), dtype=tf.float32, name=None)
    >>> model.fit(ds, epochs=10)  # each epoch reshuffled  # doctest: +SKIP
    """
    dataset = FileDataset(file, batch, params=params, seed=seed, mask=mask, in_memory=in_memory, items=items,
                          verify=verify, transform=transform)
    sampler = make_sampler(dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, bucket=bucket,
                           rank=rank, world_size=world_size, max_frames=max_frames, padded=padded,
                           by_shard=by_shard)
    # verify="skip" shortens a batch by its damaged items: the batch size cannot be static.
    layout = Layout(dataset, _static_batch(batch_size, drop_last and verify != "skip"), ragged)
    prepare_for_threads(dataset)
    epochs = _Epochs(epoch)
    n_batches = len(sampler)

    def plan(_: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        e = epochs.take()
        mat, sizes = _index_matrix(sampler.batches(e))
        return mat, sizes, np.full(len(sizes), e, _I64), np.arange(len(sizes), dtype=_I64)

    def read(row: np.ndarray, size: np.ndarray, e: np.ndarray, k: np.ndarray) -> list[np.ndarray]:
        return layout.arrays(dataset.fetch(row[: int(size)], epoch=int(e), number=int(k)))

    def batches_of_epoch(dummy: tf.Tensor) -> tf.data.Dataset:
        mat, sizes, es, ks = tf.numpy_function(plan, [dummy], [tf.int64] * 4, name="h5store_plan")
        mat.set_shape((None, None))
        for t in (sizes, es, ks):
            t.set_shape((None,))
        return tf.data.Dataset.from_tensor_slices((mat, sizes, es, ks))

    def fetch(row: tf.Tensor, size: tf.Tensor, e: tf.Tensor, k: tf.Tensor) -> dict[str, Any]:
        arrays = tf.numpy_function(read, [row, size, e, k], layout.tout, name="h5store_fetch")
        return layout.to_dict(arrays)

    ds = tf.data.Dataset.range(1).flat_map(batches_of_epoch)
    ds = ds.apply(tf.data.experimental.assert_cardinality(n_batches))
    ds = ds.map(fetch, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    out = _finish(ds, prefetch)
    # verify="skip": the ids left out so far (also warned); tf.data transformations drop it.
    out.h5store_skipped = lambda: dataset.skipped
    return out


# --------------------------------------------------------------------------- many files
def _open_recipe(path: str) -> Any:
    """A not-yet-opened read-only ``TypedFile`` of ``path`` (its schema comes from the file)."""
    # The façade sits above serving in the layers (STYLE.md); it is always imported by the
    # time this runs (importing any h5store module runs h5store/__init__), so it is looked
    # up here rather than imported by this module.
    typed_file = importlib.import_module("h5store.typed_file")
    clone = typed_file.TypedFile.__new__(typed_file.TypedFile)
    clone.__setstate__({"path": path, "mode": "r", "options": {}, "attrs": {}})
    return clone


def _recipes(files: Any) -> list[Any]:
    """Not-yet-opened read-only copies of the files: each pass opens its own, once."""
    if isinstance(files, MultiFile):
        files = list(files.files)
    elif isinstance(files, (str, os.PathLike)) or callable(getattr(files, "group", None)):
        files = [files]
    else:
        files = list(files)
    out = []
    for f in files:
        if isinstance(f, MultiFile):
            out.extend(reader_copy(g) for g in f.files)
        elif isinstance(f, (str, os.PathLike)):
            path = os.fspath(f)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path}: no such file")
            out.append(_open_recipe(path))
        elif callable(getattr(f, "group", None)):
            out.append(reader_copy(f))
        else:
            raise TypeError(f"interleave takes paths or h5store files, got {type(f).__name__}")
    if not out:
        raise ValueError("interleave needs at least one file")
    return out


def _file_seed(seed: int, k: int) -> int:
    return int(mix64(seed, k)[0] >> np.uint64(1))


class _Pass:
    """One pass over one file: its dataset (the file open) and its batches of the epoch."""

    __slots__ = ("batches", "dataset", "epoch", "k")

    def __init__(self, dataset: FileDataset, batches: list[np.ndarray], epoch: int, k: int) -> None:
        self.dataset = dataset
        self.batches = batches
        self.epoch = epoch
        self.k = k


def _close_passes(passes: dict[int, _Pass], lock: threading.Lock) -> None:
    with lock:
        left = list(passes.values())
        passes.clear()
    for p in left:
        close_dataset(p.dataset)


class _Passes:
    """The per-file passes of an :func:`interleave` dataset.

    tf.data starts a file's pass when the file enters the interleave cycle: :meth:`open`
    opens the file (once), computes its batches of the epoch and returns a token; each
    :meth:`read` reads one batch; the read of the last batch closes the file. A new
    iteration of the dataset closes what an abandoned previous one left open, and so does
    the dataset's garbage collection.
    """

    def __init__(self, recipes: list[Any], batch: Mapping[str, Getter], layout: Layout, batch_size: int, *,
                 shuffle: bool, seed: int, drop_last: bool, bucket: bool | int | None, params: SharedParams,
                 mask: bool, file_key: str | None, first_epoch: int, verify: bool | str = True,
                 transform: Any = None) -> None:
        self.recipes = recipes
        self.transform = transform
        self.batch = dict(batch)
        self.layout = layout
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.bucket = bucket
        self.params = params
        self.mask = mask
        self.file_key = file_key
        self.verify = verify
        self._epochs = _Epochs(first_epoch)
        self._lock = threading.Lock()
        self._open: dict[int, _Pass] = {}
        self._tokens = 0
        self._finalizer = weakref.finalize(self, _close_passes, self._open, self._lock)

    def plan(self, _: Any) -> tuple[np.ndarray, np.ndarray]:
        """A new iteration: the epoch's order of the files (closing an abandoned iteration's passes)."""
        _close_passes(self._open, self._lock)
        e = self._epochs.take()
        n = len(self.recipes)
        order = np.random.default_rng([self.seed & (2**63 - 1), e, 1]).permutation(n) if self.shuffle else np.arange(n)
        return order.astype(_I64), np.full(n, e, _I64)

    def open(self, k: Any, epoch: Any) -> tuple[np.ndarray, np.ndarray]:
        """Start the pass over file ``k``: (token, number of batches)."""
        k, epoch = int(k), int(epoch)
        dataset = FileDataset(MultiFile([self.recipes[k]]), self.batch, params=self.params, seed=self.seed,
                              mask=self.mask, verify=self.verify, transform=self.transform)
        try:
            prepare_for_threads(dataset)
            sampler = make_sampler(dataset, self.batch_size, shuffle=self.shuffle, seed=_file_seed(self.seed, k),
                                   drop_last=self.drop_last, bucket=self.bucket)
            batches = sampler.batches(epoch)
        except BaseException:
            close_dataset(dataset)
            raise
        if not batches:
            close_dataset(dataset)
            return np.array(-1, _I64), np.array(0, _I64)
        with self._lock:
            token = self._tokens
            self._tokens += 1
            self._open[token] = _Pass(dataset, batches, epoch, k)
        return np.array(token, _I64), np.array(len(batches), _I64)

    def read(self, token: Any, j: Any) -> list[np.ndarray]:
        """Batch ``j`` of a pass; the last one closes the file."""
        token, j = int(token), int(j)
        with self._lock:
            p = self._open.get(token)
        if p is None:
            raise RuntimeError("interleave: this pass was closed by a newer iteration of the same dataset; "
                               "iterate an interleave dataset with one iterator at a time")
        last = j >= len(p.batches) - 1
        try:
            idx = p.batches[j]
            extra = {self.file_key: np.full(len(idx), p.k, _I64)} if self.file_key else None
            # A batch's number (what seeds its transform): its file's, then its own within the file.
            return self.layout.arrays(p.dataset.fetch(idx, epoch=p.epoch, number=(p.k << 32) + j), extra)
        except BaseException:
            last = True
            raise
        finally:
            if last:
                with self._lock:
                    done = self._open.pop(token, None)
                if done is not None:
                    close_dataset(done.dataset)


def interleave(files: Any, batch: Mapping[str, Getter], batch_size: int = 1, *, shuffle: bool = False,
               drop_last: bool = False, seed: int = 0, verify: bool | str = True, cycle_length: int = 4,
               block_length: int = 1, num_parallel_calls: int | None = AUTOTUNE, deterministic: bool | None = True,
               ragged: bool = False, prefetch: int | None = AUTOTUNE, epoch: int = 0, file_key: str | None = None,
               params: Mapping[str, Any] | SharedParams | None = None, mask: bool = False,
               bucket: bool | int | None = None, mix: str = "examples", transform: Any = None) -> tf.data.Dataset:
    """Batches from many HDF5 files read concurrently: ``tf.data.Dataset.interleave`` over the files.

    ``mix="examples"`` (default): every batch mixes the files, as
    ``Dataset.interleave(..., block_length=1).batch(batch_size)`` over the examples would:
    ``cycle_length`` files are in the cycle, each gives ``block_length`` examples in turn,
    and a file that runs out is replaced by the next one. The order is planned in numpy
    once per epoch, then ``num_parallel_calls`` threads read whole batches (one planned
    read per feature and file), each file opened once per pass. ``mix="batches"``: batches
    hold examples of one file each (``block_length`` consecutive batches of a file, then the
    next file of the cycle); each pass over a file opens it, reads its batches in order and
    closes it. Use it when a batch must come from one file; otherwise a file that groups
    related items (one class, one speaker) makes batches that are all alike.

    Parameters
    ----------
    files : list of paths, TypedFiles, or a MultiFile
        The files (all with the served features). Paths open without their class
        (``h5store.open``).
    batch : dict
        Key -> getter, as for :func:`to_tf_dataset`. ``h5s.Position()`` is the item's
        position across the files (as over a concat) with ``mix="examples"``, in its own
        file with ``mix="batches"``; ``h5s.Id()`` is ``"path::id"``, as over a concat.
    batch_size : int
        Examples per batch (default 1, as PyTorch's ``DataLoader``).
    cycle_length, block_length : int
        Files in the cycle; examples (``mix="examples"``) or batches (``mix="batches"``)
        taken from one before moving to the next.
    mix : {"examples", "batches"}
        Mix the files within every batch (default), or serve batches of one file each.
    shuffle : bool
        Shuffle the order of the files and the items within each file, from
        ``(seed, epoch)`` (each file with its own stream; default False, as ``DataLoader``).
    verify : {True, False, "always", "skip"}
        Check each served item against its stored CRC-32, as for :func:`to_tf_dataset`.
    seed : int
    num_parallel_calls : int
        Threads reading files at once (``tf.data.AUTOTUNE``; None: sequential).
    deterministic : bool
        False lets batches come as soon as they are read (faster when files differ in speed).
    drop_last : bool
        Drop the epoch's last incomplete batch (each file's with ``mix="batches"``); the
        batch dimension is then static.
    ragged, prefetch, epoch, params, mask, bucket
        As for :func:`to_tf_dataset` (``bucket`` only with ``mix="batches"``: buckets are
        made within a file).
    file_key : str, optional
        Add this key: the index in ``files`` of each example's file (int64).
    transform : callable, optional
        Applied to each batch in the thread that reads it, as for :func:`to_tf_dataset`.

    Returns
    -------
    tf.data.Dataset
        Dicts of tensors; the signature is read from the first file when this is called
        (opened and closed again).

    Examples
    --------
    >>> import h5store as h5s
    >>> ds = h5s.interleave(sorted(glob("shards/*.h5")), dict(x=h5s.Window("mel", 64)),  # doctest: +SKIP
    ...                     batch_size=32, cycle_length=4, num_parallel_calls=4, file_key="file")
    >>> for b in ds.take(2):  # doctest: +SKIP
    ...     b["x"].shape, b["file"][0]
    """
    if mix not in ("examples", "batches"):
        raise ValueError(f"interleave: mix must be 'examples' (files mixed in every batch) or 'batches' "
                         f"(one file per batch), got {mix!r}")
    for name, value in (("cycle_length", cycle_length), ("block_length", block_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"interleave: {name} must be an int > 0, got {value!r}")
    recipes = _recipes(files)
    shared = params if isinstance(params, SharedParams) else SharedParams(dict(params or {}))
    if mix == "examples":
        if bucket:
            raise ValueError("interleave: bucket needs mix='batches' (buckets are made within each file)")
        return _mixed(recipes, batch, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, verify=verify,
                      cycle_length=int(cycle_length), block_length=int(block_length),
                      num_parallel_calls=num_parallel_calls, deterministic=deterministic, ragged=ragged,
                      prefetch=prefetch, epoch=epoch, file_key=file_key, params=shared, mask=mask,
                      transform=transform)
    static = _static_batch(batch_size, drop_last)
    layout = None
    for recipe in recipes:  # the signature, from the first file with an example (opened, then closed)
        first = FileDataset(MultiFile([recipe]), batch, params=shared, seed=seed, mask=mask, verify=verify,
                            transform=transform)
        try:
            make_sampler(first, batch_size)  # validates batch_size
            if len(first):
                layout = Layout(first, static, ragged, extra=(file_key,) if file_key else ())
        finally:
            close_dataset(first)
        if layout is not None:
            break
    if layout is None:
        raise ValueError(f"interleave: none of the {len(recipes)} files has an example to serve")
    passes = _Passes(recipes, batch, layout, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                     bucket=bucket, params=shared, mask=mask, file_key=file_key, first_epoch=epoch, verify=verify,
                     transform=transform)

    def files_of_epoch(dummy: tf.Tensor) -> tf.data.Dataset:
        order, es = tf.numpy_function(passes.plan, [dummy], [tf.int64, tf.int64], name="h5store_files")
        order.set_shape((None,))
        es.set_shape((None,))
        return tf.data.Dataset.from_tensor_slices((order, es))

    def per_file(k: tf.Tensor, e: tf.Tensor) -> tf.data.Dataset:
        token, n = tf.numpy_function(passes.open, [k, e], [tf.int64, tf.int64], name="h5store_open")
        token.set_shape(())
        n.set_shape(())
        # (Dataset.zip of a repeated token with range(n) crashes tf 2.21's iterator: flat_map instead.)
        return tf.data.Dataset.from_tensors((token, n)).flat_map(
            lambda t, m: tf.data.Dataset.range(m).map(lambda j: fetch(t, j)))

    def fetch(token: tf.Tensor, j: tf.Tensor) -> dict[str, Any]:
        arrays = tf.numpy_function(passes.read, [token, j], layout.tout, name="h5store_fetch")
        return layout.to_dict(arrays)

    ds = tf.data.Dataset.range(1).flat_map(files_of_epoch)
    ds = ds.interleave(per_file, cycle_length=cycle_length, block_length=block_length,
                       num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    return _finish(ds, prefetch)


# --------------------------------------------------------------------------- many files, mixed
def interleave_order(file_of: np.ndarray, n_files: int, cycle_length: int, block_length: int, *,
                     shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The example order of one epoch of a mixed :func:`interleave`: tf.data's interleave, in numpy.

    ``file_of[i]`` is the file of example ``i``. Files enter a cycle of ``cycle_length``
    slots in file order (shuffled per epoch when ``shuffle``); each slot in turn gives
    ``block_length`` examples of its file (its examples shuffled when ``shuffle``); a file
    that runs out leaves its slot to the next file.

    Examples
    --------
    >>> interleave_order(np.array([0, 0, 0, 1, 1, 2]), 3, 2, 1, shuffle=False, seed=0, epoch=0).tolist()
    [0, 3, 1, 4, 2, 5]
    """
    rng = np.random.default_rng([seed & (2**63 - 1), epoch, 2])
    files = rng.permutation(n_files) if shuffle else np.arange(n_files)
    by_file = np.argsort(file_of, kind="stable")
    bounds = np.searchsorted(file_of[by_file], np.arange(n_files + 1))
    queues = []
    for k in files.tolist():
        mine = by_file[bounds[k]:bounds[k + 1]]
        if len(mine):
            queues.append(rng.permutation(mine) if shuffle else mine)
    out: list[np.ndarray] = []
    waiting = iter(queues)
    # tf.data's loop: a slot found at its end (or ending within a block) takes the next file
    # and the turn passes to the next slot; a slot that ends exactly on a block finds out at
    # its next turn.
    slots: list[list[Any] | None] = [[q, 0] for _, q in zip(range(cycle_length), waiting)]
    live = len(slots)
    i = 0
    while live:
        slot = slots[i]
        if slot is not None:
            q, at = slot
            if at < len(q):
                out.append(q[at:at + block_length])
                slot[1] = at + block_length
            if at >= len(q) or slot[1] > len(q):
                nxt = next(waiting, None)
                slots[i] = None if nxt is None else [nxt, 0]
                live -= nxt is None
        i = (i + 1) % len(slots)
    return np.concatenate(out) if out else np.zeros(0, _I64)


def _mixed(recipes: list[Any], batch: Mapping[str, Getter], batch_size: int, *, shuffle: bool, drop_last: bool,
           seed: int, verify: bool | str, cycle_length: int, block_length: int, num_parallel_calls: int | None,
           deterministic: bool | None, ragged: bool, prefetch: int | None, epoch: int, file_key: str | None,
           params: SharedParams, mask: bool, transform: Any = None) -> tf.data.Dataset:
    """``interleave(mix="examples")``: the files as one concat, in tf.data's interleave order per epoch."""
    dataset = FileDataset(MultiFile(recipes), batch, params=params, seed=seed, mask=mask, verify=verify,
                          transform=transform)
    if not len(dataset):
        raise ValueError(f"interleave: none of the {len(recipes)} files has an example to serve")
    file_of = dataset.files.file_of(dataset.example_items()).astype(_I64)
    layout = Layout(dataset, _static_batch(batch_size, drop_last and verify != "skip"), ragged,
                    extra=(file_key,) if file_key else ())
    prepare_for_threads(dataset)
    epochs = _Epochs(epoch)
    n = len(dataset)
    n_batches = n // batch_size if drop_last else -(-n // batch_size)

    def plan(_: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        e = epochs.take()
        order = interleave_order(file_of, len(recipes), cycle_length, block_length, shuffle=shuffle, seed=seed,
                                 epoch=e)
        batches = [order[i:i + batch_size] for i in range(0, n_batches * batch_size, batch_size)]
        mat, sizes = _index_matrix(batches)
        return mat, sizes, np.full(len(sizes), e, _I64), np.arange(len(sizes), dtype=_I64)

    def read(row: np.ndarray, size: np.ndarray, e: np.ndarray, k: np.ndarray) -> list[np.ndarray]:
        idx = row[: int(size)]
        extra = {file_key: file_of[idx]} if file_key else None
        return layout.arrays(dataset.fetch(idx, epoch=int(e), number=int(k)), extra)

    def batches_of_epoch(dummy: tf.Tensor) -> tf.data.Dataset:
        mat, sizes, es, ks = tf.numpy_function(plan, [dummy], [tf.int64] * 4, name="h5store_plan")
        mat.set_shape((None, None))
        for t in (sizes, es, ks):
            t.set_shape((None,))
        return tf.data.Dataset.from_tensor_slices((mat, sizes, es, ks))

    def fetch(row: tf.Tensor, size: tf.Tensor, e: tf.Tensor, k: tf.Tensor) -> dict[str, Any]:
        arrays = tf.numpy_function(read, [row, size, e, k], layout.tout, name="h5store_fetch")
        return layout.to_dict(arrays)

    ds = tf.data.Dataset.range(1).flat_map(batches_of_epoch)
    ds = ds.apply(tf.data.experimental.assert_cardinality(n_batches))
    ds = ds.map(fetch, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    out = _finish(ds, prefetch)
    out.h5store_skipped = lambda: dataset.skipped
    return out
