"""A group as stored: its ids table (:class:`~h5store.refs.Refs`) and one :class:`~h5store.column.Column` per feature."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from h5store.column import Column, ColumnTables, create_column, open_subgroup
from h5store.errors import CorruptRecordError, FormatError, ReadOnlyError, SchemaError
from h5store.format import ABSENT, IDS, IDS_SPEC, INDEX, ColumnSpec
from h5store.handle import FileHandle
from h5store.refs import Refs

__all__ = ["GroupStore", "Tables"]


@dataclass(frozen=True)
class Tables:
    """The in-memory tables of a read-only :class:`GroupStore`, handed to a forked child."""

    refs: Refs | None
    ids_size: int
    columns: dict[str, ColumnTables]


class GroupStore:
    """A group's refs table and its columns, as stored under one HDF5 group.

    Parameters
    ----------
    g : h5py.Group
        The HDF5 group (``/`` for the root group).
    specs : dict
        Column name -> :class:`ColumnSpec`; missing columns are created when writable. None
        for a feature whose storage the first item will fix: it has no column yet (see
        :meth:`add_column`).
    where : str
        ``"file.h5:/group"``, for messages.
    """

    def __init__(self, g: h5py.Group, specs: dict[str, ColumnSpec | None], where: str, writable: bool, path: str,
                 handle: FileHandle | None = None) -> None:
        self.g = g
        self.where = where
        self.writable = writable
        if IDS not in g:
            if not writable:
                raise FormatError(f"{where}: group has no ids table")
            create_column(g, IDS, IDS_SPEC, 0)
        base = where.rstrip("/")
        self._ids = Column(open_subgroup(g, IDS, f"{base}/ids"), IDS_SPEC, f"{base}/ids", writable, path, handle)
        self._refs: Refs | None = None
        self.columns: dict[str, Column] = {}
        self._path, self._handle = path, handle
        n = int(g[IDS][INDEX].shape[0])
        for name, spec in specs.items():
            if spec is None:
                continue  # not fixed yet: no item stored, no column
            if name not in g:
                if not writable:
                    raise FormatError(f"{where}: no column {name!r} in the file")
                create_column(g, name, spec, n)
            self.columns[name] = Column(open_subgroup(g, name, f"{base}/{name}"), spec, f"{base}/{name}", writable, path, handle)
            if self.columns[name].stored_items != n:
                raise CorruptRecordError(f"{base}/{name}: index has {self.columns[name].stored_items} rows for {n} ids")
        if not writable:
            for col in (self._ids, *self.columns.values()):
                col.snapshot(n)  # the snapshot this reader sees until refresh()

    def tables(self) -> Tables | None:
        """The tables this read-only store has loaded (numpy only, no h5py object), or None."""
        if self.writable:
            return None
        columns = {n: c.tables() for n, c in self.columns.items()}
        return Tables(self._refs, self._ids.size, columns)

    def adopt(self, tables: Tables) -> None:
        """Take over tables loaded by this process's parent, where they still describe the file.

        A forked reader then shares them copy-on-write instead of reading them again: ~27 MB
        per worker for the ids of a million items, plus 20 MB per feature's index. A table
        whose dataset changed size since (a writer appended) is read afresh.
        """
        if self.writable:
            return
        n = self._ids.stored_items
        refs = tables.refs
        if refs is not None and tables.ids_size == self._ids.size and refs.merged == len(refs) == n:
            self._refs = refs
        for name, loaded in tables.columns.items():
            col = self.columns.get(name)
            if col is not None:
                col.adopt(loaded, n)

    @property
    def refs(self) -> Refs:
        if self._refs is None:
            ids = self._ids
            data = ids.read_ranges(np.array([0]), np.array([ids.size]))[0] if ids.size else np.zeros(0, np.uint8)
            self._refs = Refs(ids.index, data, ids.checksums, where=self.where)
            if not self.writable:
                ids.drop_index()  # the (N, 2) table: Refs keeps the same in N + 1 offsets
        return self._refs

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def stored_ids(self) -> int:
        """Ids in the file at its last commit (rows of the ids table's index)."""
        return self._ids.stored_items

    def add(self, ids: Sequence[str], items: dict[str, Sequence[Any]]) -> np.ndarray:
        """Append new ids with their items (each list as long as ``ids``); returns their rows."""
        if not self.writable:
            raise ReadOnlyError.opened(self.where)
        for name in items:
            if name not in self.columns:
                raise SchemaError(f"{self.where}: no feature {name!r} (features: {sorted(self.columns)})")
        rows = self.refs.add(ids)
        n = len(self.refs)
        for name, col in self.columns.items():
            col.grow_items(n)
            if name in items and len(items[name]):
                col.append(rows, items[name])
        return rows

    def add_column(self, name: str, spec: ColumnSpec) -> Column:
        """Create the column of a feature that its first item just fixed (writable stores only).

        Its index covers every id of the group, pending ones included, all absent.

        Examples
        --------
        >>> store.add_column("x", ColumnSpec(dtype="float64", shape=(None, 7), layout="ragged"))  # doctest: +SKIP
        """
        if not self.writable:
            raise ReadOnlyError.opened(self.where)
        if name in self.columns:
            raise SchemaError(f"{self.where}: feature {name!r} has a column already")
        base = self.where.rstrip("/")
        if name in self.g:
            raise FormatError(f"{base}/{name}: the schema lists no storage for it, yet the file holds an object "
                              "of that name; check the file with `h5store verify`")
        create_column(self.g, name, spec, self._ids.stored_items)
        col = self.columns[name] = Column(self.g[name], spec, f"{base}/{name}", True, self._path, self._handle)
        col.grow_items(len(self.refs))
        return col

    def put(self, name: str, row: int, item: Any) -> None:
        """Store the item of feature ``name`` for an existing row (append if absent, else overwrite)."""
        col = self.columns[name]
        if col.index[row, 0] == ABSENT:
            col.append(np.array([row]), [item])
        else:
            col.overwrite(row, item)

    def close_readers(self) -> None:
        """Close the descriptors of this process's direct readers (the file is being closed)."""
        for col in (self._ids, *self.columns.values()):
            col.close_reader(forget=True)

    def flush(self) -> None:
        if not self.writable:
            return
        refs = self.refs
        if refs.has_pending:
            start = refs.merged
            lengths, data, crc = refs.take_pending()
            self._ids.append_block(start, len(refs), lengths, data, crc)
        self._ids.flush()
        for col in self.columns.values():
            col.flush()
