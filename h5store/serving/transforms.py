"""Training-time batch transforms: augmentations applied to whole batches, with reproducible randomness.

A transform takes a collated batch (key -> array, with ``{key}_lengths`` for padded
values) and returns one. It runs where the batch is built: inside DataLoader workers
with :func:`~h5store.serve` (after the read, before the transfer to the main process),
in the reader threads of :meth:`~h5store.TypedFile.iter_batches` and of tf.data. The
same transforms also run on torch tensors (on any device) in the main process, with the
same results: their random draws are made with numpy from the generator they are given,
then applied with the array library of the data.

Randomness: subclasses of :class:`Transform` implement ``apply(batch, rng)``. The serving
engine gives each batch a generator seeded from ``(seed, epoch, batch number)``
(:func:`batch_rng`), so augmentation is identical whatever the number of workers, the
start method or the prefetching. A plain function ``fn(batch) -> batch`` is a transform
too (it draws its own randomness, if any).

Every built-in transform works on a batch axis and never loops over items in Python.

Examples
--------
>>> import numpy as np
>>> t = Compose([Gain("audio", -6, 6), TimeShift("audio", 100)])
>>> batch = {"audio": np.ones((4, 1000), np.float32), "audio_lengths": np.array([1000, 800, 500, 1000])}
>>> out = t(batch, rng=batch_rng(0, 0, 0))
>>> out["audio"].shape, out["audio"].dtype
((4, 1000), dtype('float32'))
"""

from __future__ import annotations

import importlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "AddNoise",
    "Compose",
    "FreqMask",
    "Gain",
    "Mixup",
    "SpecAugment",
    "TimeMask",
    "TimeShift",
    "Transform",
    "apply_transform",
    "batch_rng",
]

_MASK63 = (1 << 63) - 1
_SALT = 0x7A_6E_5F


def batch_rng(seed: int, epoch: int, batch: int) -> np.random.Generator:
    """The generator of batch number ``batch`` of ``epoch``: the same in every process.

    Examples
    --------
    >>> float(batch_rng(0, 1, 2).random()) == float(batch_rng(0, 1, 2).random())
    True
    """
    return np.random.default_rng([int(seed) & _MASK63, int(epoch) & _MASK63, int(batch) & _MASK63, _SALT])


def apply_transform(transform: Callable[..., Any] | None, batch: Any, rng: np.random.Generator) -> Any:
    """``transform(batch)``; a :class:`Transform` gets ``rng`` too. None: the batch unchanged."""
    if transform is None:
        return batch
    if isinstance(transform, Transform):
        return transform(batch, rng=rng)
    return transform(batch)


# ----------------------------------------------------------------------------- array helpers
def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch"


def _like(x: Any, a: np.ndarray, dtype: Any = None) -> Any:
    """numpy ``a`` as the array kind of ``x`` (a tensor on ``x``'s device), in ``x``'s dtype unless given."""
    if _is_torch(x):
        import torch

        return torch.as_tensor(np.ascontiguousarray(a), device=x.device, dtype=x.dtype if dtype is None else dtype)
    return a.astype(x.dtype if dtype is None else dtype, copy=False)


def _index(x: Any, a: np.ndarray) -> Any:
    """An int64 index array for ``x``'s library and device."""
    if _is_torch(x):
        import torch

        return torch.as_tensor(a, device=x.device, dtype=torch.int64)
    return a


def _where(cond: np.ndarray, a: Any, b: Any) -> Any:
    """``where(cond, a, b)`` for numpy arrays or torch tensors (``cond`` a numpy bool array)."""
    if _is_torch(a):
        import torch

        return torch.where(torch.as_tensor(cond, device=a.device), a, b)
    return np.where(cond, a, b)


def _lengths(batch: Mapping[str, Any], key: str) -> np.ndarray:
    x = batch[key]
    n = batch.get(f"{key}_lengths")
    if n is None:
        return np.full(x.shape[0], x.shape[1] if x.ndim > 1 else 1, np.int64)
    return np.asarray(n.cpu() if _is_torch(n) else n, dtype=np.int64)


def _expand(v: np.ndarray, ndim: int) -> np.ndarray:
    """A per-item value, shaped to broadcast over an item's other axes."""
    return v.reshape(v.shape + (1,) * (ndim - 1))


def _valid(lengths: np.ndarray, width: int, ndim: int) -> np.ndarray:
    """(B, width, 1...) bool: True on each item's real rows."""
    m = np.arange(width)[None, :] < lengths[:, None]
    return m.reshape(m.shape + (1,) * (ndim - 2))


def _out(batch: Mapping[str, Any], **changed: Any) -> Any:
    out = type(batch)() if isinstance(batch, dict) else {}
    out.update(batch)
    out.update(changed)
    owned = getattr(batch, "owned", None)
    if owned:
        out.owned = owned | set(changed)  # the arrays made here are the batch's own too
    return out


def _in_place(batch: Mapping[str, Any], key: str) -> bool:
    """Whether ``batch[key]`` may be changed in place: a writable numpy array the batch owns
    (a buffer the serving engine's getters made for it). Anything else is copied, never changed."""
    x = batch[key]
    return key in getattr(batch, "owned", ()) and isinstance(x, np.ndarray) and x.flags.writeable


def _range(value: float | tuple[float, float], what: str) -> tuple[float, float]:
    if isinstance(value, (int, float)):
        return float(value), float(value)
    lo, hi = (float(v) for v in value)
    if lo > hi:
        raise ValueError(f"{what}: the range ({lo}, {hi}) has its low end above its high end")
    return lo, hi


# ----------------------------------------------------------------------------- base classes
class _NoKey(KeyError):
    """A transform names a key the batch does not have (the message says which keys it has)."""

    def __str__(self) -> str:
        return str(self.args[0])


class Transform(ABC):
    """A batch transform with randomness from the generator the serving engine gives it.

    Subclass and define ``apply(batch, rng)``: ``batch`` maps keys to arrays (numpy, or
    torch tensors) with ``{key}_lengths`` beside padded values; draw every random number
    from ``rng`` (a :class:`numpy.random.Generator` seeded from ``(seed, epoch, batch)``)
    and return the new batch. Do not modify an array in place unless its key is in
    ``batch.owned`` and it is writable (a buffer the serving engine's getters made for this
    batch): others may be views of shared or mapped memory, or a getter's own arrays. A transform must pickle (workers receive a copy).

    Examples
    --------
    >>> class Flip(Transform):
    ...     def __init__(self, key):
    ...         self.key = key
    ...     def apply(self, batch, rng):
    ...         flip = rng.random(len(batch[self.key])) < 0.5
    ...         x = batch[self.key]
    ...         return {**batch, self.key: np.where(flip[:, None], -x, x)}
    >>> Flip("x")({"x": np.ones((3, 2))}, rng=batch_rng(0, 0, 0))["x"].shape
    (3, 2)
    """

    def __call__(self, batch: Mapping[str, Any], rng: np.random.Generator | None = None) -> Any:
        try:
            return self.apply(batch, np.random.default_rng() if rng is None else rng)
        except KeyError as e:
            key = e.args[0] if e.args else None
            if isinstance(key, str) and key not in batch and not isinstance(e, _NoKey):
                raise _NoKey(f"{self!r}: the batch has no key {key!r} (its keys: {', '.join(map(str, batch))}); "
                             "name a key of the batch dict given to serve()") from None
            raise

    @abstractmethod
    def apply(self, batch: Mapping[str, Any], rng: np.random.Generator) -> Any:
        """The transformed batch; every random number drawn from ``rng``."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class Compose(Transform):
    """Transforms applied in order; each draws from its own generator split from the batch's.

    Examples
    --------
    >>> t = Compose([Gain("audio", -3, 3), TimeShift("audio", 10)])
    >>> len(t.transforms)
    2
    """

    def __init__(self, transforms: Sequence[Callable[..., Any]]) -> None:
        self.transforms = list(transforms)
        for t in self.transforms:
            if not callable(t):
                raise TypeError(f"Compose takes callables (transforms), got {t!r}")

    def apply(self, batch: Mapping[str, Any], rng: np.random.Generator) -> Any:
        seeds = rng.integers(0, _MASK63, size=len(self.transforms))
        for t, s in zip(self.transforms, seeds.tolist()):
            batch = apply_transform(t, batch, np.random.default_rng(s))
        return batch


# ----------------------------------------------------------------------------- augmentations
class Gain(Transform):
    """A random gain per item, uniform in ``[min_db, max_db]`` decibels.

    Parameters
    ----------
    key : str
        The batch key (waveforms, magnitude or power spectrograms).
    min_db, max_db : float
    power : bool
        The values are powers (a power spectrogram): scale by ``10**(g/10)`` rather than
        the amplitude factor ``10**(g/20)``.
    p : float
        Probability that an item is changed at all.

    Examples
    --------
    >>> b = Gain("x", 6, 6)({"x": np.ones((2, 4), np.float32)}, rng=batch_rng(0, 0, 0))
    >>> np.round(b["x"][0, 0], 3)
    np.float32(1.995)
    """

    def __init__(self, key: str, min_db: float = -6.0, max_db: float = 6.0, power: bool = False, p: float = 1.0) -> None:
        self.key = key
        self.min_db, self.max_db = _range((min_db, max_db), "Gain")
        self.power = bool(power)
        self.p = float(p)

    def apply(self, batch: Mapping[str, Any], rng: np.random.Generator) -> Any:
        x = batch[self.key]
        db = rng.uniform(self.min_db, self.max_db, size=x.shape[0])
        db = np.where(rng.random(x.shape[0]) < self.p, db, 0.0)
        factor = 10.0 ** (db / (10.0 if self.power else 20.0))
        f = _like(x, _expand(factor, x.ndim))
        if _in_place(batch, self.key):
            np.multiply(x, f, out=x)
            return _out(batch)
        return _out(batch, **{self.key: x * f})


class _NoiseFile:
    """Noise items of a feature of an h5store file, opened once per process."""

    def __init__(self, path: str, feature: str) -> None:
        self.path = os.fspath(path)
        self.feature = feature
        self._file: Any = None
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "feature": self.feature}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["feature"])  # type: ignore[misc]

    def draw(self, rng: np.random.Generator, n: int) -> list[np.ndarray]:
        with self._lock:
            if self._file is None or self._pid != os.getpid():
                # The façade sits above serving in the layers; it is imported by the time this
                # runs (importing any h5store module imports it), so it is looked up here.
                self._file = importlib.import_module("h5store.typed_file").open(self.path)
                self._pid = os.getpid()
                if not len(self._file):
                    raise ValueError(f"{self.path}: no noise items in the file")
            view = self._file.feature(self.feature)
            rows = rng.integers(0, len(self._file), size=n)
            order = np.argsort(rows, kind="stable")
            got = view.read_many(rows[order])
        out: list[np.ndarray] = [None] * n  # type: ignore[list-item]
        for j, a in zip(order.tolist(), got):
            out[j] = np.asarray(a, dtype=np.float64).reshape(-1)
        return out


class AddNoise(Transform):
    """Noise mixed into each item at a random signal-to-noise ratio (in dB).

    The noise of item ``b`` is scaled so that ``10 log10(P_signal / P_noise) = snr``, with
    both powers measured over the item's real samples (its length); padding stays zero.

    Parameters
    ----------
    key : str
        The batch key of the waveforms, ``(B, T)`` (or ``(B, T, C)``).
    noise : str, array or (path, feature)
        Where noise comes from: another key of the same batch (e.g. a
        ``h5s.Window("noise", 16000)`` getter), one long noise signal (1-D array: a
        random stretch of it per item), or an h5store file of noise recordings
        ``(path, feature)`` (random items, read in the worker). Noise shorter than an item
        is repeated, longer is cropped at a random offset.
    snr_db : (float, float) or float
        SNR range, drawn uniformly per item.
    p : float
        Probability that an item gets noise.

    Examples
    --------
    >>> noise = np.random.default_rng(1).standard_normal(50_000)
    >>> t = AddNoise("x", noise, snr_db=10)
    >>> x = np.sin(np.arange(4000) / 5)[None].repeat(2, 0)
    >>> y = t({"x": x}, rng=batch_rng(0, 0, 0))["x"]
    >>> round(float(10 * np.log10((x**2).sum() / ((y - x) ** 2).sum())), 6)
    10.0
    """

    def __init__(self, key: str, noise: str | np.ndarray | tuple[str, str], snr_db: float | tuple[float, float] = (5.0, 20.0),
                 p: float = 1.0) -> None:
        self.key = key
        if isinstance(noise, tuple):
            self.noise: Any = _NoiseFile(*noise)
        elif isinstance(noise, str):
            self.noise = noise
        else:
            arr = np.asarray(noise, dtype=np.float64).reshape(-1)
            if not arr.size:
                raise ValueError("AddNoise: the noise signal is empty")
            self.noise = arr
        self.snr_db = _range(snr_db, "AddNoise snr_db")
        self.p = float(p)

    def _noise_rows(self, batch: Mapping[str, Any], rng: np.random.Generator, n: int) -> list[np.ndarray]:
        if isinstance(self.noise, str):
            src = batch[self.noise]
            src = src.cpu().numpy() if _is_torch(src) else np.asarray(src)
            lens = _lengths(batch, self.noise)
            return [np.asarray(src[b, : lens[b]], dtype=np.float64).reshape(-1) for b in range(n)]
        if isinstance(self.noise, _NoiseFile):
            return self.noise.draw(rng, n)
        return [self.noise] * n

    def apply(self, batch: Mapping[str, Any], rng: np.random.Generator) -> Any:
        x = batch[self.key]
        b, width = x.shape[0], x.shape[1]
        lengths = _lengths(batch, self.key)
        snr = rng.uniform(*self.snr_db, size=b)
        on = rng.random(b) < self.p
        rows = self._noise_rows(batch, rng, b)
        starts = rng.random(b)
        xs = x.detach().cpu().numpy() if _is_torch(x) else np.asarray(x)
        flat = xs.reshape(b, width, -1).astype(np.float64)  # (B, T, C)
        valid = _valid(lengths, width, 3)
        noise = np.zeros_like(flat)
        for j in range(b):  # building each item's noise: one vectorised take per item
            r = rows[j]
            n = int(lengths[j])
            if not n or not r.size:
                continue
            need = n * flat.shape[2]
            off = int(starts[j] * max(r.size - need, 0)) if r.size > need else 0
            idx = (off + np.arange(need)) % r.size
            noise[j, :n] = r[idx].reshape(n, flat.shape[2])
        p_sig = (flat**2 * valid).sum(axis=(1, 2))
        p_noise = (noise**2).sum(axis=(1, 2))
        scale = np.sqrt(np.divide(p_sig, p_noise * 10.0 ** (snr / 10.0), out=np.zeros(b), where=p_noise > 0))
        scale = np.where(on, scale, 0.0)
        added = _like(x, (noise * scale[:, None, None]).reshape(xs.shape))
        if _in_place(batch, self.key):
            np.add(x, added, out=x)
            return _out(batch)
        return _out(batch, **{self.key: x + added})


class TimeShift(Transform):
    """Shift each item in time by a random number of rows in ``[-max_shift, max_shift]``.

    ``mode="roll"`` wraps around within the item's real length (nothing is lost);
    ``mode="zero"`` fills the rows shifted in with zeros. Padding stays padding.

    Examples
    --------
    >>> x = np.arange(6, dtype=np.float32)[None]
    >>> TimeShift("x", 2)({"x": x}, rng=batch_rng(0, 0, 3))["x"].shape
    (1, 6)
    """

    def __init__(self, key: str, max_shift: int, mode: str = "roll", p: float = 1.0) -> None:
        if mode not in ("roll", "zero"):
            raise ValueError(f"TimeShift mode must be 'roll' or 'zero', got {mode!r}")
        if int(max_shift) < 0:
            raise ValueError(f"TimeShift max_shift must be >= 0, got {max_shift}")
        self.key = key
        self.max_shift = int(max_shift)
        self.mode = mode
        self.p = float(p)

    def apply(self, batch: Mapping[str, Any], rng: np.random.Generator) -> Any:
        x = batch[self.key]
        b, width = x.shape[0], x.shape[1]
        lengths = _lengths(batch, self.key)
        shift = rng.integers(-self.max_shift, self.max_shift + 1, size=b)
        shift = np.where(rng.random(b) < self.p, shift, 0)
        t = np.arange(width)[None, :]
        n = np.maximum(lengths, 1)[:, None]
        src = t - shift[:, None]
        inside = t < lengths[:, None]
        if self.mode == "roll":
            src = np.mod(src, n)
            keep = inside
        else:
            keep = inside & (src >= 0) & (src < lengths[:, None])
            src = np.clip(src, 0, width - 1)
        src = np.where(inside, src, t)  # padding rows stay where they are
        idx = src.reshape(src.shape + (1,) * (x.ndim - 2))
        if _is_torch(x):
            ii = _index(x, np.broadcast_to(idx, x.shape).copy())
            moved = x.gather(1, ii)
        else:
            moved = np.take_along_axis(x, np.broadcast_to(idx, x.shape), axis=1)
        keep = keep.reshape(keep.shape + (1,) * (x.ndim - 2))
        inside = inside.reshape(keep.shape)
        zero = x.new_zeros(()) if _is_torch(x) else x.dtype.type(0)
        out = _where(keep, moved, _where(inside, zero, x))  # padding rows keep what they held
        return _out(batch, **{self.key: out})


class _Masks(Transform):
    axis = 1

    def __init__(self, key: str, max_width: int, n: int = 1, value: float = 0.0) -> None:
        if int(max_width) < 0 or int(n) < 0:
            raise ValueError(f"{type(self).__name__}: max_width and n must be >= 0, got {max_width}, {n}")
        self.key = key
        self.max_width = int(max_width)
        self.n = int(n)
        self.value = float(value)

    def apply(self, batch: Mapping[str, Any], rng: np.random.Generator) -> Any:
        x = batch[self.key]
        if x.ndim != 3:
            raise ValueError(f"{type(self).__name__}({self.key!r}): expects (batch, time, frequency) values, got shape "
                             f"{tuple(x.shape)}")
        b, size = x.shape[0], x.shape[self.axis]
        span = _lengths(batch, self.key) if self.axis == 1 else np.full(b, size, np.int64)
        masked = np.zeros((b, size), dtype=bool)
        pos = np.arange(size)[None, :]
        for _ in range(self.n):
            w = np.minimum(rng.integers(0, self.max_width + 1, size=b), span)
            start = (rng.random(b) * (span - w + 1)).astype(np.int64)
            masked |= (pos >= start[:, None]) & (pos < (start + w)[:, None])
        shape = (b, size, 1) if self.axis == 1 else (b, 1, size)
        fill = x.new_full((), self.value) if _is_torch(x) else x.dtype.type(self.value)
        if _in_place(batch, self.key):
            np.copyto(x, fill, where=masked.reshape(shape))
            return _out(batch)
        out = _where(masked.reshape(shape), fill, x)
        return _out(batch, **{self.key: out})


class TimeMask(_Masks):
    """SpecAugment time masking: ``n`` bands of up to ``max_width`` frames set to ``value``.

    Bands fall within each item's real length. Values ``(B, T, F)``.

    Examples
    --------
    >>> x = np.ones((2, 50, 8), np.float32)
    >>> y = TimeMask("x", 10, n=2)({"x": x}, rng=batch_rng(0, 0, 0))["x"]
    >>> bool((y == 0).any()), y.shape
    (True, (2, 50, 8))
    """

    axis = 1


class FreqMask(_Masks):
    """SpecAugment frequency masking: ``n`` bands of up to ``max_width`` bins set to ``value``.

    Examples
    --------
    >>> x = np.ones((2, 50, 80), np.float32)
    >>> y = FreqMask("x", 27, n=2)({"x": x}, rng=batch_rng(0, 0, 0))["x"]
    >>> y.shape
    (2, 50, 80)
    """

    axis = 2


def SpecAugment(key: str, freq_width: int = 27, freq_masks: int = 2, time_width: int = 40, time_masks: int = 2,
                value: float = 0.0) -> Compose:
    """SpecAugment's masking (Park et al., 2019): frequency then time masks (no time warping).

    Examples
    --------
    >>> t = SpecAugment("mel")
    >>> [type(x).__name__ for x in t.transforms]
    ['FreqMask', 'TimeMask']
    """
    return Compose([FreqMask(key, freq_width, freq_masks, value), TimeMask(key, time_width, time_masks, value)])


class Mixup(Transform):
    """Mixup (Zhang et al., 2018) of items within a batch: ``x = lam x + (1 - lam) x[perm]``.

    One ``lam ~ Beta(alpha, alpha)`` per batch (kept ``>= 0.5`` so the first item
    dominates) and one permutation of the batch. Padded keys take the longer length of
    each pair. Labels: with ``num_classes`` the ``label`` key becomes mixed one-hot
    targets (float32); without, the batch gains ``{label}_mix`` (the partners' labels)
    and ``mixup_lambda`` for a mixed loss.

    Examples
    --------
    >>> b = {"x": np.ones((4, 3), np.float32), "y": np.array([0, 1, 2, 3])}
    >>> out = Mixup("x", label="y", num_classes=4)(b, rng=batch_rng(0, 0, 0))
    >>> out["y"].shape, np.allclose(out["y"].sum(1), 1)
    ((4, 4), True)
    """

    def __init__(self, keys: str | Sequence[str], alpha: float = 0.2, label: str | None = None,
                 num_classes: int | None = None) -> None:
        self.keys = [keys] if isinstance(keys, str) else list(keys)
        if alpha <= 0:
            raise ValueError(f"Mixup alpha must be > 0, got {alpha}")
        self.alpha = float(alpha)
        self.label = label
        self.num_classes = None if num_classes is None else int(num_classes)

    def apply(self, batch: Mapping[str, Any], rng: np.random.Generator) -> Any:
        first = batch[self.keys[0]]
        b = first.shape[0]
        lam = float(rng.beta(self.alpha, self.alpha))
        lam = max(lam, 1.0 - lam)
        perm = rng.permutation(b)
        changed: dict[str, Any] = {}
        for key in self.keys:
            x = batch[key]
            p = _index(x, perm)
            changed[key] = x * lam + x[p] * (1.0 - lam)
            n = batch.get(f"{key}_lengths")
            if n is not None:
                pn = _index(n, perm)
                changed[f"{key}_lengths"] = n.maximum(n[pn]) if _is_torch(n) else np.maximum(n, n[pn])
        if self.label is not None:
            y = batch[self.label]
            py = _index(y, perm)
            if self.num_classes is not None:
                ys = np.asarray(y.cpu() if _is_torch(y) else y, dtype=np.int64)
                onehot = np.eye(self.num_classes, dtype=np.float32)[ys]
                changed[self.label] = _like(y, lam * onehot + (1.0 - lam) * onehot[perm], dtype=_float32_of(y))
            else:
                changed[f"{self.label}_mix"] = y[py]
                changed["mixup_lambda"] = _like(y, np.full(b, lam), dtype=_float32_of(y))
        return _out(batch, **changed)


def _float32_of(x: Any) -> Any:
    if _is_torch(x):
        import torch

        return torch.float32
    return np.float32
