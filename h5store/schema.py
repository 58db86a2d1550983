"""Feature descriptors, Groups, the frozen Schema, and the feature registry.

A :class:`Feature` is a frozen dataclass: its fields are its parameters (dtype, item
shape, compression, and whatever a subclass adds: ``sr``, ``n_fft``...). As a class
attribute of a :class:`~h5store.TypedFile` it is a descriptor: ``Speech.mel`` is the
Feature, ``f.mel`` a view of that feature bound to the open file ``f``. The descriptor
holds no per-file state.

Every Feature subclass registers itself under a stable ``type_name`` so that
:func:`h5store.open` can rebuild a file's schema from the JSON stored in the file,
without the user's class (lhotse's ``register_writer``, h5py's ``register_driver``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from h5store.errors import SchemaError
from h5store.format import IDS, ColumnSpec

__all__ = [
    "DISPLAY_KINDS",
    "Feature",
    "Group",
    "Schema",
    "Source",
    "feature_types",
    "register_feature",
]

_REGISTRY: dict[str, type[Feature]] = {}
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_RESERVED = frozenset({IDS})


def register_feature(cls: type[Feature], name: str | None = None) -> type[Feature]:
    """Register a Feature class under ``name`` (default: its ``type_name``).

    Subclasses of :class:`Feature` register themselves when defined; call this only to
    register a class under an extra name (e.g. after renaming a class that old files name).

    Examples
    --------
    >>> import h5store as h5s
    >>> class Loudness(h5s.Array):
    ...     type_name = "myproject.Loudness"
    >>> h5s.feature_types()["myproject.Loudness"] is Loudness
    True
    """
    key = name or cls.type_name
    _REGISTRY[key] = cls
    return cls


def feature_types() -> dict[str, type[Feature]]:
    """The registry: type name -> Feature class."""
    return dict(_REGISTRY)


class Source(str):
    """A source handed to :meth:`Feature.load`: a path (it *is* a ``str``) plus context.

    Attributes
    ----------
    id : str
        The id this source is stored under.
    root : str
        The folder ids are relative to (the common root of the sources).
    meta : dict
        The other columns of the manifest row that listed this source (empty otherwise).
    is_dir : bool
        The source is a folder (e.g. a video's frames); only features that override
        :meth:`Feature.accepts` to take folders see it.

    Examples
    --------
    >>> s = Source("/data/wavs/a.wav", id="wavs/a", root="/data")
    >>> s.endswith(".wav"), s.id
    (True, 'wavs/a')
    """

    id: str
    root: str
    meta: Mapping[str, str]
    is_dir: bool

    def __new__(cls, path: str, id: str = "", root: str = "", meta: Mapping[str, str] | None = None,
                is_dir: bool = False) -> Source:
        self = super().__new__(cls, path)
        self.id = id
        self.root = root
        self.meta = dict(meta or {})
        self.is_dir = is_dir
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Source, (str(self), self.id, self.root, dict(self.meta), self.is_dir))

    def __repr__(self) -> str:
        # Libraries put repr(path) in their messages (soundfile does): keep those clean.
        return repr(str(self))


@dataclass(frozen=True, kw_only=True, eq=False)
class Feature:
    """A typed column of a group: how a source becomes an array, and how it is stored.

    Parameters
    ----------
    dtype : str
        numpy dtype of the stored values.
    shape : tuple
        Per-item shape. ``None`` as first dim means a variable number of rows per item
        (``(None, 80)`` for a mel spectrogram); ``()`` is one scalar per item.
    layout : {"ragged", "fixed", "blobs"} or None
        Derived from ``shape`` when None. "blobs" stores each item as a sequence of
        byte strings (frames of a video), readable a few at a time.
    compression : {None, "gzip", "lzf", "zstd", "blosc", "blosc:<codec>"}
        The codec of the stored data. "zstd" (HDF5 filter 32015) and "blosc" (filter 32001,
        lz4 inside; or "blosc:lz4hc", "blosc:zstd", "blosc:blosclz", "blosc:zlib")
        byte-shuffle numbers wider than a byte and are read with ``hdf5plugin`` by plain
        h5py. h5store decodes every codec itself, in threads, bounded by the chunk's size
        (``docs/features.md``, "Compression": which one to pick, and what it costs).
    compression_opts : int or None
        Level: gzip 0-9, zstd 1-22 (default 3), blosc 0-9 (default 5).
    shuffle : bool
        The HDF5 shuffle filter before gzip or lzf (helps them on floats); zstd and blosc
        shuffle numbers already.
    chunk_rows : int or None
        Rows per HDF5 chunk; default ~512 KiB per chunk (32 KiB compressed).
    pattern : str or None
        Regex (``re.search``) a source path must match for :meth:`load` to be called on
        it during ``create``; None means "not filled from sources" (use ``add``).
    finite : bool
        Reject items holding NaN or inf.
    attrs : dict
        JSON-serialisable user attributes stored with the feature.

    Examples
    --------
    >>> import h5store as h5s
    >>> class Energy(h5s.Feature):
    ...     type_name = "example.Energy"
    ...     def load(self, source):
    ...         return np.ones(10, dtype="float32")
    >>> Energy(shape=(None,), pattern=r"\\.wav$").spec().layout
    'ragged'
    """

    type_name: ClassVar[str] = "h5store.Feature"
    #: An annotation (a label, a CSV column) only adds to ids that a content feature creates
    #: during ``create``: a stray ``metadata.csv`` matching a label's pattern makes no id.
    annotation: ClassVar[bool] = False
    #: Folders are sources only for features that say so (a video as a folder of frames).
    takes_dirs: ClassVar[bool] = False

    dtype: str = "float32"
    shape: tuple[int | None, ...] = (None,)
    layout: str | None = None
    compression: str | None = None
    compression_opts: int | None = None
    shuffle: bool = False
    chunk_rows: int | None = None
    pattern: str | None = None
    finite: bool = False
    attrs: dict[str, Any] = field(default_factory=dict)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "type_name" not in cls.__dict__:
            cls.type_name = f"{cls.__module__}.{cls.__qualname__}"
        _plain_overrides(cls)
        dataclass(frozen=True, kw_only=True, eq=False, repr=False)(cls)
        register_feature(cls)

    def __post_init__(self) -> None:
        if isinstance(self.shape, list):
            object.__setattr__(self, "shape", tuple(self.shape))
        if self.dtype is None:
            return  # undeclared: fixed by the first item stored (see fixed_by)
        try:
            dt = np.dtype(self.dtype)
        except TypeError:
            return  # reported by problems() when the class is defined
        if dt.kind in "biufc":
            # Only numeric names round-trip: np.dtype("U8").name is "str256", which numpy can't parse.
            object.__setattr__(self, "dtype", dt.name)

    # -- declaration ---------------------------------------------------------
    def problems(self) -> list[str]:
        """What is wrong with these parameters (empty when valid). Subclasses extend it."""
        out = []
        if self.shape is not None and not isinstance(self.shape, tuple):
            out.append(f"shape must be a tuple, got {self.shape!r}")
            return out
        if not self.is_fixed and self.layout == "blobs":
            out.append("a blobs layout stores bytes: declare dtype='uint8', shape=(None,)")
            return out
        try:
            out.extend(ColumnSpec.problems(self._raw_spec()))
        except (TypeError, ValueError) as e:
            out.append(str(e))
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                out.append(f"pattern {self.pattern!r} is not a valid regex ({e})")
        return out

    def _raw_spec(self) -> ColumnSpec:
        # Build without __post_init__ validation, so problems() can list them all. An
        # undeclared dtype or shape is checked with a stand-in that any first item could fix.
        spec = object.__new__(ColumnSpec)
        kwargs = self._spec_kwargs()
        if self.dtype is None:
            kwargs["dtype"] = "float64"
        if self.shape is None:
            kwargs["shape"] = () if self.layout == "fixed" else (None,)
            kwargs["layout"] = self.layout or "ragged"
        for k, v in kwargs.items():
            object.__setattr__(spec, k, v)
        return spec

    def _spec_kwargs(self) -> dict[str, Any]:
        layout = self.layout or ("ragged" if self.shape and self.shape[0] is None else "fixed")
        return dict(dtype=self.dtype, shape=self.shape, layout=layout, compression=self.compression,
                    compression_opts=self.compression_opts, shuffle=self.shuffle,
                    fletcher32=False, chunk_rows=self.chunk_rows)

    def spec(self) -> ColumnSpec:
        """The storage description of this feature.

        Raises :class:`~h5store.errors.SchemaError` while an undeclared dtype or shape is
        not fixed yet (no item stored): see :meth:`fixed_by`.
        """
        if not self.is_fixed:
            raise SchemaError(f"{type(self).__name__}: {_undeclared(self)} not declared and no item is stored "
                              "yet, so how it is stored is not fixed")
        return ColumnSpec(**self._spec_kwargs())

    # -- undeclared dtype / shape ------------------------------------------------
    @property
    def is_fixed(self) -> bool:
        """Whether dtype and shape are known: declared, or fixed by the first item stored.

        Examples
        --------
        >>> import h5store as h5s, numpy as np
        >>> h5s.Array().is_fixed, h5s.Array().fixed_by(np.zeros((42, 7))).is_fixed
        (False, True)
        """
        return self.dtype is not None and self.shape is not None

    def fixed_by(self, value: Any) -> Feature:
        """This feature with its undeclared dtype and shape taken from ``value``, the first item.

        The dtype becomes the item's (numeric or bool only); the shape becomes
        ``(None, *item.shape[1:])`` (ragged along the first axis) for an item of 1 dim or
        more, ``()`` for a 0-d item (one scalar per item; ``layout="fixed"`` keeps the whole
        item shape). Declared parts are kept as declared. Returns ``self`` when both are
        declared. Raises :class:`~h5store.errors.SchemaError` for non-numeric items.

        Examples
        --------
        >>> import h5store as h5s, numpy as np
        >>> x = h5s.Array().fixed_by(np.zeros((42, 7)))
        >>> x.dtype, x.shape
        ('float64', (None, 7))
        """
        if self.is_fixed:
            return self
        try:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        except (ValueError, TypeError) as e:
            raise SchemaError(f"cannot be made into one numeric array ({e})") from None
        dtype, shape = self.dtype, self.shape
        if dtype is None:
            if arr.dtype.kind not in "biufc":
                what = {"U": "str", "S": "bytes", "O": "object"}.get(arr.dtype.kind, arr.dtype.kind)
                raise SchemaError(f"got {what} data (dtype {arr.dtype.str if arr.dtype.kind in 'US' else arr.dtype}); "
                                  f"an Array stores numeric or bool arrays: use h5s.Text() for text")
            dtype = arr.dtype.name
        if shape is None:
            if self.layout == "fixed" or (self.layout is None and arr.ndim == 0):
                shape = tuple(int(d) for d in arr.shape)
            elif arr.ndim == 0:
                raise SchemaError(f"a {self.layout} layout needs items of 1 dim or more, got a scalar")
            else:
                shape = (None, *(int(d) for d in arr.shape[1:]))
        out = dataclasses.replace(self, dtype=dtype, shape=shape)
        object.__setattr__(out, "_by_first_item", (self.dtype is None, self.shape is None))
        return out

    def fixed_as(self, spec: ColumnSpec, by_first_item: Feature | None = None) -> Feature:
        """This feature with its undeclared dtype and shape taken from ``spec`` (as stored).

        ``by_first_item`` is the declaration whose undeclared parts the first item fixed
        (default: this feature); error messages name them as such.

        Examples
        --------
        >>> import h5store as h5s
        >>> stored = h5s.Array(dtype="int16", shape=(None, 3)).spec()
        >>> h5s.Array().fixed_as(stored).shape
        (None, 3)
        """
        decl = by_first_item if by_first_item is not None else self
        marker = (decl.dtype is None, decl.shape is None)
        if self.is_fixed and not any(marker):
            return self
        out = dataclasses.replace(self, dtype=self.dtype if self.dtype is not None else spec.dtype,
                                  shape=self.shape if self.shape is not None else spec.shape)
        object.__setattr__(out, "_by_first_item", marker)
        return out

    def conflict(self, spec: ColumnSpec) -> bool:
        """Whether ``spec`` (how a feature is stored) differs from what this one declares.

        Undeclared parts match anything; declared ones must be equal.

        Examples
        --------
        >>> import h5store as h5s
        >>> stored = h5s.Array(dtype="float64", shape=(None, 7)).spec()
        >>> h5s.Array().conflict(stored), h5s.Array(shape=(None, 8)).conflict(stored)
        (False, True)
        """
        if self.is_fixed:
            mine = self.spec()
            return (mine.dtype, mine.shape, mine.layout) != (spec.dtype, spec.shape, spec.layout)
        if self.dtype is not None and np.dtype(self.dtype) != spec.np_dtype:
            return True
        if self.shape is not None and tuple(self.shape) != tuple(spec.shape):
            return True
        return self.layout is not None and self.layout != spec.layout

    def describe_storage(self) -> str:
        """How this feature is stored, for messages; undeclared parts read "any dtype", "any shape".

        Examples
        --------
        >>> import h5store as h5s
        >>> h5s.Array(dtype="float32", shape=(None, 80)).describe_storage(), h5s.Array().describe_storage()
        ('float32 (None, 80) (ragged)', 'any dtype any shape')
        """
        if self.is_fixed:
            s = self.spec()
            return f"{s.dtype} {s.shape} ({s.layout})"
        return f"{self.dtype or 'any dtype'} {self.shape if self.shape is not None else 'any shape'}"

    def params(self) -> dict[str, Any]:
        """All parameters, JSON-serialisable (stored in the file)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Feature:
        """Rebuild from :meth:`params` (unknown keys from newer versions are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in known})

    # -- sources -------------------------------------------------------------
    def accepts(self, source: str) -> bool:
        """Whether ``create`` should call :meth:`load` on ``source``: ``pattern`` matches and
        it is a file (features that load folders override this)."""
        if getattr(source, "is_dir", False) and not self.takes_dirs:
            return False
        return self.pattern is not None and re.search(self.pattern, str(source)) is not None

    def prepare(self, sources: list[Source], existing: Feature | None = None) -> Feature:
        """Learn dataset-wide parameters from all sources before any is loaded.

        Called once, in the parent process, with every source that this feature
        :meth:`accepts`; ``existing`` is the feature as already stored when appending to
        a file. Returns the Feature to load with (``self`` when there is nothing to learn),
        e.g. a label feature returns a copy holding the class vocabulary, which is then
        stored in the file. The result is pickled to the workers: keep it small.
        """
        return self

    def load(self, source: Any) -> Any:
        """Turn one source into this feature's item. Subclasses that take sources define it."""
        raise SchemaError(f"{type(self).__name__} has no loader: fill it with add() or define load()")

    # -- values --------------------------------------------------------------
    def encode(self, value: Any) -> Any:
        """Validate ``value`` against the declaration and return what storage writes.

        Casts only within a kind (float64 -> float32 is fine, float -> int is refused),
        checks the number of dimensions and fixed dims, and refuses NaN/inf when
        ``finite``. Raises :class:`~h5store.errors.SchemaError` saying what is wrong.
        """
        if not self.is_fixed:
            return self.fixed_by(value).encode(value)
        spec = self.spec()
        dtype_by, shape_by = self.__dict__.get("_by_first_item", (False, False))
        if spec.layout == "blobs":
            if isinstance(value, (str, bytes, bytearray, memoryview, np.ndarray)) or not hasattr(value, "__iter__"):
                raise SchemaError(f"expected a sequence of byte strings (one per blob), got {type(value).__name__}")
            try:
                return [b if isinstance(b, bytes) else bytes(memoryview(b)) for b in value]
            except TypeError as e:
                raise SchemaError(f"a blob must be bytes-like ({e})") from None
        try:
            arr = _cast(np.asarray(value), spec.np_dtype)
        except SchemaError as e:
            if not dtype_by:
                raise
            raise SchemaError(str(e).replace(" without loss", " (the dtype fixed by the first item stored) without loss")) from None
        shape = spec.shape
        if shape_by:
            if arr.ndim != len(shape) or any(exp is not None and got != exp for got, exp in zip(arr.shape, shape)):
                raise SchemaError(f"expected shape {_fmt_shape(shape)} (fixed by the first item stored), got {arr.shape}")
        if arr.ndim != len(shape):
            raise SchemaError(f"expected {len(shape)} dims {_fmt_shape(shape)}, got shape {arr.shape}")
        for d, (got, exp) in enumerate(zip(arr.shape, shape)):
            if exp is not None and got != exp:
                raise SchemaError(f"expected shape {_fmt_shape(shape)}, got {arr.shape} (axis {d})")
        if self.finite and arr.dtype.kind in "fc" and arr.size and not np.isfinite(arr).all():
            raise SchemaError("holds NaN or inf, which this feature forbids")
        return np.require(arr, requirements="C")

    def decode(self, raw: Any) -> Any:
        """Turn a stored item back into what users get (identity for arrays)."""
        return raw

    # -- how it is shown (h5store.report) ---------------------------------------
    def display_kind(self) -> str:
        """How reports (:mod:`h5store.report`) show this feature's items: one of :data:`DISPLAY_KINDS`.

        The default follows the stored spec, as fits arrays: ``()`` -> "value", a ragged
        ``(T,)`` of numbers -> "curve" (uint8: "bytes", an opaque blob such as a
        checkpoint), ``(T, C)`` -> "matrix", a fixed ``(H, W, 1|3|4)`` uint8 -> "image",
        anything else -> "array" (shape and statistics). Reports check what an item
        decodes to: one that is not numbers where numbers were expected (a feature whose
        :meth:`decode` makes something else) is shown as its text. Override this, with
        :meth:`display` and :meth:`sound` when it helps, to show a custom feature your way;
        it is a choice made from parameters alone, no item is read.

        Examples
        --------
        >>> import h5store as h5s
        >>> h5s.Array(dtype="float32", shape=(None,)).display_kind(), h5s.Scalar().display_kind()
        ('curve', 'value')
        """
        if not self.is_fixed:
            return "array"
        spec = self.spec()
        if spec.np_dtype.kind not in "biuf":
            return "value"
        shape, u8 = tuple(spec.shape), spec.np_dtype == np.uint8
        if spec.layout == "blobs":
            return "bytes"
        if shape == ():
            return "value"
        if len(shape) == 1 and shape[0] is None:
            return "bytes" if u8 else "curve"
        if len(shape) == 2 and shape[0] is None:
            return "matrix"
        if u8 and len(shape) == 3 and None not in shape and shape[2] in (1, 3, 4):
            return "image"
        return "array"

    def display(self, item: Any) -> Any:
        """One decoded item as its :meth:`display_kind` shows it (see :data:`DISPLAY_KINDS`).

        Identity by default; a label returns its class name, for instance.

        Examples
        --------
        >>> import h5store as h5s
        >>> h5s.DirLabel(classes=("cat", "dog")).display(1)
        'dog (class 1)'
        """
        return item

    def sound(self, item: Any) -> tuple[np.ndarray, int, str] | None:
        """One decoded item as audio to listen to: ``(samples, sample rate, how it was made)``.

        None (the default) when the feature is not sound. Stored audio returns itself;
        spectrograms invert their magnitudes (Griffin-Lim), and say so.
        """
        return None

    def rows_per_second(self) -> float | None:
        """Rows of an item per second of time, for durations in reports; None when rows are not time.

        Examples
        --------
        >>> import h5store as h5s
        >>> h5s.Audio(sr=16000).rows_per_second(), h5s.Array().rows_per_second()
        (16000.0, None)
        """
        return None

    # -- descriptor ----------------------------------------------------------
    def __set_name__(self, owner: type, name: str) -> None:
        object.__setattr__(self, "_attr_name", name)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.feature(self.__dict__.get("_attr_name", ""))

    def __set__(self, obj: Any, value: Any) -> None:
        name = self.__dict__.get("_attr_name", "?")
        raise AttributeError(f"use f.{name}[id] = array to write an item, not f.{name} = ...")

    def __repr__(self) -> str:
        own = {k: v for k, v in self.params().items() if k not in _BASE_DEFAULTS or _BASE_DEFAULTS[k] != v}
        args = ", ".join(f"{k}={v!r}" for k, v in own.items())
        return f"{type(self).__name__}({args})"


def _plain_overrides(cls: type) -> None:
    """Make ``pattern = r"\\.npy$"`` in a subclass body override the inherited parameter.

    Users of h5mapper and of plain Python classes set defaults as plain class attributes,
    without an annotation; a dataclass would ignore those (the inherited field keeps its
    default). Each plain assignment to an inherited parameter becomes an annotated field with
    the new default; a list default becomes a tuple, a dict one a per-instance copy.
    """
    inherited = {f.name: f for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                 for f in dataclasses.fields(base)}
    own = cls.__dict__.get("__annotations__", {})
    for name, value in list(cls.__dict__.items()):
        if name not in inherited or name in own:
            continue
        if isinstance(value, (property, staticmethod, classmethod)):
            raise SchemaError(f"{cls.__name__}.{name}: {name!r} is a feature parameter; "
                              "it cannot be replaced by a property or method")
        if isinstance(value, list):
            value = tuple(value)
        if isinstance(value, (dict, set)):
            default = dict(value) if isinstance(value, dict) else set(value)
            setattr(cls, name, field(default_factory=lambda d=default: type(d)(d)))  # type: ignore[misc]
        else:
            setattr(cls, name, value)
        # Annotations are strings under ``from __future__ import annotations``; any will do.
        cls.__annotations__ = {**own, name: inherited[name].type}
        own = cls.__annotations__


#: What :meth:`Feature.display` returns for each :meth:`Feature.display_kind`, and how
#: reports (:mod:`h5store.report`) show it. The first four are drawn by :mod:`h5store.plot`
#: with the feature's own axes (seconds, Hz) where it has them.
DISPLAY_KINDS = {
    "spectrogram": "(frames, bins) numbers, drawn with time and frequency axes from the parameters",
    "waveform": "(samples,) or (samples, channels) audio, drawn against seconds",
    "curve": "(T,) numbers, drawn as a line",
    "matrix": "(T, C) numbers, drawn as an image of rows",
    "image": "(H, W, C) uint8 pixels, shown as a thumbnail",
    "frames": "(K, H, W, C) uint8 video frames, a few shown as thumbnails",
    "text": "a str, shown as text",
    "label": "a str naming the class, shown as text",
    "value": "anything small, shown as its text",
    "bytes": "bytes or a uint8 array, shown as its size and first bytes",
    "array": "an array, shown as its shape, dtype and value range",
}


_BASE_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else {}) for f in dataclasses.fields(Feature)}
_BASE_DEFAULTS["shape"] = [None]
register_feature(Feature)


def _undeclared(feat: Feature) -> str:
    parts = [p for p in ("dtype", "shape") if getattr(feat, p) is None]
    return " and ".join(parts) + (" are" if len(parts) > 1 else " is")


def _fmt_shape(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("T" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _cast(arr: np.ndarray, want: np.dtype) -> np.ndarray:
    """``arr`` as ``want``, refusing casts that lose more than float precision."""
    have = arr.dtype
    if have == want:
        return arr
    k, w = have.kind, want.kind
    ok = k in "biufc" and (
        (w == "b" and k == "b")
        or (w in "iu" and k in "biu")
        or (w == "f" and k in "biuf")
        or (w == "c")
    )
    if not ok:
        raise SchemaError(f"dtype {have} cannot be stored as {want} without loss")
    if w in "iu" and k in "iu" and arr.size:
        info = np.iinfo(want)
        if arr.min() < info.min or arr.max() > info.max:
            raise SchemaError(f"values in [{arr.min()}, {arr.max()}] do not fit {want}")
    return arr.astype(want)


class Group:
    """Features that share one id axis, stored under their own HDF5 group.

    Examples
    --------
    >>> import h5store as h5s
    >>> class Run(h5s.TypedFile):
    ...     logs = h5s.Group(loss=h5s.Array(dtype="float32"))
    >>> sorted(Run.schema.groups)
    ['', 'logs']
    """

    def __init__(self, **features: Feature) -> None:
        for name, feat in features.items():
            if not isinstance(feat, Feature):
                raise SchemaError(f"Group({name}=...): expected a Feature, got {type(feat).__name__}")
        self.features: dict[str, Feature] = dict(features)

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr_name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.group(self._attr_name)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"group {self._attr_name!r} cannot be replaced; add items with .add()")

    def __repr__(self) -> str:
        return f"Group({', '.join(f'{k}={v!r}' for k, v in self.features.items())})"


@dataclass(frozen=True)
class Schema:
    """A frozen schema: group name ("" for the root) -> feature name -> Feature."""

    name: str
    groups: Mapping[str, Mapping[str, Feature]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.name,
            "groups": {
                g: {n: {"type": f.type_name, "params": f.params()} for n, f in feats.items()}
                for g, feats in self.groups.items()
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Schema:
        """Rebuild from :meth:`to_dict`. An unregistered type reads as a plain Feature
        with the same storage (its custom decoding, if any, is not applied)."""
        groups: dict[str, dict[str, Feature]] = {}
        for g, feats in d.get("groups", {}).items():
            groups[g] = {}
            for n, entry in feats.items():
                known = _REGISTRY.get(entry.get("type"))
                ftype = known or Feature
                try:
                    feat = ftype.from_params(entry.get("params", {}))
                except (TypeError, ValueError) as e:
                    raise SchemaError(f"{g or '/'}{'/' if g else ''}{n}: stored parameters rejected ({e})") from None
                if known is None:  # what the file says it is, for comparisons with the class's schema
                    object.__setattr__(feat, "stored_as", (str(entry.get("type")), dict(entry.get("params", {}))))
                groups[g][n] = feat
        return cls(str(d.get("class", "H5File")), groups)

    @classmethod
    def collect(cls, owner: type) -> Schema:
        """Collect the Features and Groups of ``owner`` over its MRO (derived overrides base)."""
        root: dict[str, Feature] = {}
        groups: dict[str, dict[str, Feature]] = {}
        for klass in reversed(owner.__mro__):
            for name, value in vars(klass).items():
                if isinstance(value, Feature):
                    groups.pop(name, None)
                    root[name] = value
                elif isinstance(value, Group):
                    root.pop(name, None)
                    groups[name] = dict(value.features)
                elif name in root or name in groups:
                    root.pop(name, None)  # overridden by a non-feature: removed
                    groups.pop(name, None)
        problems = []
        for gname, feats in [("", root), *groups.items()]:
            if gname and (not _NAME.match(gname) or gname in _RESERVED):
                problems.append(f"{owner.__name__}.{gname}: invalid group name")
            for fname, feat in feats.items():
                where = f"{owner.__name__}.{gname + '.' if gname else ''}{fname}"
                if not _NAME.match(fname) or fname in _RESERVED:
                    problems.append(f"{where}: invalid feature name (reserved or not an identifier)")
                problems.extend(f"{where}: {p}" for p in feat.problems())
        if problems:
            raise SchemaError("; ".join(problems))
        return cls(owner.__name__, {"": root, **groups})

    def feature(self, group: str, name: str) -> Feature:
        return self.groups[group][name]
