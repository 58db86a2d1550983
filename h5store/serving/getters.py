"""Getters: what each entry of a served batch is made of.

A batch is declared as a dict of getters, ``dict(x=h5s.Window("mel", 64), y=h5s.Label("label"))``.
A getter reads a whole batch at once: it receives the items' positions (numpy) and
returns one numpy array for the batch (or a :class:`Padded` array with lengths, or a
list for values that are not arrays, such as text). No torch here: the same getters feed
PyTorch, tf.data and plain numpy loops.

Subclass :class:`Getter` for your own::

    class Energy(h5s.Getter):
        def __init__(self, feature):
            self.features = (feature,)
        def fetch(self, files, request):
            mel = h5s.Item(self.features[0]).fetch(files, request)
            return (mel.values ** 2).sum(axis=(1, 2))
        def signature(self, files):
            return np.dtype("float32"), ()

Random crops are reproducible: a :class:`Window`'s offset is a hash (splitmix64) of
``(seed, epoch, example index)``, computed for the whole batch with numpy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from h5store.errors import SchemaError
from h5store.layout import count_windows

if TYPE_CHECKING:
    from h5store.serving.files import FileSet

__all__ = ["Clips", "Encoded", "Frames", "Getter", "Id", "ImageCrop", "Item", "Label", "Padded", "Position", "Request",
           "Window", "crop_boxes", "mix64"]

_I64 = np.int64
_U64 = np.uint64


class Padded(NamedTuple):
    """A batch of variable-length values, zero-padded along axis 1, with their lengths.

    ``always`` says whether the ``{key}_lengths`` entry is part of every batch (True for
    whole variable-length items) or only with ``mask=True`` (fixed-size windows).
    """

    values: np.ndarray
    lengths: np.ndarray
    always: bool = True


class Request:
    """What a getter is asked for: one batch of examples.

    Attributes
    ----------
    items : (B,) int64
        Position of each example's item in the served files (global across
        :func:`~h5store.concat`'d files).
    subs : (B,) int64
        Which example of its item each one is, for getters that make several examples
        of one item (:class:`Frames`); zeros otherwise.
    indices : (B,) int64
        The examples' dataset indices (what the sampler drew).
    epoch : int
        The epoch the batch belongs to (reshuffles random crops).
    seed : int
        The dataset's seed.
    params : mapping
        The shared parameters (:class:`~h5store.serving.shared.SharedParams`).
    """

    __slots__ = ("epoch", "indices", "items", "params", "seed", "subs")

    def __init__(self, items: np.ndarray, subs: np.ndarray, indices: np.ndarray, epoch: int, seed: int,
                 params: Mapping[str, Any]) -> None:
        self.items = items
        self.subs = subs
        self.indices = indices
        self.epoch = epoch
        self.seed = seed
        self.params = params

    def __len__(self) -> int:
        return len(self.items)


class Getter(ABC):
    """Base class of batch entries. Subclass it to serve something of your own.

    Set ``features`` (the names read; ``"group/name"`` for a feature of a group) and
    define :meth:`fetch`. Override :meth:`counts` to change how many examples an item
    makes (0 drops it, 3 makes three), :meth:`check` to validate against the file when
    the dataset is made, and :meth:`signature` to describe one example (tf.data needs it).

    Examples
    --------
    >>> import h5store as h5s, numpy as np
    >>> class Ones(h5s.Getter):
    ...     features = ()
    ...     def fetch(self, files, request):
    ...         return np.ones(len(request), dtype="float32")
    ...     def signature(self, files):
    ...         return np.dtype("float32"), ()
    """

    features: tuple[str, ...] = ()

    def check(self, files: FileSet) -> None:
        """Raise :class:`~h5store.errors.SchemaError` when this getter cannot read ``files``."""
        for name in self.features:
            files.feature(_name(name))

    def counts(self, files: FileSet, params: Mapping[str, Any]) -> np.ndarray | None:
        """Examples per item (int64, one entry per item), or None for one each."""
        return None

    @abstractmethod
    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        """The batch's values: an array with the batch on axis 0, a :class:`Padded`, or a list."""

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        """dtype and shape of one example (``None`` for a variable axis; dtype object for str)."""
        raise SchemaError(f"{type(self).__name__} does not describe its output: define signature()")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k != "features")
        return f"{type(self).__name__}({args})"


def _name(ref: str) -> str:
    # Getters name a feature as "mel" or "group/mel"; FileSet serves one group.
    return ref.rpartition("/")[2]


# --------------------------------------------------------------------------- hashing
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1
_S30, _S27, _S31 = _U64(30), _U64(27), _U64(31)
_GOLDEN_INT, _M1_INT, _M2_INT = int(_GOLDEN), int(_M1), int(_M2)


def _mix_int(h: int, x: int) -> int:
    """One splitmix64 round on Python ints (scalars: no numpy call per operation)."""
    z = ((h ^ (x & _MASK)) + _GOLDEN_INT) & _MASK
    z = ((z ^ (z >> 30)) * _M1_INT) & _MASK
    z = ((z ^ (z >> 27)) * _M2_INT) & _MASK
    return z ^ (z >> 31)


def mix64(*parts: np.ndarray | int) -> np.ndarray:
    """splitmix64 over the parts, element-wise: a well-mixed uint64 per element.

    Used for reproducible per-example randomness without a Generator per example.
    Scalar parts are mixed as Python ints, array parts with numpy (in place): the same
    values either way.

    Examples
    --------
    >>> a = mix64(0, 1, np.arange(3))
    >>> a.dtype, (a == mix64(0, 1, np.arange(3))).all(), len(set(a.tolist()))
    (dtype('uint64'), np.True_, 3)
    """
    h: int | np.ndarray = 0
    for p in parts:
        if not np.ndim(p):
            x = int(p)
            if isinstance(h, int):
                h = _mix_int(h, x)
                continue
            z = h ^ _U64(x & _MASK)
        else:
            z = np.asarray(p).astype(_U64)  # a copy: mixed in place below
            z ^= h if isinstance(h, np.ndarray) else _U64(h)
        z += _GOLDEN  # (uint64 arrays wrap around silently)
        z ^= z >> _S30
        z *= _M1
        z ^= z >> _S27
        z *= _M2
        z ^= z >> _S31
        h = z
    return h if isinstance(h, np.ndarray) else np.array([h], dtype=_U64)


def _resolve(length: int | str, params: Mapping[str, Any], who: str) -> int:
    if isinstance(length, str):
        try:
            value = params[length]
        except KeyError:
            raise SchemaError(f"{who}: no shared parameter {length!r}; pass params=dict({length}=...)") from None
    else:
        value = length
    if isinstance(value, bool) or int(value) != value or int(value) <= 0:
        raise SchemaError(f"{who}: length must be an int > 0, got {value!r}")
    return int(value)


def _ragged(files: FileSet, name: str, who: str) -> None:
    spec = files.spec(name)
    if spec.layout == "fixed":
        raise SchemaError(f"{who}: {files.where(name)} has fixed-shape items {spec.shape}; windows need a variable first axis")


def _decode_many(files: FileSet, name: str, raws: list[Any]) -> list[Any]:
    feat = files.feature(name)
    return [feat.decode(r) for r in raws]


def _collate_values(values: list[Any], alloc: Any) -> tuple[np.ndarray | list[Any], np.ndarray | None]:
    """Stack equal-shaped arrays; zero-pad differing ones on every axis (lengths of axis 0)."""
    numeric = (np.ndarray, np.generic, int, float)  # bool is an int
    if not values or not all(isinstance(v, numeric) for v in values):
        return list(values), None
    arrays = [np.asarray(v) for v in values]
    shape0 = arrays[0].shape
    lengths = np.array([a.shape[0] if a.ndim else 1 for a in arrays], dtype=_I64)
    dtype = np.result_type(*{a.dtype for a in arrays})
    if all(a.shape == shape0 for a in arrays):
        out = alloc((len(arrays), *shape0), dtype)
        for j, a in enumerate(arrays):
            out[j] = a
        return out, lengths
    if len({a.ndim for a in arrays}) != 1:
        raise SchemaError(f"decoded items differ in number of dimensions: {sorted({a.shape for a in arrays})}")
    big = tuple(max(s) for s in zip(*(a.shape for a in arrays)))
    out = alloc((len(arrays), *big), dtype)
    out[...] = 0
    for j, a in enumerate(arrays):
        out[(j, *(slice(0, d) for d in a.shape))] = a
    return out, lengths


def _decoded_signature(files: FileSet, name: str, variable: bool) -> tuple[np.dtype, tuple[int | None, ...]]:
    present = np.flatnonzero(files.present(name))
    if not present.size:
        raise SchemaError(f"{files.where(name)}: no item to learn the decoded shape from")
    value = _decode_many(files, name, files.read_items(name, present[:1]))[0]
    if not isinstance(value, (np.ndarray, np.generic, int, float)):
        return np.dtype(object), ()
    value = np.asarray(value)
    shape: tuple[int | None, ...] = value.shape
    if variable and value.ndim:
        shape = (None, *value.shape[1:])
    return value.dtype, shape


# --------------------------------------------------------------------------- getters
class Item(Getter):
    """The whole item of a feature.

    Variable-length items are zero-padded to the longest in the batch and come with
    ``{key}_lengths`` (int64); fixed shapes are stacked; scalars give a ``(B,)`` array;
    :class:`~h5store.Text` gives a list of str. Features with their own ``decode``
    (encoded images, video frames) are decoded item by item, then stacked (or padded on
    every axis when shapes differ).

    Parameters
    ----------
    feature : str
        The feature (``"group/name"`` for one of a group).
    lengths : bool or None
        Return ``{key}_lengths`` with the values. Default: for every variable-length
        item (decoded ones too: a video's frame count, an image's rows), in torch, tf.data
        and numpy alike.

    Examples
    --------
    >>> batch = dict(x=h5s.Item("mel"), text=h5s.Item("text"))  # doctest: +SKIP
    >>> # -> x (B, Tmax, 80) float32, x_lengths (B,) int64, text: list of str
    """

    def __init__(self, feature: str, lengths: bool | None = None) -> None:
        self.feature = feature
        self.lengths = lengths
        self.features = (feature,)

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        name = _name(self.feature)
        items = request.items
        spec = files.spec(name)
        if files.decoded(name):
            values, lengths = _collate_values(_decode_many(files, name, files.read_items(name, items)), files.alloc)
            wanted = self.lengths if self.lengths is not None else spec.layout != "fixed"
            if wanted and lengths is not None and isinstance(values, np.ndarray):
                return Padded(values, lengths)
            return values
        if spec.layout == "fixed":
            return files.read_fixed(name, items)
        if spec.layout == "blobs":
            return files.read_items(name, items)
        count = files.lengths(name)[items]
        width = int(count.max()) if len(count) else 0
        values = files.read_padded(name, items, 0, count, width)
        return values if self.lengths is False else Padded(values, count)

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        name = _name(self.feature)
        spec = files.spec(name)
        if files.decoded(name) or spec.layout == "blobs":
            return _decoded_signature(files, name, spec.layout != "fixed")
        return spec.np_dtype, tuple(spec.shape)


class Window(Getter):
    """A fixed-length crop of each item: ``length`` rows from a random (or fixed) offset.

    Parameters
    ----------
    feature : str
        A feature with a variable first axis.
    length : int or str
        Rows per window, or the name of a shared parameter holding it (changed during
        training with ``dataset.params.<name> = ...``).
    random : bool
        Random offsets, reproducible from ``(seed, epoch, example index)``: the same seed
        and epoch give the same crops, another epoch others. Two windows of the same length
        over features of equal lengths (mel and mag) get the same offsets, so they stay
        aligned. ``random=False`` starts at row 0, or with ``hop`` at ``hop * (epoch mod
        positions)``, sweeping each item over the epochs.
    hop : int or None
        Offsets are multiples of ``hop`` (default 1).
    pad : {"zero", "skip"}
        Items shorter than ``length`` are zero-padded ("zero"; ``mask=True`` then returns
        ``{key}_mask`` and ``{key}_lengths``), or left out of the dataset ("skip", decided
        once with the length the dataset is made with).

    Examples
    --------
    >>> batch = dict(x=h5s.Window("mel", 64), y=h5s.Window("mag", 64))  # aligned crops  # doctest: +SKIP
    >>> ds = FileDataset(f, dict(x=h5s.Window("mel", "crop")), params=dict(crop=64))  # doctest: +SKIP
    >>> ds.params.crop = 128  # every worker crops 128 rows from its next batch  # doctest: +SKIP
    """

    def __init__(self, feature: str, length: int | str, random: bool = True, hop: int | None = None,
                 pad: str = "zero") -> None:
        if pad not in ("zero", "skip"):
            raise ValueError(f"Window({feature!r}): pad must be 'zero' or 'skip', got {pad!r}")
        if not isinstance(length, str) and (isinstance(length, bool) or int(length) <= 0):
            raise ValueError(f"Window({feature!r}): length must be > 0 or a parameter name, got {length!r}")
        if hop is not None and int(hop) <= 0:
            raise ValueError(f"Window({feature!r}): hop must be > 0, got {hop!r}")
        self.feature = feature
        self.length = length if isinstance(length, str) else int(length)
        self.random = random
        self.hop = None if hop is None else int(hop)
        self.pad = pad
        self.features = (feature,)

    def check(self, files: FileSet) -> None:
        super().check(files)
        _ragged(files, _name(self.feature), repr(self))

    def counts(self, files: FileSet, params: Mapping[str, Any]) -> np.ndarray | None:
        if self.pad != "skip":
            return None
        length = _resolve(self.length, params, repr(self))
        return (files.lengths(_name(self.feature)) >= length).astype(_I64)

    def offsets(self, lengths: np.ndarray, length: int, request: Request) -> np.ndarray:
        """First row of each window, for items of ``lengths`` rows."""
        hop = self.hop or 1
        room = lengths - length
        positions = np.where(room > 0, room // hop + 1, 1)
        if self.random:
            h = mix64(request.seed, request.epoch, request.indices)
            pick = (h % positions.astype(_U64)).astype(_I64)
        elif self.hop:
            pick = request.epoch % positions
        else:
            return np.zeros(len(lengths), _I64)
        return pick * hop

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        name = _name(self.feature)
        length = _resolve(self.length, request.params, repr(self))
        lengths = files.lengths(name)[request.items]
        first = self.offsets(lengths, length, request)
        count = np.clip(lengths - first, 0, length)
        if files.spec(name).layout == "blobs":
            raws = files.read_blobs(name, request.items, first, count)
            return _decoded_window(files, name, raws, count, length)
        values = files.read_padded(name, request.items, first, count, length)
        if files.decoded(name):
            raws = [values[j, :c] for j, c in enumerate(count.tolist())]
            return _decoded_window(files, name, raws, count, length)
        return Padded(values, count, always=False)

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        name = _name(self.feature)
        spec = files.spec(name)
        length = self.length if isinstance(self.length, int) else None
        if files.decoded(name) or spec.layout == "blobs":
            dtype, shape = _decoded_signature(files, name, True)
            return dtype, (length, *shape[1:])
        return spec.np_dtype, (length, *spec.inner)


def _decoded_window(files: FileSet, name: str, raws: list[Any], count: np.ndarray, length: int) -> Padded:
    feat = files.feature(name)
    blob = getattr(feat, "decode_blob", None)
    if files.spec(name).layout == "blobs" and callable(blob):
        values = [np.stack([blob(b) for b in r]) if len(r) else None for r in raws]
    else:
        values = [feat.decode(r) if len(r) else None for r in raws]
    example = next((v for v in values if v is not None), None)
    if example is None:
        raise SchemaError(f"{files.where(name)}: every item of the batch is empty; nothing to window")
    if not isinstance(example, np.ndarray) or example.dtype.kind not in "biufc":
        raise SchemaError(f"{files.where(name)}: decodes to {type(example).__name__}, not numeric arrays; "
                          "windows need arrays (use Item)")
    out = files.alloc((len(values), length, *example.shape[1:]), example.dtype)
    out[...] = 0
    for j, v in enumerate(values):
        if v is not None:
            out[j, : len(v)] = v
    return Padded(out, count, always=False)


class Frames(Getter):
    """Every window of every item as its own example (the dataset grows to the window count).

    Windows of ``length`` rows start every ``hop`` rows; only whole windows are served
    (an item shorter than ``length`` makes none). Other getters of the batch read the item
    each window comes from.

    Examples
    --------
    >>> ds = FileDataset(f, dict(x=h5s.Frames("mel", 64, hop=32), y=h5s.Label("label")))  # doctest: +SKIP
    >>> len(ds) == h5store.layout.count_windows(f.mel.lengths, 64, 32).sum()  # doctest: +SKIP
    True
    """

    def __init__(self, feature: str, length: int, hop: int | None = None) -> None:
        if isinstance(length, bool) or int(length) <= 0:
            raise ValueError(f"Frames({feature!r}): length must be an int > 0, got {length!r}")
        if hop is not None and int(hop) <= 0:
            raise ValueError(f"Frames({feature!r}): hop must be > 0, got {hop!r}")
        self.feature = feature
        self.length = int(length)
        self.hop = int(hop) if hop is not None else int(length)
        self.features = (feature,)

    def check(self, files: FileSet) -> None:
        super().check(files)
        _ragged(files, _name(self.feature), repr(self))

    def counts(self, files: FileSet, params: Mapping[str, Any]) -> np.ndarray | None:
        return count_windows(files.lengths(_name(self.feature)), self.length, self.hop)

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        name = _name(self.feature)
        first = request.subs * self.hop
        count = np.full(len(request), self.length, dtype=_I64)
        if files.spec(name).layout == "blobs":
            return _decode_clips(files, name, files.read_blobs(name, request.items, first, count), count,
                                 self.length).values
        values = files.read_padded(name, request.items, first, count, self.length)
        if files.decoded(name):
            return _decoded_window(files, name, list(values), count, self.length).values
        return values

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        name = _name(self.feature)
        spec = files.spec(name)
        if files.decoded(name) or spec.layout == "blobs":
            dtype, shape = _decoded_signature(files, name, True)
            return dtype, (self.length, *shape[1:])
        return spec.np_dtype, (self.length, *spec.inner)


class Label(Getter):
    """A scalar per item as a number: int64 for integer and bool features, the stored float otherwise.

    Reads the stored numbers (no decoding), so a class-label feature gives class indices.

    Examples
    --------
    >>> batch = dict(x=h5s.Window("mel", 64), y=h5s.Label("label"))  # doctest: +SKIP
    """

    def __init__(self, feature: str | None = None) -> None:
        if not isinstance(feature, str):
            # What a user of datasets/h5mapper writes for a schema's label column: say what to write.
            raise TypeError(f"h5s.Label(feature) serves a stored feature, named by a str: h5s.Label('label'), got "
                            f"{feature!r}; to store a label, declare a Feature in the schema: "
                            "label = h5s.Scalar(dtype='int64'), h5s.Text() or h5s.DirLabel()")
        self.feature = feature
        self.features = (feature,)

    def check(self, files: FileSet) -> None:
        super().check(files)
        spec = files.spec(_name(self.feature))
        if spec.layout != "fixed" or int(np.prod(spec.inner, dtype=_I64)) != 1:
            raise SchemaError(f"{self!r}: {files.where(_name(self.feature))} is not one number per item "
                              f"(shape {spec.shape}); use Item() for arrays")

    def _dtype(self, files: FileSet) -> np.dtype:
        dt = files.spec(_name(self.feature)).np_dtype
        return np.dtype(_I64) if dt.kind in "biu" else dt

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        values = files.read_fixed(_name(self.feature), request.items)
        if values.ndim != 1:
            values = values.reshape(len(request))
        dt = self._dtype(files)
        if values.dtype == dt:
            return values
        out = files.alloc(values.shape, dt)
        out[...] = values
        return out

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        return self._dtype(files), ()


class Position(Getter):
    """The position of each example's item in the served files (int64), or its dataset index.

    Handy to look an example up again (``f.ids[p]``), and to check what was served.

    Parameters
    ----------
    of : {"item", "example"}
        The item's position in the file(s) (global across :func:`~h5store.concat`), or
        the example's index in the dataset (what the sampler drew).

    Examples
    --------
    >>> batch = dict(x=h5s.Item("mel"), pos=h5s.Position())  # doctest: +SKIP
    """

    def __init__(self, of: str = "item") -> None:
        if of not in ("item", "example"):
            raise ValueError(f"Position: of must be 'item' or 'example', got {of!r}")
        self.of = of
        self.features = ()

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        src = request.items if self.of == "item" else request.indices
        out = files.alloc((len(src),), _I64)
        out[...] = src
        return out

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype(_I64), ()


class Id(Getter):
    """The id of each example's item: a list of str, in batch order.

    Over a :func:`~h5store.concat` of files (and in :func:`~h5store.interleave`) an id alone
    may name items of several files, so each is ``"path::id"`` (the file's path as opened):
    ``path, _, id = value.rpartition("::")``. In a batch: a list of str (PyTorch and
    ``iter_batches``, as text), a ``tf.string`` tensor (tf.data). The ids stay aligned with
    the other values of the batch, also when ``verify="skip"`` leaves damaged items out.

    Parameters
    ----------
    file : bool or None
        Prefix each id with its file's path and ``"::"``: None (default) over a concat,
        True always, False never (bare ids, ambiguous across files).

    Examples
    --------
    >>> b = next(iter(f.serve(dict(x=h5s.Item("mel"), id=h5s.Id()), batch_size=2)))  # doctest: +SKIP
    >>> b["id"]  # doctest: +SKIP
    ['utt000', 'utt001']
    """

    def __init__(self, file: bool | None = None) -> None:
        if file is not None and not isinstance(file, bool):
            raise ValueError(f"Id: file must be True, False or None, got {file!r}")
        self.file = file
        self.features = ()

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        qualify = files.concat if self.file is None else self.file
        return files.ids(request.items, qualify)

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype(object), ()


# --------------------------------------------------------------------------- video clips, encoded bytes
def _decode_clips(files: FileSet, name: str, raws: list[list[Any]], count: np.ndarray, length: int,
                  min_size: tuple[int, int] | None = None) -> Padded:
    """Clips of encoded frames decoded straight into one ``(B, length, H, W, C)`` batch buffer."""
    feat = files.feature(name)
    into = getattr(feat, "decode_into", None)
    if into is None:
        return _decoded_window(files, name, raws, count, length)
    first = next((r[0] for r in raws if len(r)), None)
    if first is None:
        raise SchemaError(f"{files.where(name)}: every item of the batch is empty; nothing to clip")
    shape = tuple(feat.frame_shape(first, min_size))
    out = files.alloc((len(raws), length, *shape), np.uint8)
    many = getattr(feat, "decode_frames_into", None)
    for j, r in enumerate(raws):
        try:
            if many is not None:
                many(r, out[j, : len(r)], min_size)
            else:
                for t, blob in enumerate(r):
                    into(blob, out[j, t], min_size)
        except SchemaError as e:
            raise SchemaError(f"{files.where(name)}: {e} (videos of one batch must share a frame size: "
                              "pass min_size to decode them smaller, or serve them with Item)") from None
        if len(r) < length:
            out[j, len(r):] = 0
    return Padded(out, count, always=False)


class Clips(Getter):
    """Clips of ``length`` consecutive frames of each video, one or several per video per epoch.

    Between :class:`Window` (one clip per video per epoch: a 400-frame video weighs as much
    as a 10-frame one) and :class:`Frames` (every clip): each video makes ``per_item``
    clips, or one per ``every`` frames (in proportion to its length). A video's clips are
    spread over it as TSN-style segments: clip ``j`` of ``n`` starts in the ``j``-th of ``n``
    equal parts of the possible offsets, at a position drawn from ``(seed, epoch, example
    index)`` (reproducible, new each epoch), or in the middle of its part with
    ``random=False``. Only the clip's frames are read and decoded (GIL released), straight
    into the batch buffer.

    Parameters
    ----------
    feature : str
        An :class:`~h5store.EncodedFrames` feature (any "blobs" or variable-length feature).
    length : int
        Frames per clip.
    per_item : int
        Clips per video per epoch (ignored when ``every`` is given).
    every : int, optional
        One clip per ``every`` frames of a video (at least one): ``ceil(frames / every)``.
    random : bool
        Random offsets within each clip's segment (default), or the middle of it.
    encoded : bool
        Return the clip's stored bytes instead of pixels: a ``(B, length)`` object array of
        ``bytes`` (``b""`` past a short video's end; ``tf.string`` in tf.data) with
        ``{key}_lengths``, to decode on an accelerator (``tf.io.decode_jpeg``,
        ``torchvision.io.decode_jpeg(device="cuda")``, nvJPEG, DALI).
    min_size : (int, int), optional
        Decode frames at 1/2, 1/4 or 1/8 scale inside the IDCT, the smallest whose
        ``(height, width)`` are at least these (simplejpeg; PIL's ``draft`` without it).
    pad : {"zero", "skip"}
        Videos shorter than ``length``: zero-padded (``mask=True`` adds ``{key}_lengths`` and
        ``{key}_mask``) or left out.

    Examples
    --------
    >>> batch = dict(clip=h5s.Clips("video", 8, every=16), y=h5s.Label("label"))  # doctest: +SKIP
    >>> b = next(iter(f.serve(batch, batch_size=16, shuffle=True)))  # doctest: +SKIP
    >>> b["clip"].shape  # doctest: +SKIP
    torch.Size([16, 8, 96, 128, 3])
    """

    def __init__(self, feature: str, length: int, per_item: int = 1, every: int | None = None, random: bool = True,
                 encoded: bool = False, min_size: tuple[int, int] | None = None, pad: str = "zero") -> None:
        for what, v in (("length", length), ("per_item", per_item), ("every", 1 if every is None else every)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"Clips({feature!r}): {what} must be an int > 0, got {v!r}")
        if pad not in ("zero", "skip"):
            raise ValueError(f"Clips({feature!r}): pad must be 'zero' or 'skip', got {pad!r}")
        if min_size is not None and (len(min_size) != 2 or min(int(v) for v in min_size) <= 0):
            raise ValueError(f"Clips({feature!r}): min_size must be (height, width) > 0, got {min_size!r}")
        self.feature = feature
        self.length = int(length)
        self.per_item = int(per_item)
        self.every = None if every is None else int(every)
        self.random = bool(random)
        self.encoded = bool(encoded)
        self.min_size = None if min_size is None else (int(min_size[0]), int(min_size[1]))
        self.pad = pad
        self.features = (feature,)

    def check(self, files: FileSet) -> None:
        super().check(files)
        _ragged(files, _name(self.feature), repr(self))
        if self.encoded and files.spec(_name(self.feature)).layout != "blobs":
            raise SchemaError(f"{self!r}: encoded=True needs frames stored as blobs (EncodedFrames), "
                              f"{files.where(_name(self.feature))} is not")

    def _per(self, lengths: np.ndarray) -> np.ndarray:
        if self.every is not None:
            return np.maximum(1, -(-lengths // self.every)).astype(_I64)
        return np.full(len(lengths), self.per_item, _I64)

    def counts(self, files: FileSet, params: Mapping[str, Any]) -> np.ndarray | None:
        lengths = files.lengths(_name(self.feature))
        per = self._per(lengths)
        return per * (lengths >= self.length) if self.pad == "skip" else per

    def offsets(self, lengths: np.ndarray, request: Request) -> np.ndarray:
        """First frame of each clip: clip ``subs`` of its video's ``n``, in its segment."""
        positions = np.maximum(lengths - self.length, 0) + 1
        n = self._per(lengths)
        j = np.minimum(request.subs, n - 1)
        lo = j * positions // n
        width = np.maximum((j + 1) * positions // n - lo, 1)
        if self.random:
            pick = (mix64(request.seed, request.epoch, request.indices) % width.astype(_U64)).astype(_I64)
        else:
            pick = (width - 1) // 2
        return np.minimum(lo + pick, positions - 1)

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        name = _name(self.feature)
        lengths = files.lengths(name)[request.items]
        first = self.offsets(lengths, request)
        count = np.clip(lengths - first, 0, self.length)
        if files.spec(name).layout != "blobs":
            values = files.read_padded(name, request.items, first, count, self.length)
            if files.decoded(name):
                return _decoded_window(files, name, [values[j, :c] for j, c in enumerate(count.tolist())], count,
                                       self.length)
            return Padded(values, count, always=False)
        raws = files.read_blobs(name, request.items, first, count)
        if self.encoded:
            out = np.full((len(raws), self.length), b"", dtype=object)
            for j, r in enumerate(raws):
                for t, blob in enumerate(r):
                    out[j, t] = blob.tobytes() if isinstance(blob, np.ndarray) else bytes(blob)
            return Padded(out, count, always=True)
        return _decode_clips(files, name, raws, count, self.length, self.min_size)

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        name = _name(self.feature)
        spec = files.spec(name)
        if self.encoded:
            return np.dtype(object), (self.length,)
        if spec.layout == "blobs":
            feat = files.feature(name)
            present = np.flatnonzero(files.present(name))
            if present.size and callable(getattr(feat, "frame_shape", None)):
                blob = files.read_blobs(name, present[:1], np.zeros(1, _I64), np.ones(1, _I64))[0][0]
                return np.dtype(np.uint8), (self.length, *feat.frame_shape(blob, self.min_size))
        if files.decoded(name) or spec.layout == "blobs":
            dtype, shape = _decoded_signature(files, name, True)
            return dtype, (self.length, *shape[1:])
        return spec.np_dtype, (self.length, *spec.inner)


class Encoded(Getter):
    """The stored bytes of each item, undecoded: an image's JPEG/PNG file as it was ingested.

    For decoding elsewhere: in the graph (``tf.io.decode_jpeg`` / ``decode_image`` in a
    parallel ``map``) or on an accelerator (``torchvision.io.decode_jpeg(..., device="cuda")``,
    nvJPEG, DALI). A batch is a list of ``bytes`` (PyTorch, numpy) or a ``(B,)`` ``tf.string``
    tensor. For video clips use ``Clips(..., encoded=True)``.

    Examples
    --------
    >>> ds = f.to_tf_dataset(dict(jpeg=h5s.Encoded("image"), y=h5s.Label("label")), batch_size=32)  # doctest: +SKIP
    >>> ds = ds.map(lambda b: (tf.map_fn(tf.io.decode_jpeg, b["jpeg"], fn_output_signature=tf.uint8), b["y"]))  # doctest: +SKIP
    """

    def __init__(self, feature: str) -> None:
        self.feature = feature
        self.features = (feature,)

    def check(self, files: FileSet) -> None:
        super().check(files)
        spec = files.spec(_name(self.feature))
        if spec.layout == "blobs":
            raise SchemaError(f"{self!r}: {files.where(_name(self.feature))} holds several blobs per item (frames); "
                              "use Clips(..., encoded=True) for their bytes")
        if spec.np_dtype != np.uint8 or tuple(spec.shape) != (None,):
            raise SchemaError(f"{self!r}: {files.where(_name(self.feature))} is not stored as bytes "
                              f"(dtype {spec.np_dtype}, shape {spec.shape}); Encoded serves encoded images")

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        raws = files.read_items(_name(self.feature), request.items)
        return [r.tobytes() if isinstance(r, np.ndarray) else bytes(r) for r in raws]

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype(object), ()


# --------------------------------------------------------------------------- images: random resized crops
def _uniform(seed: int, epoch: int, indices: np.ndarray, stream: int) -> np.ndarray:
    """A uniform in [0, 1) per example, from ``(seed, epoch, index, stream)`` (splitmix64)."""
    return (mix64(seed, epoch, indices, stream) >> _U64(11)).astype(np.float64) / float(1 << 53)


def crop_boxes(heights: np.ndarray, widths: np.ndarray, scale: tuple[float, float], ratio: tuple[float, float],
               seed: int, epoch: int, indices: np.ndarray, attempts: int = 10) -> np.ndarray:
    """torchvision's ``RandomResizedCrop`` boxes ``(top, left, height, width)``, one per example.

    Up to ``attempts`` draws of an area fraction in ``scale`` and a log-uniform aspect ratio in
    ``ratio``; the first that fits the image wins, else the centre crop of the ratio clamped
    to ``ratio``. Reproducible from ``(seed, epoch, example index)``, computed for the batch.

    Examples
    --------
    >>> b = crop_boxes(np.array([100]), np.array([200]), (0.08, 1.0), (3 / 4, 4 / 3), 0, 0, np.array([5]))
    >>> bool((b[:, 2] <= 100).all() and (b[:, 3] <= 200).all())
    True
    """
    h = heights.astype(np.float64)
    w = widths.astype(np.float64)
    n = len(h)
    out = np.zeros((n, 4), _I64)
    done = np.zeros(n, bool)
    lo, hi = np.log(ratio[0]), np.log(ratio[1])
    for a in range(attempts):
        area = h * w * (scale[0] + (scale[1] - scale[0]) * _uniform(seed, epoch, indices, 4 * a))
        r = np.exp(lo + (hi - lo) * _uniform(seed, epoch, indices, 4 * a + 1))
        cw = np.round(np.sqrt(area * r))
        ch = np.round(np.sqrt(area / r))
        ok = ~done & (cw > 0) & (ch > 0) & (cw <= w) & (ch <= h)
        top = np.floor(_uniform(seed, epoch, indices, 4 * a + 2) * (h - ch + 1))
        left = np.floor(_uniform(seed, epoch, indices, 4 * a + 3) * (w - cw + 1))
        out[ok] = np.stack([top, left, ch, cw], 1)[ok].astype(_I64)
        done |= ok
    if not done.all():  # the centre crop, its ratio clamped
        rest = ~done
        in_ratio = w[rest] / h[rest]
        cw = np.where(in_ratio < ratio[0], w[rest], np.where(in_ratio > ratio[1], np.round(h[rest] * ratio[1]), w[rest]))
        ch = np.where(in_ratio < ratio[0], np.round(w[rest] / ratio[0]), h[rest])
        out[rest] = np.stack([(h[rest] - ch) // 2, (w[rest] - cw) // 2, ch, cw], 1).astype(_I64)
    return out


class ImageCrop(Getter):
    """Random resized crops of encoded images, flipped at random: ``(B, height, width, 3)`` uint8.

    torchvision's ``RandomResizedCrop(size, scale, ratio)`` + ``RandomHorizontalFlip`` done at
    decode time: the crop box is drawn from the image's header (no decode), the JPEG is
    decoded at the smallest 1/1, 1/2, 1/4, 1/8 scale that still gives the crop at least
    ``size`` pixels (scaled inside the IDCT: simplejpeg, GIL released), then the box is
    resized (PIL bilinear, antialiased, GIL released) straight into the batch buffer.
    Reproducible from ``(seed, epoch, example index)``; ``random=False`` takes the centre
    crop of ``scale[1]`` (validation).

    Parameters
    ----------
    feature : str
        An :class:`~h5store.EncodedImage` feature.
    size : int or (int, int)
        Output ``(height, width)``.
    scale, ratio : (float, float)
        Area fraction and aspect-ratio range of the crop (torchvision's defaults).
    flip : bool
        Flip half of the crops left-right.
    random : bool
        Random crops (training) or the centre crop (validation).

    Examples
    --------
    >>> batch = dict(x=h5s.ImageCrop("image", 224), y=h5s.Label("label"))  # doctest: +SKIP
    >>> loader = f.serve(batch, batch_size=64, shuffle=True, num_workers=8)  # doctest: +SKIP
    """

    def __init__(self, feature: str, size: int | tuple[int, int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True, random: bool = True) -> None:
        hw = (size, size) if isinstance(size, (int, np.integer)) else tuple(size)
        if len(hw) != 2 or any(isinstance(v, bool) or int(v) <= 0 for v in hw):
            raise ValueError(f"ImageCrop({feature!r}): size must be an int or (height, width) > 0, got {size!r}")
        if not (0 < scale[0] <= scale[1] <= 1) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ImageCrop({feature!r}): need 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= "
                             f"ratio[1], got scale={scale!r}, ratio={ratio!r}")
        self.feature = feature
        self.size = (int(hw[0]), int(hw[1]))
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip = bool(flip)
        self.random = bool(random)
        self.features = (feature,)

    def check(self, files: FileSet) -> None:
        super().check(files)
        if not callable(getattr(files.feature(_name(self.feature)), "crop_into", None)):
            raise SchemaError(f"{self!r}: {files.where(_name(self.feature))} is not an encoded image feature "
                              "(EncodedImage)")

    def boxes(self, shapes: np.ndarray, request: Request) -> np.ndarray:
        """``(top, left, height, width)`` of each example's crop, for images of ``shapes`` (H, W)."""
        h, w = shapes[:, 0], shapes[:, 1]
        if self.random:
            return crop_boxes(h, w, self.scale, self.ratio, request.seed, request.epoch, request.indices)
        side = np.sqrt(h * w * self.scale[1]).astype(np.float64)
        r = self.size[1] / self.size[0]
        ch = np.minimum(np.round(side / np.sqrt(r)), h)
        cw = np.minimum(np.round(side * np.sqrt(r)), w)
        return np.stack([(h - ch) // 2, (w - cw) // 2, ch, cw], 1).astype(_I64)

    def fetch(self, files: FileSet, request: Request) -> np.ndarray | Padded | list[Any]:
        name = _name(self.feature)
        feat = files.feature(name)
        raws = files.read_items(name, request.items)
        shapes = np.array([feat.image_size(r) for r in raws], _I64).reshape(-1, 2)
        boxes = self.boxes(shapes, request)
        flips = (mix64(request.seed, request.epoch, request.indices, 99) & _U64(1)).astype(bool) if self.flip \
            else np.zeros(len(raws), bool)
        out = files.alloc((len(raws), *self.size, 3), np.uint8)
        for j, raw in enumerate(raws):
            try:
                feat.crop_into(raw, tuple(boxes[j].tolist()), out[j], bool(flips[j]))
            except SchemaError as e:
                raise SchemaError(f"{files.where(name)}: item at {int(request.items[j])}: {e}") from None
        return out

    def signature(self, files: FileSet) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype(np.uint8), (*self.size, 3)
