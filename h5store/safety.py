"""Refuse hostile HDF5 files before HDF5 reads their data: the checks behind ``untrusted=True``.

An HDF5 file can make a plain ``ds[...]`` return bytes of *other* local files (external raw
storage, external links, virtual datasets), declare 2^40 rows in a 1.6 KB file, or hold a
chunk of zeros that inflates to gigabytes. :func:`check_untrusted` walks an open file with
HDF5's low-level API, reading object headers, dataset creation properties and chunk tables
but no raw data, and raises :class:`~h5store.errors.FormatError` naming the first object that
is not plain h5store data within the :class:`Limits`.

It cannot make HDF5 itself safe: the HDF5 releases bundled with h5py have published CVEs
(memory corruption while parsing crafted metadata) that no check above the library prevents.
:func:`~h5store.advisories.hdf5_advisories` lists those that apply to the HDF5 in use, and a
check on such a version warns with :class:`~h5store.advisories.H5StoreSecurityWarning`. For
files from strangers, run the checks in a separate, resource-limited process:
:func:`h5store.integrity.verify_in_subprocess`. The superblock (:mod:`h5store.superblock`) and
the check every trusted open runs (:mod:`h5store.external_data`) live beside this module.
See ``docs/reliability.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from h5store.advisories import Advisory, H5StoreSecurityWarning, hdf5_advisories, warn_advisories
from h5store.column import Column
from h5store.errors import FormatError, H5StoreError
from h5store.external_data import check_local, link_problem, storage_problem
from h5store.format import IDS, IDS_SPEC, ColumnSpec, check_root
from h5store.groups import GroupStore
from h5store.schema import Schema
from h5store.superblock import Superblock, read_superblock

# Advisory, H5StoreSecurityWarning, hdf5_advisories, Superblock, read_superblock, check_local,
# link_problem and storage_problem are re-exported from the modules that define them.
__all__ = [
    "ALLOWED_FILTERS",
    "Advisory",
    "H5StoreSecurityWarning",
    "Limits",
    "Superblock",
    "check_local",
    "check_untrusted",
    "duplicate_ids",
    "hdf5_advisories",
    "link_problem",
    "read_superblock",
    "storage_problem",
]

#: HDF5 filter ids h5store files may use: what h5py decodes without plugins, minus the
#: filters with published decoder CVEs (scale-offset, n-bit) and szip.
#: zstd and blosc (hdf5plugin's ids) are decoded by h5store's bounded decoders, never by HDF5.
ALLOWED_FILTERS: Mapping[int, str] = {1: "gzip", 2: "shuffle", 3: "fletcher32", 32000: "lzf", 32001: "blosc",
                                      32015: "zstd"}
_KNOWN_FILTERS = {**ALLOWED_FILTERS, 4: "szip", 5: "nbit", 6: "scaleoffset"}
#: Objects under ``/_h5store`` (library bookkeeping, e.g. the failures of a create).
INTERNAL_GROUP = "_h5store"
INTERNAL_DATASETS = frozenset({"failures"})
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_COLUMN_DATASETS = frozenset({"data", "index", "checksum"})
_TYPE_CLASSES = {0: "integer", 1: "float", 2: "time", 3: "string", 4: "bitfield", 5: "opaque", 6: "compound",
                 7: "reference", 8: "enum", 9: "variable-length", 10: "array"}


@dataclass(frozen=True)
class Limits:
    """What an untrusted file may declare; anything beyond is refused before it is read.

    Attributes
    ----------
    max_chunk_bytes : int
        Largest decompressed chunk (chunk shape x item size). HDF5 inflates a whole chunk
        to read one element of it, so this caps the memory of any single read.
    max_ratio : float
        Declared decompressed bytes of all filtered datasets, per byte of file. gzip
        inflates at most ~1000:1; h5store's own arrays compress far less.
    max_filtered_bytes : int or None
        Optional absolute cap on one filtered dataset's declared size.
    max_attr_bytes : int
        Largest attribute (the schema JSON is the largest h5store writes).
    max_attrs : int
        Most attributes on one object.
    max_objects : int
        Most groups and datasets in the file.
    max_chunks : int
        Most stored chunks in one dataset (listing them costs ~3 us each).

    Examples
    --------
    >>> Limits(max_chunk_bytes=1 << 20).max_ratio
    100.0
    """

    max_chunk_bytes: int = 64 << 20
    max_ratio: float = 100.0
    max_filtered_bytes: int | None = None
    max_attr_bytes: int = 16 << 20
    max_attrs: int = 64
    max_objects: int = 100_000
    max_chunks: int = 5_000_000



def __getattr__(name: str) -> Any:
    # HDF5_ADVISORIES lives in h5store.advisories, read from its data file at first use.
    if name == "HDF5_ADVISORIES":
        from h5store import advisories

        return advisories.HDF5_ADVISORIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- the walk
def _nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for d in shape:
        n *= int(d)
    return n


class _Walk:
    """One pass over an open file; ``refuse`` raises FormatError naming the object."""

    def __init__(self, f: h5py.File, path: str, limits: Limits) -> None:
        self.f = f
        self.path = path
        self.limits = limits
        self.file_size = int(f.id.get_filesize())
        self.objects = 0
        self.filtered_bytes = 0

    def refuse(self, where: str, why: str) -> FormatError:
        return FormatError(f"{self.path}:{where}: {why}; refused (untrusted file)")

    # -- objects -------------------------------------------------------------
    def children(self, g: h5py.Group, where: str) -> list[str]:
        names = []
        for raw in g.id.__iter__():
            name = raw.decode("utf-8", "replace")
            self.objects += 1
            if self.objects > self.limits.max_objects:
                raise self.refuse(where, f"more than {self.limits.max_objects} objects")
            why = link_problem(g.id, raw)
            if why:
                raise self.refuse(_join(where, name), why)
            names.append(name)
        return names

    def open_group(self, parent: h5py.Group, name: str, where: str) -> h5py.Group:
        obj = parent[name]
        if not isinstance(obj, h5py.Group):
            raise self.refuse(where, "expected a group, found a dataset")
        self.attrs(obj, where)
        return obj

    def attrs(self, obj: h5py.HLObject, where: str) -> None:
        n = h5py.h5o.get_info(obj.id).num_attrs
        if n > self.limits.max_attrs:
            raise self.refuse(where, f"{n} attributes (limit {self.limits.max_attrs})")
        for i in range(n):
            aid = h5py.h5a.open(obj.id, index=i)
            name = aid.get_name().decode("utf-8", "replace")
            size = int(aid.get_storage_size())
            declared = _nbytes(aid.shape, aid.get_type().get_size())
            if max(size, declared) > self.limits.max_attr_bytes:
                raise self.refuse(where, f"attribute {name!r} holds {max(size, declared)} bytes "
                                  f"(limit {self.limits.max_attr_bytes})")
            tid = aid.get_type()
            variable = tid.get_class() == h5py.h5t.VLEN or (tid.get_class() == h5py.h5t.STRING and tid.is_variable_str())
            if variable:
                if aid.shape not in ((), (1,)):
                    raise self.refuse(where, f"attribute {name!r} is an array of variable-length values")
                # Its length lives in the global heap (inside the file, so bounded by its size):
                # only reading it tells.
                length = _value_bytes(obj.attrs[name])
                if length > self.limits.max_attr_bytes:
                    raise self.refuse(where, f"attribute {name!r} holds {length} bytes "
                                      f"(limit {self.limits.max_attr_bytes})")

    # -- datasets ------------------------------------------------------------
    def dataset(self, parent: h5py.Group, name: str, where: str,
                expect: Callable[[np.dtype, tuple[int, ...]], str | None]) -> h5py.Dataset:
        obj = parent[name]
        if not isinstance(obj, h5py.Dataset):
            raise self.refuse(where, "expected a dataset, found a group")
        self.attrs(obj, where)
        dcpl = obj.id.get_create_plist()
        layout = dcpl.get_layout()
        why = storage_problem(dcpl)
        if why:
            raise self.refuse(where, why)
        filtered = False
        for i in range(dcpl.get_nfilters()):
            code = int(dcpl.get_filter(i)[0])
            if code not in ALLOWED_FILTERS:
                label = _KNOWN_FILTERS.get(code, "unknown")
                raise self.refuse(where, f"HDF5 filter {code} ({label}) is not allowed "
                                  f"(allowed: {', '.join(ALLOWED_FILTERS.values())})")
            filtered = filtered or code != 3  # fletcher32 only appends 4 bytes per chunk
        tid = obj.id.get_type()
        if tid.get_class() not in (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.ENUM, h5py.h5t.COMPOUND):
            label = _TYPE_CLASSES.get(tid.get_class(), str(tid.get_class()))
            raise self.refuse(where, f"datatype class {label} is not a plain number")
        dtype = obj.dtype
        if dtype.hasobject or dtype.kind not in "biufc" or dtype.shape != ():
            raise self.refuse(where, f"datatype {dtype} is not a plain number")
        shape = tuple(int(d) for d in obj.shape or ())
        why = expect(dtype, shape)
        if why:
            raise self.refuse(where, why)
        nbytes = _nbytes(shape, dtype.itemsize)
        chunk_bytes = 0
        if layout == h5py.h5d.CHUNKED:
            chunk = tuple(int(c) for c in dcpl.get_chunk())
            if len(chunk) != len(shape):
                raise self.refuse(where, f"chunk rank {len(chunk)} differs from the dataset's rank {len(shape)}")
            if any(c <= 0 for c in chunk):
                raise self.refuse(where, f"chunk shape {chunk} has an empty dimension")
            chunk_bytes = _nbytes(chunk, dtype.itemsize)
            if chunk_bytes > self.limits.max_chunk_bytes:
                raise self.refuse(where, f"chunks of {chunk_bytes} bytes decompressed (chunk shape {chunk}; "
                                  f"limit {self.limits.max_chunk_bytes})")
        if filtered:
            self.filtered_bytes += nbytes
            cap = self.limits.max_ratio * max(self.file_size, 1)
            if self.limits.max_filtered_bytes is not None:
                cap = min(cap, self.limits.max_filtered_bytes)
            if nbytes > cap:
                raise self.refuse(where, f"declares {nbytes} bytes of compressed data ({shape} x {dtype.itemsize} "
                                  f"bytes) in a file of {self.file_size} bytes (limit {int(cap)})")
        elif nbytes > self.file_size + chunk_bytes:
            raise self.refuse(where, f"declares {shape[0] if shape else 1} rows ({nbytes} bytes) in a file of "
                              f"{self.file_size} bytes")
        self.storage(obj, where, layout, filtered, nbytes, chunk_bytes)
        return obj

    def storage(self, ds: h5py.Dataset, where: str, layout: int, filtered: bool, nbytes: int,
                chunk_bytes: int) -> None:
        """Where the bytes are: every chunk (or the contiguous block) inside the file."""
        if layout == h5py.h5d.CONTIGUOUS:
            off = ds.id.get_offset()
            if off is not None and off + nbytes > self.file_size:
                raise self.refuse(where, f"contiguous data at byte {off} ({nbytes} bytes) runs past the end "
                                  f"of the file ({self.file_size} bytes)")
            return
        if layout != h5py.h5d.CHUNKED or not nbytes:
            return
        # Compressed chunks may exceed their raw size a little (gzip/lzf framing, fletcher32).
        max_stored = chunk_bytes + chunk_bytes // 16 + 1024 if filtered else chunk_bytes + 4
        bad: list[str] = []
        count = [0]

        def check(info: Any) -> Any:
            count[0] += 1
            if count[0] > self.limits.max_chunks:
                bad.append(f"more than {self.limits.max_chunks} chunks")
            elif info.byte_offset is None or info.byte_offset + info.size > self.file_size:
                bad.append(f"a chunk at byte {info.byte_offset} ({info.size} bytes) lies past the end of the file "
                           f"({self.file_size} bytes)")
            elif info.size > max_stored or (not filtered and info.size < chunk_bytes):
                bad.append(f"a chunk stores {info.size} bytes for {chunk_bytes} bytes of data")
            return True if bad else None

        ds.id.chunk_iter(check)
        if bad:
            raise self.refuse(where, bad[0])


def _value_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogateescape"))
    if isinstance(value, bytes):
        return len(value)
    arr = np.asarray(value)
    if arr.dtype.hasobject:
        return sum(_value_bytes(v) for v in arr.reshape(-1))
    return int(arr.nbytes)


def _join(where: str, name: str) -> str:
    return f"{where.rstrip('/')}/{name}"


def _expect(dtype: str | None, rank: int, inner: tuple[int, ...] | None = None) -> Callable[[np.dtype, tuple[int, ...]], str | None]:
    def check(dt: np.dtype, shape: tuple[int, ...]) -> str | None:
        if dtype is not None and dt != np.dtype(dtype):
            return f"dtype {dt}, the format says {dtype}"
        if len(shape) != rank or (inner is not None and shape[1:] != inner):
            want = f"(N, {', '.join(map(str, inner))})" if inner else f"rank {rank}"
            return f"shape {shape}, the format says {want}"
        return None

    return check


def check_untrusted(h5file: h5py.File, path: str | None = None, limits: Limits | None = None) -> None:
    """Refuse a file that is not plain h5store data within ``limits``, reading no raw data.

    Walks every object of the layout (``docs/format.md``) with HDF5's low-level API and
    raises :class:`~h5store.errors.FormatError`, naming the object, for: soft, external and
    user-defined links; external raw storage; virtual datasets; a filter other than gzip,
    lzf, zstd, blosc, shuffle or fletcher32; a datatype that is not a plain number; any object the
    format does not name; a declared shape whose bytes exceed the file (unfiltered) or
    ``limits.max_ratio`` x the file (filtered); chunks larger than
    ``limits.max_chunk_bytes`` once decompressed, or stored outside the file, or whose rank
    differs from the dataset's; oversized attributes. Then it checks that ids, indexes and
    checksums agree, that every index row lies inside its data and that no id repeats (a
    repeated id hides the item of its second copy), before anything reads an item. Every
    later read decodes compressed chunks no further than their declared size
    (:class:`~h5store.storage.ChunkReader`). Warns :class:`H5StoreSecurityWarning` when the HDF5 in use has published CVEs.

    Parameters
    ----------
    h5file : h5py.File
        The open file (read-only is enough).
    path : str, optional
        Names the file in messages (default: ``h5file.filename``).
    limits : Limits, optional
        What the file may declare.

    Examples
    --------
    >>> import warnings
    >>> with h5py.File(path, "r", locking=False) as f, warnings.catch_warnings():  # doctest: +SKIP
    ...     warnings.simplefilter("ignore", H5StoreSecurityWarning)
    ...     check_untrusted(f, path)
    """
    warn_advisories()
    path = path or h5file.filename
    try:
        _check(h5file, path, limits or Limits())
    except FormatError:
        raise
    except (OSError, KeyError, RuntimeError, ValueError, TypeError, UnicodeError) as e:
        # Damaged or hostile metadata surfaces from h5py as any of these.
        raise FormatError(f"{path}: unreadable HDF5 metadata ({type(e).__name__}: {e}); "
                          "refused (untrusted file)") from None


def _check(h5file: h5py.File, path: str, limits: Limits) -> None:
    walk = _Walk(h5file, path, limits)
    walk.attrs(h5file, "/")
    try:
        schema_dict = check_root(h5file, path)
        schema = Schema.from_dict(schema_dict)
        # A feature awaiting its first item (h5s.Array()) has no column: none may be in the file.
        specs = {g: {n: ft.spec() for n, ft in feats.items() if ft.is_fixed} for g, feats in schema.groups.items()}
    except H5StoreError as e:
        raise FormatError(f"{e}; refused (untrusted file)") from None
    for gname in specs:
        if gname and (not _NAME.match(gname) or gname == IDS or gname == INTERNAL_GROUP):
            raise walk.refuse("/", f"the schema names an invalid group {gname!r}")
        for fname in specs[gname]:
            if not _NAME.match(fname) or fname == IDS:
                raise walk.refuse(f"/{gname}", f"the schema names an invalid feature {fname!r}")
    root_names = set(walk.children(h5file, "/"))
    allowed_root = {IDS, INTERNAL_GROUP} | set(specs.get("", {})) | {g for g in specs if g}
    for name in sorted(root_names - allowed_root):
        raise walk.refuse(f"/{name}", "object not in the h5store layout (neither ids, a feature nor a group "
                          "of the schema)")
    if INTERNAL_GROUP in root_names:
        g = walk.open_group(h5file, INTERNAL_GROUP, f"/{INTERNAL_GROUP}")
        for name in walk.children(g, f"/{INTERNAL_GROUP}"):
            if name not in INTERNAL_DATASETS:
                raise walk.refuse(f"/{INTERNAL_GROUP}/{name}", "object not in the h5store layout")
            walk.dataset(g, name, f"/{INTERNAL_GROUP}/{name}", _expect("uint8", 1))
    for gname, feats in specs.items():
        where = f"/{gname}" if gname else ""
        if gname:
            if gname not in root_names:
                raise walk.refuse(where, "group of the schema missing from the file")
            g = walk.open_group(h5file, gname, where)
            names = set(walk.children(g, where))
            extra = names - {IDS} - set(feats)
            if extra:
                raise walk.refuse(_join(where, sorted(extra)[0]), "object not in the h5store layout")
        else:
            g, names = h5file, root_names
        for cname, spec in [(IDS, IDS_SPEC), *feats.items()]:
            if cname not in names:
                raise walk.refuse(_join(where, cname), "listed by the schema but missing from the file")
            _check_column(walk, g, cname, spec, _join(where, cname))
    if walk.filtered_bytes > walk.limits.max_ratio * max(walk.file_size, 1):
        raise walk.refuse("/", f"declares {walk.filtered_bytes} bytes of compressed data in a file of "
                          f"{walk.file_size} bytes (more than {walk.limits.max_ratio:g} times its size)")
    _check_consistency(h5file, path, specs)



def _check_column(walk: _Walk, parent: h5py.Group, name: str, spec: ColumnSpec, where: str) -> None:
    g = walk.open_group(parent, name, where)
    names = set(walk.children(g, where))
    want = _COLUMN_DATASETS | ({"frames"} if spec.layout == "blobs" else set())
    for extra in sorted(names - want):
        raise walk.refuse(_join(where, extra), "object not in the h5store layout")
    for missing in sorted(want - names):
        raise walk.refuse(_join(where, missing), "dataset missing")
    walk.dataset(g, "data", _join(where, "data"), _expect(spec.dtype, 1 + len(spec.inner), spec.inner))
    walk.dataset(g, "index", _join(where, "index"), _expect(None, 2, (2,)))
    walk.dataset(g, "checksum", _join(where, "checksum"), _expect("uint32", 1))
    if spec.layout == "blobs":
        walk.dataset(g, "frames", _join(where, "frames"), _expect(None, 2, (2,)))
    for ds in ("index", "frames"):
        if ds in names and g[ds].dtype.kind not in "iu":
            raise walk.refuse(_join(where, ds), f"dtype {g[ds].dtype} is not an integer")


def duplicate_ids(index: np.ndarray, raw: bytes, crc: np.ndarray, valid: np.ndarray | None = None) -> list[tuple[int, int]]:
    """``(row, first)`` for every id that repeats the id at an earlier row ``first``.

    ``index`` is the ids table's ``(N, 2)`` ``[start, stop)`` bytes of ``raw``, ``crc`` each
    id's stored CRC-32, ``valid`` the rows to consider (default: all). Vectorised: rows are
    sorted by CRC-32 and only ids whose CRC-32 equals a neighbour's have their bytes
    compared. A repeated id makes every later copy unreachable (a lookup finds the first).
    Used by :func:`h5store.integrity.verify` and by the untrusted checks.

    Examples
    --------
    >>> import zlib
    >>> ids = [b"k0", b"k0", b"k2", b"k3"]
    >>> stops = np.cumsum([len(i) for i in ids])
    >>> index = np.stack([stops - 2, stops], axis=1)
    >>> duplicate_ids(index, b"".join(ids), np.array([zlib.crc32(i) for i in ids], np.uint32))
    [(1, 0)]
    """
    rows = np.arange(len(index)) if valid is None else np.flatnonzero(valid)
    if rows.size < 2:
        return []
    order = rows[np.argsort(crc[rows], kind="stable")]
    same = np.flatnonzero(crc[order][1:] == crc[order][:-1])
    out = []
    seen: dict[bytes, int] = {}
    for k in sorted(set(same.tolist()) | {i + 1 for i in same.tolist()}):
        row = int(order[k])
        key = raw[int(index[row, 0]) : int(index[row, 1])]
        first = seen.setdefault(key, row)
        if first != row:
            out.append((row, first))
    return out


def _check_consistency(f: h5py.File, path: str, specs: Mapping[str, Mapping[str, ColumnSpec]]) -> None:
    """Ids, indexes and checksums agree, and every index row lies inside its data.

    Every table read here passed the declared-size checks, so no read allocates more than
    the file's size; the same validation guards every later read of an item.
    """
    for gname, feats in specs.items():
        g = f[gname] if gname else f
        where = f"{path}:/{gname}"
        try:
            # GroupStore checks that every column has one index row per id.
            store = GroupStore(g, dict(feats), where, False, path)
            ids = Column(g[IDS], IDS_SPEC, f"{where.rstrip('/')}/{IDS}", False, path)
            for col in [ids, *store.columns.values()]:
                _ = col.index, col.checksums
            # Every id once: a repeated id hides the item of its second copy (ids are
            # checked against their CRC-32 as they are read).
            raw = ids.read_ranges(np.array([0]), np.array([ids._size]))[0].tobytes() if ids._size else b""
            dup = duplicate_ids(ids.index, raw, ids.checksums)
            if dup:
                row, first = dup[0]
                raise FormatError(f"{where.rstrip('/')}/{IDS}: the id at row {row} repeats the id at row {first} "
                                  "(ids must be unique: the second cannot be reached)")
        except FormatError as e:
            raise FormatError(f"{e}; refused (untrusted file)") from None
        except (OSError, KeyError, ValueError) as e:
            raise FormatError(f"{where}: unreadable tables ({e}); refused (untrusted file)") from None
