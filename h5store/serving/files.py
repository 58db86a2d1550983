"""The files a dataset serves, and the batched read engine every getter goes through.

:class:`FileSet` turns "these B items (global positions), rows ``[first, first+count)``
of each" into one planned read per file and feature (:func:`h5store.layout.plan_reads`:
sort, coalesce, one ``os.preadv`` or ``read_direct`` per run), then scatters the runs
into one batch buffer. Index tables are numpy arrays built once in the main process, so
forked workers share them and spawned ones receive them pickled; the files themselves
are pickled as their recipe and reopened read-only, lazily, in each process.

Several files (a :func:`~h5store.serving.multifile.concat`, re-exported here) are served as
one: global position ``p`` is row ``p - starts[k]`` of file ``k``, found with
``np.searchsorted`` over the cumulative sizes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from h5store.checksum import crc32
from h5store.column import Column
from h5store.errors import CorruptRecordError, NotFound, SchemaError
from h5store.format import ABSENT, ColumnSpec
from h5store.readers import copy_dataset, read_whole
from h5store.schema import Feature
from h5store.serving.multifile import MultiFile, check_compatible, concat, feature_identity, reader_copy
from h5store.serving.shared import SharedArray, SharedFlags

__all__ = ["FileSet", "MultiFile", "check_compatible", "concat"]

_I64 = np.int64
# Fixed-shape columns up to this size (labels, scores) are read whole once per process:
# a batch of them is then one fancy index instead of one read call per item.
_SMALL_BYTES = 8 << 20


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
        try:  # where the checked flags outlive this FileSet (the next epoch's, see keep_checked)
            self._source: Any = weakref.ref(source)
        except TypeError:
            self._source = None
        files = source.files if isinstance(source, MultiFile) else [source]
        # os.stat of each local file (device, inode, size, mtime, ctime; None for a remote one),
        # noted before the copies open, so that their snapshots are this state or a later one;
        # carried to workers: a file rewritten in place under the same inode (`cp`,
        # h5py.File(path, "w")) changes it, and the items checked before are checked again.
        self._stamps: list[tuple[int, ...] | None] = [_state(f) for f in files]
        # The read-only copies the last FileSet of this source left open (see keep_checked),
        # while no file changed on disk since: an epoch of ``f.iter_batches`` then reopens none.
        self.files = self._kept_files(files) or [reader_copy(f) for f in files]
        self.group = group
        # Served through concat(): ids are named with their file ("path::id"), see Id.
        self.concat = isinstance(source, MultiFile) and not source.unique_ids
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
        # What a served item is checked against (True: raise; "always": raise, whole items
        # re-checked at every read; "skip": report and drop; False: off).
        self.verify: bool | str = True
        self._local = threading.local()  # per thread: what failed its check in the current fetch
        self._crc: dict[str, np.ndarray] = {}
        # Items whose whole bytes passed their check: one flag per item, shared by the
        # processes serving this FileSet when made by pin() (forked and spawned workers,
        # and the workers of later epochs), else kept in this process.
        self._checked: dict[str, SharedFlags | np.ndarray] = {}
        self._features: dict[str, Feature] = {}
        self._specs: dict[str, ColumnSpec] = {}
        self._index: dict[str, np.ndarray] = {}
        self._lengths: dict[str, np.ndarray] = {}
        self._shared: dict[tuple[int, str], SharedArray] = {}
        self._cols: dict[tuple[int, str], Column] = {}
        self._pid = os.getpid()
        # (st_dev, st_ino) of each local file whose tables this FileSet read (None: not yet,
        # or remote). A process that opens the path later and finds another file there (one
        # moved to the path: a create(mode="w"), an atomic rename) raises instead of reading
        # its bytes through these tables (and the shared "checked" flags of the old file).
        self._ident: list[tuple[int, int] | None] = [None] * len(self.files)
        self._rewritten: set[int] = set()  # files seen changing in this process (for messages)
        self._left = False  # the copies were left for the next FileSet of the source (keep_checked)
        self.alloc = np.empty

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cols"] = {}
        state["alloc"] = None
        state["_origin"] = [None] * len(self.files)  # tables travel as numpy, never a file
        state.pop("_local", None)
        state["_source"] = None
        # Shared flags travel as their path (reopened below); per-process ones as arrays.
        state["_checked"] = {k: v if isinstance(v, np.ndarray) else (v.path, v.n) for k, v in self._checked.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        checked = state.pop("_checked", {})
        self.__dict__.update(state)
        self.alloc = np.empty
        self._local = threading.local()
        self._checked = {}
        for name, v in checked.items():
            if isinstance(v, np.ndarray):
                self._checked[name] = v
                continue
            flags = SharedFlags.__new__(SharedFlags)
            try:
                flags.__setstate__({"path": v[0], "n": v[1]})
            except FileNotFoundError:  # the loader that made them is gone: check again, in this process
                self._checked[name] = np.zeros(len(self), dtype=bool)
            else:
                self._checked[name] = flags

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
            key = feature_identity(feat)
            for f, other in zip(self.files[1:], found[1:]):
                if feature_identity(other) != key:
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
            self._cols = {}  # the parent's columns (and descriptors): not ours
            self._pid = pid
        col = self._cols.get((k, name))
        if col is None:
            self.feature(name)
            col = self.files[k].group(self.group).store.columns[name]
            shared = self._shared.get((k, name))
            if shared is None:  # bytes read from the file: it must be the file of the tables
                self._same_file(k, self.files[k])
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

    def open_readers(self, names: Sequence[str]) -> None:
        """Open, in this thread, everything reading ``names`` needs (tables, readers, descriptors):
        threads that share this FileSet afterwards only read."""
        for name in names:
            self.feature(name)
            self.spec(name)
            self.lengths(name)
            for k in range(len(self.files)):
                col = self.column(k, name)
                col.checksums  # noqa: B018 - loads the table now, not in a reader thread
                if col.spec.layout == "blobs":
                    col.frames  # noqa: B018 - idem
                col.reader().open()

    def close(self) -> None:
        """Close this process's descriptors and handles (they reopen on the next read)."""
        left, self._left = self._left, True  # closed copies are never left for the next FileSet
        self.keep_checked()
        if self._pid == os.getpid():
            source = self._source_now()
            if left and source is not None:  # left earlier (an iterator's end): no longer
                with _KEPT_LOCK, contextlib.suppress(TypeError):
                    if _KEPT_FILES.get(source, (0, (), []))[2] is self.files:
                        del _KEPT_FILES[source]
            for col in self._cols.values():
                col.close_reader()
            for f in self.files:
                f.close()
        self._cols = {}

    def _source_now(self) -> Any:
        """The TypedFile or MultiFile this FileSet serves, if it is still alive in this process."""
        return self._source() if self._source is not None else None

    def _kept_files(self, files: Sequence[Any]) -> list[Any] | None:
        """The copies of ``files`` an earlier FileSet of the same source left (keep_checked),
        when they are still open in this process and every file's ``os.stat`` state is the one
        they were served at (no commit, no file moved to the path, no rewrite since); else None.

        Taken, not shared: a FileSet made while another still serves the same source (an
        iterator not finished) opens copies of its own, so that closing one never closes the
        descriptors the other reads through."""
        source = self._source_now()
        if source is None:
            return None
        with _KEPT_LOCK:
            try:
                kept = _KEPT_FILES.pop(source, None)  # taken: two FileSets never share copies
            except TypeError:
                return None
        if kept is None:
            return None
        pid, stamps, copies = kept
        if pid != os.getpid() or stamps != tuple(self._stamps) or len(copies) != len(files):
            return None
        if any(c.path != f.path or not _snapshot_here(c) for f, c in zip(files, copies)):
            return None
        return copies

    def _table(self, k: int, name: str, what: str) -> np.ndarray:
        """Table ``what`` ("index" or "checksums") of file ``k``, cut to the served snapshot."""
        origin = self._origin[k] if self._origin_pid == os.getpid() else None
        if origin is not None:
            self.feature(name)
            col = origin.group(self.group).store.columns[name]
            self._same_file(k, origin)
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

    def _same_file(self, k: int, f: Any) -> None:
        """Note the identity of file ``k`` as ``f`` has it open, or raise if it differs from the noted one."""
        ident = _identity(f)
        if ident is None:
            return
        was = self._ident[k]
        if was is None:
            self._ident[k] = ident
        elif ident != was:
            raise CorruptRecordError(
                f"{self.files[k].path}: another file was moved to the path (inode {ident[1]}, device {ident[0]}) "
                f"since this loader read its tables (inode {was[1]}, device {was[0]}): its items would be read "
                "through the old file's index. Serve it again (a new loader)"
            )

    def _stamp(self, k: int) -> tuple[int, ...] | None:
        return _state(self.files[k])

    def watch(self) -> None:
        """Note each local file's state (os.stat) now, when its tables are read, unless noted."""
        for k in range(len(self.files)):
            if self._stamps[k] is None:
                self._stamps[k] = self._stamp(k)

    def changed(self, items: np.ndarray) -> bool:
        """Whether a file of ``items`` changed on disk since its state was noted (then noted anew).

        A change (a writer's commit, or a file rewritten in place) forgets which of that file's
        items passed their CRC-32, so each is checked again the next time it is served:
        committed items never change, so a writer's commit costs only the checks again, while
        another file's bytes read through this loader's tables fail them instead of being served.
        Two ``os.stat`` calls a batch per file (``FileDataset`` calls it before and after a read).
        """
        if not self.verify:
            return False
        ks = range(len(self.files)) if len(self.files) == 1 else np.unique(self.file_of(items)).tolist()
        found = False
        for k in ks:
            now = self._stamp(k)
            was = self._stamps[k]
            if was is None:
                self._stamps[k] = now
            elif now != was:
                a, b = int(self.starts[k]), int(self.starts[k + 1])
                for name in list(self._checked):
                    self._done(name)[a:b] = False
                # After the flags are cleared: keep_checked reads the states, then copies the flags.
                self._stamps[k] = now
                self._rewritten.add(k)
                found = True
        return found

    def pin(self, names: Sequence[str]) -> None:
        """Load the tables of ``names`` now, in this process (workers then never read them)."""
        self.watch()
        for name in names:
            self.index(name)
            if self.verify:
                self.checksums(name)
                if name not in self._checked:
                    try:
                        self._checked[name] = SharedFlags(len(self))
                    except (OSError, MemoryError):  # a full or small /dev/shm: flags kept per process
                        self._checked[name] = np.zeros(len(self), dtype=bool)
                    kept = self._kept().get((self.group, name, len(self)))
                    if kept is not None and kept[0] == tuple(self._stamps):
                        self._done(name)[:] = kept[1]

    def _kept(self) -> dict[tuple[str, str, int], tuple[tuple[Any, ...], np.ndarray]]:
        """The checked flags earlier FileSets of the same open file(s) left (see :meth:`keep_checked`)."""
        source = self._source_now()
        if source is None or self._pid != os.getpid():
            return {}
        with _KEPT_LOCK:
            try:
                return _KEPT.setdefault(source, {})
            except TypeError:  # not weakly referable
                return {}

    def keep_checked(self) -> None:
        """Leave which items passed their CRC-32 with the open file(s) this FileSet serves, for
        the next FileSet made of them (``f.iter_batches`` makes one per epoch): it starts from
        these flags when every file is unchanged on disk since (the same ``os.stat`` state,
        noted when the tables were read). Remote files are never kept: a new open may read a
        new version of an object."""
        if any(st is None for st in self._stamps):
            return
        source = self._source_now()
        if (source is not None and self._pid == os.getpid() and not self._rewritten and not self._left
                and all(_stat(f.path) == st for f, st in zip(self.files, self._stamps))):
            # The copies, for the next FileSet of the source (once: the next may have taken
            # them already); only while no file changed since its state was noted, before the
            # copies opened (their snapshots are that state).
            self._left = True
            dropped: list[tuple[int, tuple[Any, ...], list[Any]]] = []
            with _KEPT_LOCK, contextlib.suppress(TypeError):
                _KEPT_FILES[source] = (self._pid, tuple(self._stamps), self.files)
                # A bounded number of sources: a file opened afresh every epoch (``for e in
                # ...: h5s.open(p).iter_batches(...)``) and kept alive by the caller must not
                # keep every epoch's copies open.
                while len(_KEPT_FILES) > _KEEP_SOURCES:
                    dropped.append(_KEPT_FILES.pop(next(iter(_KEPT_FILES.keys()))))
            for entry in dropped:
                _close_copies(entry)
        if not self.verify:
            return
        kept = self._kept()
        for name in list(self._checked):
            states = tuple(self._stamps)  # before the flags: see changed()
            kept[(self.group, name, len(self))] = (states, self._done(name).copy())

    def _joined(self, cache: dict[str, np.ndarray], name: str, what: str) -> np.ndarray:
        """Table ``what`` of every file, joined (global positions), loaded once."""
        table = cache.get(name)
        if table is None:
            parts = [self._table(k, name, what) for k in range(len(self.files))]
            table = cache[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return table

    def index(self, name: str) -> np.ndarray:
        """``(N, 2)`` ``[start, stop)`` rows of each item in its own file's data (global positions)."""
        return self._joined(self._index, name, "index")

    def checksums(self, name: str) -> np.ndarray:
        """The stored CRC-32 of every item (global positions), of the served snapshot."""
        return self._joined(self._crc, name, "checksums")

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
                shared = SharedArray(ds.shape, ds.dtype, lambda out, ds=ds, col=col: copy_dataset(ds, out, col.path, col.where))
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
            # Straight into the batch buffer (from the file with os.preadv where the reader can).
            self.column(k, name).read_scatter(out, dest, starts[sel], count[sel])
        if self.verify:
            whole = count == self.lengths(name)[items]
            whole &= (first == 0) if isinstance(first, np.ndarray) else int(first) == 0
            # Whole items just read are checked over these bytes: every time with
            # verify="always", else the first time the loader serves them (the shared flags).
            todo = whole if self.verify == "always" else whole & ~self._done(name)[items]
            if todo.all():  # the bytes just read are the whole items (Item), none checked yet
                self._check_rows(name, items, out, count)
            elif todo.any():
                sel = np.flatnonzero(todo)
                self._check_rows(name, items[sel], out[sel], count[sel])
            if not whole.all():
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
            col = self.column(k, name)
            got = col.take(rows[sel])
            out[sel] = got
            if self.verify:
                mine = items[sel]
                if self.verify == "always" and not col.reader().resident:
                    todo: Any = range(len(mine))
                else:  # each item checked once in this process (in memory: always so)
                    todo = np.flatnonzero(~self._done(name)[mine]).tolist()
                for j in todo:
                    self._check(name, int(mine[j]), got[j])
        return out

    def read_items(self, name: str, items: np.ndarray) -> list[Any]:
        """Raw stored items (arrays, or lists of blobs), in order: for features that decode."""
        out: list[Any] = [None] * len(items)
        for k, sel in self._parts(items):
            pos = np.arange(len(items)) if isinstance(sel, slice) else sel
            rows = items[pos] - self.starts[k]
            done = self._done(name) if self.verify and self.verify != "always" else None
            for j, raw in zip(pos.tolist(), self.column(k, name).read_items(rows)):
                out[j] = raw
                if self.verify and (done is None or not done[items[j]]):
                    self._check(name, int(items[j]), raw)
        return out

    def read_blobs(self, name: str, items: np.ndarray, first: np.ndarray, count: np.ndarray) -> list[list[np.ndarray]]:
        """Blobs ``[first, first + count)`` of each "blobs" item (only their bytes are read)."""
        items = np.asarray(items, dtype=_I64)
        first = np.broadcast_to(np.asarray(first, dtype=_I64), items.shape)
        count = np.broadcast_to(np.asarray(count, dtype=_I64), items.shape).copy()
        ks = self.file_of(items) if len(self.files) > 1 else np.zeros(len(items), _I64)
        if self.verify:
            self._check_once(name, items)
        bad = [p for p, n in self.failed if n == name]
        if bad:  # skipped (verify="skip"): the batch is fetched again without them
            count[np.isin(items, bad)] = 0
        out: list[list[np.ndarray]] = [[] for _ in range(len(items))]
        for k in np.unique(ks).tolist():  # one planned read per file
            at = np.flatnonzero(ks == k)
            # verify=False: this loader's own policy (_check_once above) checks whole items
            got = self.column(k, name).read_blob_spans(items[at] - int(self.starts[k]), first[at], first[at] + count[at],
                                                       verify=False)
            for j, blobs in zip(at.tolist(), got):
                out[j] = blobs
        return out

    # -- checks -----------------------------------------------------------------
    def _done(self, name: str) -> np.ndarray:
        """Bool per item: its whole bytes passed their CRC-32 (here, or in a process sharing the flags)."""
        done = self._checked.get(name)
        if done is None:
            done = self._checked[name] = np.zeros(len(self), dtype=bool)
        return done if isinstance(done, np.ndarray) else done.array.view(bool)

    def _check_rows(self, name: str, items: np.ndarray, out: np.ndarray, count: np.ndarray) -> None:
        """Check whole items read into the rows ``out[j, :count[j]]`` (one C loop per item)."""
        expect = self.checksums(name)[items].tolist()
        bad = []
        for j, (n, c) in enumerate(zip(count.tolist(), expect)):
            if crc32(out[j, :n]) != c and not self._check(name, int(items[j]), out[j, :n]):
                bad.append(j)  # verify="skip" (else _check raised): never marked as checked
        self._done(name)[np.delete(items, bad) if bad else items] = True

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
        if k in self._rewritten:
            message = (
                f"{path}:{g}/{name}: item {self.id(position)!r} (position {position}) fails its CRC-32 check "
                f"after {path} changed on disk while served: the file was rewritten in place (cp, h5py.File(path, "
                "'w')) or its bytes are damaged. Replace a served file by renaming a new one over it and serve it "
                f"again (a new loader); `h5store verify {path}` lists damaged records"
            )
        else:
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

    def check_whole(self, name: str, items: np.ndarray) -> None:
        """Read and check the whole of each item not yet checked (``verify`` policy applies):
        for items the dataset leaves out unread, which no served read would check."""
        if self.verify and len(items):
            self._check_once(name, items)

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


#: Checked flags left by closed FileSets, per open source (TypedFile or MultiFile), for the next
#: FileSet of the same source: (group, feature, items) -> (os.stat states, one bool per item).
_KEPT: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, int], tuple[tuple[Any, ...], np.ndarray]]] = \
    weakref.WeakKeyDictionary()
#: The read-only copies the last FileSet of a source opened, for the next one (see keep_checked):
#: source -> (pid, os.stat states when served, copies).
_KEPT_FILES: weakref.WeakKeyDictionary[Any, tuple[int, tuple[Any, ...], list[Any]]] = weakref.WeakKeyDictionary()
_KEPT_LOCK = threading.Lock()
#: At most this many sources keep their copies open (the least recently served are closed).
_KEEP_SOURCES = 4


def release_kept(source: Any) -> None:
    """Close the read-only copies that served ``source`` and were left for its next dataset
    (called when ``source`` itself is closed: its descriptors do not outlive it)."""
    with _KEPT_LOCK:
        try:
            kept = _KEPT_FILES.pop(source, None)
        except TypeError:
            return
    if kept is not None:
        _close_copies(kept)


def _close_copies(entry: tuple[int, tuple[Any, ...], list[Any]]) -> None:
    """Close the copies of a ``_KEPT_FILES`` entry (made in this process; a forked child's
    inherited entries are its parent's, never touched)."""
    if entry[0] == os.getpid():
        for f in entry[2]:
            f.close()


def _state(f: Any) -> tuple[int, ...] | None:
    """:func:`_stat` of the file ``f`` (a TypedFile) at its path; None for a remote one."""
    if getattr(getattr(f, "_handle", None), "remote", False):
        return None
    return _stat(f.path)


def _stat(path: str) -> tuple[int, ...] | None:
    """What says a local file changed: (device, inode, size, mtime, ctime); None if it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _identity(f: Any) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the local file ``f`` has open in this process (None: remote, or no reader open)."""
    h = getattr(f, "_handle", None)
    fobj = getattr(h, "_reader_file", None)
    if h is None or getattr(h, "remote", False) or fobj is None:
        return None
    st = os.fstat(fobj.fileno())
    return st.st_dev, st.st_ino


def _snapshot_here(f: Any) -> bool:
    """Whether ``f`` is a read-only file open in this process: its snapshot is what is served."""
    return bool(getattr(f, "serves_own_snapshot", False))
