"""Collate: pad variable-length values to the batch's longest, report lengths and masks.

The served datasets collate in numpy (:meth:`FileDataset.fetch
<h5store.serving.FileDataset.fetch>` returns the batch ready), so in a DataLoader the
worker does the padding and the main process only receives a few large tensors.
:func:`to_torch` turns such a batch into tensors; :func:`pad_collate` is the same rules
as a ``collate_fn`` for datasets of your own that return one example at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Batch", "lengths_mask", "pad", "pad_collate", "pad_collate_numpy", "to_torch"]


class Batch(dict):  # type: ignore[type-arg]
    """A collated batch: key -> numpy array (batch on axis 0) or list.

    :meth:`FileDataset.__getitems__ <h5store.serving.FileDataset.__getitems__>` returns
    one; ``collate_fn=dataset.collate`` turns it into torch tensors. ``owned`` names the
    keys whose arrays belong to this batch alone (fresh buffers the built-in getters made
    for it): the built-in transforms change those in place instead of copying.
    """

    owned: frozenset[str] = frozenset()


def lengths_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    """``(B, width)`` bool, True on the first ``lengths[b]`` rows of each example."""
    return np.arange(width, dtype=np.int64)[None, :] < np.asarray(lengths, dtype=np.int64)[:, None]


def pad(arrays: Sequence[np.ndarray], width: int | None = None, value: Any = 0) -> tuple[np.ndarray, np.ndarray]:
    """Stack arrays that differ in their first axis, padding with ``value``.

    Returns ``(padded, lengths)``: ``padded`` is ``(B, width, *rest)`` (``width``
    defaults to the longest) and ``lengths`` int64.

    Examples
    --------
    >>> x, n = pad([np.ones((2, 3)), np.ones((4, 3))])
    >>> x.shape, n.tolist(), x[0, 2:].sum()
    ((2, 4, 3), [2, 4], np.float64(0.0))
    """
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    if width is None:
        width = int(lengths.max()) if len(lengths) else 0
    if not len(arrays):
        return np.zeros((0, width)), lengths
    first = np.asarray(arrays[0])
    rest = first.shape[1:]
    dtype = np.result_type(*{np.asarray(a).dtype for a in arrays})
    out = np.empty((len(arrays), width, *rest), dtype=dtype)
    for j, a in enumerate(arrays):
        n = min(len(a), width)
        if np.shape(a)[1:] != rest:
            raise ValueError(f"cannot pad: example {j} has shape {np.shape(a)}, example 0 {first.shape}")
        out[j, :n] = a[:n]
        if n < width:
            out[j, n:] = value
    return out, np.minimum(lengths, width)


def pad_collate_numpy(samples: Sequence[Mapping[str, Any]], mask: bool = False,
                      ragged: Iterable[str] = ()) -> Batch:
    """Collate examples (dicts) into a :class:`Batch` of numpy arrays.

    Arrays of equal shape are stacked. Arrays whose first axis differs, and every key
    in ``ragged``, are zero-padded and get ``{key}_lengths`` (and ``{key}_mask`` with
    ``mask=True``). Strings and other objects are kept as lists.

    BEWARE: without ``ragged``, whether a key is padded is decided per batch, so a batch
    whose items happen to have equal lengths has no ``{key}_lengths``: name the
    variable-length keys in ``ragged`` to always get them.

    Examples
    --------
    >>> b = pad_collate_numpy([dict(x=np.ones((2, 3)), y=1), dict(x=np.ones((4, 3)), y=0)])
    >>> b["x"].shape, b["x_lengths"].tolist(), b["y"].tolist()
    ((2, 4, 3), [2, 4], [1, 0])
    """
    out = Batch()
    if not samples:
        return out
    ragged = set(ragged)
    for key in samples[0]:
        values = [s[key] for s in samples]
        if not all(isinstance(v, (np.ndarray, np.generic, int, float, bool)) for v in values):
            out[key] = values
            continue
        arrays = [np.asarray(v) for v in values]
        shapes = {a.shape for a in arrays}
        if key in ragged or (len(shapes) > 1 and all(a.ndim >= 1 for a in arrays)):
            values_, lengths = pad(arrays)
            out[key] = values_
            out[f"{key}_lengths"] = lengths
            if mask:
                out[f"{key}_mask"] = lengths_mask(lengths, values_.shape[1])
        else:
            out[key] = np.stack(arrays)
    return out


def to_torch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """numpy arrays -> torch tensors (sharing memory); lists stay lists."""
    import torch

    out: dict[str, Any] = {}
    for key, v in batch.items():
        if isinstance(v, np.ndarray) and v.dtype.kind in "biufc":
            if not v.flags.writeable:
                v = v.copy()  # torch wants writable memory; read-only means a shared mapping
            out[key] = torch.from_numpy(v)
        elif isinstance(v, np.generic):
            out[key] = torch.as_tensor(v)
        else:
            out[key] = v
    return out


def pad_collate(samples: Sequence[Mapping[str, Any]], mask: bool = False, ragged: Iterable[str] = ()) -> dict[str, Any]:
    """A ``collate_fn`` that pads variable-length values: :func:`pad_collate_numpy`, as tensors.

    Examples
    --------
    >>> loader = torch.utils.data.DataLoader(my_dataset, batch_size=16, collate_fn=pad_collate)  # doctest: +SKIP
    """
    return to_torch(pad_collate_numpy(samples, mask=mask, ragged=ragged))
