"""Serving: h5store files to PyTorch DataLoaders (and, through the same engine, to numpy loops).

``import h5store`` imports this package for the getters (``h5s.Item``...),
:func:`concat` and :func:`iter_batches`: nothing here imports torch until :func:`serve`
is called, nor tensorflow until :func:`to_tf_dataset` or :func:`interleave` is.

Module map::

    getters.py   Getter base class; Item, Window, Frames, Label, Position
    files.py     FileSet (batched reads over one or many files), MultiFile, concat
    dataset.py   FileDataset: __getitems__ / fetch, one planned read per feature per batch
    collate.py   padding, lengths and masks; numpy -> torch
    samplers.py  BatchSampler, BucketBatchSampler: epochs, ranks, resumable state
    shared.py    SharedParams and SharedArray in /dev/shm (no Manager, no copies)
    loader.py    serve() and Loader (imports torch)
    numpy_iter.py  iter_batches(): batches read ahead by threads, numpy only (JAX, plain loops)
    tf.py        to_tf_dataset() and interleave(): tf.data pipelines (imports tensorflow)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from h5store.serving.collate import Batch, pad, pad_collate, pad_collate_numpy, to_torch
from h5store.serving.dataset import CorruptRecordWarning, FileDataset
from h5store.serving.files import FileSet, MultiFile, concat
from h5store.serving.getters import Frames, Getter, Item, Label, Padded, Position, Request, Window
from h5store.serving.numpy_iter import BatchIterator, iter_batches
from h5store.serving.samplers import BatchSampler, BucketBatchSampler, EpochIndices
from h5store.serving.shared import SharedArray, SharedParams

__all__ = [
    "Batch",
    "BatchIterator",
    "BatchSampler",
    "BucketBatchSampler",
    "CorruptRecordWarning",
    "EpochIndices",
    "FileDataset",
    "FileSet",
    "Frames",
    "Getter",
    "Item",
    "Label",
    "MultiFile",
    "Padded",
    "Position",
    "Request",
    "SharedArray",
    "SharedParams",
    "Window",
    "concat",
    "interleave",
    "iter_batches",
    "pad",
    "pad_collate",
    "pad_collate_numpy",
    "serve",
    "to_tf_dataset",
    "to_torch",
]


def serve(file: Any, batch: Mapping[str, Getter], **kwargs: Any) -> Any:
    """A PyTorch DataLoader over ``file``; see :func:`h5store.serving.loader.serve` for the options.

    Examples
    --------
    >>> import h5store as h5s
    >>> loader = h5s.serving.serve(f, dict(x=h5s.Item("mel")), batch_size=16, num_workers=2)  # doctest: +SKIP
    """
    from h5store.serving.loader import serve as _serve

    return _serve(file, batch, **kwargs)


def to_tf_dataset(file: Any, batch: Mapping[str, Getter], batch_size: int, **kwargs: Any) -> Any:
    """A ``tf.data.Dataset`` of batches; see :func:`h5store.serving.tf.to_tf_dataset` for the options.

    Examples
    --------
    >>> import h5store as h5s
    >>> ds = h5s.serving.to_tf_dataset(h5s.concat([a, b]), dict(x=h5s.Item("mel")), 32)  # doctest: +SKIP
    """
    from h5store.serving.tf import to_tf_dataset as _to_tf_dataset

    return _to_tf_dataset(file, batch, batch_size, **kwargs)


def interleave(files: Any, batch: Mapping[str, Getter], **kwargs: Any) -> Any:
    """Batches of many files read concurrently by tf.data; see :func:`h5store.serving.tf.interleave`.

    Examples
    --------
    >>> import h5store as h5s
    >>> ds = h5s.interleave(paths, dict(x=h5s.Window("mel", 64)), batch_size=32, cycle_length=4)  # doctest: +SKIP
    """
    from h5store.serving.tf import interleave as _interleave

    return _interleave(files, batch, **kwargs)


def __getattr__(name: str) -> Any:
    # torch-using names, imported on first use.
    if name in ("Loader", "RingBatch", "SharedBatches"):
        from h5store.serving import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'h5store.serving' has no attribute {name!r}")
