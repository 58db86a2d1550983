"""TypedFile: the schema class, and the open / create / serve façade.

Declare a schema as a class; an instance is one open file::

    class Speech(h5s.TypedFile):
        mel = h5s.MelSpectrogram(sr=22050, n_mels=80)
        label = h5s.DirLabel()
        logs = h5s.Group(loss=h5s.Array())

    with Speech("speech.h5", mode="a") as f:
        f.add("a", dict(mel=np.zeros((10, 80), "float32"), label=0))

The instance opens its file in ``__init__`` (so a foreign or damaged file is refused at
once) and pickles to its recipe: unpickled in a DataLoader worker it reopens the file
lazily, read-only, in that process.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from h5store.access import FeatureView, GroupView, IdsView
from h5store.errors import FormatError, H5StoreError, NotFound, ReadOnlyError, SchemaError, WriteError
from h5store.follow import follow
from h5store.format import check_root, init_root
from h5store.groups import GroupStore, Tables
from h5store.handle import FileHandle
from h5store.objstore import is_remote, replaced
from h5store.schema import Feature, Schema
from h5store.schema_merge import check_names, merge, with_fixed, with_learned
from h5store.serving import api as _serving_api
from h5store.serving.files import release_kept
from h5store.serving.getters import Getter

__all__ = ["TypedFile", "open"]

# Writable files open in this process: committed at interpreter exit, buffered rows included,
# as h5py flushes open files at exit (a script ending without close() keeps its records).
# Held strongly until closed: a writer dropped without close() (``Clip(p, mode="a").add(...)``)
# stays open and is committed at exit, as the guide says. In a WeakSet it was committed only if
# no garbage collection had run since: a collection freed it and its added items were lost.
_open_writers: set[TypedFile] = set()


def _commit_at_exit() -> None:
    for f in list(_open_writers):
        if f._pid == os.getpid():
            with contextlib.suppress(Exception):
                f.close()


atexit.register(_commit_at_exit)  # runs before handle.py's hook (atexit is last in, first out)


def _version() -> str:
    from h5store import __version__

    return __version__


def _weak_call(method: Any) -> Any:
    """``method`` (bound) called through a weak reference to its object: a no-op once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        return None if m is None else m(*args, **kwargs)

    return call


def _refuse_getters(cls: type) -> None:
    """A getter (``h5s.Label("spk")``, ``h5s.Item(...)``) as a schema's class attribute used to be
    ignored without a word: the file then stored no such feature. Refused, saying what to write."""
    for name, value in vars(cls).items():
        if isinstance(value, Getter):
            raise SchemaError(
                f"{cls.__name__}.{name} = {value!r} is a getter: it says what a batch serves "
                f"(f.serve(dict({name}=...))), not what the file stores. Declare the stored feature with a "
                f"Feature, e.g. {name} = h5s.Scalar(dtype='int64') for class indices, h5s.Text() for strings, "
                "h5s.DirLabel() for the folder's name, h5s.Array(...) for arrays; then serve it with "
                f"dict({name}={type(value).__name__}({name!r}))"
            )


class TypedFile:
    """A schema class whose instances are open h5store files.

    Parameters
    ----------
    path : str or Path
        The file.
    mode : {"r", "r+", "a", "w", "w-", "x"}
        h5py's modes: "r" read-only (default), "r+" read/write an existing file, "a"
        read/write, creating it if absent, "w" create (truncate), "w-"/"x" create, fail if
        it exists.
    untrusted : bool
        Check the whole file before anything is read (:func:`h5store.safety.check_untrusted`).
    allow_external : bool
        Read data that the file keeps outside itself (external raw storage) and soft
        links. Refused by default (``FormatError`` at open, naming the dataset and the
        other file): such a file can make a read return the bytes of any local file, e.g.
        ``/etc/passwd``. Opt in only for files you trust, and what they point to.
        External links and virtual datasets are refused either way (HDF5 cannot follow
        them through the file object h5store reads with); ``untrusted=True`` refuses all.
    **options
        Passed to :class:`h5py.File` (e.g. ``rdcc_nbytes``).

    Notes
    -----
    The file holds its schema. Opening it with a class checks that every declared
    feature is stored the way the class declares it (dtype, shape, layout); features the
    file has and the class does not are still readable. A writable open adds declared
    features the file lacks. BEWARE: only one process may write a file at a time; any
    number may read it, also while it is being written (they see what was flushed).

    Examples
    --------
    >>> import h5store as h5s, numpy as np, tempfile, os
    >>> class Tiny(h5s.TypedFile):
    ...     x = h5s.Array(dtype="float32", shape=(None, 2))
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.h5")
    >>> with Tiny(path, mode="w") as f:
    ...     _ = f.add("a", dict(x=np.ones((3, 2))))
    >>> with h5s.open(path) as f:
    ...     f.x["a"].shape
    (3, 2)
    """

    schema: ClassVar[Schema] = Schema("TypedFile", {"": {}})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _refuse_getters(cls)
        cls.schema = Schema.collect(cls)
        check_names(cls, set(dir(TypedFile)) | {"report"})  # ``create`` sets ``f.report``

    def __init__(self, path: str | os.PathLike[str], mode: str = "r", *, untrusted: bool = False,
                 allow_external: bool = False, **options: Any) -> None:
        self._allow_external = allow_external  # travels with the pickled recipe (not _INTERNAL)
        self._setup(str(path), mode, options, untrusted)
        try:
            self._ensure_open()
        except BaseException:
            # A refused file must not keep the h5py handle, nor the writer lock, of this attempt.
            self._handle.close()
            raise

    def _setup(self, path: str, mode: str, options: dict[str, Any], untrusted: bool = False) -> None:
        self._handle = FileHandle(path, mode, **options)
        self._untrusted = untrusted
        self._schema: Schema = type(self).schema
        self._groups: dict[str, GroupView] = {}
        self._inherited: dict[str, Tables] = {}  # a read-only parent's tables, after a fork
        self._snapshot: tuple[Any, ...] | None = None
        self._pid = -1
        self._committed: dict[str, int | None] = {}  # ids per group at the last commit (write errors)
        me = weakref.ref(self)  # no cycle: dropping the file still frees its handle at once
        self._handle.describe_kept = lambda: me()._kept()  # type: ignore[union-attr]

    # -- opening -------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], mode: str = "r", **options: Any) -> TypedFile:
        """Open an existing file (``cls(path, mode)``; TypedFile itself reads any schema)."""
        return cls(path, mode, **options)

    def _ensure_open(self) -> None:
        if self._pid == os.getpid() and self._handle.is_open:
            return
        h = self._handle
        if self._pid not in (-1, os.getpid()) and not h.writable:
            # Forked: the parent's views hold h5py objects this process must not use, and
            # numpy tables it may share; keep the tables for group() to adopt.
            self._inherited = {n: t for n, v in self._groups.items() if (t := v.store.tables()) is not None}
        with h.reading() as f:  # a reader reads metadata under the commit lock
            self._open_file(f)
            self._snapshot = h._token  # the commit this reader's tables describe
            if not h.writable:
                # Every group's snapshot is this open's commit, also of groups first read
                # later: their row counts are taken now (the tables, read lazily, are cut
                # to them). A damaged group reports its error when it is used.
                for name in self._schema.groups:
                    with contextlib.suppress(H5StoreError, OSError, KeyError):
                        self.group(name)
        if h.writable:
            _open_writers.add(self)
            # Every group and feature the stored schema lists must exist in the file, also
            # those nothing was written to (a reader refuses a listed but missing group).
            for name in self._schema.groups:
                self.group(name)
            self._note_commit()

    def _open_file(self, f: Any) -> None:
        h = self._handle
        self._groups = {}
        path = h.path
        if self._untrusted:
            # Before anything is read: refuse external storage, links, VDS, unknown filters,
            # and declared sizes that would make a read allocate without bound.
            from h5store.safety import check_untrusted

            check_untrusted(f, path)
        is_new = h.writable and len(f) == 0 and len(f.attrs) == 0
        declared = type(self).schema
        if is_new:
            if not any(declared.groups.values()) and type(self) is TypedFile:
                raise SchemaError(f"{path}: creating a file needs a schema: use a TypedFile subclass")
            init_root(f, declared.to_dict(), _version())
            self._schema = declared
        else:
            try:
                stored = Schema.from_dict(check_root(f, path))
            except SchemaError as e:
                raise FormatError(f"{path}: {e}") from None
            self._schema = merge(stored, declared, path, h.writable)
            if h.writable and self._schema.to_dict()["groups"] != stored.to_dict()["groups"]:
                init_root(f, self._schema.to_dict(), _version())
            if not self._untrusted:
                # Before any data is read: none of it may come from another file (unless opted in).
                from h5store.safety import check_local

                check_local(f, path, self._schema.groups, getattr(self, "_allow_external", False))
        self._pid = os.getpid()

    def _learn(self, features: Mapping[str, Feature]) -> None:
        """Replace root features by versions holding learned parameters (ingest's prepare).

        Storage must not change; the new parameters are written to the file's schema.
        """
        self._need_writable()
        self._ensure_open()
        self._schema = with_learned(self._schema, features, self.path)
        self._groups.pop("", None)
        init_root(self._handle.file, self._schema.to_dict(), _version())

    def _fixed(self, group: str, features: Mapping[str, Feature]) -> None:
        """Record in the file's schema what first items fixed (called by the group's view)."""
        self._schema = with_fixed(self._schema, group, features)
        init_root(self._handle.file, self._schema.to_dict(), _version())

    # -- pickling: the recipe ------------------------------------------------
    _INTERNAL = frozenset({"_handle", "_schema", "_groups", "_pid", "_inherited", "_untrusted", "_snapshot"})

    def __getstate__(self) -> dict[str, Any]:
        h = self._handle
        # A copy in another process is a reader: h5store allows one writer. Attributes a
        # subclass set (``class MyDS(Speech, Dataset)`` with its own __init__) travel along.
        user = {k: v for k, v in self.__dict__.items() if k not in self._INTERNAL}
        options = {**h.options, **h.remote_options}  # a remote file's client options travel too
        return {"path": h.path, "mode": "r", "options": options, "attrs": user, "untrusted": self._untrusted}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["path"], state["mode"], dict(state["options"]), state.get("untrusted", False))
        self.__dict__.update(state.get("attrs", {}))

    # -- structure -----------------------------------------------------------
    @property
    def path(self) -> str:
        return self._handle.path

    @property
    def mode(self) -> str:
        return self._handle.mode

    @property
    def writable(self) -> bool:
        return self._handle.writable

    @property
    def serves_own_snapshot(self) -> bool:
        """Whether this is a read-only file open in this process: serving it serves this snapshot
        (its ``len``, ids and tables), not whatever a fresh open would find."""
        h = self._handle
        return not h.writable and self._pid == os.getpid() and h.is_open

    @property
    def file_schema(self) -> Schema:
        """The schema of the open file (the class's, plus what the file adds)."""
        self._ensure_open()
        return self._schema

    @property
    def h5(self) -> Any:
        """The underlying :class:`h5py.File` of this process (read it, don't restructure it)."""
        self._ensure_open()
        return self._handle.file

    def group(self, name: str = "") -> GroupView:
        """The view of one group ("" is the root group)."""
        self._ensure_open()
        view = self._groups.get(name)
        if view is None:
            if name not in self._schema.groups:
                raise NotFound(f"{self.path}: no group {name!r} (groups: {sorted(g for g in self._schema.groups if g)})")
            feats = self._schema.groups[name]
            where = f"{self.path}:/{name}"
            with self._handle.reading() as f:
                if name and name not in f:
                    if not self.writable:
                        raise FormatError(f"{where}: group missing from the file")
                    f.create_group(name)
                try:
                    g = f[name] if name else f
                except (KeyError, OSError) as e:  # h5py: "Unable to open object (incorrect metadata checksum ...)"
                    raise FormatError(f"{where}: group unreadable ({e})") from None
                # A feature whose first item will fix its dtype or shape has no column yet (None).
                store = GroupStore(g, {n: ft.spec() if ft.is_fixed else None for n, ft in feats.items()}, where,
                                   self.writable, self.path, self._handle)
            tables = self._inherited.pop(name, None)
            if tables is not None:
                store.adopt(tables)
            # A weak call back: the view must not keep the file alive (a cycle, freed only by the
            # cyclic collector, that held a dropped reader's descriptors until it ran). Writers
            # are held by _open_writers until closed.
            view = self._groups[name] = GroupView(name, store, feats, on_fix=_weak_call(self._fixed))
        return view

    def feature(self, name: str) -> FeatureView:
        """The view of a root-group feature (``f.feature("mel")`` is ``f.mel``)."""
        return self.group("").feature(name)

    def __getattr__(self, name: str) -> Any:
        # Features known only from the file (h5s.open without a class).
        if name.startswith("_"):
            raise AttributeError(name)
        self._ensure_open()
        schema = self.__dict__.get("_schema")
        if schema is not None:
            if name in schema.groups.get("", {}):
                return self.feature(name)
            if name in schema.groups:
                return self.group(name)
        raise AttributeError(f"{type(self).__name__!s} has no feature or group {name!r}")

    @property
    def features(self) -> dict[str, Feature]:
        """Root-group features of the open file."""
        return dict(self.file_schema.groups[""])

    @property
    def groups(self) -> list[str]:
        return [g for g in self.file_schema.groups if g]

    # -- root group shortcuts --------------------------------------------------
    @property
    def ids(self) -> IdsView:
        """The root group's ids, in insertion order."""
        view = self._groups.get("") if self._pid == os.getpid() else None
        if view is not None:
            # Lookups need only the in-memory tables: skip the open-file checks (~3 us per call).
            return view.ids
        return self.group().ids

    def __len__(self) -> int:
        return len(self.group())

    def __contains__(self, id: object) -> bool:
        return id in self.group()

    def __iter__(self) -> Iterator[str]:
        return iter(self.group())

    def get(self, key: str | int, default: Any = None) -> Any:
        """Every feature of one id as a dict (``default`` when absent)."""
        return self.group().get(key, default)

    def __getitem__(self, key: str | int) -> dict[str, Any]:
        """Every feature of one item, by id or (possibly negative) position: ``f["spk1/a"]``, ``f[0]``.

        The same dict as :meth:`get`, but an absent id raises
        :class:`~h5store.errors.NotFound` (a ``KeyError``) and a position out of range
        ``IndexError``. A feature is ``f.mel`` (or ``f.feature("mel")``), not ``f["mel"]``.

        Examples
        --------
        >>> f[0]  # doctest: +SKIP
        {'mel': array([[...]], dtype=float32), 'label': 3}
        """
        group = self.group()
        if isinstance(key, str) and key not in group and (key in self._schema.groups[""] or key in self._schema.groups):
            raise NotFound(f"{self.path}: {key!r} is not an id; the feature or group is f.{key} "
                           f"(or f.feature({key!r}) / f.group({key!r}))")
        row = group.position(key)
        return group.get(row)

    def add(self, id: str, values: Mapping[str, Any]) -> int:
        """Add one id to the root group; returns its position.

        Raises :class:`~h5store.errors.DuplicateIdError` when the id exists and
        :class:`~h5store.errors.SchemaError` when a value does not fit its feature.
        """
        self._need_writable()
        return self.group().add(id, values)

    def extend(self, records: Any, columns: Mapping[str, Sequence[Any]] | None = None) -> np.ndarray:
        """Add many ids at once (see :meth:`GroupView.extend <h5store.access.GroupView.extend>`)."""
        self._need_writable()
        return self.group().extend(records, columns)

    def _need_writable(self) -> None:
        if not self.writable:
            raise ReadOnlyError.opened(self.path)

    def describe(self) -> list[dict[str, Any]]:
        """Per group and feature: items, dtype, item shape, length percentiles, bytes on disk,
        compression ratio. Reads index tables and metadata only.

        Examples
        --------
        >>> for row in f.describe():  # doctest: +SKIP
        ...     print(row["group"], row["feature"], row["items"], row["lengths"])
        """
        out = []
        for g in self.file_schema.groups:
            for row in self.group(g).describe():
                out.append({"group": g, **row})
        return out

    def report_html(self, path: str | os.PathLike[str], n: int = 8, seed: int = 0, verify: str = "quick") -> Any:
        """Write one self-contained HTML page about this file (:mod:`h5store.report`).

        The schema and sizes, item-length histograms from the index alone, ``n`` random items
        drawn and played, the stored ingest failures, a verify pass and the log curves; it
        opens from disk with no network. Needs matplotlib (``pip install h5store[plot]``).

        Parameters
        ----------
        path : str or Path
            The HTML file to write.
        n : int
            Random items to show; only these (and log curves) are read.
        seed : int
            Which items (the same seed shows the same ones).
        verify : {"quick", "deep", "none"}
            "quick" checks structure, ids and indexes; "deep" reads every item (the whole file).

        Returns
        -------
        h5store.report.ReportInfo

        Examples
        --------
        >>> with h5s.open("speech.h5") as f:  # doctest: +SKIP
        ...     print(f.report_html("speech.html", n=12).summary())
        speech.html: 12 items shown, 48 items read, 3.1 MB, written in 4.2 s
        """
        from h5store.report import write_report

        return write_report(self, path, n=n, seed=seed, verify=verify)

    def verify(self, deep: bool = True, max_errors: int = 1000) -> Any:
        """Check this file (``h5store verify``): structure, ids, indexes and, with ``deep``, every
        item's CRC-32; see :func:`h5store.integrity.verify`.

        A remote file (``s3://``) is checked read-only through ranged GETs, with the options
        it was opened with; a damaged item is reported by URL, feature and id.

        Returns
        -------
        h5store.integrity.VerifyReport
            Falsy when anything is wrong.

        Examples
        --------
        >>> with h5s.open("s3://bucket/speech.h5") as f:  # doctest: +SKIP
        ...     print(f.verify().summary())
        s3://bucket/speech.h5: OK: 1 group(s), 2 feature(s), 13100 id(s), 26200 item(s), ...
        """
        from h5store.integrity import verify

        return verify(self.path, deep=deep, max_errors=max_errors, **self._handle.remote_options)

    # -- lifecycle -----------------------------------------------------------
    def commit(self) -> None:
        """Make every record added so far durable: when this returns, a crash loses none of them.

        Writes to an existing file go through a rollback journal (see ``docs/reliability.md``):
        a kill at any moment leaves the file as of the last commit. ``close()`` commits too.
        """
        self.flush()

    def flush(self) -> None:
        """Write everything pending and commit; afterwards ids, index and data agree on disk.

        Raises :class:`~h5store.errors.WriteError` (an ``OSError``) when the disk is full or
        fails, now or at an earlier write: the file keeps its last commit (the message says
        how many records); ``close()`` then releases it.
        """
        if self.writable and self._pid == os.getpid():
            if self._handle.failure is None:  # else the handle's flush raises at once
                for view in self._groups.values():
                    view.store.flush()
            self._handle.flush()
            self._note_commit()

    def close(self) -> None:
        """Flush and close this process's handle.

        After a write error (:class:`~h5store.errors.WriteError`, raised once, by the call
        that met it) close keeps the last commit, drops the rest, releases the writer lock
        and raises nothing more: a file this handle created and never committed is removed.

        Examples
        --------
        >>> f = Tiny(path, mode="a")  # doctest: +SKIP
        >>> try:  # doctest: +SKIP
        ...     f.add("b", dict(x=big))  # the disk fills up
        ... except h5s.WriteError as e:
        ...     print(e)  # names the file and the records its last commit kept
        ... finally:
        ...     f.close()  # releases the writer lock; the file is as of its last commit
        """
        _open_writers.discard(self)
        if self._pid == os.getpid() and self._handle.is_open:
            if self.writable and self._handle.failure is None:
                try:
                    for view in self._groups.values():
                        view.store.flush()  # the handle's close commits it, with HDF5's last writes
                except WriteError:
                    self._handle.close()  # keeps the last commit, releases the writer lock
                    self._groups = {}
                    self._pid = -1
                    raise
            for view in self._groups.values():
                view.store.close_readers()
        release_kept(self)  # the copies its last iter_batches left open for the next
        self._handle.close()
        self._groups = {}
        self._pid = -1

    def _note_commit(self) -> None:
        """Remember each group's id count at this commit, for a later write error's message."""
        self._committed = {}
        for name, view in self._groups.items():
            refs = getattr(view.store, "_refs", None)
            n: int | None = None
            if refs is not None:
                n = len(refs)
            else:
                with contextlib.suppress(Exception):
                    n = view.store.stored_ids
            self._committed[name] = n

    def _kept(self) -> str:
        """What a write error leaves: the records of the last commit, not those added since.

        Called from inside HDF5's write callback: in-memory state only, never an HDF5 call.
        """
        advice = "close() it (that releases the writer lock), free space, then reopen it and add them again"
        kept, lost = [], 0
        for name, view in self._groups.items():
            n = self._committed.get(name)
            refs = getattr(view.store, "_refs", None)
            if n is None:
                return f"its last commit is intact; what was added since was not written. {advice}"
            now = len(refs) if refs is not None else n
            lost += max(now - n, 0)
            if name == "" or n:
                kept.append(f"{n} records" if name == "" else f"{n} in group {name!r}")
        since = {0: "no record was added since", 1: "the 1 record added since was not written"}.get(
            lost, f"the {lost} records added since were not written")
        return f"its last commit is intact ({', '.join(kept) or 'no records'}); {since}. {advice}"

    def refresh(self) -> int:
        """See what writers committed since this file was opened or last refreshed.

        A read-only file is a snapshot: its ids, index tables and reads stay those of the
        commit it opened, however much a writer appends meanwhile (the writer never changes
        committed bytes outside its commit, and never moves them). ``refresh()`` moves the
        snapshot to the latest commit. Views taken before keep working on the old snapshot.

        Returns
        -------
        int
            How many ids the root group gained (0 for a writable file, which sees its own).

        Examples
        --------
        >>> log = h5s.open("train_log.h5")  # doctest: +SKIP
        >>> log.refresh()  # doctest: +SKIP
        50
        """
        if self.writable:
            return 0
        before = len(self) if self._pid == os.getpid() and self._handle.is_open else None
        self._handle.close()
        if self._handle.remote:
            replaced(self._handle.path)  # the next open asks for the object's current version (one HEAD)
        self._groups = {}
        self._inherited = {}
        self._pid = -1
        self._ensure_open()
        return len(self) - before if before is not None else 0

    def changed(self) -> bool:
        """Whether a writer committed since this snapshot (a cheap check: no lock, no read)."""
        h = self._handle
        return not h.writable and self._pid == os.getpid() and h.commit_token() != self._snapshot

    def tail(self, start: int | None = None, timeout: float | None = None, poll: float = 0.1,
             group: str = "") -> Iterator[str]:
        """Follow a file that a writer is appending to: yield each id once it is committed.

        The live-tail mode for watching training logs: the reader polls the writer's commit
        counter (a few system calls), refreshes when it moved, and yields the new ids in the
        order they were added. Only committed records are ever seen, whole, every feature
        of them; reads wait at most ``lock_timeout`` for a commit in progress.

        Parameters
        ----------
        start : int, optional
            The first position to yield (default: the current end, only new ids; 0 replays
            the whole group first).
        timeout : float, optional
            Stop after this many seconds without a new commit (default: follow forever).
        poll : float
            Seconds between checks for a new commit.
        group : str
            The group to follow ("" is the root group).

        Examples
        --------
        >>> log = h5s.open("train_log.h5")  # doctest: +SKIP
        >>> for id in log.tail(timeout=60):  # doctest: +SKIP
        ...     print(id, log.loss[id])
        """
        return follow(self, start, timeout, poll, group)  # a generator: errors come at the first next()

    def __enter__(self) -> TypedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._handle.is_open else "closed"
        return f"<{type(self).__name__} {self.path!r} mode={self.mode!r} ({state})>"

    # -- ingest and serving (their layers import torch/joblib lazily) ----------
    @classmethod
    def create(cls, path: str | os.PathLike[str], sources: Any, **kwargs: Any) -> Any:
        """Build a file from raw sources in parallel; see :func:`h5store.ingest.create`.

        With ``shard_size=`` (ids per shard) or ``shards=`` (their number), ``path`` is a folder
        of shards and their manifest, built shard by shard (on Dask, each worker writes whole
        shards) and returned open as one :class:`~h5store.shards.ShardedDataset`; see
        :func:`h5store.shards.create_sharded`.
        """
        if kwargs.get("shard_size") is not None or kwargs.get("shards") is not None:
            from h5store.shards import create_sharded

            return create_sharded(cls, path, sources, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("shard_size", "shards")}
        from h5store.ingest import create

        return create(cls, path, sources, **kwargs)

    @classmethod
    def merge(cls, shards: Sequence[str | os.PathLike[str]], path: str | os.PathLike[str], **kwargs: Any) -> TypedFile:
        """Merge complete files (shards) into one; see :func:`h5store.ingest.merge`."""
        from h5store.ingest import merge

        return merge(cls, shards, path, **kwargs)

    # One spelling per framework, one signature and one set of defaults (DataLoader's):
    # f.serve / f.iter_batches / f.to_tf_dataset(batch, batch_size=1, *, shuffle=False,
    # drop_last=False, seed=0, verify=True, ...); see h5store.serving.api and docs/serving.md.
    serve = _serving_api.serve
    iter_batches = _serving_api.iter_batches
    to_tf_dataset = _serving_api.to_tf_dataset


def open(path: str | os.PathLike[str], mode: str = "r", *, untrusted: bool = False, allow_external: bool = False,
         **options: Any) -> TypedFile:
    """Open any h5store file without its class; the schema comes from the file.

    Built-in features decode as usual; a custom feature whose class is not imported reads
    as its raw stored arrays. ``untrusted=True`` checks the whole file before anything is
    read (:func:`h5store.safety.check_untrusted`) and warns when the bundled HDF5 has known
    CVEs: for files from elsewhere, also consider :func:`h5store.integrity.verify_in_subprocess`.
    Data kept outside the file (external raw storage, virtual datasets, external or soft
    links) is refused at open; ``allow_external=True`` reads external raw storage and soft
    links (see :class:`TypedFile`).

    A sharded dataset's folder or ``index.json`` (local or ``s3://``) opens as one read-only
    :class:`~h5store.shards.ShardedDataset` (``docs/shards.md``).

    Examples
    --------
    >>> f = h5store.open("speech.h5")  # doctest: +SKIP
    >>> f.mel[0].shape  # doctest: +SKIP
    (212, 80)
    """
    local = str(path)[len("file://"):] if str(path).startswith("file://") else path
    if not is_remote(path) and not Path(local).exists():
        raise FileNotFoundError(f"{path}: no such file")
    from h5store.shards import is_sharded, open_sharded

    if is_sharded(local):  # a sharded dataset's folder or index.json (local or s3://): one dataset of its shards
        if mode != "r":
            raise ValueError(f"{path}: a sharded dataset opens read-only (mode='r'), not mode={mode!r}")
        return open_sharded(local, untrusted=untrusted, allow_external=allow_external, **options)  # type: ignore[return-value]
    return TypedFile(path, mode, untrusted=untrusted, allow_external=allow_external, **options)


