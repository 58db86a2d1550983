"""Ragged concatenated columns on HDF5: the names of the storage layer, in one place to import.

The storage layer is split by concept; this module re-exports its names for code that
imports them from here:

* :mod:`h5store.format` - names, attributes, the ids spec, version rules, the index check;
* :mod:`h5store.codecs` - bounded decoding of gzip/lzf/shuffle/fletcher32 chunks;
* :mod:`h5store.readers` - the :class:`~h5store.readers.Reader` protocol and its readers;
* :mod:`h5store.column` - :class:`~h5store.column.Column`, one feature's reads and writes;
* :mod:`h5store.groups` - :class:`~h5store.groups.GroupStore`, a group's ids and columns.
"""

from __future__ import annotations

# (the codecs' private names, for tests that import them from here)
from h5store.codecs import _fletcher32 as _fletcher32
from h5store.codecs import _lzf as _lzf
from h5store.codecs import _lzf_decode as _lzf_decode
from h5store.codecs import _TooLarge as _TooLarge
from h5store.column import Column, create_column
from h5store.format import (
    ABSENT,
    ATTR_FORMAT,
    ATTR_SCHEMA,
    ATTR_SCHEMA_CRC,
    ATTR_VERSION,
    COMPRESSIONS,
    FORMAT_VERSION,
    IDS,
    LAYOUTS,
    ColumnSpec,
    check_root,
    init_root,
)
from h5store.groups import GroupStore, Tables
from h5store.readers import ChunkReader, DirectReader, H5Reader, MemoryReader, Reader, read_whole

__all__ = [
    "ABSENT",
    "ATTR_FORMAT",
    "ATTR_SCHEMA",
    "ATTR_SCHEMA_CRC",
    "ATTR_VERSION",
    "COMPRESSIONS",
    "FORMAT_VERSION",
    "IDS",
    "LAYOUTS",
    "ChunkReader",
    "Column",
    "ColumnSpec",
    "DirectReader",
    "GroupStore",
    "H5Reader",
    "MemoryReader",
    "Reader",
    "Tables",
    "check_root",
    "create_column",
    "init_root",
    "read_whole",
]
