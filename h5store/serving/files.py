"""The files a dataset serves, and the batched read engine every getter goes through.

:class:`FileSet` turns "these B items (global positions), rows ``[first, first+count)``
of each" into one planned read per file and feature (:func:`h5store.layout.plan_reads`:
sort, coalesce, one ``os.preadv`` or ``read_direct`` per run), then scatters the runs
into one batch buffer. Index tables are numpy arrays built once in the main process, so
forked workers share them and spawned ones receive them pickled; the files themselves
are pickled as their recipe and reopened read-only, lazily, in each process.

:func:`concat` joins several files with the same served features into one
:class:`MultiFile`: global position ``p`` is row ``p - starts[k]`` of file ``k``, found
with ``np.searchsorted`` over the cumulative sizes.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from h5store.checksum import crc32
from h5store.errors import CorruptRecordError, NotFound, SchemaError
from h5store.layout import ReadPlan, plan_reads
from h5store.schema import Feature
from h5store.serving import api as _api
from h5store.serving.shared import SharedArray
from h5store.storage import ABSENT, ChunkReader, Column, ColumnSpec, DirectReader, H5Reader, MemoryReader, read_whole

__all__ = ["FileSet", "MultiFile", "check_compatible", "concat"]

_I64 = np.int64

# Feature parameters that say how bytes are stored, not what they mean: files may differ.
_STORAGE_PARAMS = frozenset({"compression", "compression_opts", "shuffle", "chunk_rows", "attrs", "pattern", "finite"})
# Fixed-shape columns up to this size (labels, scores) are read whole once per process:
# a batch of them is then one fancy index instead of one read call per item.
_SMALL_BYTES = 8 << 20


def reader_copy(f: Any) -> Any:
    """A read-only, not yet opened copy of a TypedFile: its pickled recipe, rebuilt here."""
    clone = type(f).__new__(type(f))
    clone.__setstate__(f.__getstate__())
    return clone


class MultiFile:
    """Several files with the same schema, served as one (positions run across files).

    Made by :func:`concat`. Served with the same methods as a TypedFile: ``.serve(...)``,
    ``.iter_batches(...)``, ``.to_tf_dataset(...)``; also by
    :class:`~h5store.serving.FileDataset` and the getters' reads.

    Examples
    --------
    >>> shards = h5s.concat(["a.h5", "b.h5"])  # doctest: +SKIP
    >>> loader = shards.serve(dict(x=h5s.Item("mel"), id=h5s.Id()), batch_size=16)  # doctest: +SKIP
    """

    def __init__(self, files: Sequence[Any]) -> None:
        if isinstance(files, (str, os.PathLike)) or callable(getattr(files, "group", None)):
            raise TypeError(f"concat takes a list of files or paths, got {files!r}: h5s.concat([a, b])")
        flat: list[Any] = []
        for f in files:
            if isinstance(f, MultiFile):
                flat.extend(f.files)
            elif isinstance(f, (str, os.PathLike)):
                flat.append(_open_path(f))
            elif not callable(getattr(f, "group", None)):
                raise TypeError(f"concat takes paths or h5store files (TypedFile), got {type(f).__name__}: {f!r}")
            else:
                flat.append(f)
        if not flat:
            raise ValueError("concat needs at least one file")
        if len(flat) > 1:
            check_compatible(flat)
        self.files = flat

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def sizes(self, group: str = "") -> np.ndarray:
        """Ids per file in ``group``."""
        return np.array([len(f.group(group)) for f in self.files], dtype=_I64)

    def __len__(self) -> int:
        return int(self.sizes().sum())

    # One spelling per framework, the same as TypedFile's (h5store.serving.api).
    serve = _api.serve
    iter_batches = _api.iter_batches
    to_tf_dataset = _api.to_tf_dataset

    def __repr__(self) -> str:
        return f"<MultiFile of {len(self.files)} files: {self.paths[:3]}{' ...' if len(self.files) > 3 else ''}>"


def _open_path(path: str | os.PathLike[str]) -> Any:
    """``h5store.open(path)``: read-only, its schema from the file (checked by concat now)."""
    # The façade sits above serving in the layers; importing any h5store module has
    # imported it by the time this runs, so it is looked up rather than imported here.
    return importlib.import_module("h5store.typed_file").open(path)


def _shown(value: Any) -> Any:
    return tuple(_shown(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_compatible(files: Sequence[Any]) -> None:
    """Raise :class:`~h5store.errors.SchemaError` unless every file has the features of the first,
    with the same type and parameters (dtype, shape, layout, learned ones such as a label's
    classes); how they are stored (compression, chunks) may differ.

    Examples
    --------
    >>> check_compatible([Speech("a.h5"), Speech("b.h5")])  # doctest: +SKIP
    """
    first = files[0]
    ref = first.file_schema.groups
    for f in files[1:]:
        groups = f.file_schema.groups
        for g in sorted(set(ref) | set(groups)):
            mine, theirs = ref.get(g, {}), groups.get(g, {})
            for name in sorted(set(mine) | set(theirs)):
                if name not in theirs or name not in mine:
                    lacks, has = (f, first) if name not in theirs else (first, f)
                    raise SchemaError(
                        f"concat: {lacks.path} lacks the feature {_ref(g, name)!r} that {has.path} has; "
                        "concat files of one schema (or serve each file on its own)"
                    )
                a, b = mine[name], theirs[name]
                diff = _difference(a, b)
                if diff is not None:
                    param, va, vb = diff
                    raise SchemaError(
                        f"concat: feature {_ref(g, name)!r}: {param} is {va!r} in {first.path} but {vb!r} in "
                        f"{f.path}; concat files whose features agree (type, dtype, shape, parameters such as "
                        "a label's classes; compression may differ)"
                    )


def _ref(group: str, name: str) -> str:
    return f"{group}/{name}" if group else name


def _difference(a: Feature, b: Feature) -> tuple[str, Any, Any] | None:
    """The first parameter that differs between two features (storage parameters aside)."""
    if a.type_name != b.type_name:
        return "the type", a.type_name, b.type_name
    pa, pb = a.params(), b.params()
    for key in sorted((set(pa) | set(pb)) - _STORAGE_PARAMS):
        if _shown(pa.get(key)) != _shown(pb.get(key)):
            return key, _shown(pa.get(key)), _shown(pb.get(key))
    return None


def concat(files: Sequence[Any]) -> MultiFile:
    """Serve several files (paths or open files) as one: positions run through the files in order.

    The files are checked now: every file must have the features of the first with the same
    type, dtype, shape and parameters (learned ones too, such as a label's classes;
    compression may differ), or a :class:`~h5store.errors.SchemaError` names the file, the
    feature and the difference. Paths are opened read-only (``h5store.open``). Each file is
    then opened once per worker process, lazily. ``h5s.Id()`` over a concat gives
    ``"path::id"``: ids alone may repeat across files.

    Examples
    --------
    >>> import h5store as h5s
    >>> shards = h5s.concat(sorted(glob("shards/*.h5")))  # doctest: +SKIP
    >>> loader = shards.serve(dict(x=h5s.Window("mel", 64)), batch_size=32, shuffle=True)  # doctest: +SKIP
    """
    return MultiFile(files)


def split_name(name: str) -> tuple[str, str]:
    """``"logs/loss"`` -> ``("logs", "loss")``; ``"mel"`` -> ``("", "mel")``."""
    if "/" in name:
        g, _, n = name.strip("/").rpartition("/")
        return g, n
    return "", name


class FileSet:
    """The files of one dataset, one group of each, and batched reads of their features.

    Parameters
    ----------
    source : TypedFile or MultiFile
        What to serve. Read-only copies are kept (a copy reopens lazily in each process).
    group : str
        The group served ("" is the root group).
    """

    def __init__(self, source: Any, group: str = "") -> None:
        files = source.files if isinstance(source, MultiFile) else [source]
        self.files = [reader_copy(f) for f in files]
        self.group = group
        # Served through concat(): ids are named with their file ("path::id"), see Id.
        self.concat = isinstance(source, MultiFile)
        # One snapshot: a file open read-only here is served as ITS snapshot (its len(),
        # ids and tables), whatever was committed since; other files as the commit their
        # copy opens now. Every table is cut to these sizes, in every process: copies that
        # workers open later see later commits, whose first rows are the same items.
        self._origin: list[Any] = [f if _snapshot_here(f) else None for f in files]
        self._origin_pid = os.getpid()
        sizes = np.array([len((o if o is not None else c).group(group)) for o, c in zip(self._origin, self.files)],
                         dtype=_I64)
        self.starts = np.zeros(len(sizes) + 1, dtype=_I64)
        np.cumsum(sizes, out=self.starts[1:])
        # What a served item is checked against (True: raise; "skip": report and drop; False: off).
        self.verify: bool | str = True
        self._local = threading.local()  # per thread: what failed its check in the current fetch
        self._crc: dict[str, np.ndarray] = {}
        self._checked: dict[str, np.ndarray] = {}  # items whose whole bytes passed, in this process
        self._features: dict[str, Feature] = {}
        self._specs: dict[str, ColumnSpec] = {}
        self._index: dict[str, np.ndarray] = {}
        self._lengths: dict[str, np.ndarray] = {}
        self._shared: dict[tuple[int, str], SharedArray] = {}
        self._cols: dict[tuple[int, str], Column] = {}
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        self.alloc = np.empty

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cols"] = {}
        state["_fds"] = {}
        state["alloc"] = None
        state["_origin"] = [None] * len(self.files)  # tables travel as numpy, never a file
        state.pop("_local", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.alloc = np.empty
        self._local = threading.local()

    @property
    def failed(self) -> list[tuple[int, str]]:
        """(position, feature) of the items that failed their check in this thread's fetch (``verify="skip"``)."""
        failed = getattr(self._local, "failed", None)
        if failed is None:
            failed = self._local.failed = []
        return failed

    @failed.setter
    def failed(self, value: list[tuple[int, str]]) -> None:
        self._local.failed = value

    def __len__(self) -> int:
        return int(self.starts[-1])

    def where(self, name: str = "") -> str:
        g = f"/{self.group}" if self.group else ""
        paths = self.files[0].path if len(self.files) == 1 else f"{len(self.files)} files ({self.files[0].path}, ...)"
        return f"{paths}:{g}/{name}" if name else f"{paths}:{g or '/'}"

    # -- schema --------------------------------------------------------------
    def feature(self, name: str) -> Feature:
        """The Feature ``name`` of the served group (the same in every file, checked)."""
        feat = self._features.get(name)
        if feat is None:
            found = []
            for f in self.files:
                feats = f.file_schema.groups.get(self.group, {})
                if name not in feats:
                    raise NotFound(f"{f.path}:/{self.group}: no feature {name!r} (features: {sorted(feats)}); "
                                   "name one of these in the getter")
                if not feats[name].is_fixed:  # h5s.Array() before its first item
                    raise SchemaError(f"{f.path}:/{self.group}: feature {name!r} holds no item yet (its dtype and "
                                      "shape are fixed by the first item stored): nothing to serve")
                found.append(feats[name])
            feat = found[0]
            key = _identity(feat)
            for f, other in zip(self.files[1:], found[1:]):
                if _identity(other) != key:
                    raise SchemaError(
                        f"concat: feature {name!r} differs between {self.files[0].path} ({feat!r}) "
                        f"and {f.path} ({other!r}); served features must agree in every file"
                    )
            self._features[name] = feat
        return feat

    def spec(self, name: str) -> ColumnSpec:
        spec = self._specs.get(name)
        if spec is None:
            spec = self._specs[name] = self.feature(name).spec()
        return spec

    def decoded(self, name: str) -> bool:
        """Whether the feature turns stored items into something else (``decode`` overridden)."""
        return type(self.feature(name)).decode is not Feature.decode

    def column(self, k: int, name: str) -> Column:
        """The storage column of feature ``name`` in file ``k``, opened in this process."""
        pid = os.getpid()
        if pid != self._pid:
            self._cols = {}
            self._fds = {}  # the parent's descriptors: not ours to close
            self._pid = pid
        col = self._cols.get((k, name))
        if col is None:
            self.feature(name)
            col = self.files[k].group(self.group).store.columns[name]
            shared = self._shared.get((k, name))
            if shared is not None:
                col.use_memory(shared.array)
            elif col.spec.layout == "fixed":
                # Under the commit lock: after a commit the file reopens and ``col.data``
                # is rebound (an h5py object of the closed open would raise RuntimeError).
                with col.reading():
                    if col.data.size * col.data.dtype.itemsize <= _SMALL_BYTES:
                        col.use_memory(read_whole(col.data, col.path, col.where))  # compressed: bounded
            self._cols[(k, name)] = col
        return col

    def _fd(self, k: int, path: str) -> int:
        fd = self._fds.get(k)
        if fd is None:
            fd = self._fds[k] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        """Close this process's descriptors and handles (they reopen on the next read)."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
            for f in self.files:
                f.close()
        self._fds = {}
        self._cols = {}

    def _table(self, k: int, name: str, what: str) -> np.ndarray:
        """Table ``what`` ("index" or "checksums") of file ``k``, cut to the served snapshot."""
        origin = self._origin[k] if self._origin_pid == os.getpid() else None
        if origin is not None:
            self.feature(name)
            col = origin.group(self.group).store.columns[name]
        else:
            col = self.column(k, name)
        table = getattr(col, what)
        n = int(self.starts[k + 1] - self.starts[k])
        if len(table) < n:
            raise CorruptRecordError(
                f"{self.where(name)}: {self.files[k].path} now holds {len(table)} items, the served snapshot "
                f"{n}: was another file moved to the path? Serve it again (a new loader)"
            )
        return table[:n]

    def pin(self, names: Sequence[str]) -> None:
        """Load the tables of ``names`` now, in this process (workers then never read them)."""
        for name in names:
            self.index(name)
            if self.verify:
                self.checksums(name)
                self._done(name)

    def index(self, name: str) -> np.ndarray:
        """``(N, 2)`` ``[start, stop)`` rows of each item in its own file's data (global positions)."""
        idx = self._index.get(name)
        if idx is None:
            parts = [self._table(k, name, "index") for k in range(len(self.files))]
            idx = parts[0] if len(parts) == 1 else np.concatenate(parts)
            self._index[name] = idx
        return idx

    def checksums(self, name: str) -> np.ndarray:
        """The stored CRC-32 of every item (global positions), of the served snapshot."""
        crc = self._crc.get(name)
        if crc is None:
            parts = [self._table(k, name, "checksums") for k in range(len(self.files))]
            crc = parts[0] if len(parts) == 1 else np.concatenate(parts)
            self._crc[name] = crc
        return crc

    def lengths(self, name: str) -> np.ndarray:
        """Rows per item (blobs per item for "blobs" features); 0 where absent."""
        n = self._lengths.get(name)
        if n is None:
            idx = self.index(name)
            n = self._lengths[name] = idx[:, 1] - idx[:, 0]
        return n

    def present(self, name: str) -> np.ndarray:
        return self.index(name)[:, 0] != ABSENT

    def id(self, position: int) -> str:
        """The id at a global position (for messages)."""
        k = int(np.searchsorted(self.starts, position, side="right")) - 1
        origin = self._origin[k] if self._origin_pid == os.getpid() else None
        return (origin if origin is not None else self.files[k]).group(self.group).ids[int(position - self.starts[k])]

    def ids(self, items: np.ndarray, qualify: bool = False) -> list[str]:
        """The ids at global positions, in order; ``qualify``: as ``"path::id"``."""
        out: list[str] = [""] * len(items)
        pid = os.getpid()
        for k, sel in self._parts(items):
            pos = np.arange(len(items)) if isinstance(sel, slice) else sel
            origin = self._origin[k] if self._origin_pid == pid else None
            view = (origin if origin is not None else self.files[k]).group(self.group).ids
            base = int(self.starts[k])
            prefix = f"{self.files[k].path}::" if qualify else ""
            for j, p in zip(pos.tolist(), items[pos].tolist()):
                out[j] = prefix + view[p - base]
        return out

    def file_of(self, items: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, items, side="right") - 1

    # -- in-memory ------------------------------------------------------------
    def load_shared(self, name: str) -> None:
        """Copy feature ``name`` of every file into shared memory, once (in this process)."""
        for k in range(len(self.files)):
            if (k, name) in self._shared:
                continue
            col = self.column(k, name)
            with col.reading():
                ds = col.data
                shared = SharedArray(ds.shape, ds.dtype, lambda out, ds=ds, col=col: _copy_dataset(ds, out, col.path, col.where))
            self._shared[(k, name)] = shared
            self.column(k, name).use_memory(shared.array)

    @property
    def shared_bytes(self) -> int:
        return sum(s.nbytes for s in self._shared.values())

    # -- reads -----------------------------------------------------------------
    def _parts(self, items: np.ndarray) -> Iterator[tuple[int, Any]]:
        """(file number, batch positions) for each file the items fall in."""
        if len(self.files) == 1:
            yield 0, slice(None)
            return
        k = self.file_of(items)
        for kk in np.unique(k).tolist():
            yield kk, np.flatnonzero(k == kk)

    def _read(self, k: int, name: str, starts: np.ndarray, stops: np.ndarray) -> tuple[ReadPlan, np.ndarray]:
        col = self.column(k, name)
        reader = col.reader()
        # Through HDF5 each call costs ~20 us: merge runs separated by < 64 KiB of rows.
        gap = max(0, (64 << 10) // max(col.spec.row_nbytes, 1)) if isinstance(reader, H5Reader) else 0
        plan = plan_reads(starts, stops, max_gap=gap)
        if getattr(reader, "stable", False):
            return plan, reader.read_runs(plan)
        # HDF5 reads metadata and chunk addresses: under the commit lock, through the
        # dataset of the current open (rebound after a commit reopened the file).
        with col.reading():
            return plan, col.reader().read_runs(plan)

    def read_padded(self, name: str, items: np.ndarray, first: np.ndarray | int, count: np.ndarray,
                    width: int) -> np.ndarray:
        """Rows ``[first, first + count)`` of each item, zero-padded to ``width`` rows.

        Returns a ``(B, width, *row_shape)`` array; ``first + count`` must not pass the
        item's end (the caller clips). One planned read per file for the whole batch.
        """
        spec = self.spec(name)
        b = len(items)
        out = self.alloc((b, width, *spec.inner), spec.np_dtype)
        if not b:
            return out
        idx = self.index(name)
        starts = idx[items, 0] + first
        for k, sel in self._parts(items):
            dest = np.arange(b, dtype=_I64) if isinstance(sel, slice) else sel
            s, c = starts[sel], count[sel]
            reader = self.column(k, name).reader()
            if isinstance(reader, DirectReader):
                # Straight from the file into the batch buffer: one copy, no HDF5.
                _pread_scatter(self._fd(k, reader.path), reader, out, dest, s, c, self.where(name))
            elif isinstance(reader, MemoryReader):
                arr = reader.array
                for j, a, n in zip(dest.tolist(), s.tolist(), c.tolist()):
                    out[j, :n] = arr[a : a + n]
            else:
                plan, buf = self._read(k, name, s, s + c)
                _scatter(out, dest, buf, plan.offsets, c)
        if self.verify:
            whole = count == self.lengths(name)[items]
            whole &= (first == 0) if isinstance(first, np.ndarray) else int(first) == 0
            if whole.all():  # the bytes just read are the whole items (Item)
                self._check_rows(name, items, out, count)
            else:
                if whole.any():
                    sel = np.flatnonzero(whole)
                    self._check_rows(name, items[sel], out[sel], count[sel])
                self._check_once(name, items[~whole])
        short = np.flatnonzero(count < width)
        if short.size:
            for j, n in zip(short.tolist(), count[short].tolist()):
                out[j, n:] = 0
        return out

    def read_fixed(self, name: str, items: np.ndarray) -> np.ndarray:
        """The item of each position for a fixed-shape feature: ``(B, *shape)``."""
        spec = self.spec(name)
        b = len(items)
        out = self.alloc((b, *spec.inner), spec.np_dtype)
        if not b:
            return out
        rows = self.index(name)[items, 0]
        for k, sel in self._parts(items):
            r = rows[sel]
            reader = self.column(k, name).reader()
            if isinstance(reader, MemoryReader):
                out[sel] = reader.array[r]
                if self.verify:  # in memory: each item checked once in this process
                    mine = items[sel]
                    done = self._done(name)
                    for j in np.flatnonzero(~done[mine]).tolist():
                        self._check(name, int(mine[j]), reader.array[int(r[j])])
                continue
            plan, buf = self._read(k, name, r, r + 1)
            out[sel] = buf[plan.offsets]
            if self.verify:
                mine = items[sel]
                for j in range(len(mine)):
                    self._check(name, int(mine[j]), buf[int(plan.offsets[j])])
        return out

    def read_items(self, name: str, items: np.ndarray) -> list[Any]:
        """Raw stored items (arrays, or lists of blobs), in order: for features that decode."""
        out: list[Any] = [None] * len(items)
        for k, sel in self._parts(items):
            pos = np.arange(len(items)) if isinstance(sel, slice) else sel
            rows = items[pos] - self.starts[k]
            for j, raw in zip(pos.tolist(), self.column(k, name).read_items(rows)):
                out[j] = raw
                if self.verify:
                    self._check(name, int(items[j]), raw)
        return out

    def read_blobs(self, name: str, items: np.ndarray, first: np.ndarray, count: np.ndarray) -> list[list[np.ndarray]]:
        """Blobs ``[first, first + count)`` of each "blobs" item (only their bytes are read)."""
        ks = self.file_of(items) if len(self.files) > 1 else np.zeros(len(items), _I64)
        out = []
        if self.verify:
            self._check_once(name, items)
        bad = {p for p, n in self.failed if n == name}
        for k, p, a, c in zip(ks.tolist(), items.tolist(), np.broadcast_to(first, len(items)).tolist(), count.tolist()):
            if p in bad:  # skipped (verify="skip"): the batch is fetched again without it
                out.append([])
                continue
            out.append(self.column(k, name).read_blobs(p - int(self.starts[k]), a, a + c))
        return out

    # -- checks -----------------------------------------------------------------
    def _done(self, name: str) -> np.ndarray:
        """Bool per item: its whole bytes passed their CRC-32 in this process."""
        done = self._checked.get(name)
        if done is None:
            done = self._checked[name] = np.zeros(len(self), dtype=bool)
        return done

    def _check_rows(self, name: str, items: np.ndarray, out: np.ndarray, count: np.ndarray) -> None:
        """Check whole items read into the rows ``out[j, :count[j]]`` (one C loop per item)."""
        expect = self.checksums(name)[items].tolist()
        for j, (n, c) in enumerate(zip(count.tolist(), expect)):
            if crc32(out[j, :n]) != c:
                self._check(name, int(items[j]), out[j, :n])
        self._done(name)[items] = True  # (a failed one raises, or is skipped: never served)

    def _check(self, name: str, position: int, value: Any) -> bool:
        """Compare an item's whole stored bytes (an array, or a list of blobs) with its CRC-32."""
        if isinstance(value, list):
            crc = 0
            for blob in value:
                crc = crc32(np.ascontiguousarray(blob), crc)
        else:
            crc = crc32(np.ascontiguousarray(value))
        if crc == int(self.checksums(name)[position]):
            self._done(name)[position] = True
            return True
        k = int(self.file_of(np.array([position]))[0])
        g = f"/{self.group}" if self.group else ""
        path = self.files[k].path
        message = (
            f"{path}:{g}/{name}: item {self.id(position)!r} (position {position}) fails its CRC-32 check: "
            f"its stored bytes are damaged. `h5store verify {path}` lists every damaged record; serve with "
            "verify='skip' to leave damaged items out (reported), or verify=False to deliver them unchecked"
        )
        if self.verify != "skip":
            raise CorruptRecordError(message)
        self.failed.append((position, name))
        return False

    def _check_once(self, name: str, items: np.ndarray) -> None:
        """Read and check the whole of each item not yet checked in this process.

        For reads of a part of an item (windows, crops, some blobs): a part cannot be
        checked against the whole item's CRC-32, so the first time any part of an item
        is served in a process, all of it is read and checked; later parts are not.
        """
        left = ~self._done(name)[items]
        if not left.any():
            return
        todo = np.unique(items[left])
        ks = self.file_of(todo) if len(self.files) > 1 else np.zeros(len(todo), _I64)
        blobs = self.spec(name).layout == "blobs"
        idx = self.index(name)
        for k in np.unique(ks).tolist():
            mine = todo[ks == k]
            col = self.column(k, name)
            # Rows from the served snapshot's index (blobs: the column's frames, same items).
            raws = col.read_items(mine - self.starts[k]) if blobs else col.read_ranges(idx[mine, 0], idx[mine, 1])
            for p, raw in zip(mine.tolist(), raws):
                self._check(name, p, raw)

    def check_present(self, names: Sequence[str], items: np.ndarray) -> None:
        """Raise :class:`~h5store.errors.NotFound` when a served item lacks a feature."""
        for name in names:
            absent = ~self.present(name)[items]
            if absent.any():
                first = int(items[np.argmax(absent)])
                raise NotFound(
                    f"{self.where(name)}: {int(absent.sum())} of {len(items)} served items have no {name!r} "
                    f"(first: id {self.id(first)!r}); serve only items that have it, e.g. "
                    f"items=np.flatnonzero(f.{name}.present)"
                )


def _snapshot_here(f: Any) -> bool:
    """Whether ``f`` is a read-only file open in this process: its snapshot is what is served."""
    handle = getattr(f, "_handle", None)
    return (handle is not None and not handle.writable and getattr(f, "_pid", None) == os.getpid()
            and handle.is_open)


def _identity(feat: Feature) -> tuple[str, str]:
    params = {k: v for k, v in feat.params().items() if k not in _STORAGE_PARAMS}
    return feat.type_name, repr(sorted(params.items()))


def _copy_dataset(ds: Any, out: np.ndarray, path: str | None = None, where: str | None = None) -> None:
    n = int(ds.shape[0]) if ds.shape else 0
    row = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
    step = max(1, (64 << 20) // row)
    # Compressed chunks are decoded by h5store, never past their declared size.
    chunked = ChunkReader.for_dataset(ds, path, where, cache_bytes=0) if path else None
    for a in range(0, n, step):
        b = min(n, a + step)
        if chunked is not None:
            out[a:b] = chunked.read_runs(plan_reads(np.array([a]), np.array([b])))
        else:
            ds.read_direct(out, np.s_[a:b], np.s_[a:b])
    if chunked is not None:
        chunked.close()


def _scatter(out: np.ndarray, dest: np.ndarray, buf: np.ndarray, offsets: np.ndarray, counts: np.ndarray) -> None:
    """``out[dest[j], :counts[j]] = buf[offsets[j]:+counts[j]]``."""
    for j, o, c in zip(dest.tolist(), offsets.tolist(), counts.tolist()):
        out[j, :c] = buf[o : o + c]


def _pread_scatter(fd: int, reader: DirectReader, out: np.ndarray, dest: np.ndarray, starts: np.ndarray,
                   counts: np.ndarray, where: str) -> None:
    """Read rows ``[starts[j], +counts[j])`` of the dataset into ``out[dest[j]]`` with ``os.preadv``.

    Byte offsets come from the reader's piece table (contiguous data is one piece,
    chunked data one per chunk), vectorised; reads go in file order, and ranges that
    follow each other on disk share one ``preadv`` call (one iovec per batch slot).
    """
    rb = reader.row_nbytes
    if not rb or not len(dest):
        return
    if int((starts + counts).max()) > reader.shape[0]:
        raise CorruptRecordError(f"{where}: read past the end of the data ({reader.shape[0]} rows)")
    view = memoryview(out).cast("B")
    slot = (out.strides[0] if out.ndim > 1 else rb)
    piece = np.searchsorted(reader.starts, starts, side="right") - 1
    base = reader.starts[piece]
    inside = starts + counts <= base + reader.piece_rows
    byte = reader.offsets[piece] + (starts - base) * rb
    nbytes = counts * rb
    order = np.argsort(byte, kind="stable")
    iov: list[memoryview] = []
    at = end = -1
    for j, o, n, ok, s, c in zip(dest[order].tolist(), byte[order].tolist(), nbytes[order].tolist(),
                                 inside[order].tolist(), starts[order].tolist(), counts[order].tolist()):
        if not n:
            continue
        if not ok:  # the range crosses chunks: read it piece by piece
            _pread_pieces(fd, reader, view[j * slot : j * slot + n], s, c, where)
            continue
        if o != end:
            if iov:
                _preadv_all(fd, iov, at, end - at, where)
            iov, at = [], o
        iov.append(view[j * slot : j * slot + n])
        end = o + n
    if iov:
        _preadv_all(fd, iov, at, end - at, where)


def _pread_pieces(fd: int, reader: DirectReader, dst: memoryview, start: int, count: int, where: str) -> None:
    rb = reader.row_nbytes
    a, b, o = start, start + count, 0
    while a < b:
        p = int(reader.starts.searchsorted(a, side="right")) - 1
        first = int(reader.starts[p])
        stop = min(b, first + reader.piece_rows)
        n = (stop - a) * rb
        _preadv_all(fd, [dst[o : o + n]], int(reader.offsets[p]) + (a - first) * rb, n, where)
        o += n
        a = stop


def _preadv_all(fd: int, iov: list[memoryview], offset: int, want: int, where: str) -> None:
    got = os.preadv(fd, iov, offset)
    if got == want:
        return
    # Short read (signals, huge requests): finish buffer by buffer.
    done = 0
    for v in iov:
        n = len(v)
        if done + n <= got:
            done += n
            continue
        skip = max(0, got - done)
        pos = skip
        while pos < n:
            r = os.preadv(fd, [v[pos:]], offset + done + pos)
            if r <= 0:
                raise CorruptRecordError(f"{where}: short read ({done + pos} of {want} bytes): the file is truncated")
            pos += r
        done += n
