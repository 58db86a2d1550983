"""The h5store file format in one place: names, attributes, the ids spec, version rules, index checks.

A file (see ``docs/format.md``) is stamped at its root with :data:`ATTR_FORMAT` (the format
version, :data:`FORMAT_VERSION`), :data:`ATTR_VERSION` (the library that wrote it) and
:data:`ATTR_SCHEMA` (the schema as JSON, with its CRC-32 in :data:`ATTR_SCHEMA_CRC`). Each
group holds an ids table (:data:`IDS`, stored as :data:`IDS_SPEC`) and one *column* per
feature::

    <group>/<name>/data      every item concatenated along axis 0
    <group>/<name>/index     (N, 2) int64 [start, stop) rows of `data` (or of `frames`) per id;
                             an absent item is [-1, -1]
    <group>/<name>/checksum  (N,) uint32 CRC-32 of each item's bytes (0 when absent)
    <group>/<name>/frames    (F, 2) int64 [start, stop) bytes of `data` per blob ("blobs" layout)

and the column's :class:`ColumnSpec` as JSON in its :data:`ATTR_COLUMN` attribute. Storage,
integrity (``h5store verify``) and safety (``untrusted=True``) all read these names and run
the same index check (:func:`bad_ranges`) from here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import h5py
import numpy as np

from h5store.checksum import crc32
from h5store.errors import FormatError, SchemaError

__all__ = [
    "ABSENT",
    "ATTR_COLUMN",
    "ATTR_FORMAT",
    "ATTR_SCHEMA",
    "ATTR_SCHEMA_CRC",
    "ATTR_VERSION",
    "CHECKSUM",
    "COLUMN_DATASETS",
    "BLOSC_CODECS",
    "COMPRESSIONS",
    "DATA",
    "FORMAT_VERSION",
    "FRAMES",
    "IDS",
    "IDS_SPEC",
    "INDEX",
    "LAYOUTS",
    "ColumnSpec",
    "bad_ranges",
    "check_root",
    "init_root",
]

FORMAT_VERSION = 1
ATTR_FORMAT = "h5store_format"
ATTR_SCHEMA = "h5store_schema"
ATTR_VERSION = "h5store_version"
ATTR_SCHEMA_CRC = "h5store_schema_crc32"
#: The attribute of a column's group holding its :class:`ColumnSpec` as JSON.
ATTR_COLUMN = "h5store_column"
#: The datasets of a column (``FRAMES`` only in the "blobs" layout).
DATA, INDEX, CHECKSUM, FRAMES = "data", "index", "checksum", "frames"
COLUMN_DATASETS = (DATA, INDEX, CHECKSUM, FRAMES)
#: An absent item's index row is ``[ABSENT, ABSENT]``.
ABSENT = -1
LAYOUTS = ("fixed", "ragged", "blobs")
#: The codecs a feature may declare. "zstd" and "blosc" (also "blosc:<codec>", one of
#: :data:`BLOSC_CODECS`; "blosc" is "blosc:lz4") are stored as the registered HDF5 filters
#: 32015 and 32001 that ``hdf5plugin`` writes and reads, byte-shuffled for numbers wider
#: than a byte (``docs/format.md``).
COMPRESSIONS = (None, "gzip", "lzf", "zstd", "blosc")
BLOSC_CODECS = ("lz4", "lz4hc", "blosclz", "zstd", "zlib")
#: Levels each codec takes as ``compression_opts`` (None: the codec's default).
_LEVELS = {"gzip": range(10), "zstd": range(1, 23), "blosc": range(10)}


def codec_family(compression: str | None) -> str | None:
    """``"blosc"`` for ``"blosc:zstd"``; the name itself otherwise (None for no compression)."""
    return compression.split(":", 1)[0] if compression else None


def compression_problems(compression: Any, opts: Any, shuffle: bool) -> list[str]:
    """What is wrong with a declared codec, level and shuffle (empty when valid)."""
    if compression is not None and not isinstance(compression, str):
        return [f"compression must be one of {COMPRESSIONS} or 'blosc:<codec>', got {compression!r}"]
    family = codec_family(compression)
    if family not in COMPRESSIONS or (
            compression != family and (family != "blosc" or compression.split(":", 1)[1] not in BLOSC_CODECS)):
        return [f"compression must be one of {COMPRESSIONS} or 'blosc:<codec>' with a codec of {BLOSC_CODECS}, "
                f"got {compression!r}"]
    out = []
    if opts is not None:
        levels = _LEVELS.get(family or "")
        if levels is None:
            out.append(f"compression_opts (a level) is for {tuple(_LEVELS)}, not {compression!r}")
        elif not isinstance(opts, int) or isinstance(opts, bool) or opts not in levels:
            out.append(f"compression_opts for {family} is a level in [{levels.start}, {levels.stop - 1}], got {opts!r}")
    if family == "blosc" and shuffle:
        out.append("blosc shuffles bytes itself: leave shuffle=False (an HDF5 shuffle before it would undo its own)")
    return out
#: The ids table of every group.
IDS = "ids"


@dataclass(frozen=True)
class ColumnSpec:
    """How one column is stored.

    ``shape`` is the per-item shape: ``(None, 80)`` is ragged along its first axis, ``(3,)``
    fixed, ``()`` a scalar per item. The "blobs" layout stores each item as a sequence of
    variable-length byte strings (e.g. a video's JPEG frames); its ``dtype`` is uint8 and
    ``shape`` ``(None,)``.
    """

    dtype: str
    shape: tuple[int | None, ...]
    layout: str
    compression: str | None = None
    compression_opts: int | None = None
    shuffle: bool = False
    fletcher32: bool = False
    chunk_rows: int | None = None

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise SchemaError("; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        try:
            dt = np.dtype(self.dtype)
            if dt.hasobject or dt.kind in "OUSV":
                out.append(f"dtype must be numeric or bool, got {self.dtype!r}")
        except TypeError:
            out.append(f"unknown dtype {self.dtype!r}")
        if self.layout not in LAYOUTS:
            out.append(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if any(d is not None and (not isinstance(d, int) or d < 0) for d in self.shape):
            out.append(f"shape dims must be ints >= 0 or None, got {self.shape!r}")
        if any(d is None for d in self.shape[1:]):
            out.append(f"only the first axis may be variable (None), got {self.shape!r}")
        if self.layout == "fixed" and None in self.shape:
            out.append(f"a fixed layout needs a fixed shape, got {self.shape!r}")
        if self.layout == "blobs" and (self.dtype != "uint8" or tuple(self.shape) != (None,)):
            out.append(f"a blobs layout stores bytes: dtype 'uint8', shape (None,), got {self.dtype!r} {self.shape!r}")
        if self.layout == "ragged" and (not self.shape or self.shape[0] is not None):
            out.append(f"a ragged layout needs shape (None, ...), got {self.shape!r}")
        out.extend(compression_problems(self.compression, self.compression_opts, self.shuffle))
        if self.chunk_rows is not None and self.chunk_rows <= 0:
            out.append(f"chunk_rows must be > 0, got {self.chunk_rows}")
        return out

    @property
    def inner(self) -> tuple[int, ...]:
        """Shape of one row of ``data``."""
        if self.layout == "fixed":
            return tuple(int(d) for d in self.shape)  # type: ignore[arg-type]
        if self.layout == "blobs":
            return ()
        return tuple(int(d) for d in self.shape[1:])  # type: ignore[arg-type]

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.inner, dtype=np.int64)) * self.np_dtype.itemsize

    @property
    def filtered(self) -> bool:
        return bool(self.compression or self.shuffle or self.fletcher32)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ColumnSpec:
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        return cls(**d)


#: How every group's ids table is stored: each id's UTF-8 bytes, one ragged item per id.
IDS_SPEC = ColumnSpec(dtype="uint8", shape=(None,), layout="ragged", chunk_rows=1 << 16)


def bad_ranges(ranges: np.ndarray, limit: int, fixed: bool = False, absent_ok: bool = True) -> np.ndarray:
    """Bool per row of ``(N, 2)`` ``[start, stop)`` ranges: True where it points outside ``[0, limit)``.

    The one index check of storage and ``verify``: a row must be absent (``[ABSENT,
    ABSENT]``, unless ``absent_ok`` is False: the ids table, blob frames) or
    ``0 <= start <= stop <= limit``; with ``fixed`` (a fixed layout's index) also exactly
    one row long.

    Examples
    --------
    >>> bad_ranges(np.array([[0, 2], [-1, -1], [2, 9], [3, 2]]), limit=5).tolist()
    [False, False, True, True]
    """
    # Column views and boolean masks only: fancy-indexed copies would cost 16 bytes per
    # row of transient memory (the allocator keeps much of it after the check).
    s, e = ranges[:, 0], ranges[:, 1]
    bad = (s < 0) | (e < s) | (e > limit)
    if fixed:
        bad |= e - s != 1
    if absent_ok:
        bad &= ~((s == ABSENT) & (e == ABSENT))
    return bad


# --------------------------------------------------------------------------- root
def init_root(f: h5py.File, schema: dict[str, Any], version: str) -> None:
    """Stamp an empty file as an h5store file of this format version."""
    f.attrs[ATTR_FORMAT] = FORMAT_VERSION
    f.attrs[ATTR_VERSION] = version
    text = json.dumps(schema, sort_keys=True)
    f.attrs[ATTR_SCHEMA] = text
    # Variable-length strings live in HDF5's global heap, which has no checksum of its own.
    f.attrs[ATTR_SCHEMA_CRC] = np.uint32(crc32(text.encode("utf-8")))


def check_root(f: h5py.File, path: str) -> dict[str, Any]:
    """The schema dict of an h5store file; ``FormatError`` for anything else."""
    try:
        fmt = f.attrs.get(ATTR_FORMAT)
        raw = f.attrs.get(ATTR_SCHEMA)
    except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as anything
        raise FormatError(f"{path}: unreadable root attributes ({e})") from None
    if fmt is None or raw is None:
        raise FormatError(f"{path}: not an h5store file (no {ATTR_FORMAT!r} attribute)")
    try:
        fmt = int(fmt)
    except (TypeError, ValueError):
        raise FormatError(f"{path}: malformed {ATTR_FORMAT!r} attribute {fmt!r}") from None
    if fmt > FORMAT_VERSION:
        raise FormatError(
            f"{path}: h5store format {fmt} is newer than this library reads ({FORMAT_VERSION});"
            " upgrade h5store"
        )
    if fmt < 1:
        raise FormatError(f"{path}: invalid h5store format version {fmt}")
    text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8", "surrogateescape")
    try:
        schema = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: malformed schema attribute ({e})") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("groups"), dict):
        raise FormatError(f"{path}: malformed schema attribute (no 'groups')")
    crc = f.attrs.get(ATTR_SCHEMA_CRC)
    if crc is not None and crc32(text.encode("utf-8", "surrogateescape")) != int(crc):
        raise FormatError(f"{path}: the schema attribute fails its CRC-32 (damaged file)")
    return schema
