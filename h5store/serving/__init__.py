"""Serving: h5store files to PyTorch DataLoaders (and, through the same engine, to numpy loops).

``import h5store`` imports this package for the getters (``h5s.Item``...) and
:func:`concat`: nothing here imports torch until ``f.serve(...)`` is called, nor tensorflow
until ``f.to_tf_dataset(...)`` or :func:`interleave` is.

The public spelling is the method, one per framework, on a TypedFile and on what
:func:`concat` returns: ``f.serve`` (PyTorch), ``f.iter_batches`` (numpy), ``f.to_tf_dataset``
(tf.data), all ``(batch, batch_size=1, *, shuffle=False, drop_last=False, seed=0,
verify=True, ...)``; the functions here of the same names are those methods (``file``
first), defined in ``api.py``.

Module map::

    api.py       serve, iter_batches, to_tf_dataset, interleave: the checked entry points
    getters.py   Getter base class; Item, Window, Frames, Label, Position, Id, Clips, Encoded
    files.py     FileSet (batched reads over one or many files), MultiFile, concat
    dataset.py   FileDataset: __getitems__ / fetch, one planned read per feature per batch
    collate.py   padding, lengths and masks; numpy -> torch
    samplers.py  BatchSampler, BucketBatchSampler, QuasiRandomBatchSampler, DurationBatchSampler,
                 ShardBatchSampler (whole shards per rank): epochs, ranks, resumable state
    transforms.py  batch augmentations (Gain, AddNoise, SpecAugment, Mixup...), seeded per batch
    shared.py    SharedParams and SharedArray in /dev/shm (no Manager, no copies)
    loader.py    serve() and Loader (imports torch)
    numpy_iter.py  iter_batches(): batches read ahead by threads, numpy only (JAX, plain loops)
    tf.py        to_tf_dataset() and interleave(): tf.data pipelines (imports tensorflow)
"""

from __future__ import annotations

from typing import Any

from h5store.serving import transforms
from h5store.serving.api import interleave, iter_batches, serve, to_tf_dataset
from h5store.serving.collate import Batch, pad, pad_collate, pad_collate_numpy, to_torch
from h5store.serving.dataset import CorruptRecordWarning, FileDataset
from h5store.serving.files import FileSet, MultiFile, concat
from h5store.serving.getters import (
    Clips,
    Encoded,
    Frames,
    Getter,
    Id,
    ImageCrop,
    Item,
    Label,
    Padded,
    Position,
    Request,
    Window,
)
from h5store.serving.numpy_iter import BatchIterator
from h5store.serving.samplers import (
    BatchSampler,
    BucketBatchSampler,
    DurationBatchSampler,
    EpochIndices,
    QuasiRandomBatchSampler,
    ShardBatchSampler,
)
from h5store.serving.shared import SharedArray, SharedParams

__all__ = [
    "Batch",
    "BatchIterator",
    "BatchSampler",
    "BucketBatchSampler",
    "CorruptRecordWarning",
    "DurationBatchSampler",
    "EpochIndices",
    "FileDataset",
    "FileSet",
    "Clips",
    "Encoded",
    "Frames",
    "ImageCrop",
    "Getter",
    "Id",
    "Item",
    "Label",
    "MultiFile",
    "ShardBatchSampler",
    "Padded",
    "Position",
    "QuasiRandomBatchSampler",
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
    "transforms",
]


def __getattr__(name: str) -> Any:
    # torch-using names, imported on first use.
    if name in ("Loader", "RingBatch", "SharedBatches"):
        from h5store.serving import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'h5store.serving' has no attribute {name!r}")
