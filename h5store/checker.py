"""The checker behind :func:`h5store.integrity.verify`: one pass over an open file (its root,
schema, every group's ids table, every feature's index, blob frames, checksums and, deep,
every item's CRC-32), writing each problem into a :class:`~h5store.verify_report.VerifyReport`.
A file cut short is checked up to the cut, and the items that lay past it are named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import h5py
import numpy as np

from h5store.checksum import crc32
from h5store.column import Column
from h5store.errors import FormatError, H5StoreError
from h5store.external_data import storage_problem
from h5store.format import IDS, ColumnSpec, bad_ranges, check_root
from h5store.readers import read_whole
from h5store.refs import normalize_id
from h5store.safety import Limits, check_untrusted, duplicate_ids
from h5store.schema import Schema
from h5store.verify_report import Problem, VerifyReport

__all__ = ["Checker", "error_text"]



def error_text(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        raise e  # the machine's limit, not the file's fault: never reported as a damaged item
    return f"{type(e).__name__}: {e}" if not isinstance(e, H5StoreError) else str(e)



class _Ids:
    """A group's ids as checked: their bytes, and which rows are valid."""

    def __init__(self, index: np.ndarray, data: np.ndarray, valid: np.ndarray) -> None:
        self.index, self.data, self.valid = index, data, valid

    def name(self, row: int) -> str | None:
        if 0 <= row < len(self.valid) and self.valid[row]:
            a, b = self.index[row]
            return self.data[a:b].tobytes().decode("utf-8")
        return None


class Checker:
    """One verification pass over an open file, writing into ``report``."""

    def __init__(self, report: VerifyReport, f: h5py.File, path: str, limits: Limits, block_bytes: int,
                 lost_after: int | None, file_size: int | None = None) -> None:
        self.r = report
        self.f = f
        self.path = path
        self.limits = limits
        self.block_bytes = max(int(block_bytes), 1)
        self.lost_after = lost_after
        # A remote object (s3://) gives its size from its HEAD; a local file from the disk.
        size = os.path.getsize(path) if file_size is None else file_size
        self.file_size = max(int(f.id.get_filesize()), size)

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
        self.problem(group, feature, f"{what} unreadable ({e if isinstance(e, str) else error_text(e)})")
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
                r.fatal = f"{self.path}: unreadable metadata ({error_text(e)}); refused (untrusted file)"
                return
        try:
            schema = Schema.from_dict(check_root(self.f, self.path))
        except H5StoreError as e:
            r.fatal = str(e) if str(e).startswith(self.path) else f"{self.path}: {e}"
            return
        except Exception as e:  # noqa: BLE001 - damaged metadata surfaces as any error
            r.fatal = f"{self.path}: unreadable root attributes ({error_text(e)})"
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
        filtered = bool(ds.id.get_create_plist().get_nfilters())  # plugins' too (zstd, blosc)
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
        bad = bad_ranges(idx, len(data), absent_ok=False)
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
            self.problem(gname, name, f"column attribute 'h5store_column' unreadable ({error_text(e)})")
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
        bad = bad_ranges(idx, limit)
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
        bad_frame = bad_ranges(frames, data_rows, absent_ok=False)
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
            # A reader may hold a descriptor of its own: give it back now, not at exit.
            col.close_reader()

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
                        self.problem(gname, name, f"unreadable ({error_text(e)})", row, ids)
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
            self.problem(gname, name, f"unreadable ({error_text(e)})", row, ids)
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

