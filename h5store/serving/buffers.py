"""Batch buffers reused across batches in one process: :class:`BatchPool`.

A served batch of whole items is a few MB. ``np.empty`` of that size is often a fresh
``mmap`` (glibc hands large blocks back to the kernel on free, depending on its state), so
every batch page-faults its buffer in again while the read fills it (measured here:
~150-230 minor faults per 3 MB batch of whole items, 48-52 us per item against 26
pooled). The pool keeps freed batch buffers and hands them out again; a buffer returns to
the pool when the last array (or torch tensor) viewing it is garbage, so a batch the
training loop still holds is never overwritten. Workers use the shared-memory ring of
:mod:`h5store.serving.loader` instead; the numpy and tf.data iterators their own aligned
pool (:mod:`h5store.serving.numpy_iter`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BatchPool"]

# glibc's default mmap threshold: smaller buffers come from its heap, reused without faults.
# A 655 KB batch of windows faulted 158 times per batch with np.empty in a fresh process
# (FileDataset.fetch: 630 us per batch of 32 windows, 245 us pooled).
_MIN_POOLED = 128 << 10
_ALIGN = 64  # bytes: tensorflow adopts a 64-byte aligned numpy buffer without a copy


def _give_back(free: list[np.ndarray], keep: int, block: np.ndarray) -> None:
    if len(free) < keep:  # list.append is atomic under the GIL: no lock (see BatchPool)
        free.append(block)


class BatchPool:
    """An allocator with ``np.empty``'s signature whose large buffers are reused.

    Buffers of at least 128 KiB are cut from blocks of power-of-two sizes (64-byte
    aligned); a block returns to its free list when the array handed out (and every view
    or tensor of it) is garbage. At most ``keep`` free blocks are kept per size. Like ``np.empty``, the
    contents are whatever was there: callers write every element (padding included).

    Thread-safe without a lock: blocks move between lists with ``list.pop`` and
    ``list.append``, atomic under the GIL, so a finalizer that runs inside an allocation
    (the garbage collector may run anywhere) cannot deadlock.

    Parameters
    ----------
    keep : int
        Free blocks kept per size.

    Examples
    --------
    >>> pool = BatchPool()
    >>> a = pool((16, 600, 80), np.float32)
    >>> address = a.__array_interface__["data"][0]
    >>> del a  # garbage: its block is free again
    >>> b = pool((16, 590, 80), np.float32)
    >>> b.__array_interface__["data"][0] == address
    True
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: dict[int, list[np.ndarray]] = {}

    def __call__(self, shape: Sequence[int] | int, dtype: Any = float) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < _MIN_POOLED or dtype.hasobject:
            return np.empty(shape, dtype)
        size = 1 << (nbytes - 1).bit_length()
        free = self._free.setdefault(size, [])
        try:
            block = free.pop()
        except IndexError:
            raw = np.empty(size + _ALIGN, np.uint8)
            start = -raw.ctypes.data % _ALIGN
            block = raw[start : start + size]
        # An array over a memoryview: numpy's views of it (slices, reshapes, torch tensors of
        # those) name *it* as their base, not the block, so it lives as long as any of them.
        flat = np.frombuffer(memoryview(block)[:nbytes], dtype=dtype)
        weakref.finalize(flat, _give_back, free, self.keep, block)
        return flat.reshape(shape)

    @property
    def pooled_bytes(self) -> int:
        """Bytes held in free blocks now."""
        return sum(size * len(free) for size, free in list(self._free.items()))

    def __getstate__(self) -> dict[str, Any]:
        return {"keep": self.keep, "_free": {}}  # buffers stay in their process
