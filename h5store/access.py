"""Views binding a schema to an open file: ``f.ids``, ``f.mel``, ``f.logs``.

A view is cheap and per-process: it holds the storage objects of the process that made
it. Users get views from a :class:`~h5store.TypedFile`; serving and ingest use the same
views, so every read and write goes through one validated path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from h5store.column import Column
from h5store.errors import NotFound, SchemaError
from h5store.groups import GroupStore
from h5store.refs import Refs
from h5store.schema import Feature

__all__ = ["BlobsView", "FeatureView", "GroupView", "IdsView"]

Key = str | int | np.integer


class IdsView(Sequence[str]):
    """The ids of a group, in insertion order, without materialising them.

    Examples
    --------
    >>> f.ids[0], len(f.ids), "a" in f.ids  # doctest: +SKIP
    ('a', 3, True)
    """

    def __init__(self, refs: Refs) -> None:
        self._refs = refs

    def __len__(self) -> int:
        return len(self._refs)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return [self._refs.id(r) for r in range(*key.indices(len(self)))]
        n = len(self)
        r = int(key)
        if not -n <= r < n:
            raise IndexError(f"{self._refs.where}: position {r} out of range for {n} ids")
        return self._refs.id(r)

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __contains__(self, id: object) -> bool:
        return id in self._refs

    def index(self, id: Any, start: int = 0, stop: int | None = None) -> int:
        """Position of ``id`` (raises :class:`~h5store.errors.NotFound`)."""
        return self._refs.row(id)

    def positions(self, ids: Iterable[str]) -> np.ndarray:
        """Positions of many ids at once."""
        return self._refs.rows(ids)

    def to_numpy(self) -> np.ndarray:
        return self._refs.to_numpy()

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(repr(self[i]) for i in range(min(n, 3)))
        return f"<ids [{head}{', ...' if n > 3 else ''}] ({n})>"


class FeatureView:
    """One feature of an open file.

    ``view[id]`` and ``view[position]`` read one item; ``view[list]`` or
    :meth:`read_many` read a batch with one planned read; ``view.data`` is the raw
    concatenated h5py dataset for any h5py-style selection.

    Examples
    --------
    >>> f.mel["LJ001-0001"].shape  # doctest: +SKIP
    (212, 80)
    >>> [x.shape for x in f.mel.read_many([5, 0, 5])]  # doctest: +SKIP
    [(98, 80), (212, 80), (98, 80)]
    """

    def __init__(self, group: GroupView, name: str, feature: Feature, column: Column | None) -> None:
        self.group = group
        self.name = name
        self._feature = feature
        self._column = column

    @property
    def feature(self) -> Feature:
        """The Feature (once its first item fixed an undeclared dtype or shape, the fixed one)."""
        if self._column is None:
            return self.group.features[self.name]
        return self._feature

    @property
    def column(self) -> Column | _NoItemYet:
        """The storage column; a stand-in without items while the first item is awaited."""
        if self._column is None:
            col = self.group.store.columns.get(self.name)
            if col is None:
                return _NoItemYet(self.group.store, self.name)
            self._column, self._feature = col, self.group.features[self.name]
        return self._column

    @property
    def where(self) -> str:
        return self.column.where

    @property
    def data(self) -> Any:
        """The concatenated h5py dataset (flushes pending writes first)."""
        self.column.flush_pending()
        return self.column.data

    @property
    def index(self) -> np.ndarray:
        """``(N, 2)`` ``[start, stop)`` rows of :attr:`data` per id ([-1, -1] when absent)."""
        return self.column.index

    @property
    def lengths(self) -> np.ndarray:
        """Rows per item (numpy, 0 where absent)."""
        return self.column.lengths

    @property
    def present(self) -> np.ndarray:
        """Boolean mask of the ids that have this feature."""
        return self.column.present

    @property
    def refs(self) -> IdsView:
        return self.group.ids

    @property
    def attrs(self) -> dict[str, Any]:
        """The feature's parameters as stored in the file."""
        return self.feature.params()

    def __len__(self) -> int:
        return len(self.group)

    def _rows(self, keys: Iterable[Key]) -> np.ndarray:
        keys = list(keys)
        if keys and all(isinstance(k, str) for k in keys):
            return self.group.store.refs.rows(keys)
        n = len(self)
        rows = np.array([self.group.position(k) for k in keys], dtype=np.int64) if keys else np.zeros(0, np.int64)
        if rows.size and (rows.min() < -n or rows.max() >= n):
            raise IndexError(f"{self.where}: positions out of range for {n} items")
        return np.where(rows < 0, rows + n, rows)

    def read_many(self, keys: Iterable[Key] | np.ndarray, verify: bool = True) -> list[Any]:
        """Read a batch of items (ids or positions) with one planned read.

        Parameters
        ----------
        keys : sequence of ids or positions
            In any order, with repeats.
        verify : bool
            Check each item against its stored CRC-32.

        Returns
        -------
        list
            The decoded items, in the order of ``keys``.
        """
        rows = self._rows(keys.tolist() if isinstance(keys, np.ndarray) else keys)
        try:
            raw = self.column.read_items(rows, verify=verify)
        except KeyError as e:
            row = int(e.args[0])
            raise NotFound(f"{self.where}: id {self.group.store.refs.id(row)!r} has no {self.name!r} item") from None
        return [self.feature.decode(r) for r in raw]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self.read_many(range(*key.indices(len(self))))
        if isinstance(key, (list, tuple, np.ndarray)):
            return self.read_many(key)
        return self.read_many([key])[0]

    def __setitem__(self, key: Key, value: Any) -> None:
        row = self.group.position(key)
        fixing: dict[str, Feature] = {}
        item = self.group._encode(self.name, value, key, fixing)
        if fixing:
            self.group.fix(fixing)  # the first item of an undeclared feature
        try:
            self.group.store.put(self.name, row, item)
        except SchemaError as e:
            raise SchemaError(f"{e} (id {self.group.store.refs.id(row)!r})") from None

    def __iter__(self) -> Iterator[Any]:
        n = len(self)
        present = np.flatnonzero(self.present)
        for a in range(0, len(present), 256):
            yield from self.read_many(present[a : a + 256])
        del n

    def blobs(self, key: Key, first: int | None = 0, stop: int | None = None) -> list[Any]:
        """Blobs ``first..stop-1`` of one "blobs" item, reading only their bytes (after the
        first part read of the item in this process, which reads and checks the whole item
        against its CRC-32).

        The bounds behave like a slice's (``list(item)[first:stop]``): negative ones count
        from the end, out-of-range ones are clamped, an empty range gives ``[]``. Each blob
        is decoded (``decode_blob``) when the feature has a decoder; :meth:`frames` gives a
        clip as one array.

        Examples
        --------
        >>> f.video.blobs("v1", -8)  # the last 8 frames (fewer if the video is shorter)  # doctest: +SKIP
        """
        row, first, stop = self._blob_range(key, slice(first, stop))
        raw = self._read_blobs(row, first, stop)
        decode = getattr(self.feature, "decode_blob", None)
        return [decode(b) for b in raw] if decode else raw

    def frames(self, key: Key, encoded: bool = False) -> BlobsView:
        """The frames of one "blobs" item (a video) as a sliceable view: ``f.video.frames(id)[k:k+8]``.

        Nothing is read until the view is indexed; a slice reads only the bytes of its frames
        (the first read of a part of the item in this process reads and checks all of it).

        Parameters
        ----------
        key : str or int
            The item's id or position.
        encoded : bool
            Index to the stored bytes (a list of ``bytes``, e.g. for ``tf.io.decode_jpeg``
            or a GPU decoder) instead of decoded frames.

        Examples
        --------
        >>> clip = f.video.frames("v1")[8:16]  # (8, H, W, C) uint8, fewer rows past the end  # doctest: +SKIP
        >>> jpegs = f.video.frames("v1", encoded=True)[-4:]  # the last four frames' JPEG bytes  # doctest: +SKIP
        """
        row = self.group.position(key)
        if self.feature.spec().layout != "blobs":
            raise SchemaError(f"{self.where}: frames() needs a feature stored as blobs (EncodedFrames), "
                              f"not {type(self.feature).__name__}; read the item with f.{self.name}[id]")
        return BlobsView(self, row, encoded)

    def _blob_range(self, key: Key, sl: slice) -> tuple[int, int, int]:
        row = self.group.position(key)
        start, stop, _ = slice(sl.start, sl.stop).indices(int(self.lengths[row]))
        return row, start, max(start, stop)

    def _read_blobs(self, row: int, first: int, stop: int) -> list[Any]:
        try:
            return self.column.read_blobs(row, first, stop)
        except KeyError:
            raise NotFound(f"{self.where}: id {self.group.store.refs.id(row)!r} has no {self.name!r} item") from None

    def __repr__(self) -> str:
        return f"<feature {self.where} {self.feature!r}: {int(self.present.sum())} items>"


class BlobsView:
    """The frames of one "blobs" item, indexed like a sequence (made by :meth:`FeatureView.frames`).

    ``view[k]`` is one frame (``IndexError`` out of range, as a list); ``view[a:b:s]`` is
    the frames a Python slice would pick, stacked into one ``(n, H, W, C)`` array (``n`` may
    be 0), reading only the bytes from the first to the last picked frame (once the whole item
    passed its CRC-32 check in this process: the first part read checks it). With
    ``encoded=True`` values are the stored bytes (``bytes``; a list for a slice).

    Examples
    --------
    >>> v = f.video.frames("v1")  # doctest: +SKIP
    >>> len(v), v[0].shape, v[-3:].shape, v[100:108].shape  # doctest: +SKIP
    (20, (96, 128, 3), (3, 96, 128, 3), (0, 96, 128, 3))
    """

    __slots__ = ("_encoded", "_row", "_view")

    def __init__(self, view: FeatureView, row: int, encoded: bool) -> None:
        self._view = view
        self._row = row
        self._encoded = bool(encoded)

    def __len__(self) -> int:
        return int(self._view.lengths[self._row])

    def __getitem__(self, key: Any) -> Any:
        n = len(self)
        if isinstance(key, slice):
            picked = range(*key.indices(n))
            if not len(picked):
                if not n:  # a whole empty item: its CRC-32 still says whether it should be empty
                    self._view._read_blobs(self._row, 0, 0)
                return [] if self._encoded else self._empty()
            lo, hi = min(picked[0], picked[-1]), max(picked[0], picked[-1]) + 1
            raw = self._view._read_blobs(self._row, lo, hi)
            raw = [raw[k - lo] for k in picked]
            return [bytes(b) for b in raw] if self._encoded else self._decode(raw)
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"frame indices must be ints or slices, not {type(key).__name__}")
        k = int(key) + n if key < 0 else int(key)
        if not 0 <= k < n:
            raise IndexError(f"{self._view.where}: frame {int(key)} out of range for a video of {n} frames")
        raw = self._view._read_blobs(self._row, k, k + 1)
        return bytes(raw[0]) if self._encoded else self._decode(raw)[0]

    def _decode(self, raw: list[Any]) -> np.ndarray:
        decode = getattr(self._view.feature, "decode", None)
        return np.asarray(decode(raw)) if decode is not None else np.stack(raw)

    def _empty(self) -> np.ndarray:
        first = self._decode(self._view._read_blobs(self._row, 0, 1)) if len(self) else np.zeros((1, 0), np.uint8)
        return first[:0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self[:])

    def __repr__(self) -> str:
        return f"<frames of {self._view.where} item {self._row}: {len(self)}{' encoded' if self._encoded else ''}>"


class _NoItemYet:
    """The column of a feature whose dtype or shape its first item will fix: no item yet.

    Reads see every id as absent, as for a feature the ids were added without.
    """

    spec = None

    def __init__(self, store: GroupStore, name: str) -> None:
        self.where = f"{store.where.rstrip('/')}/{name}"
        self._n = len(store)

    @property
    def index(self) -> np.ndarray:
        return np.full((self._n, 2), -1, dtype=np.int64)

    @property
    def lengths(self) -> np.ndarray:
        return np.zeros(self._n, dtype=np.int64)

    @property
    def present(self) -> np.ndarray:
        return np.zeros(self._n, dtype=bool)

    @property
    def data(self) -> Any:
        raise NotFound(f"{self.where}: holds no item yet, so it has no data (its dtype and shape are fixed by "
                       "the first item stored)")

    def flush_pending(self) -> None:
        pass

    def read_items(self, rows: Sequence[int] | np.ndarray, verify: bool = False) -> list[np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size:
            raise KeyError(int(rows[0]))
        return []

    def read_blobs(self, row: int, first: int, stop: int) -> list[np.ndarray]:
        raise KeyError(row)


_EXTEND_FORMS = (
    "extend() takes one of:\n"
    "  f.extend({id: {feature: value, ...}, ...})            a dict of ids to their features\n"
    "  f.extend([(id, {feature: value, ...}), ...])          (id, dict) pairs\n"
    "  f.extend([id, ...], {feature: [value, ...], ...})     ids plus one list per feature\n"
    "with ids as str"
)


def _records_form(where: str, records: Any, columns: Mapping[str, Sequence[Any]] | None) -> Any:
    """``records`` as ``extend``'s pairs or ids; one error listing the accepted forms otherwise."""

    def refuse(got: str) -> SchemaError:
        return SchemaError(f"{where}: {got}; {_EXTEND_FORMS}")

    if columns is not None:
        if isinstance(records, (str, bytes, Mapping)) or not isinstance(columns, Mapping):
            raise refuse(f"ids plus columns, but got {type(records).__name__} and {type(columns).__name__}")
        ids = list(records)
        bad = next((i for i in ids if not isinstance(i, str)), None)
        if bad is not None:
            raise refuse(f"an id must be a str, got {bad!r}")
        return ids
    if isinstance(records, Mapping):
        pairs = list(records.items())
        if pairs and not isinstance(pairs[0][1], Mapping):
            k = pairs[0][0]
            raise refuse(f"a dict whose values are not dicts ({k!r}: {type(pairs[0][1]).__name__}); "
                         "a dict of features needs the ids too")
    elif isinstance(records, (str, bytes)) or not hasattr(records, "__iter__"):
        raise refuse(f"got {type(records).__name__}")
    else:
        pairs = list(records)
    for p in pairs:
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], Mapping)):
            shown = repr(p) if len(repr(p)) < 60 else f"{type(p).__name__} {repr(p)[:50]}..."
            raise refuse(f"a record must be (id, {{feature: value}}), got {shown}")
    return pairs


class GroupView:
    """The ids and features of one group of an open file (``f`` itself is the root group).

    Examples
    --------
    >>> f.logs.add("run-1", dict(loss=np.array([0.9, 0.5])))  # doctest: +SKIP
    >>> f.logs.loss["run-1"]  # doctest: +SKIP
    array([0.9, 0.5], dtype=float32)
    """

    def __init__(self, name: str, store: GroupStore, features: Mapping[str, Feature],
                 on_fix: Callable[[str, Mapping[str, Feature]], None] | None = None) -> None:
        self.name = name
        self.store = store
        self.features = dict(features)
        self._views: dict[str, FeatureView] = {}
        self._ids: IdsView | None = None
        # Called with the features their first items fixed (TypedFile writes the file's schema).
        self._on_fix = on_fix

    def feature(self, name: str) -> FeatureView:
        view = self._views.get(name)
        if view is None:
            if name not in self.features:
                raise NotFound(f"{self.store.where}: no feature {name!r} (features: {sorted(self.features)})")
            view = self._views[name] = FeatureView(self, name, self.features[name], self.store.columns.get(name))
        return view

    def fix(self, fixed: Mapping[str, Feature]) -> None:
        """Store the dtype and shape that first items fixed for undeclared features.

        Each feature of ``fixed`` (from :meth:`Feature.fixed_by <h5store.schema.Feature.fixed_by>`)
        gets its column, and the file's schema records it, committed with the items. Called
        by :meth:`extend` and by ingest, before the first items are stored.

        Examples
        --------
        >>> x = f.features["x"].fixed_by(first)  # doctest: +SKIP
        >>> f.group().fix({"x": x})  # doctest: +SKIP
        """
        for name in fixed:
            if name not in self.features or name in self.store.columns:
                raise SchemaError(f"{self.store.where.rstrip('/')}/{name}: not a feature awaiting its first item")
        for name, feat in fixed.items():
            self.store.add_column(name, feat.spec())
            self.features[name] = feat
        if self._on_fix is not None:
            self._on_fix(self.name, fixed)

    def __getattr__(self, name: str) -> FeatureView:
        if name.startswith("_") or name not in self.__dict__.get("features", {}):
            raise AttributeError(name)
        return self.feature(name)

    @property
    def ids(self) -> IdsView:
        if self._ids is None:
            self._ids = IdsView(self.store.refs)
        return self._ids

    def __len__(self) -> int:
        return len(self.store)

    def __contains__(self, id: object) -> bool:
        return id in self.store.refs

    def __iter__(self) -> Iterator[str]:
        return iter(self.store.refs)

    def position(self, key: Key) -> int:
        """Row of an id, or a (possibly negative) position checked against the size."""
        if isinstance(key, str):
            return self.store.refs.row(key)
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"{self.store.where}: key must be an id (str) or a position (int), got {key!r}")
        n = len(self)
        r = int(key)
        if not -n <= r < n:
            raise IndexError(f"{self.store.where}: position {r} out of range for {n} items")
        return r + n if r < 0 else r

    def get(self, key: Key, default: Any = None) -> dict[str, Any] | Any:
        """Every present feature of one id as a dict (``default`` when the id is absent)."""
        try:
            row = self.position(key)
        except (KeyError, IndexError):
            return default
        cols = self.store.columns
        return {n: self.feature(n)[row] for n in self.features if n in cols and cols[n].index[row, 0] >= 0}

    # -- writing -------------------------------------------------------------
    def _encode(self, name: str, value: Any, id: Any, fixing: dict[str, Feature] | None = None) -> Any:
        """``value`` encoded for feature ``name``. A feature awaiting its first item is fixed by
        ``value`` into ``fixing`` (applied with :meth:`fix` once the whole batch is valid)."""
        if name not in self.features:
            raise SchemaError(f"{self.store.where}: no feature {name!r} (features: {sorted(self.features)})")
        feat = self.features[name]
        try:
            if not feat.is_fixed and fixing is not None:
                feat = fixing.get(name) or fixing.setdefault(name, feat.fixed_by(value))
            return feat.encode(value)
        except SchemaError as e:
            raise SchemaError(f"{self.store.where.rstrip('/')}/{name}: id {id!r}: {e}") from None

    def add(self, id: str, values: Mapping[str, Any]) -> int:
        """Add one id with its features' items; returns its position."""
        return int(self.extend([(id, values)])[0])

    def extend(self, records: Iterable[tuple[str, Mapping[str, Any]]] | Sequence[str],
               columns: Mapping[str, Sequence[Any]] | None = None, *, encoded: bool = False,
               checksums: Sequence[Mapping[str, int]] | None = None,
               packed: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray, Callable[[np.ndarray], object]]] | None = None,
               ) -> np.ndarray:
        """Add many ids at once: ``extend({id: {feat: x}, ...})``, ``extend([(id, {feat: x}), ...])``
        or ``extend(ids, {feat: [x, ...]})``; any other shape of input raises one
        :class:`~h5store.errors.SchemaError` listing these forms.

        Every item is validated before anything is stored, so a bad item adds nothing.
        ``encoded=True`` skips validation for items that already went through
        :meth:`Feature.encode <h5store.schema.Feature.encode>` (ingest validates in its workers);
        ``checksums`` (one dict per record) then gives their CRC-32s, computed by the caller.
        ``packed`` (ingest) gives encoded items as concatenated rows instead: per feature
        ``(positions, lengths, crcs, fill)``, the items of the records at ``positions``, where
        ``fill(out)`` writes all their rows into ``out`` (see :meth:`Column.append_rows
        <h5store.column.Column.append_rows>`).
        Returns the new positions.
        """
        records = _records_form(self.store.where, records, columns)
        if columns is not None:
            ids = list(records)  # type: ignore[arg-type]
            for name, col in columns.items():
                if len(col) != len(ids):
                    raise ValueError(f"{self.store.where.rstrip('/')}/{name}: {len(col)} items for {len(ids)} ids")
            recs: list[tuple[str, Mapping[str, Any]]] = [
                (i, {n: columns[n][j] for n in columns}) for j, i in enumerate(ids)
            ]
        else:
            recs = list(records)  # type: ignore[arg-type]
        per: dict[str, tuple[list[int], list[Any], list[int]]] = {}
        fixing: dict[str, Feature] = {}  # features whose first item is in this batch
        for j, (id, values) in enumerate(recs):
            for name, value in values.items():
                sel, items, crcs = per.setdefault(name, ([], [], []))
                sel.append(j)
                items.append(value if encoded else self._encode(name, value, id, fixing))
                if checksums is not None:
                    crcs.append(checksums[j][name])
        for name in [*per, *(packed or {})]:
            if name not in self.store.columns and name not in fixing:
                if name in self.features:
                    raise SchemaError(f"{self.store.where.rstrip('/')}/{name}: encoded items for a feature awaiting "
                                      "its first item: fix() it first")
                raise SchemaError(f"{self.store.where}: no feature {name!r} (features: {sorted(self.store.columns)})")
        rows = self.store.add([r[0] for r in recs], {})
        if fixing:
            self.fix(fixing)  # the batch is valid and its ids are new: its first items fix the storage
        for name, (sel, items, crcs) in per.items():
            self.store.columns[name].append(rows[np.asarray(sel, dtype=np.int64)], items,
                                            crcs if checksums is not None else None)
        for name, (pos, lengths, sums, fill) in (packed or {}).items():
            self.store.columns[name].append_rows(rows[pos], lengths, sums, fill)
        return rows

    def describe(self) -> list[dict[str, Any]]:
        """One row per feature: items, dtype, item shape, length percentiles, bytes, compression.

        Reads only index tables and HDF5 metadata, never the data: cheap on any file size.
        """
        rows = []
        for name in self.features:
            col = self.store.columns.get(name)
            if col is None:  # awaiting its first item
                feat = self.features[name]
                rows.append(dict(feature=name, type=feat.type_name, items=0, ids=len(self), dtype=feat.dtype,
                                 shape=feat.shape, layout=feat.layout, lengths=[], compression=feat.compression,
                                 data_bytes=0, disk_bytes=0, ratio=None))
                continue
            spec = col.spec
            present = col.present
            lengths = col.lengths[present]
            on_disk = sum(int(d.id.get_storage_size()) for d in col.g.values() if hasattr(d, "id") and hasattr(d.id, "get_storage_size"))
            raw = int(col.data.shape[0]) * spec.row_nbytes if spec.layout != "blobs" else int(col.data.shape[0])
            pct = np.percentile(lengths, [0, 50, 95, 100]).tolist() if spec.layout != "fixed" and lengths.size else []
            rows.append(dict(
                feature=name, type=self.features[name].type_name, items=int(present.sum()), ids=len(present),
                dtype=spec.dtype, shape=spec.shape, layout=spec.layout, lengths=pct,
                compression=spec.compression, data_bytes=raw, disk_bytes=on_disk,
                ratio=(raw / on_disk) if on_disk else None,
            ))
        return rows

    def __repr__(self) -> str:
        return f"<group {self.store.where}: {len(self)} ids, features {sorted(self.features)}>"
