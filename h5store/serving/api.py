"""The public entry points: one per framework, one signature shape, one set of defaults.

``f.serve`` (PyTorch), ``f.iter_batches`` (numpy/JAX) and ``f.to_tf_dataset`` (tf.data) are
these functions, bound as methods of :class:`~h5store.TypedFile` and of what
:func:`~h5store.concat` returns. All take ``(batch, batch_size=1, *, shuffle=False,
drop_last=False, seed=0, verify=True, ...)``: the defaults of PyTorch's ``DataLoader``
(``batch_size`` may be given by position, as ``DataLoader(dataset, 32)`` allows), and
``shuffle`` also takes ``"chunks"`` (a quasi-random, chunk-aware order: see
:func:`check_shuffle_option`).
Arguments are checked here, before anything is read or imported, so that a wrong call
fails with one message that says what to write instead.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from h5store.errors import ArgumentError

__all__ = ["check_batch_size", "check_shuffle_option", "interleave", "iter_batches", "serve", "to_tf_dataset"]

# What a user of one front end may carry over to another: the name it has there.
_HINTS: dict[str, dict[str, str]] = {
    "serve": {
        "threads": "serve() reads with worker processes: num_workers={v}",
        "num_parallel_calls": "serve() reads with worker processes: num_workers={v}",
        "prefetch": "serve() prefetches per worker: prefetch_factor={v} (with num_workers > 0)",
    },
    "iter_batches": {
        "num_workers": "iter_batches() reads with threads: threads={v} (num_workers is serve()'s worker processes)",
        "num_parallel_calls": "iter_batches() reads with threads: threads={v}",
        "prefetch_factor": "iter_batches() reads ahead a number of batches: prefetch={v}",
    },
    "to_tf_dataset": {
        "num_workers": "to_tf_dataset() reads with tf.data threads: num_parallel_calls={v}",
        "threads": "to_tf_dataset() reads with tf.data threads: num_parallel_calls={v}",
        "prefetch_factor": "to_tf_dataset() prefetches with tf.data: prefetch={v}",
    },
}
_HINTS["interleave"] = _HINTS["to_tf_dataset"]


def check_batch_size(who: str, batch_size: Any, none: bool = False) -> int | None:
    """``batch_size`` as an int > 0 (or None where ``none``), else :class:`~h5store.errors.ArgumentError`.

    Examples
    --------
    >>> check_batch_size("serve", 32)
    32
    """
    if batch_size is None and none:
        return None
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        also = " or None (no batching)" if none else ""
        raise ArgumentError(f"{who}: batch_size must be an int > 0{also}, got {batch_size!r}")
    return int(batch_size)


def check_shuffle_option(who: str, shuffle: Any, batch_size: int | None = 1) -> bool | str:
    """``shuffle`` as False, True or ``"chunks"``, else :class:`~h5store.errors.ArgumentError`.

    - ``False``: in order. ``True``: a new uniform permutation each epoch, from ``(seed, epoch)``.
    - ``"chunks"``: quasi-random (FFCV's ``QUASI_RANDOM``, MosaicML's ``py1e``): blocks of
      consecutive examples holding a few MB of stored data are shuffled, then the examples
      of every window of 8 blocks (:class:`~h5store.serving.QuasiRandomBatchSampler`).
      Every example once per epoch, seeded by ``(seed, epoch)``, equal steps per rank.
      For files that do not sit in the page cache (larger than RAM, cold disks, network
      file systems): each batch reads from a few MB-sized regions instead of from
      anywhere. Less random: a batch mixes examples of ~8 blocks only.

    Examples
    --------
    >>> check_shuffle_option("serve", "chunks", 32)
    'chunks'
    """
    from h5store.serving.samplers import check_shuffle

    try:
        value = check_shuffle(shuffle)
    except ValueError as e:
        raise ArgumentError(f"{who}: {e}") from None
    if value == "chunks" and batch_size is None:
        raise ArgumentError(f"{who}: shuffle='chunks' orders batches; pass a batch_size (or shuffle=True)")
    return value


def _check_options(who: str, options: Mapping[str, Any], allowed: Iterable[str]) -> None:
    allowed = set(allowed)
    for key, value in options.items():
        if key in allowed:
            continue
        hint = _HINTS.get(who, {}).get(key)
        if hint is not None:
            raise ArgumentError(f"{who}(): no keyword {key!r}: {hint.format(v=value)}")
        close = difflib.get_close_matches(key, sorted(allowed), n=1)
        if close:
            raise ArgumentError(f"{who}(): unknown keyword {key!r}; did you mean {close[0]!r}?")
        raise ArgumentError(f"{who}(): unknown keyword {key!r}; it takes {', '.join(sorted(allowed))}")


def _keywords(*functions: Callable[..., Any]) -> set[str]:
    out: set[str] = set()
    for fn in functions:
        out.update(name for name, p in inspect.signature(fn).parameters.items()
                   if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    return out


def serve(file: Any, batch: Mapping[str, Any], batch_size: int | None = 1, *, shuffle: bool | str = False,
          drop_last: bool = False, seed: int = 0, verify: bool | str = True, num_workers: int = 0,
          **options: Any) -> Any:
    """A PyTorch DataLoader whose batches are dicts of tensors: ``f.serve(batch, batch_size=32, ...)``.

    Parameters
    ----------
    batch : dict
        Key -> getter (``h5s.Item``, ``h5s.Window``, ``h5s.Frames``, ``h5s.Label``,
        ``h5s.Position``, ``h5s.Id`` or your own :class:`~h5store.serving.Getter`).
    batch_size : int or None
        Examples per batch (default 1, as ``DataLoader``; may be given by position).
        None: one example at a time, unbatched.
    shuffle : bool or "chunks"
        A new order each epoch, from ``(seed, epoch)`` (default False, as ``DataLoader``).
        ``"chunks"``: a quasi-random order that reads the file a few MB-sized blocks at a
        time, for files not in the page cache (see :func:`check_shuffle_option`).
    drop_last : bool
        Drop the last incomplete batch.
    seed : int
        Seed of the order and of random crops.
    verify : {True, False, "always", "skip"}
        Check every served item against its stored CRC-32, the first time it is served (default;
        ``"always"``: whole items at every read; see
        :func:`h5store.serving.loader.serve`).
    num_workers : int
        DataLoader worker processes (0: read in the loop's process).
    **options
        ``in_memory``, ``distributed``, ``rank``, ``world_size``, ``mask``, ``bucket``,
        ``params``, ``items`` (see :func:`h5store.serving.loader.serve`) and the other
        ``DataLoader`` arguments (``pin_memory``, ``persistent_workers``,
        ``prefetch_factor``, ``multiprocessing_context``, ``collate_fn``, ``sampler``...).

    Returns
    -------
    h5store.serving.Loader
        A ``torch.utils.data.DataLoader``.

    Examples
    --------
    >>> loader = f.serve(dict(x=h5s.Window("mel", 64), y=h5s.Label("label")),  # doctest: +SKIP
    ...                  batch_size=32, shuffle=True, num_workers=2)
    """
    size = check_batch_size("serve", batch_size, none=True)
    shuffle = check_shuffle_option("serve", shuffle, size)
    from torch.utils.data import DataLoader

    from h5store.serving import loader

    _check_options("serve", options, _keywords(loader.serve, DataLoader.__init__) - {"self", "dataset"})
    return loader.serve(file, batch, size, shuffle=shuffle, drop_last=drop_last, seed=seed, verify=verify,
                        num_workers=num_workers, **options)


def iter_batches(file: Any, batch: Mapping[str, Any] | None, batch_size: int = 1, *, shuffle: bool | str = False,
                 drop_last: bool = False, seed: int = 0, verify: bool | str = True, threads: int = 2,
                 epoch: int = 0, **options: Any) -> Any:
    """One epoch of batches as dicts of numpy arrays, read ahead by threads: ``f.iter_batches(batch, batch_size=32)``.

    Parameters
    ----------
    batch, batch_size, shuffle, drop_last, seed, verify
        As for :meth:`serve` (same defaults).
    threads : int
        Reader threads (0: read in the loop's thread).
    epoch : int
        The epoch served: its order and random crops.
    **options
        ``prefetch``, ``params``, ``mask``, ``bucket``, ``items``, ``in_memory``, ``rank``,
        ``world_size`` (see :func:`h5store.serving.numpy_iter.iter_batches`).

    Returns
    -------
    h5store.serving.BatchIterator

    Examples
    --------
    >>> for b in f.iter_batches(dict(x=h5s.Window("mel", 64)), batch_size=32, shuffle=True, epoch=0):  # doctest: +SKIP
    ...     step(b["x"])
    """
    size = check_batch_size("iter_batches", batch_size)
    shuffle = check_shuffle_option("iter_batches", shuffle, size)
    from h5store.serving import numpy_iter

    _check_options("iter_batches", options, _keywords(numpy_iter.iter_batches))
    return numpy_iter.iter_batches(file, batch, size, shuffle=shuffle, drop_last=drop_last, seed=seed, verify=verify,
                                   threads=threads, epoch=epoch, **options)


def to_tf_dataset(file: Any, batch: Mapping[str, Any], batch_size: int = 1, *, shuffle: bool | str = False,
                  drop_last: bool = False, seed: int = 0, verify: bool | str = True, epoch: int = 0,
                  **options: Any) -> Any:
    """A ``tf.data.Dataset`` of batches (dicts of tensors): ``f.to_tf_dataset(batch, batch_size=32)``.

    Parameters
    ----------
    batch, batch_size, shuffle, drop_last, seed, verify
        As for :meth:`serve` (same defaults).
    epoch : int
        The epoch of the first iteration; each further iteration serves the next one.
    **options
        ``num_parallel_calls``, ``ragged``, ``prefetch``, ``deterministic``, ``params``,
        ``mask``, ``bucket``, ``items``, ``in_memory``, ``rank``, ``world_size`` (see
        :func:`h5store.serving.tf.to_tf_dataset`).

    Returns
    -------
    tf.data.Dataset

    Examples
    --------
    >>> ds = f.to_tf_dataset(dict(x=h5s.Item("mel"), y=h5s.Label("label")), batch_size=32)  # doctest: +SKIP
    """
    size = check_batch_size("to_tf_dataset", batch_size)
    shuffle = check_shuffle_option("to_tf_dataset", shuffle, size)
    from h5store.serving import tf

    _check_options("to_tf_dataset", options, _keywords(tf.to_tf_dataset))
    return tf.to_tf_dataset(file, batch, size, shuffle=shuffle, drop_last=drop_last, seed=seed, verify=verify,
                            epoch=epoch, **options)


def interleave(files: Any, batch: Mapping[str, Any], batch_size: int = 1, *, shuffle: bool | str = False,
               drop_last: bool = False, seed: int = 0, verify: bool | str = True, cycle_length: int = 4,
               **options: Any) -> Any:
    """Batches of many files read concurrently by tf.data: ``h5s.interleave(paths, batch, batch_size=32)``.

    The signature and defaults of :meth:`to_tf_dataset`; see :func:`h5store.serving.tf.interleave`
    for ``cycle_length``, ``block_length``, ``mix``, ``file_key`` and the rest. Every batch
    mixes the files (``mix="examples"``, tf.data's ``block_length=1``); ``mix="batches"``
    serves batches of one file each.

    Examples
    --------
    >>> ds = h5s.interleave(paths, dict(x=h5s.Window("mel", 64)), batch_size=32, cycle_length=4)  # doctest: +SKIP
    """
    size = check_batch_size("interleave", batch_size)
    shuffle = check_shuffle_option("interleave", shuffle, size)
    from h5store.serving import tf

    _check_options("interleave", options, _keywords(tf.interleave))
    return tf.interleave(files, batch, size, shuffle=shuffle, drop_last=drop_last, seed=seed, verify=verify,
                         cycle_length=cycle_length, **options)
