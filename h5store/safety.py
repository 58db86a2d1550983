"""Refuse hostile HDF5 files before HDF5 reads their data: the checks behind ``untrusted=True``.

An HDF5 file can make a plain ``ds[...]`` return bytes of *other* local files (external raw
storage, external links, virtual datasets), declare 2^40 rows in a 1.6 KB file, or hold a
chunk of zeros that inflates to gigabytes. :func:`check_untrusted` walks an open file with
HDF5's low-level API, reading object headers, dataset creation properties and chunk tables
but no raw data, and raises :class:`~h5store.errors.FormatError` naming the first object that
is not plain h5store data within the :class:`Limits`.

It cannot make HDF5 itself safe: the HDF5 releases bundled with h5py have published CVEs
(memory corruption while parsing crafted metadata) that no check above the library prevents.
:func:`hdf5_advisories` lists those that apply to the HDF5 in use, and a check on such a
version warns with :class:`H5StoreSecurityWarning`. For files from strangers, run the checks
in a separate, resource-limited process: :func:`h5store.integrity.verify_in_subprocess`.
See ``docs/reliability.md``.
"""

from __future__ import annotations

import os
import re
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from h5store.errors import FormatError, H5StoreError
from h5store.schema import Schema
from h5store.storage import IDS, Column, ColumnSpec, GroupStore, check_root

__all__ = [
    "ALLOWED_FILTERS",
    "HDF5_ADVISORIES",
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
ALLOWED_FILTERS: Mapping[int, str] = {1: "gzip", 2: "shuffle", 3: "fletcher32", 32000: "lzf"}
_KNOWN_FILTERS = {**ALLOWED_FILTERS, 4: "szip", 5: "nbit", 6: "scaleoffset"}
#: Objects under ``/_h5store`` (library bookkeeping, e.g. the failures of a create).
INTERNAL_GROUP = "_h5store"
INTERNAL_DATASETS = frozenset({"failures"})
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_COLUMN_DATASETS = frozenset({"data", "index", "checksum"})
_TYPE_CLASSES = {0: "integer", 1: "float", 2: "time", 3: "string", 4: "bitfield", 5: "opaque", 6: "compound",
                 7: "reference", 8: "enum", 9: "variable-length", 10: "array"}


class H5StoreSecurityWarning(UserWarning):
    """The HDF5 library in use has published vulnerabilities reachable from crafted files."""


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


# --------------------------------------------------------------------------- advisories
@dataclass(frozen=True)
class Advisory:
    """Published vulnerabilities of HDF5 releases before ``fixed_in``."""

    ids: str
    summary: str
    fixed_in: tuple[int, int, int] | None
    affected_through: tuple[int, int, int] | None
    mitigation: str
    source: str

    def affects(self, version: tuple[int, int, int]) -> bool:
        if self.fixed_in is not None and version >= self.fixed_in:
            return False
        return self.affected_through is None or version <= self.affected_through


_H5PY_2947 = "h5py PR #2947 (https://github.com/h5py/h5py/pull/2947)"
_PYTABLES_1347 = "PyTables PR #1347 (https://github.com/PyTables/PyTables/pull/1347)"

#: Known CVEs of the HDF5 library reachable by opening or reading a crafted file, with the
#: first release that fixes them. Sources are cited per entry; docs/reliability.md explains.
HDF5_ADVISORIES: tuple[Advisory, ...] = (
    Advisory("CVE-2025-44905", "heap buffer overflow in the scale-offset filter (H5Z__filter_scaleoffset)",
             (2, 0, 0), None, "the scale-offset filter is refused", _PYTABLES_1347),
    Advisory("CVE-2025-2153, CVE-2025-2310, CVE-2025-2912 to CVE-2025-2926, CVE-2025-6269, CVE-2025-6270, "
             "CVE-2025-6516, CVE-2025-6750, CVE-2025-6816 to CVE-2025-6858, CVE-2025-7067 to CVE-2025-7069",
             "heap/stack overflows, use-after-free, double free and NULL dereferences in the metadata "
             "parsers (object headers, free-space manager, local heaps, metadata cache, v1 B-trees)",
             (2, 0, 0), None, "none: parse in a resource-limited subprocess", _PYTABLES_1347),
    Advisory("CVE-2025-44904", "heap buffer overflow in H5VM_memcpyvv through an unvalidated stored chunk size",
             (2, 1, 0), None, "stored chunk sizes are checked against the chunk shape before any read",
             _H5PY_2947),
    Advisory("CVE-2025-2308", "heap overflow in scale-offset decompression", (2, 1, 0), None,
             "the scale-offset filter is refused", _H5PY_2947),
    Advisory("CVE-2025-2309", "heap overflow in datatype conversion (H5T__bit_copy)", (2, 1, 0), None,
             "only plain numeric datatypes are accepted", _H5PY_2947),
    Advisory("CVE-2026-26197", "out-of-bounds read decoding a malformed array datatype", (2, 1, 0), None,
             "none: the datatype is decoded when the dataset is opened", _H5PY_2947),
    Advisory("CVE-2026-26199", "buffer underflow in H5Iget_name/H5G_get_name called with size 0",
             (2, 1, 0), None, "not reached through h5store", _H5PY_2947),
    Advisory("CVE-2026-17572", "heap buffer overflow deserializing a crafted shared-message (SOHM) list index",
             (2, 2, 0), None, "none: parse in a resource-limited subprocess", _H5PY_2947),
    Advisory("CVE-2026-17573", "double free in the chunk-copy code via a crafted chunk", (2, 2, 0), None,
             "none: parse in a resource-limited subprocess", _H5PY_2947),
    Advisory("CVE-2026-19025", "divide by zero when a chunked dataset's stored chunk rank differs from its "
             "dataspace rank (H5O__layout_decode), reported for HDF5 through 2.3.0", None, (2, 3, 0),
             "the chunk rank is checked against the dataspace rank before any read",
             "NVD / Tenable plugin 474819"),
)


def _parse_version(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]] + [0, 0, 0]
    return parts[0], parts[1], parts[2]


def hdf5_advisories(version: str | None = None) -> list[Advisory]:
    """The :data:`HDF5_ADVISORIES` that apply to ``version`` (default: the HDF5 h5py uses).

    Examples
    --------
    >>> [a.ids for a in hdf5_advisories("2.2.0")]
    ['CVE-2026-19025']
    """
    v = _parse_version(version if version is not None else h5py.version.hdf5_version)
    return [a for a in HDF5_ADVISORIES if a.affects(v)]


def _warn_advisories() -> None:
    found = hdf5_advisories()
    if not found:
        return
    fixed = sorted({".".join(map(str, a.fixed_in)) for a in found if a.fixed_in})
    warnings.warn(
        f"HDF5 {h5py.version.hdf5_version} (used by h5py {h5py.version.version}) has published CVEs "
        f"reachable from crafted files ({len(found)} advisories, fixed in HDF5 {', '.join(fixed) or 'no release yet'}); "
        "h5store's untrusted checks avoid some of them, not all: parse files from strangers with "
        "h5store.integrity.verify_in_subprocess (see docs/reliability.md)",
        H5StoreSecurityWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- superblock
_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class Superblock:
    """What the superblock says about a file, read with plain file I/O (no HDF5).

    ``eof`` is the end-of-file address HDF5 recorded, relative to the start of the file;
    a file shorter than that was truncated. ``checksum_ok`` is None for versions 0 and 1,
    which carry no checksum.
    """

    version: int
    offset: int
    eof: int
    checksum_ok: bool | None


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & 0xFFFFFFFF


def _lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``, the checksum of HDF5's v2/v3 superblocks."""
    m = 0xFFFFFFFF
    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & m
    k = 0
    while n > 12:
        a = (a + int.from_bytes(data[k : k + 4], "little")) & m
        b = (b + int.from_bytes(data[k + 4 : k + 8], "little")) & m
        c = (c + int.from_bytes(data[k + 8 : k + 12], "little")) & m
        a = (a - c) & m; a ^= _rot(c, 4); c = (c + b) & m  # noqa: E702 - lookup3's mix(), as published
        b = (b - a) & m; b ^= _rot(a, 6); a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= _rot(b, 8); b = (b + a) & m  # noqa: E702
        a = (a - c) & m; a ^= _rot(c, 16); c = (c + b) & m  # noqa: E702
        b = (b - a) & m; b ^= _rot(a, 19); a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= _rot(b, 4); b = (b + a) & m  # noqa: E702
        n -= 12
        k += 12
    if n == 0:
        return c
    tail = data[k:] + bytes(12 - n)
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + int.from_bytes(tail[8:12], "little")) & m
    c ^= b; c = (c - _rot(b, 14)) & m  # noqa: E702 - lookup3's final(), as published
    a ^= c; a = (a - _rot(c, 11)) & m  # noqa: E702
    b ^= a; b = (b - _rot(a, 25)) & m  # noqa: E702
    c ^= b; c = (c - _rot(b, 16)) & m  # noqa: E702
    a ^= c; a = (a - _rot(c, 4)) & m  # noqa: E702
    b ^= a; b = (b - _rot(a, 14)) & m  # noqa: E702
    c ^= b; c = (c - _rot(b, 24)) & m  # noqa: E702
    return c


def read_superblock(path: str | os.PathLike[str]) -> Superblock | str:
    """The superblock of ``path``, or a sentence saying why there is none.

    HDF5 looks for its signature at offsets 0, 512, 1024, 2048, ... (after a user block).
    Layouts: HDF5 File Format Specification, "Superblock" (versions 0-3).

    Examples
    --------
    >>> read_superblock(__file__)  # doctest: +ELLIPSIS
    '...no HDF5 signature...'
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        offset = 0
        while offset + len(_SIGNATURE) <= size:
            fh.seek(offset)
            head = fh.read(128)
            if head.startswith(_SIGNATURE):
                return _parse_superblock(head, offset, size)
            offset = 512 if offset == 0 else offset * 2
    if size < len(_SIGNATURE):
        return f"{size} bytes: too short to hold an HDF5 superblock (truncated, or not HDF5)"
    return "no HDF5 signature at offset 0, 512, 1024, ...: not an HDF5 file"


def _parse_superblock(head: bytes, offset: int, size: int) -> Superblock | str:
    if len(head) < 9:
        return f"the file ends inside its superblock (at byte {size}): truncated"
    version = head[8]
    if version in (0, 1):
        if len(head) < 16:
            return f"the file ends inside its superblock (at byte {size}): truncated"
        so = head[13]
        at = 24 if version == 0 else 28  # base address follows the fixed fields (+4 in v1)
    elif version in (2, 3):
        so = head[9]
        at = 12
    else:
        return f"unknown superblock version {version}"
    if so not in (2, 4, 8):
        return f"superblock declares {so}-byte addresses: damaged"
    need = at + 4 * so + (4 if version >= 2 else 0)
    if len(head) < need:
        return f"the file ends inside its superblock (at byte {size}): truncated"
    # The stored end-of-file address is absolute (HDF5 compares it with the file size plus
    # the base address, then subtracts that again): no base offset to add.
    eof_at = at + 2 * so
    eof = int.from_bytes(head[eof_at : eof_at + so], "little")
    checksum_ok = None
    if version >= 2:
        body = head[: at + 4 * so]
        stored = struct.unpack_from("<I", head, at + 4 * so)[0]
        checksum_ok = _lookup3(body) == stored
    return Superblock(version, offset, eof, checksum_ok)


# --------------------------------------------------------------------------- data outside the file
def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def link_problem(gid: Any, name: bytes, detail: bool = False) -> str | None:
    """Why following link ``name`` of group ``gid`` could leave the file's own objects, or None.

    Hard links are plain; soft links (h5store never writes one: they may lead through an
    external link), external links and user-defined links are not. ``detail`` adds where
    an external link points (the untrusted checks leave it out of their messages).

    Examples
    --------
    >>> link_problem(f.id, b"mel")  # doctest: +SKIP
    """
    info = gid.links.get_info(name)
    if info.type == h5py.h5l.TYPE_HARD:
        return None
    if info.type == h5py.h5l.TYPE_SOFT:
        return "soft link (may point anywhere in the file)"
    if info.type == h5py.h5l.TYPE_EXTERNAL:
        if detail:
            target, obj = gid.links.get_val(name)
            return f"external link to {_text(obj)!r} in {_text(target)!r} (would open another file)"
        return "external link (would open another file)"
    return f"user-defined link of type {info.type}"


def storage_problem(dcpl: Any, detail: bool = False) -> str | None:
    """Why a dataset's bytes would come from outside the file (external raw storage, a
    virtual dataset), or None. ``detail`` names the first other file.

    Examples
    --------
    >>> storage_problem(ds.id.get_create_plist(), detail=True)  # doctest: +SKIP
    "external raw storage (its bytes live in another file: '/etc/passwd')"
    """
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        if detail and dcpl.get_virtual_count():
            return (f"virtual dataset (maps data of other datasets or files: "
                    f"{_text(dcpl.get_virtual_filename(0))!r})")
        return "virtual dataset (maps data of other datasets or files)"
    if dcpl.get_external_count():
        if detail:
            return f"external raw storage (its bytes live in another file: {_text(dcpl.get_external(0)[0])!r})"
        return "external raw storage (its bytes live in another file)"
    return None


_COLUMN_PARTS = (b"data", b"index", b"checksum", b"frames")
_OPT_IN = ("refused: h5store reads only data stored inside the file. Open it with allow_external=True only if "
           "you trust the file and what it points to")
_NEVER = ("refused: h5store opens files through a file object, and HDF5 cannot follow that through one (an "
          "external link fails to open, a virtual dataset crashes the process); copy the data into the file")


def check_local(h5file: h5py.File, path: str, groups: Mapping[str, Any], allow_external: bool = False) -> None:
    """Refuse an h5store file whose own datasets would read bytes from outside it.

    What every trusted open runs (``h5store.open``, ``TypedFile(path)``): on the path to
    the objects h5store reads (each group of the schema, its ids table and features, their
    ``data``, ``index``, ``checksum`` and ``frames``), not on every object of the file, so
    it costs microseconds per dataset. HDF5 would otherwise read another file (say
    ``/etc/passwd``) as if it were the feature's data. External raw storage and soft links
    are refused unless ``allow_external``; external links, user-defined links and virtual
    datasets always (HDF5 cannot follow them through the file object h5store opens files
    with: measured, a virtual dataset crashed the process). Objects that are missing or
    unreadable are left to the reads that use them, which report them.

    Parameters
    ----------
    h5file : h5py.File
        The open file.
    path : str
        Names the file in messages.
    groups : Mapping
        Group name ("" for the root) -> its feature names (the schema's ``groups``).
    allow_external : bool
        The caller's opt-in (``h5store.open(path, allow_external=True)``).

    Raises
    ------
    FormatError
        Naming the file, the object, where it points and, where one exists, the opt-in.

    Examples
    --------
    >>> check_local(f.h5, f.path, f.file_schema.groups)  # doctest: +SKIP
    """
    for gname, feats in groups.items():
        g = h5file.id
        if gname:
            g = _local_child(g, gname.encode("utf-8"), path, f"/{gname}", allow_external)
            if g is None:
                continue
        base = f"/{gname}" if gname else ""
        for name in (IDS, *feats):
            col = _local_child(g, name.encode("utf-8"), path, f"{base}/{name}", allow_external)
            if col is None:
                continue
            for part in _COLUMN_PARTS:
                _local_child(col, part, path, f"{base}/{name}/{part.decode()}", allow_external, dataset=True)


def _local_child(g: Any, name: bytes, path: str, where: str, allow_external: bool, dataset: bool = False) -> Any:
    """The group behind link ``name`` (with ``dataset``: True), after checking it; None
    when absent or unreadable (the read that needs it reports that)."""
    try:
        try:
            why = link_problem(g, name, detail=True)
        except KeyError:
            return None  # absent
        # Only a soft link (inside the file) and external raw storage can be opted into.
        opt_in = why is not None and g.links.get_info(name).type == h5py.h5l.TYPE_SOFT
        if why is None or (opt_in and allow_external):
            if not dataset:
                return h5py.h5g.open(g, name)
            dcpl = h5py.h5d.open(g, name).get_create_plist()
            why = storage_problem(dcpl, detail=True)
            opt_in = why is not None and dcpl.get_layout() != h5py.h5d.VIRTUAL
            if why is None or (opt_in and allow_external):
                return True
    except (OSError, KeyError, RuntimeError, ValueError, TypeError):
        return None  # not a group (dataset), or damaged metadata: the read of this object reports it
    raise FormatError(f"{path}:{where}: {why}; {_OPT_IN if opt_in else _NEVER}")


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
    lzf, shuffle or fletcher32; a datatype that is not a plain number; any object the
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
    _warn_advisories()
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
        for cname, spec in [(IDS, _IDS_SPEC), *feats.items()]:
            if cname not in names:
                raise walk.refuse(_join(where, cname), "listed by the schema but missing from the file")
            _check_column(walk, g, cname, spec, _join(where, cname))
    if walk.filtered_bytes > walk.limits.max_ratio * max(walk.file_size, 1):
        raise walk.refuse("/", f"declares {walk.filtered_bytes} bytes of compressed data in a file of "
                          f"{walk.file_size} bytes (more than {walk.limits.max_ratio:g} times its size)")
    _check_consistency(h5file, path, specs)


_IDS_SPEC = ColumnSpec(dtype="uint8", shape=(None,), layout="ragged")


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
            ids = Column(g[IDS], _IDS_SPEC, f"{where.rstrip('/')}/{IDS}", False, path)
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
