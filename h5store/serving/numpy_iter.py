"""Batches as numpy arrays from background threads: the numpy/JAX iterator (no framework imported).

:func:`iter_batches` serves the same batches as :func:`~h5store.serving.serve` (same keys,
values and order for the same seed and epoch) without torch: ``threads`` threads read
whole batches ahead of the loop through :meth:`FileDataset.fetch
<h5store.serving.FileDataset.fetch>`, into a bounded window of ``prefetch`` batches, and
the loop receives them in sampler order.

Threads, not processes: uncompressed data is read with ``os.preadv`` straight into the
batch buffer (:class:`~h5store.readers.DirectReader`'s offsets), which releases the GIL
for the copy, so threads read in parallel without pickling anything or copying a batch
between processes. What stays under the GIL is the per-batch planning (a few numpy calls
and one Python step per item); features read through HDF5 (compressed ones) serialise on
HDF5's global lock.

This module also holds what the tf.data path (:mod:`h5store.serving.tf`) shares with the
iterator: :func:`prepare_for_threads` (one dataset read by many threads at once) and
:func:`aligned_empty` (batch buffers that tensorflow adopts without a copy).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from h5store.readers import ChunkReader
from h5store.serving.collate import Batch
from h5store.serving.dataset import FileDataset
from h5store.serving.getters import Getter
from h5store.serving.samplers import make_sampler  # (importable from here, as before)
from h5store.serving.shared import SharedParams

__all__ = ["BatchIterator", "GzipChunkReader", "aligned_empty", "close_dataset", "iter_batches", "make_sampler",
           "prepare_for_threads"]

ALIGN = 64  # bytes; tensorflow adopts a numpy buffer without copying when it is 64-byte aligned


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose data starts on a 64-byte boundary.

    ``tf.numpy_function`` wraps an aligned array in a tensor as it is; an unaligned one
    (numpy's large allocations start 16 bytes into a page) is copied first, while the
    calling thread holds the GIL. Used as ``FileDataset.files.alloc``: every batch buffer
    a getter fills comes from here.

    Examples
    --------
    >>> a = aligned_empty((3, 5), "float32")
    >>> a.shape, a.dtype, a.ctypes.data % 64
    ((3, 5), dtype('float32'), 0)
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    if dtype.hasobject:
        return np.empty(shape, dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class BufferPool:
    """Batch buffers that are used again once nothing refers to them any more.

    A fresh large ``np.empty`` per batch is a fresh mapping from the allocator, faulted in
    page by page while it is filled, and freeing it from another thread (the loop's)
    contends on the allocator's locks. The pool keeps up to ``size`` large buffers
    (64-byte aligned, see :func:`aligned_empty`) and hands out one whose only reference is
    the pool's: a batch the loop (or a tensorflow tensor) still holds is never reused.
    Small requests, and large ones when every pooled buffer is in use, are plain
    :func:`aligned_empty` arrays.

    Examples
    --------
    >>> pool = BufferPool(size=2)
    >>> a = pool((1024, 1024), "float32"); p = a.ctypes.data; del a
    >>> pool((512, 1024), "float32").ctypes.data == p  # the same memory, free again
    True
    """

    def __init__(self, size: int = 8, min_bytes: int = 1 << 20) -> None:
        self.size = size
        self.min_bytes = min_bytes
        self._raws: list[np.ndarray] = []
        self._lock = threading.Lock()

    def __call__(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if dtype.hasobject or nbytes < self.min_bytes:
            return aligned_empty(shape, dtype)
        with self._lock:
            best = None
            for raw in self._raws:
                # 3 references: the list, the loop variable, getrefcount's argument.
                if raw.nbytes >= nbytes + ALIGN and sys.getrefcount(raw) <= 3 and (
                        best is None or raw.nbytes < best.nbytes):
                    best = raw
            if best is None:
                best = np.empty(nbytes + nbytes // 8 + ALIGN, np.uint8)  # room for slightly longer batches
                if len(self._raws) >= self.size:
                    free = [r for r in self._raws if sys.getrefcount(r) <= 3]
                    if not free:
                        return aligned_empty(shape, dtype)
                    self._raws.remove(min(free, key=lambda r: r.nbytes))
                self._raws.append(best)
            start = -best.ctypes.data % ALIGN
            return best[start : start + nbytes].view(dtype).reshape(shape)  # holds `best` until freed


#: The chunk reader of compressed features: :class:`h5store.readers.ChunkReader`, which every
#: read path uses (this name stays for code that imported it from here).
GzipChunkReader = ChunkReader


def prepare_for_threads(dataset: FileDataset) -> FileDataset:
    """Make ``dataset`` safe to :meth:`~FileDataset.fetch` from several threads at once.

    A FileDataset opens files, columns and descriptors lazily, on the first read that
    needs them; two threads doing that at once could each open a descriptor (one leaks)
    or interleave the opening of a file. This opens everything the dataset's features
    read, in the calling thread (:meth:`FileSet.open_readers
    <h5store.serving.files.FileSet.open_readers>`), so that the threads only read
    afterwards. It also has batch buffers come from a :class:`BufferPool` (reused, 64-byte
    aligned). Compressed features are read by a :class:`GzipChunkReader` (threads inflate
    chunks in parallel), as every read-only column chooses. Returns ``dataset``.

    Examples
    --------
    >>> ds = prepare_for_threads(FileDataset(f, dict(x=h5s.Item("mel"))))  # doctest: +SKIP
    """
    files = dataset.files
    files.open_readers(list(dataset.features))
    if files.alloc is np.empty:
        files.alloc = BufferPool()
    return dataset


def close_dataset(dataset: FileDataset) -> None:
    """Close every handle and descriptor ``dataset`` opened in this process.

    :meth:`FileDataset.close` closes the readers of the served columns (their
    descriptors), then the files (each closes the readers of its groups, the ids tables
    included), so that opening a file once per pass, epoch after epoch, does not pile up
    descriptors.
    """
    dataset.close()


class _Failure:
    """An exception raised while reading a batch, handed to the loop at that batch's turn."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pipeline:
    """The state the reader threads share with the loop (never the iterator object itself,
    so that dropping the iterator ends the threads)."""

    def __init__(self, dataset: FileDataset, batches: list[np.ndarray], epoch: int, window: int) -> None:
        self.dataset = dataset
        self.batches = batches
        self.epoch = epoch
        self.window = window
        self.cond = threading.Condition()
        self.ready: dict[int, Batch | _Failure] = {}
        self.next_task = 0  # the next batch a thread will read
        self.consumed = 0  # batches handed to the loop
        self.stopped = False
        self.threads: list[threading.Thread] = []

    def work(self) -> None:
        n = len(self.batches)
        cond = self.cond
        while True:
            with cond:
                while not self.stopped and self.next_task < n and self.next_task >= self.consumed + self.window:
                    cond.wait()
                if self.stopped or self.next_task >= n:
                    return
                k = self.next_task
                self.next_task += 1
            try:
                result: Batch | _Failure = self.dataset.fetch(self.batches[k], epoch=self.epoch, number=k)
            except BaseException as e:  # noqa: BLE001 - handed to the loop, raised there
                result = _Failure(e)
            with cond:
                self.ready[k] = result
                cond.notify_all()

    def take(self) -> Batch | _Failure | None:
        """The next batch in order (waiting for it), or None at the end."""
        with self.cond:
            k = self.consumed
            if k >= len(self.batches) or self.stopped:
                return None
            while k not in self.ready:
                if self.stopped:
                    return None
                self.cond.wait()
            result = self.ready.pop(k)
            self.consumed += 1
            self.cond.notify_all()
        return result

    def stop(self) -> None:
        """Stop the threads (each finishes the batch it is reading) and wait for them."""
        with self.cond:
            self.stopped = True
            self.ready.clear()
            self.cond.notify_all()
        me = threading.current_thread()
        for t in self.threads:
            if t is not me and t.is_alive():
                t.join()
        self.threads = []


class BatchIterator:
    """One epoch of batches, read ahead by background threads; made by :func:`iter_batches`.

    Iterate it once. ``close()`` (or leaving a ``with`` block, or dropping the last
    reference) stops the threads; they also stop by themselves at the end of the epoch.

    Attributes
    ----------
    dataset : FileDataset
        What is read (``it.dataset.params.crop = 128`` reaches the batches read after it).
    epoch : int
        The epoch served: its order and random crops depend only on ``(seed, epoch)``.
    """

    def __init__(self, dataset: FileDataset, batches: list[np.ndarray], epoch: int, prefetch: int,
                 threads: int) -> None:
        if isinstance(threads, bool) or int(threads) < 0:
            raise ValueError(f"threads must be an int >= 0, got {threads!r}")
        if isinstance(prefetch, bool) or int(prefetch) < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.dataset = dataset
        self.epoch = int(epoch)
        self._batches = batches
        self._sync = int(threads) == 0
        self._pos = 0
        self._pipe: _Pipeline | None = None
        if not self._sync and batches:
            prepare_for_threads(dataset)
            pipe = self._pipe = _Pipeline(dataset, batches, self.epoch, max(int(prefetch), int(threads), 1))
            for j in range(min(int(threads), len(batches))):
                t = threading.Thread(target=pipe.work, name=f"h5store-batches-{j}", daemon=True)
                pipe.threads.append(t)
                t.start()
        self._finalizer = weakref.finalize(self, _Pipeline.stop, self._pipe) if self._pipe is not None else None

    def __iter__(self) -> BatchIterator:
        return self

    def __len__(self) -> int:
        return len(self._batches)

    def __next__(self) -> Batch:
        if self._sync:
            if self._pos >= len(self._batches):
                self.dataset.files.keep_checked()  # for the next epoch's dataset of the same file
                raise StopIteration
            self._pos += 1
            return self.dataset.fetch(self._batches[self._pos - 1], epoch=self.epoch, number=self._pos - 1)
        pipe = self._pipe
        result = pipe.take() if pipe is not None else None
        if result is None:
            self.close()
            raise StopIteration
        if isinstance(result, _Failure):
            self.close()
            raise result.error
        if pipe is not None and pipe.consumed >= len(self._batches):
            self.close()  # the threads have nothing left to read: let them go now
        return result

    def close(self) -> None:
        """Stop the reader threads and wait for them (each finishes its current batch)."""
        if self._finalizer is not None:
            self._finalizer()
        # Which items passed their CRC-32, for the next epoch's dataset of the same open file.
        self.dataset.files.keep_checked()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def threads(self) -> list[threading.Thread]:
        """The reader threads still running."""
        return [t for t in (self._pipe.threads if self._pipe is not None else []) if t.is_alive()]

    def __repr__(self) -> str:
        return f"<BatchIterator epoch {self.epoch}: {len(self._batches)} batches of {self.dataset!r}>"


def iter_batches(file: Any, batch: Mapping[str, Getter] | None, batch_size: int = 1, *, shuffle: bool = False,
                 drop_last: bool = False, seed: int = 0, verify: bool | str = True, threads: int = 2,
                 epoch: int = 0, prefetch: int = 2, params: Mapping[str, Any] | SharedParams | None = None,
                 mask: bool = False, bucket: bool | int | None = None,
                 items: Sequence[int] | np.ndarray | None = None, in_memory: bool | Sequence[str] = False,
                 rank: int = 0, world_size: int = 1, transform: Any = None, max_frames: int | None = None,
                 padded: bool = False, by_shard: bool = False) -> BatchIterator:
    """One epoch of batches as dicts of numpy arrays, read ahead by background threads.

    The implementation of ``f.iter_batches(...)`` (:func:`h5store.serving.api.iter_batches`,
    which checks the arguments first); called directly it also serves a
    :class:`~h5store.serving.FileDataset` (``batch=None``).

    The batches are those of :func:`~h5store.serving.serve` with the same options (same
    keys, values and order for the same ``seed`` and ``epoch``): variable-length items
    zero-padded with ``{key}_lengths``, text as lists of str. Nothing of torch, tensorflow
    or JAX is imported: hand the arrays to ``jax.device_put`` or any numpy code.

    Parameters
    ----------
    file : TypedFile, MultiFile or FileDataset
        What to serve (a :func:`~h5store.concat` of files too). A
        :class:`~h5store.serving.FileDataset` is served as it is (pass ``batch=None``):
        make it once and iterate an epoch per call.
    batch : dict or None
        Key -> getter (``h5s.Item``, ``h5s.Window``, ``h5s.Frames``, ``h5s.Label``,
        ``h5s.Position``, ``h5s.Id`` or your own).
    batch_size : int
        Examples per batch (default 1, as PyTorch's ``DataLoader``).
    shuffle : bool
        A new order each epoch, from ``(seed, epoch)`` (default False, as ``DataLoader``).
    seed : int
        Seed of the order and of random crops (a FileDataset has its own for the crops).
    prefetch : int
        Batches read ahead of the loop (being read or waiting): at least ``threads``, so
        that every thread has work. Memory holds up to this many batches.
    threads : int
        Reader threads (0: read in the loop's own thread, nothing ahead).
    drop_last : bool
        Drop the last incomplete batch.
    epoch : int
        Which epoch to serve (its order and crops).
    params, mask, bucket, items, in_memory, rank, world_size, transform, max_frames, padded, by_shard
        As for :func:`~h5store.serving.serve` (``transform`` runs in the reader threads).
    verify : {True, False, "always", "skip"}
        Check each served item against its stored CRC-32, the first time it is served (default;
        ``"always"``: whole items at every read; a damaged one raises
        :class:`~h5store.errors.CorruptRecordError`), ``"skip"`` damaged items (warned, listed
        in ``dataset.skipped``), or False: unchecked. See :class:`~h5store.serving.FileDataset`.

    Returns
    -------
    BatchIterator
        Iterate it once; ``len()`` is the number of batches. Stopping early is fine: the
        threads end when the iterator is closed, left (``with``) or dropped.

    Examples
    --------
    >>> import h5store as h5s
    >>> for epoch in range(10):  # doctest: +SKIP
    ...     for b in f.iter_batches(dict(x=h5s.Window("mel", 64), y=h5s.Label("label")),
    ...                             batch_size=32, epoch=epoch):
    ...         loss = train_step(jax.device_put(b["x"]), b["y"])
    """
    if isinstance(file, FileDataset):
        if batch is not None:
            raise TypeError("iter_batches(dataset, ...): a FileDataset has its getters already; pass batch=None")
        if params is not None or mask or items is not None or in_memory or transform is not None:
            raise TypeError("iter_batches(dataset, ...): params, mask, items, in_memory and transform belong to the "
                            "FileDataset")
        dataset = file
    else:
        if batch is None:
            raise TypeError("iter_batches: pass batch=dict(key=getter, ...)")
        dataset = FileDataset(file, batch, params=params, seed=seed, mask=mask, in_memory=in_memory, items=items,
                              verify=verify, transform=transform)
    sampler = make_sampler(dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, bucket=bucket,
                           rank=rank, world_size=world_size, max_frames=max_frames, padded=padded,
                           by_shard=by_shard)
    return BatchIterator(dataset, sampler.batches(int(epoch)), int(epoch), prefetch, threads)
