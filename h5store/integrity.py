"""Verify an h5store file: its structure, ids and indexes, and (deep) every item's CRC-32.

:func:`verify` opens a file read-only through the same layers every read uses
(:class:`~h5store.handle.FileHandle`, :func:`~h5store.storage.check_root`,
:class:`~h5store.storage.Column`) and reports every problem it finds, named by group,
feature and id, instead of stopping at the first: a report is falsy when anything is wrong.
A truncated file is diagnosed from its superblock (the end-of-file address HDF5 recorded)
and, when what remains can still be parsed, the report says which items were lost.

:func:`verify_in_subprocess` runs the same checks in a child process under memory and
time limits and returns the report as JSON: the way to look at files from strangers (see
``docs/reliability.md``; the checks for hostile files are in :mod:`h5store.safety`).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import h5py
import numpy as np

from h5store.checksum import crc32
from h5store.errors import FormatError, H5StoreError
from h5store.handle import FileHandle
from h5store.refs import normalize_id
from h5store.safety import (
    H5StoreSecurityWarning,
    Limits,
    Superblock,
    check_untrusted,
    duplicate_ids,
    read_superblock,
    storage_problem,
)
from h5store.schema import Schema
from h5store.storage import IDS, Column, ColumnSpec, check_root, read_whole

__all__ = [
    "H5StoreSecurityWarning",
    "Limits",
    "Problem",
    "VerifyReport",
    "check_untrusted",
    "verify",
    "verify_in_subprocess",
]

BLOCK_BYTES = 64 << 20
_IDS_SPEC = ColumnSpec(dtype="uint8", shape=(None,), layout="ragged")


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a file: where, which id (when one), and why.

    ``group`` is "" for the root group; ``feature`` is "" for the group itself and
    ``"ids"`` for its ids table; ``row`` is the id's position.
    """

    group: str
    feature: str
    reason: str
    id: str | None = None
    row: int | None = None

    @property
    def where(self) -> str:
        return "/" + "/".join(p for p in (self.group, self.feature) if p)

    def __str__(self) -> str:
        who = ""
        if self.id is not None:
            who = f" id {self.id!r}" + (f" (row {self.row})" if self.row is not None else "")
        elif self.row is not None:
            who = f" row {self.row}"
        return f"{self.where}{who}: {self.reason}"


@dataclass
class VerifyReport:
    """What :func:`verify` found. Falsy when the file has any problem.

    Attributes
    ----------
    fatal : str or None
        Why the file could not be checked at all (unopenable, refused as untrusted).
    truncated : (int, int) or None
        ``(size, expected)``: the file's size and the end-of-file address in its superblock.
    problems : list of Problem
        The first ``max_errors`` problems; ``n_problems`` counts them all.
    lost : dict
        Feature path -> items lost to a truncation.
    unreadable : dict
        Group, feature or ids path -> the parts of it that could not be read.
    """

    path: str
    deep: bool = False
    untrusted: bool = False
    max_errors: int = 1000
    fatal: str | None = None
    truncated: tuple[int, int] | None = None
    problems: list[Problem] = field(default_factory=list)
    n_problems: int = 0
    groups: int = 0
    features: int = 0
    ids: int = 0
    items: int = 0
    items_verified: int = 0
    bytes_verified: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    unreadable: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __bool__(self) -> bool:
        return self.fatal is None and self.n_problems == 0 and self.truncated is None

    @property
    def ok(self) -> bool:
        return bool(self)

    def add(self, problem: Problem) -> None:
        self.n_problems += 1
        if len(self.problems) < self.max_errors:
            self.problems.append(problem)

    def summary(self) -> str:
        """One line: the verdict and what was checked."""
        counts = (f"{self.groups} group(s), {self.features} feature(s), {self.ids} id(s), {self.items} item(s)"
                  + (f", {self.items_verified} CRC-32 checked ({_human(self.bytes_verified)})" if self.deep else ""))
        if self.truncated is not None:
            size, eof = self.truncated
            lost = sum(self.lost.values())
            parts = [f"{self.path}: TRUNCATED: {size} of {eof} bytes (the end-of-file address in its superblock)"]
            if self.fatal is not None:
                parts.append(self.fatal.removeprefix(f"{self.path}: "))
            else:
                what = ", ".join(f"{k} {v}" for k, v in sorted(self.lost.items()))
                if self.items:
                    parts.append(f"lost {lost} of the {self.items} item(s) whose index survived"
                                 + (f" ({what})" if what else ""))
                if self.unreadable:
                    parts.append("unreadable (lost): " + ", ".join(
                        f"{k} ({', '.join(v)})" for k, v in self.unreadable.items()))
            return "; ".join(parts)
        if self.fatal is not None:
            return self.fatal
        quick = "" if self.deep else ("; structure only: item data was not read (its CRC-32s not checked; "
                                      "check every item with deep=True, `h5store verify` without --quick)")
        if self.n_problems:
            return f"{self.path}: {self.n_problems} problem(s) in {counts}{quick}"
        return f"{self.path}: OK: {counts}{quick}"

    def lines(self) -> list[str]:
        """The summary, then one line per problem (at most ``max_errors``)."""
        out = [self.summary()]
        out.extend(f"  {p}" for p in self.problems)
        if self.n_problems > len(self.problems):
            out.append(f"  ... and {self.n_problems - len(self.problems)} more")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["truncated"] = list(self.truncated) if self.truncated else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifyReport:
        d = dict(d)
        d["problems"] = [Problem(**p) for p in d.get("problems", [])]
        d["truncated"] = tuple(d["truncated"]) if d.get("truncated") else None
        return cls(**d)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _err(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        raise e  # the machine's limit, not the file's fault: never reported as a damaged item
    return f"{type(e).__name__}: {e}" if not isinstance(e, H5StoreError) else str(e)


# --------------------------------------------------------------------------- verify
def verify(path: str | os.PathLike[str], deep: bool = True, untrusted: bool = False, max_errors: int = 1000, *,
           limits: Limits | None = None, block_bytes: int = BLOCK_BYTES) -> VerifyReport:
    """Check a file and report every problem, by group, feature and id.

    Always: the file opens (a truncated one is diagnosed from its superblock, with the
    items lost), the root attributes and schema, every group's ids table (index bounds,
    each id's CRC-32, valid and unique ids, one row per id in every feature), every
    feature's index (shape, bounds, one row per fixed item, absent items), blob frames,
    and checksum lengths. By default (``deep=True``) every item's bytes are read, at most
    ``block_bytes`` at a time, and compared with its stored CRC-32; ``deep=False`` is the
    quick structure-only check, and its summary says that item data was not read.

    Parameters
    ----------
    path : str or Path
        The file.
    deep : bool
        Read every item and check its CRC-32 (reads the whole file once; the default).
        False: structure only, no item data read (a flipped data byte goes unseen).
    untrusted : bool
        First run :func:`~h5store.safety.check_untrusted`; a refusal is reported as
        ``fatal`` and nothing else is read. BEWARE: HDF5 still parses the file in this
        process; for files from strangers use :func:`verify_in_subprocess`.
    max_errors : int
        Problems kept in the report (all are counted).
    limits : Limits, optional
        For ``untrusted``; also bounds the tables read here.
    block_bytes : int
        Most bytes of items held in memory at once by a deep check.

    Returns
    -------
    VerifyReport
        Falsy when anything is wrong. Raises only ``FileNotFoundError``.

    Examples
    --------
    >>> report = verify("speech.h5", deep=True)  # doctest: +SKIP
    >>> bool(report), report.summary()  # doctest: +SKIP
    (True, 'speech.h5: OK: 1 group(s), 2 feature(s), 13100 id(s), 26200 item(s), ...')
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    t0 = time.perf_counter()
    report = VerifyReport(path, deep=deep, untrusted=untrusted, max_errors=max_errors)
    limits = limits or Limits()
    size = os.path.getsize(path)
    sb = read_superblock(path) if size else None
    if isinstance(sb, Superblock) and sb.checksum_ok is not False and sb.eof > size:
        report.truncated = (size, sb.eof)
    handle = FileHandle(path, "r")
    try:
        try:
            f = handle.file
        except FormatError as e:
            if report.truncated is not None and not untrusted:
                _salvage(report, path, size, report.truncated[1], limits, block_bytes)
            else:
                report.fatal = _open_failure(path, size, sb, e)
            return report
        _Checker(report, f, path, limits, block_bytes, lost_after=None).run()
    finally:
        handle.close()
        report.seconds = time.perf_counter() - t0
    return report


def _open_failure(path: str, size: int, sb: Superblock | str | None, e: BaseException) -> str:
    if size == 0:
        return f"{path}: empty file (0 bytes), not an HDF5 file"
    if isinstance(sb, str):
        return f"{path}: {sb}"
    if sb is not None and sb.checksum_ok is False:
        return f"{path}: the superblock fails its checksum: the file is damaged"
    return str(e)


class _PaddedFile(io.RawIOBase):
    """A truncated file, read-only, extended with zeros to the size its superblock records.

    HDF5 refuses to open a file shorter than its end-of-file address. Through this view it
    opens, so the objects and chunks that lie before the cut can be checked; whatever lay
    past it reads as zeros, which every checksummed structure and every item's CRC-32 rejects.
    """

    def __init__(self, path: str, size: int) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)
        self._real = os.fstat(self._fd).st_size
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        got = os.pread(self._fd, n, self._pos) if self._pos < self._real else b""
        view[: len(got)] = got
        view[len(got) : n] = bytes(n - len(got))
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def _salvage(report: VerifyReport, path: str, size: int, eof: int, limits: Limits, block_bytes: int) -> None:
    view = _PaddedFile(path, eof)
    try:
        try:
            f = h5py.File(view, "r")
        except Exception as e:  # noqa: BLE001 - whatever HDF5 says, what remains is unreadable
            report.fatal = f"what remains cannot be opened ({_err(e)})"
            return
        try:
            _Checker(report, f, path, limits, block_bytes, lost_after=size).run()
        finally:
            f.close()  # before the view: HDF5 must never call into a closed file object
    finally:
        view.close()


class _Ids:
    """A group's ids as checked: their bytes, and which rows are valid."""

    def __init__(self, index: np.ndarray, data: np.ndarray, valid: np.ndarray) -> None:
        self.index, self.data, self.valid = index, data, valid

    def name(self, row: int) -> str | None:
        if 0 <= row < len(self.valid) and self.valid[row]:
            a, b = self.index[row]
            return self.data[a:b].tobytes().decode("utf-8")
        return None


class _Checker:
    """One verification pass over an open file, writing into ``report``."""

    def __init__(self, report: VerifyReport, f: h5py.File, path: str, limits: Limits, block_bytes: int,
                 lost_after: int | None) -> None:
        self.r = report
        self.f = f
        self.path = path
        self.limits = limits
        self.block_bytes = max(int(block_bytes), 1)
        self.lost_after = lost_after
        self.file_size = max(int(f.id.get_filesize()), os.path.getsize(path))

    # -- reporting -----------------------------------------------------------
    def problem(self, group: str, feature: str, reason: str, row: int | None = None, ids: _Ids | None = None) -> None:
        name = ids.name(row) if ids is not None and row is not None else None
        self.r.add(Problem(group, feature, reason, name, row))

    def rows(self, group: str, feature: str, rows: np.ndarray, reason: Callable[[int], str], ids: _Ids | None) -> None:
        """One problem per row; past ``max_errors`` they are only counted."""
        rows = rows.tolist()
        for k, row in enumerate(rows):
            if len(self.r.problems) >= self.r.max_errors:
                self.r.n_problems += len(rows) - k
                return
            self.problem(group, feature, reason(row), row, ids)

    def unreadable(self, group: str, feature: str, what: str, e: BaseException | str) -> None:
        self.problem(group, feature, f"{what} unreadable ({e if isinstance(e, str) else _err(e)})")
        self.r.unreadable.setdefault("/" + "/".join(p for p in (group, feature) if p), []).append(what)

    # -- the pass ------------------------------------------------------------
    def run(self) -> None:
        r = self.r
        if r.untrusted:
            try:
                check_untrusted(self.f, self.path, self.limits)
            except FormatError as e:
                r.fatal = str(e)
                return
            except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as any error
                r.fatal = f"{self.path}: unreadable metadata ({_err(e)}); refused (untrusted file)"
                return
        try:
            schema = Schema.from_dict(check_root(self.f, self.path))
        except H5StoreError as e:
            r.fatal = str(e) if str(e).startswith(self.path) else f"{self.path}: {e}"
            return
        except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as any error
            r.fatal = f"{self.path}: unreadable root attributes ({_err(e)})"
            return
        for gname, feats in schema.groups.items():
            try:
                self.group(gname, feats)
            except Exception as e:  # noqa: BLE001 - a damaged group must not hide the others
                self.unreadable(gname, "", "group", e)

    def group(self, gname: str, feats: Any) -> None:
        self.r.groups += 1
        try:
            g = self.f[gname] if gname else self.f
        except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as any error
            self.unreadable(gname, "", "group", e)
            self.r.features += len(feats)
            return
        ids = self.ids_table(gname, g)
        n_ids = len(ids.valid) if ids is not None else None
        for name, feat in feats.items():
            self.r.features += 1
            if not feat.is_fixed:
                continue  # h5s.Array() awaiting its first item: no column, nothing stored yet
            try:
                spec = feat.spec()
            except H5StoreError as e:
                self.problem(gname, name, f"stored parameters rejected ({e})")
                continue
            try:
                self.feature(gname, g, name, spec, ids, n_ids)
            except Exception as e:  # noqa: BLE001 - a damaged feature must not hide the others
                self.unreadable(gname, name, "feature", e)

    def too_large(self, ds: h5py.Dataset) -> str | None:
        """Why reading ``ds`` whole would need more memory than the file can justify, or None."""
        filtered = bool(ds.compression or ds.shuffle or ds.scaleoffset)
        nbytes = ds.dtype.itemsize
        for d in ds.shape or ():
            nbytes *= int(d)
        cap = self.file_size * (self.limits.max_ratio if filtered else 1) + (_chunk_nbytes(ds) if ds.chunks else 0)
        if nbytes > cap:
            return f"declares {nbytes} bytes ({ds.shape} x {ds.dtype}) in a file of {self.file_size} bytes"
        return None

    @staticmethod
    def outside(ds: h5py.Dataset) -> str | None:
        """Why ``ds``'s bytes would come from another file (not read then), or None."""
        why = storage_problem(ds.id.get_create_plist(), detail=True)
        return f"{why}: not read, h5store reads only data inside the file" if why else None

    def table(self, ds: h5py.Dataset, group: str, feature: str, what: str) -> np.ndarray | None:
        """Read a whole index-like table, bounded by the file's size; None when unreadable."""
        if self.lost_after is not None:
            try:
                lost = bool(_lost_pieces(ds, self.lost_after)[1].any())
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001 - the chunk index itself may lie past the cut
                lost = True
            if lost:
                self.unreadable(group, feature, what, "lost in the truncation")
                return None
        why = self.too_large(ds) or self.outside(ds)
        if why:
            self.unreadable(group, feature, what, why)
            return None
        try:
            # Compressed tables too are decoded no further than their chunks' declared size.
            return np.asarray(read_whole(ds, self.path, f"{self.path}:{ds.name}"))
        except Exception as e:  # noqa: BLE001 - HDF5 reports damaged chunks as OSError, or worse
            self.unreadable(group, feature, what, e)
            return None

    def ids_table(self, gname: str, g: h5py.Group) -> _Ids | None:
        try:
            cg = g[IDS]
            index_ds, crc_ds, data_ds = cg["index"], cg["checksum"], cg["data"]
        except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as any error
            self.unreadable(gname, IDS, "ids table", e)
            return None
        idx = self.table(index_ds, gname, IDS, "index")
        crc = self.table(crc_ds, gname, IDS, "checksum")
        data = self.table(data_ds, gname, IDS, "data")
        if idx is None or crc is None or data is None:
            return None
        if idx.ndim != 2 or idx.shape[1:] != (2,) or idx.dtype.kind not in "iu":
            self.unreadable(gname, IDS, "index", f"shape {idx.shape} {idx.dtype}, expected (N, 2) integers")
            return None
        if data.ndim != 1 or data.dtype != np.uint8:
            self.unreadable(gname, IDS, "data", f"shape {data.shape} {data.dtype}, expected (B,) uint8")
            return None
        n = len(idx)
        self.r.ids += n
        idx = idx.astype(np.int64)
        valid = np.ones(n, dtype=bool)
        if crc.shape != (n,):
            self.problem(gname, IDS, f"checksum has shape {crc.shape} for {n} ids")
            valid[min(len(crc), n):] = False
            crc = np.resize(crc.reshape(-1), n)
        s, e = idx[:, 0], idx[:, 1]
        bad = (s < 0) | (e < s) | (e > len(data))
        self.rows(gname, IDS, np.flatnonzero(bad),
                  lambda r: f"index {idx[r].tolist()} outside the {len(data)} bytes of ids", None)
        valid &= ~bad
        raw = data.tobytes()
        for row in np.flatnonzero(valid).tolist():
            key = raw[s[row] : e[row]]
            if crc32(key) != int(crc[row]):
                valid[row] = False
                # Never echo the bytes: in a hostile file they may be another file's content.
                self.problem(gname, IDS, f"id bytes [{s[row]}, {e[row]}) fail their CRC-32 (ids table damaged)", row)
                continue
            try:
                text = key.decode("utf-8")
                if normalize_id(text) != text:
                    raise ValueError("not in Unicode NFC")
            except (UnicodeDecodeError, ValueError) as err:
                valid[row] = False
                self.problem(gname, IDS, f"not a valid id ({err})", row)
        self._duplicates(gname, idx, raw, crc, valid)
        return _Ids(idx, data, valid)

    def _duplicates(self, gname: str, idx: np.ndarray, raw: bytes, crc: np.ndarray, valid: np.ndarray) -> None:
        for row, first in duplicate_ids(idx, raw, crc, valid):
            self.problem(gname, IDS, f"duplicate of the id at row {first}", row)

    def feature(self, gname: str, g: h5py.Group, name: str, spec: ColumnSpec, ids: _Ids | None,
                n_ids: int | None) -> None:
        try:
            cg = g[name]
            col = Column(cg, spec, f"{self.path}:{'/' + gname if gname else ''}/{name}", False, self.path)
        except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as any error
            self.unreadable(gname, name, "feature", e)
            return
        try:
            stored = ColumnSpec.from_dict(json.loads(cg.attrs["h5store_column"]))
            if (stored.dtype, stored.shape, stored.layout) != (spec.dtype, spec.shape, spec.layout):
                self.problem(gname, name, f"stored as {stored.dtype} {stored.shape} ({stored.layout}) but the "
                             f"schema says {spec.dtype} {spec.shape} ({spec.layout})")
        except Exception as e:  # noqa: BLE001 - a missing or damaged attribute is reported, not fatal
            self.problem(gname, name, f"column attribute 'h5store_column' unreadable ({_err(e)})")
        idx = self.table(cg["index"], gname, name, "index")
        crc = self.table(cg["checksum"], gname, name, "checksum")
        if idx is None or crc is None:
            return
        if idx.ndim != 2 or idx.shape[1:] != (2,) or idx.dtype.kind not in "iu":
            self.unreadable(gname, name, "index", f"shape {idx.shape} {idx.dtype}, expected (N, 2) integers")
            return
        idx = idx.astype(np.int64)
        n = len(idx)
        if n_ids is not None and n != n_ids:
            self.problem(gname, name, f"index has {n} rows for {n_ids} ids")
        if crc.shape != (n,):
            self.problem(gname, name, f"checksum has shape {crc.shape} for {n} index rows")
            crc = np.resize(crc.reshape(-1), n) if crc.size else np.zeros(n, np.uint32)
        data_rows = int(col.data.shape[0])
        s, e = idx[:, 0], idx[:, 1]
        absent = (s == -1) & (e == -1)
        huge = self.too_large(col.data) or self.outside(col.data)
        if huge:
            # Items would read fill values from unallocated chunks: gigabytes of nothing.
            self.r.items += int((~absent).sum())
            self.unreadable(gname, name, "data", huge)
            return
        frames = None
        if spec.layout == "blobs":
            frames = self.table(cg["frames"], gname, name, "frames")
            if frames is None:
                return
            if frames.ndim != 2 or frames.shape[1:] != (2,):
                self.unreadable(gname, name, "frames", f"shape {frames.shape}, expected (F, 2)")
                return
            frames = frames.astype(np.int64)
        limit = len(frames) if frames is not None else data_rows
        bad = ~absent & ((s < 0) | (e < s) | (e > limit))
        what = "frames" if frames is not None else "stored rows"
        self.rows(gname, name, np.flatnonzero(bad), lambda r: f"index {idx[r].tolist()} outside the {limit} {what}", ids)
        if spec.layout == "fixed":
            wide = ~absent & ~bad & (e - s != 1)
            self.rows(gname, name, np.flatnonzero(wide), lambda r: f"index {idx[r].tolist()} spans {e[r] - s[r]} rows "
                      "for a fixed-shape item", ids)
            bad |= wide
        stray = absent & (crc != 0)
        self.rows(gname, name, np.flatnonzero(stray),
                  lambda r: f"absent item has checksum {int(crc[r])} (index or checksum damaged)", ids)
        present = ~absent & ~bad
        self.r.items += int((~absent).sum())
        # Each present item as a [start, stop) range of data rows (bytes for blobs).
        starts, stops = s.copy(), e.copy()
        if frames is not None:
            ok, starts, stops = self._blob_ranges(gname, name, frames, s, e, present, data_rows, ids)
            present &= ok
        if self.lost_after is not None:
            try:
                lost = present & _lost_items(col.data, self.lost_after, starts, stops)
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001 - the chunk index itself may lie past the cut
                lost = present & (stops > starts)
            where = "/" + "/".join(p for p in (gname, name) if p)
            if lost.any():
                self.r.lost[where] = int(lost.sum())
                self.rows(gname, name, np.flatnonzero(lost),
                          lambda r: "lost: its bytes lay past the truncation point", ids)
            present &= ~lost
        if self.r.deep:
            rows = np.flatnonzero(present)
            self.crc_items(gname, name, col, rows, starts[rows], stops[rows], crc[rows], ids)

    def _blob_ranges(self, gname: str, name: str, frames: np.ndarray, s: np.ndarray, e: np.ndarray,
                     present: np.ndarray, data_rows: int, ids: _Ids | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        fs, fe = frames[:, 0], frames[:, 1]
        bad_frame = (fs < 0) | (fe < fs) | (fe > data_rows)
        # A frame joins its successor when it ends where the next begins; items need joined frames.
        gap = np.ones(len(frames), dtype=bool)
        if len(frames) > 1:
            gap[:-1] = fs[1:] != fe[:-1]
        bad_upto = np.concatenate([[0], np.cumsum(bad_frame)])
        gap_upto = np.concatenate([[0], np.cumsum(gap)])
        ok = np.ones(len(s), dtype=bool)
        starts = np.zeros(len(s), np.int64)
        stops = np.zeros(len(s), np.int64)
        rows = np.flatnonzero(present & (e > s))
        a, b = s[rows], e[rows]
        broken = bad_upto[b] - bad_upto[a] > 0
        split = gap_upto[b - 1] - gap_upto[a] > 0
        self.rows(gname, name, rows[broken], lambda r: f"a blob frame of this item lies outside the {data_rows} "
                  "bytes of data", ids)
        self.rows(gname, name, rows[~broken & split], lambda r: "the blobs of this item are not contiguous in data", ids)
        ok[rows[broken | split]] = False
        good = rows[~(broken | split)]
        starts[good] = fs[s[good]]
        stops[good] = fe[e[good] - 1]
        return ok, starts, stops

    # -- deep ----------------------------------------------------------------
    def crc_items(self, gname: str, name: str, col: Column, rows: np.ndarray, starts: np.ndarray,
                  stops: np.ndarray, expect: np.ndarray, ids: _Ids | None) -> None:
        if not rows.size:
            return
        try:
            self._crc_items(gname, name, col, rows, starts, stops, expect, ids)
        finally:
            # DirectReader holds a descriptor of its own: give it back now, not at exit.
            try:
                close = getattr(col.reader(), "close", None)
            except Exception:  # noqa: BLE001 - no reader could be made: nothing to close
                close = None
            if close is not None:
                close()

    def _crc_items(self, gname: str, name: str, col: Column, rows: np.ndarray, starts: np.ndarray,
                   stops: np.ndarray, expect: np.ndarray, ids: _Ids | None) -> None:
        row_bytes = 1 if col.spec.layout == "blobs" else max(col.spec.row_nbytes, 1)
        budget = max(1, self.block_bytes // row_bytes)
        order = np.argsort(starts, kind="stable")
        lengths = (stops - starts)[order]
        ends = np.cumsum(lengths)
        i = 0
        while i < len(order):
            before = int(ends[i - 1]) if i else 0
            j = max(i + 1, int(np.searchsorted(ends, before + budget, side="right")))
            batch = order[i:j]
            if j == i + 1 and lengths[i] > budget:
                self._crc_large(gname, name, col, int(rows[batch[0]]), int(starts[batch[0]]), int(stops[batch[0]]),
                                int(expect[batch[0]]), budget, ids)
            else:
                try:
                    parts = col.read_ranges(starts[batch], stops[batch])
                except MemoryError:
                    raise
                except Exception:  # noqa: BLE001 - find the unreadable items one by one
                    parts = None
                for k, b in enumerate(batch.tolist()):
                    row = int(rows[b])
                    try:
                        p = parts[k] if parts is not None else col.read_ranges(starts[b : b + 1], stops[b : b + 1])[0]
                    except Exception as e:  # noqa: BLE001 - damaged chunks surface as any error
                        self.problem(gname, name, f"unreadable ({_err(e)})", row, ids)
                        continue
                    self._compare(gname, name, row, crc32(np.ascontiguousarray(p)), int(expect[b]), p.nbytes, ids)
            i = j

    def _crc_large(self, gname: str, name: str, col: Column, row: int, a: int, b: int, expect: int, budget: int,
                   ids: _Ids | None) -> None:
        crc, nbytes = 0, 0
        try:
            for lo in range(a, b, budget):
                part = col.read_ranges(np.array([lo]), np.array([min(lo + budget, b)]))[0]
                crc = crc32(np.ascontiguousarray(part), crc)
                nbytes += part.nbytes
        except Exception as e:  # noqa: BLE001 - damaged chunks surface as any error
            self.problem(gname, name, f"unreadable ({_err(e)})", row, ids)
            return
        self._compare(gname, name, row, crc, expect, nbytes, ids)

    def _compare(self, gname: str, name: str, row: int, got: int, expect: int, nbytes: int, ids: _Ids | None) -> None:
        self.r.items_verified += 1
        self.r.bytes_verified += nbytes
        if got != expect:
            self.problem(gname, name, f"fails its CRC-32 (stored {expect:#010x}, computed {got:#010x})", row, ids)


def _chunk_nbytes(ds: h5py.Dataset) -> int:
    return int(np.prod(ds.chunks, dtype=np.int64)) * ds.dtype.itemsize


def _lost_pieces(ds: h5py.Dataset, lost_after: int) -> tuple[int, np.ndarray]:
    """``(rows per piece, lost flag per piece)`` of a dataset in a file cut at ``lost_after``.

    A piece is a chunk (or the whole contiguous block); it is lost when it is not stored
    or its bytes reach past the cut.
    """
    n = int(ds.shape[0]) if ds.shape else 1
    if ds.chunks is None:
        off = ds.id.get_offset()
        row_bytes = max(int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize, 1)
        if off is None:
            return max(n, 1), np.array([n > 0])
        keep = max(0, (lost_after - off) // row_bytes)
        return 1, np.arange(n) >= keep
    rows = int(ds.chunks[0]) if ds.shape else 1
    count = -(-n // rows) if n else 0
    lost = np.ones(count, dtype=bool)
    if count:
        def mark(info: Any) -> None:
            k = int(info.chunk_offset[0]) // rows if ds.shape else 0
            if 0 <= k < count and info.byte_offset is not None and info.byte_offset + info.size <= lost_after:
                lost[k] = False

        ds.id.chunk_iter(mark)
    return rows, lost


def _lost_items(data: h5py.Dataset, lost_after: int, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    rows, lost = _lost_pieces(data, lost_after)
    upto = np.concatenate([[0], np.cumsum(lost)])
    n = len(lost)
    first = np.clip(starts // rows, 0, n)
    last = np.clip((np.maximum(stops, starts + 1) - 1) // rows + 1, 0, n)
    return (stops > starts) & (upto[last] - upto[first] > 0)


# --------------------------------------------------------------------------- subprocess
_MARK = "H5STORE-VERIFY-REPORT "
_CHILD = """
import json, sys
args = json.loads(sys.argv[1])
from h5store.integrity import _child_main
sys.exit(_child_main(args))
"""


def _child_main(args: dict[str, Any]) -> int:
    """Body of the child process of :func:`verify_in_subprocess` (limits, verify, JSON out)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if args.get("max_memory"):
        base = 0
        try:
            with open("/proc/self/statm") as fh:
                base = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        cap = base + int(args["max_memory"])
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if args.get("timeout"):
        cpu = int(args["timeout"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", H5StoreSecurityWarning)
        try:
            report = verify(args["path"], deep=args["deep"], untrusted=args["untrusted"],
                            max_errors=args["max_errors"], block_bytes=args["block_bytes"])
        except MemoryError:
            report = VerifyReport(args["path"], deep=args["deep"], untrusted=args["untrusted"],
                                  max_errors=args["max_errors"])
            report.fatal = (f"{args['path']}: verification needs more than the {args['max_memory']} bytes of memory "
                            "it may use: refused")
        except FileNotFoundError as e:
            report = VerifyReport(args["path"], deep=args["deep"], untrusted=args["untrusted"],
                                  max_errors=args["max_errors"])
            report.fatal = str(e)
    report.notes.extend(str(w.message) for w in caught if issubclass(w.category, H5StoreSecurityWarning))
    sys.stdout.write(_MARK + json.dumps(report.to_dict()) + "\n")
    sys.stdout.flush()
    return 0


def verify_in_subprocess(path: str | os.PathLike[str], deep: bool = True, untrusted: bool = True, *,
                         timeout: float = 300.0, max_memory: int = 2 << 30, max_errors: int = 1000,
                         block_bytes: int = BLOCK_BYTES) -> VerifyReport:
    """:func:`verify` in a fresh child process limited in memory and time.

    HDF5 parses a file in C: a crafted file can crash it, make it loop, or make it allocate
    without bound, and some published CVEs (see :mod:`h5store.safety`) are memory
    corruption. Here that happens to a child: its address space is capped by
    ``RLIMIT_AS`` (``max_memory`` bytes beyond the interpreter and its imports), its CPU
    time by ``RLIMIT_CPU``, and it is killed after ``timeout`` seconds. The report comes
    back as JSON (never a pickle); a crash, a kill or an exhausted limit becomes the
    report's ``fatal`` reason.

    Parameters
    ----------
    path : str or Path
        The file.
    deep, untrusted, max_errors, block_bytes
        As for :func:`verify`; ``untrusted`` defaults to True here.
    timeout : float
        Seconds before the child is killed.
    max_memory : int
        Bytes the verification may allocate.

    Returns
    -------
    VerifyReport
        Falsy when the file has problems or could not be checked safely.

    Examples
    --------
    >>> report = verify_in_subprocess("download.h5", deep=True, timeout=60)  # doctest: +SKIP
    >>> if not report:  # doctest: +SKIP
    ...     raise SystemExit(report.summary())
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    args = dict(path=path, deep=deep, untrusted=untrusted, max_errors=max_errors,
                block_bytes=block_bytes, max_memory=max_memory, timeout=timeout)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        failed = VerifyReport(path, deep=deep, untrusted=untrusted, max_errors=max_errors)
        failed.fatal = (f"{path}: verification did not finish within {timeout:g} s and was killed "
                        "(a damaged or hostile file can make HDF5 loop): refused")
        return failed
    report = _child_report(path, proc.returncode, proc.stdout, proc.stderr, max_memory)
    report.deep, report.untrusted, report.max_errors = deep, untrusted, max_errors
    for note in report.notes:
        warnings.warn(note, H5StoreSecurityWarning, stacklevel=2)
    return report


def _child_report(path: str, returncode: int, stdout: bytes, stderr: bytes, max_memory: int = 0) -> VerifyReport:
    """The report a verifying child printed, or one saying how the child failed."""
    out = stdout.decode("utf-8", "replace")
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(_MARK)), None)
    if returncode == 0 and line is not None:
        return VerifyReport.from_dict(json.loads(line[len(_MARK) :]))
    if returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"was killed by signal {-returncode}"
    else:
        how = f"exited with status {returncode}"
    tail = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    # Measured: HDF5 may crash (SIGSEGV) instead of failing cleanly when RLIMIT_AS denies it memory.
    memory = f", or when denied more than {max_memory} bytes of memory" if max_memory and returncode < 0 else ""
    failed = VerifyReport(path)
    failed.fatal = (f"{path}: the verifying process {how} (HDF5 cannot parse this file safely{memory}; never "
                    f"open it in-process){': ' + tail[0][:200] if tail[0] else ''}")
    return failed
