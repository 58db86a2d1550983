"""Label features: a class from the source's folder, a column of a metadata table.

:class:`DirLabel` learns its class vocabulary in :meth:`~DirLabel.prepare` (the
vocabulary is a parameter, so it is stored in the file and extended, never renumbered,
when appending). :class:`CSVColumn` joins a metadata table (LJSpeech's
``metadata.csv``) or the manifest row to each source by id.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from h5store.errors import SourceError
from h5store.features.array import Text
from h5store.features.audio_file import AUDIO_PATTERN
from h5store.schema import Feature

__all__ = ["CSVColumn", "DirLabel"]

_TEXT = Text()


def _parent_name(source: str) -> str:
    return os.path.basename(os.path.dirname(os.path.abspath(str(source).rstrip("/\\") or ".")))


class DirLabel(Feature):
    """The class of a source, from the name of the folder holding it.

    ``root/dog/1.wav`` is class ``"dog"``. Items are int64 scalars numbering
    :attr:`classes`; :meth:`label_name` maps a number back to its folder name.

    Parameters
    ----------
    classes : tuple of str
        The vocabulary. Empty (default): learned by :meth:`prepare` as the sorted folder
        names of the sources. Given: fixed; a source in another folder is refused.
        Either way, when appending to a file, the stored classes come first and keep their
        numbers; new folders are numbered after them.
    pattern : str
        Which sources get a label (default: every source).

    Examples
    --------
    >>> import h5store as h5s
    >>> lab = h5s.DirLabel().prepare([h5s.Source("/d/dog/1.wav"), h5s.Source("/d/cat/2.wav")])
    >>> lab.classes, int(lab.load(h5s.Source("/d/dog/3.wav"))), lab.label_name(0)
    (('cat', 'dog'), 1, 'cat')
    """

    type_name = "h5store.DirLabel"
    annotation = True
    takes_dirs = True
    dtype: str = "int64"
    shape: tuple[int | None, ...] = ()
    pattern: str | None = r"."
    classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.classes, list):
            object.__setattr__(self, "classes", tuple(self.classes))

    def problems(self) -> list[str]:
        out = super().problems()
        if not isinstance(self.classes, tuple) or not all(isinstance(c, str) for c in self.classes):
            out.append(f"classes must be a tuple of str, got {self.classes!r}")
        elif len(set(self.classes)) != len(self.classes):
            dup = sorted({c for c in self.classes if self.classes.count(c) > 1})
            out.append(f"classes must be unique, {dup} repeat")
        if tuple(self.shape) != () or not _valid_int_dtype(self.dtype):
            out.append(f"DirLabel is stored as an integer scalar: shape () and an int dtype, got {self.dtype} {self.shape}")
        return out

    def prepare(self, sources: list[Any], existing: Feature | None = None) -> DirLabel:
        base = tuple(getattr(existing, "classes", ()) or ())
        if self.classes:
            extra = [c for c in self.classes if c not in base]
        else:
            extra = sorted({_parent_name(s) for s in sources} - set(base))
        classes = base + tuple(extra)
        return self if classes == self.classes else dataclasses.replace(self, classes=classes)

    def _lookup(self) -> dict[str, int]:
        table = self.__dict__.get("_table")
        if table is None:
            table = {c: i for i, c in enumerate(self.classes)}
            object.__setattr__(self, "_table", table)
        return table

    def load(self, source: Any) -> np.int64:
        name = _parent_name(source)
        i = self._lookup().get(name)
        if i is None:
            if not self.classes:
                raise SourceError(f"{source}: DirLabel has no classes (declare classes=... or let create() prepare it)")
            shown = list(self.classes[:10]) + (["..."] if len(self.classes) > 10 else [])
            raise SourceError(f"{source}: folder {name!r} is not one of the {len(self.classes)} classes {shown}")
        return np.int64(i)

    def decode(self, raw: Any) -> int:
        return int(raw)

    def label_name(self, i: int) -> str:
        """The folder name of class number ``i``."""
        try:
            return self.classes[int(i)]
        except IndexError:
            raise IndexError(f"DirLabel: class {int(i)} out of range for {len(self.classes)} classes") from None

    def display_kind(self) -> str:
        return "label"

    def display(self, item: Any) -> str:
        i = int(item)
        return f"{self.classes[i]} (class {i})" if 0 <= i < len(self.classes) else f"class {i} (no name stored)"


def _valid_int_dtype(d: str) -> bool:
    try:
        return np.dtype(d).kind in "iu"
    except TypeError:
        return False


# --------------------------------------------------------------------------- CSVColumn
@dataclass
class _Table:
    """One column of a metadata file, by key (the parsed result CSVColumn keeps)."""

    path: str
    values: dict[str, str] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)  # key -> why its row is unusable
    complete: bool = True  # False: only the keys of the prepared sources were kept


def _positional_path(init: Any) -> Any:
    def __init__(self: Any, path: str | None = None, /, **params: Any) -> None:
        if path is not None:
            if "path" in params:
                raise TypeError("CSVColumn() got path both positionally and as a keyword")
            params["path"] = path
        init(self, **params)

    __init__.__doc__ = init.__doc__
    return __init__


class CSVColumn(Feature):
    """One column of a metadata table (LJSpeech's ``metadata.csv``), joined to sources by id.

    Parameters
    ----------
    path : str or None
        The table, relative to the sources' root (:attr:`Source.root
        <h5store.Source>`) unless absolute. None: take the column from the manifest row
        the source came from (:attr:`Source.meta <h5store.Source>`).
    column : int or str
        The column to store: an index, or a header name (``header=True``). With
        ``path=None``, the key of the manifest row (an int ``k`` looks up ``"k"`` too).
    key_column : int or str
        The column holding the id.
    sep : str
        Field separator. Fields are read with ``csv.QUOTE_NONE``: quotes are text.
    header : bool
        The first row names the columns.
    dtype : str
        "str" stores utf-8 text (as :class:`~h5store.Text`); a numeric dtype stores one
        number per item (as :class:`~h5store.Scalar`).
    pattern : str
        Which sources get a value (default: audio files).

    Notes
    -----
    Ids are matched first exactly, then by their last path component: an ingested
    ``root/wavs/LJ001-0001.wav`` has id ``"wavs/LJ001-0001"``, and LJSpeech keys are
    ``"LJ001-0001"``; both match. A source whose key has no row, or whose row lacks the
    column, or appears twice, is refused with a :class:`~h5store.errors.SourceError`.
    :meth:`prepare` reads the table once and keeps only the rows of the given sources,
    so what is sent to the workers stays small.

    Examples
    --------
    >>> import h5store as h5s
    >>> class Speech(h5s.TypedFile):
    ...     text = h5s.CSVColumn("metadata.csv", column=2)
    >>> Speech.text.spec().dtype, Speech.text.spec().shape
    ('uint8', (None,))
    """

    type_name = "h5store.CSVColumn"
    annotation = True
    takes_dirs = True
    path: str | None = None
    column: int | str = 1
    key_column: int | str = 0
    sep: str = "|"
    header: bool = False
    dtype: str = "str"
    pattern: str | None = AUDIO_PATTERN

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "shape", (None,) if self.is_text else ())

    @property
    def is_text(self) -> bool:
        return self.dtype == "str"

    def _spec_kwargs(self) -> dict[str, Any]:
        kw = super()._spec_kwargs()
        if self.is_text:
            kw.update(dtype="uint8", shape=(None,), layout="ragged")
        return kw

    def problems(self) -> list[str]:
        out = super().problems()
        if self.path is not None and not isinstance(self.path, str):
            out.append(f"path must be a str or None, got {self.path!r}")
        for name in ("column", "key_column"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, int) and v < 0):
                out.append(f"{name} must be an index >= 0 or a header name, got {v!r}")
            elif isinstance(v, str) and self.path is not None and not self.header:
                out.append(f"{name}={v!r} is a name: set header=True, or give its index")
        if not isinstance(self.sep, str) or len(self.sep) != 1:
            out.append(f"sep must be one character, got {self.sep!r}")
        if not isinstance(self.header, bool):
            out.append(f"header must be a bool, got {self.header!r}")
        if not self.is_text:
            try:
                if np.dtype(self.dtype).kind not in "biufc":
                    out.append(f"dtype must be 'str' or numeric, got {self.dtype!r}")
            except TypeError:
                pass  # reported by the base class
        return out

    # ---------------------------------------------------------------- the table
    def _resolve(self, root: str) -> str:
        """The table's path: absolute, or found in ``root`` or the folder above it.

        LJSpeech keeps ``metadata.csv`` beside ``wavs/``: whether the user names the corpus
        (``sources="LJSpeech-1.1"``) or its wav folder (``sources="LJSpeech-1.1/wavs"``),
        ``CSVColumn("metadata.csv")`` finds it.
        """
        p = os.path.expanduser(str(self.path))
        if os.path.isabs(p):
            return p
        base = os.path.abspath(root or os.getcwd())
        for folder in (base, os.path.dirname(base)):
            candidate = os.path.join(folder, p)
            if os.path.isfile(candidate):
                return candidate
        return os.path.join(base, p)

    def _read(self, path: str, keep: set[str] | None = None) -> _Table:
        try:
            fh = open(path, encoding="utf-8-sig", newline="")
        except FileNotFoundError:
            here = os.path.dirname(path)
            raise SourceError(
                f"{path}: no such file: CSVColumn({self.path!r}) is looked up in {here} and the folder "
                f"above it; give its absolute path or one relative to the sources' root"
            ) from None
        except OSError as e:
            raise SourceError(f"{path}: cannot read the CSVColumn table ({e.strerror or e})") from None
        table = _Table(path, complete=keep is None)
        seen: dict[str, int] = {}
        with fh:
            rows = csv.reader(fh, delimiter=self.sep, quoting=csv.QUOTE_NONE)
            try:
                names = next(rows) if self.header else []
                col, key = (self._position(c, names, path) for c in (self.column, self.key_column))
                for row in rows:
                    if not row or len(row) <= key:
                        continue
                    k = row[key].strip()
                    if keep is not None and k not in keep:
                        continue
                    line = rows.line_num
                    if k in seen:
                        table.bad[k] = f"{path}: id {k!r} has two rows (lines {seen[k]} and {line})"
                    elif len(row) <= col:
                        table.bad[k] = f"{path}: line {line} has {len(row)} fields, column {self.column!r} is missing"
                    else:
                        table.values[k] = row[col]
                    seen[k] = line
            except StopIteration:
                pass  # an empty file: every source is reported as having no row
            except (csv.Error, UnicodeDecodeError) as e:
                raise SourceError(f"{path}: unreadable table ({e})") from None
        return table

    def _position(self, c: int | str, names: list[str], path: str) -> int:
        if isinstance(c, int):
            return c
        try:
            return names.index(c)
        except ValueError:
            raise SourceError(f"{path}: no column {c!r} in the header {names}") from None

    def _table(self, root: str) -> _Table:
        tables = self.__dict__.setdefault("_tables", {})
        path = self._resolve(root)
        t = tables.get(path)
        if t is None or not t.complete:
            t = tables[path] = self._read(path)
        return t

    def prepare(self, sources: list[Any], existing: Feature | None = None) -> CSVColumn:
        if self.path is None:
            return self
        by_path: dict[str, set[str]] = {}
        for s in sources:
            by_path.setdefault(self._resolve(getattr(s, "root", "")), set()).update(_keys(s))
        new = dataclasses.replace(self)
        object.__setattr__(new, "_tables", {p: self._read(p, keep) for p, keep in by_path.items()})
        return new

    # ---------------------------------------------------------------- loading
    def load(self, source: Any) -> Any:
        keys = _keys(source)
        if self.path is None:
            raw = _from_meta(source, self.column)
        else:
            root = getattr(source, "root", "")
            tables = self.__dict__.get("_tables", {})
            table = tables.get(self._resolve(root)) or self._table(root)
            raw = _lookup(table, keys)
            if raw is None and not table.complete:
                table = self._table(root)
                raw = _lookup(table, keys)
            if raw is None:
                tried = " or ".join(repr(k) for k in keys)
                raise SourceError(f"{source}: no row for id {tried} in {table.path}")
        return raw if self.is_text else self._number(raw, source)

    def _number(self, raw: str, source: Any) -> np.ndarray:
        dt = np.dtype(self.dtype)
        s = raw.strip()
        try:
            if dt.kind == "b":
                low = s.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(s)
                value: Any = low in ("true", "1", "yes")
            elif dt.kind in "iu":
                value = int(s)
            elif dt.kind == "c":
                value = complex(s)
            else:
                value = float(s)
            return np.asarray(value, dtype=dt)
        except (ValueError, OverflowError):
            raise SourceError(f"{source}: value {raw!r} of column {self.column!r} is not a {dt.name}") from None

    # ---------------------------------------------------------------- values
    def encode(self, value: Any) -> Any:
        return _TEXT.encode(value) if self.is_text else super().encode(value)

    def decode(self, raw: Any) -> Any:
        return _TEXT.decode(raw) if self.is_text else raw

    def display_kind(self) -> str:
        return "text" if self.is_text else "value"


CSVColumn.__init__ = _positional_path(CSVColumn.__init__)  # type: ignore[method-assign]


def _keys(source: Any) -> list[str]:
    """The keys a source may be listed under: its id, then the id's last path component."""
    sid = getattr(source, "id", "") or os.path.splitext(os.path.basename(str(source)))[0]
    last = sid.rsplit("/", 1)[-1]
    return [sid] if last == sid else [sid, last]


def _lookup(table: _Table, keys: Iterable[str]) -> str | None:
    for k in keys:
        if k in table.bad:
            raise SourceError(table.bad[k])
        if k in table.values:
            return table.values[k]
    return None


def _from_meta(source: Any, column: int | str) -> str:
    meta = getattr(source, "meta", None) or {}
    for k in (column, str(column)):
        if k in meta:
            return str(meta[k])
    raise SourceError(
        f"{source}: the manifest row of id {getattr(source, 'id', '')!r} has no column {column!r} "
        f"(columns: {sorted(map(str, meta))})"
    )

