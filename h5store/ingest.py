"""Parallel create / append: joblib workers compute, the parent alone writes.

``Speech.create("speech.h5", sources="wavs/", n_workers=8)``:

1. **Sources** are expanded (a folder, recursively; a glob; a list of paths; CSV manifests)
   into :class:`~h5store.schema.Source` objects with stable ids: the path relative to the
   common root, without extension, ``/``-separated, sorted.
2. **Prepare**: each feature sees all the sources it accepts once, in the parent, and may
   learn dataset-wide parameters (a label vocabulary, a CSV table).
3. **Load**: sources go to joblib workers in small chunks; each worker runs
   ``feature.encode(feature.load(source))`` for every feature that accepts the source.
   Results stream back *in order* (``return_as="generator"``, bounded by ``pre_dispatch``)
   to the parent, the one writer, which appends them in large blocks.
4. **Publish**: everything is written to a temporary sibling ``.<name>.partial``, flushed
   and fsynced every few seconds (the resume point), and moved into place with
   ``os.replace`` only when complete; the directory is fsynced after. An interrupted
   create leaves the previous file at ``path`` untouched, and ``resume=True`` continues
   from the partial file, loading only the sources it does not hold yet. An existing file
   at ``path`` is replaced only with ``mode="w"`` and extended only with ``mode="a"``
   (after checking, before anything is written, that the declared features have the
   parameters they were stored with); without a mode it is refused.

A source whose load fails is not stored, the others are; failures come back in the
:class:`IngestReport` and are stored in the file (``/_h5store/failures``, JSON).

Because ingest is joblib, the same create runs on a Dask or Ray cluster through joblib's
backends (``with joblib.parallel_config(backend="dask"): Speech.create(...)``).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import functools
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from h5store.checksum import item_crc
from h5store.errors import (
    FormatError,
    H5StoreError,
    LockedError,
    SchemaError,
    SourceError,
    TargetExistsError,
    WriteError,
)
from h5store.journal import journal_path
from h5store.refs import normalize_id
from h5store.schema import Feature, Source

if TYPE_CHECKING:
    from h5store.typed_file import TypedFile

__all__ = ["Failure", "IngestReport", "create", "expand_sources", "merge", "source_id",
           "stored_failures"]

FAILURES_PATH = "_h5store/failures"
_NUMBERS = re.compile(r"\d+(\.\d+)?")
_COMMIT_SECONDS = 5.0


def _shown(text: str) -> str:
    """``text`` as is, or its repr when it holds a newline or another unprintable character."""
    return text if text.isprintable() else repr(text)


@dataclass(frozen=True)
class Failure:
    """One source that was not stored, and why.

    ``error`` is the exception type a feature raised, or one of ``DuplicateIdError`` (more
    than one source has this id: none of them is stored), ``InvalidIdError`` (the source's
    name makes no valid id, e.g. it holds a newline), ``WorkerDied`` and ``SpoolError``.
    """

    id: str
    feature: str
    error: str
    message: str
    source: str

    def __str__(self) -> str:
        return f"{_shown(self.id)} [{self.feature}] {self.error}: {self.message}"


@dataclass
class IngestReport:
    """What a create or append did.

    Attributes
    ----------
    n_sources : int
        Sources that at least one feature accepts.
    n_stored : int
        Ids stored by this run.
    n_skipped : int
        Sources already in the file (append or resume), not loaded again.
    failures : list of Failure
        Sources not stored: one entry per source and feature that failed, with the
        exception type and message (a source fails whole when any of its features fails).
    warnings : list of [category, message, count, example id]
        Each distinct warning the features raised while loading (e.g. librosa's "n_fft is
        too large"), once, with how many sources raised it and one of them.
    wall_seconds, writer_seconds, load_seconds : float
        Wall time of the run; time the parent spent writing; summed worker time.

    Examples
    --------
    >>> r = IngestReport(n_sources=11, n_stored=7)
    >>> r.failures.append(Failure("a", "mel", "ValueError", "too short", "/d/a.wav"))
    >>> r.summary()
    '7 stored, 0 already present, 1 of 11 sources failed in 0.0 s (writer 0.0 s)'
    """

    n_sources: int = 0
    n_stored: int = 0
    n_skipped: int = 0
    failures: list[Failure] = field(default_factory=list)
    warnings: list[list[Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    writer_seconds: float = 0.0
    load_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def n_failed(self) -> int:
        """Sources that failed (a source with two failing features counts once)."""
        return len({f.source for f in self.failures})

    def summary(self) -> str:
        warned = f", {len(self.warnings)} distinct warning(s)" if self.warnings else ""
        return (
            f"{self.n_stored} stored, {self.n_skipped} already present, {self.n_failed} of "
            f"{self.n_sources} sources failed in {self.wall_seconds:.1f} s "
            f"(writer {self.writer_seconds:.1f} s){warned}"
        )

    def lines(self) -> list[str]:
        """The summary, then each failed source with its features' errors, then the warnings."""
        out = [self.summary()]
        by_source: dict[str, list[Failure]] = {}
        for f in self.failures:
            by_source.setdefault(f.source, []).append(f)
        for source, fails in by_source.items():
            out.append(f"  failed: {_shown(source)} (id {_shown(fails[0].id)})")
            out.extend(f"    {f.feature}: {f.error}: {f.message}" for f in fails)
        for category, message, count, example in self.warnings:
            out.append(f"  warning ({count} source{'s' if count != 1 else ''}, e.g. {_shown(example)}): "
                       f"{category}: {message}")
        return out

    def _warn(self, warning: tuple[str, str], id: str) -> None:
        # "n_fft=1024 is too large for input signal of length=500" differs by its numbers
        # from source to source: those count as one warning, shown by its first message.
        key = (warning[0], _NUMBERS.sub("#", warning[1]))
        for entry in self.warnings:
            if (entry[0], _NUMBERS.sub("#", entry[1])) == key:
                entry[2] += 1
                return
        self.warnings.append([warning[0], warning[1], 1, id])


# ----------------------------------------------------------------------------- sources
def source_id(path: str, root: str) -> str:
    """The id of ``path``: relative to ``root``, without extension, ``/``-separated.

    Examples
    --------
    >>> source_id("/data/wavs/LJ001-0001.wav", "/data")
    'wavs/LJ001-0001'
    """
    rel = os.path.relpath(path, root) if root else os.path.basename(path)
    stem, ext = os.path.splitext(rel)
    if os.path.isdir(path) or not ext:
        stem = rel
    return stem.replace(os.sep, "/")


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _read_manifest(path: str) -> list[tuple[str, dict[str, str]]]:
    """Rows of a CSV manifest: a ``path`` column (else the first) plus the other columns."""
    with open(path, newline="", encoding="utf-8") as fh:
        sample = fh.read(65536)
        fh.seek(0)
        try:
            dialect: Any = csv.Sniffer().sniff(sample, delimiters=",|\t;")
        except csv.Error:
            dialect = csv.excel
        reader = csv.reader(fh, dialect)
        rows = [r for r in reader if r]
    if not rows:
        raise SourceError(f"{path}: empty manifest")
    header = [h.strip() for h in rows[0]]
    key = header.index("path") if "path" in header else 0
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for r in rows[1:]:
        p = r[key] if key < len(r) else ""
        full = p if os.path.isabs(p) else os.path.join(base, p)
        out.append((full, {h: v for j, (h, v) in enumerate(zip(header, r)) if j != key}))
    if out and not any(os.path.exists(p) for p, _ in out[:1000]):
        # LJSpeech's metadata.csv given as the sources: its first column holds ids, not paths.
        column = "its 'path' column" if "path" in header else "its first column (no 'path' header)"
        raise SourceError(
            f"{path}: read as a manifest, {column} should list files, but none of them exists "
            f"(first: {out[0][0]}). A table of ids and texts (such as LJSpeech's metadata.csv) is not "
            f"a list of sources: pass the audio folder as sources and read the table with "
            f"h5s.CSVColumn({os.path.basename(path)!r}, column=...)"
        )
    return out


def expand_sources(sources: Any, root: str | None = None) -> tuple[list[Source], str]:
    """Expand ``sources`` into sorted :class:`Source` objects and their common root.

    ``sources`` may be a folder (walked recursively; folders are sources too, for features
    such as video frames), a glob pattern, a CSV manifest (``.csv`` given explicitly: a
    ``path`` column, or the first column, plus other columns kept as ``Source.meta``), or a
    list mixing these and plain paths.
    """
    items: list[tuple[str, dict[str, str]]] = []
    dirs: set[str] = set()
    roots: list[str] = []
    entries = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    for s in entries:
        s = os.fspath(s)
        if not os.path.exists(s) and not _is_glob(s) and (len(entries) == 1 or not os.path.splitext(s)[1]):
            # A missing folder (or the only source named) would otherwise just match nothing.
            raise SourceError(f"no such file or folder: {s}")
        if os.path.isdir(s):
            top = os.path.abspath(s)
            roots.append(top)
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames.sort()
                for name in dirnames:
                    items.append((os.path.join(dirpath, name), {}))
                    dirs.add(items[-1][0])
                for name in sorted(filenames):
                    items.append((os.path.join(dirpath, name), {}))
        elif _is_glob(s):
            found = sorted(glob.glob(s, recursive=True))
            if not found and len(entries) == 1:
                raise SourceError(f"no file or folder matches {s}")
            for p in found:
                items.append((os.path.abspath(p), {}))
        elif s.lower().endswith(".csv") and os.path.isfile(s):
            for p, meta in _read_manifest(s):
                items.append((os.path.abspath(p), meta))
        else:
            items.append((os.path.abspath(s), {}))
    if root is None:
        if len(roots) == 1:
            root = roots[0]
        else:
            parents = [os.path.dirname(p) for p, _ in items] or [os.getcwd()]
            root = os.path.commonpath(parents)
    root = os.path.abspath(root)
    out = [Source(p, id=source_id(p, root), root=root, meta=m, is_dir=p in dirs or os.path.isdir(p)) for p, m in items]
    out.sort(key=lambda s: (s.id, str(s)))
    return out, root


# ----------------------------------------------------------------------------- workers
# Workers on this machine hand their arrays over through files in a private folder of
# /dev/shm (RAM) instead of the result pipe. Through the pipe, the one writer pays ~1.4 ms of
# CPU per MiB (loky reads the pickle 64 KiB at a time into a growing buffer, then unpickling
# copies every array); from a spool file it reads the rows straight into its staging buffer,
# one copy (~0.5 ms/MiB). On 2 cores, the writer's CPU is taken from the workers.
_SPOOL_ROOT = "/dev/shm"
_SPOOL_PREFIX = "h5store-ingest-"
_SPOOL_STALE_SECONDS = 600.0


@dataclass
class _Spooled:
    """A chunk's items of its row-stored features, written by a worker to one spool file.

    ``columns`` maps a feature to ``(positions, lengths, crcs, offset)``: the positions of its
    items among the chunk's good sources, their lengths in rows and CRC-32s, and the byte
    offset of their rows, concatenated in that order, in the file.
    """

    path: str
    columns: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]]
    nbytes: int = 0

    def check(self) -> str | None:
        """Why the file cannot be read back whole (someone removed or cut it), or None."""
        try:
            size = os.stat(self.path).st_size
        except OSError as e:
            return f"the worker's result file {self.path} is gone ({e.strerror})"
        return None if size == self.nbytes else f"the worker's result file {self.path} holds {size} of {self.nbytes} bytes"

    @contextlib.contextmanager
    def opened(self) -> Iterator[dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, Callable[[np.ndarray], None]]]]:
        """Per feature ``(positions, lengths, crcs, fill)`` for ``GroupView.extend(packed=...)``;
        the file is deleted afterwards."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            yield {name: (pos, lengths, crcs, functools.partial(_read_rows, fd, offset, self.path))
                   for name, (pos, lengths, crcs, offset) in self.columns.items()}
        finally:
            os.close(fd)
            os.unlink(self.path)


def _read_rows(fd: int, offset: int, path: str, out: np.ndarray) -> None:
    if not out.nbytes:
        return  # (a memoryview of an empty array cannot be cast to bytes)
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{path}: spool file ends at {offset + done}, {len(view) - done} bytes short")
        done += n


def _spool(features: dict[str, Feature], out: list[tuple[Any, ...]], folder: str) -> _Spooled | None:
    """Move the good sources' items of ragged and fixed features into a file in ``folder``.

    A feature is spooled when all its items of the chunk are arrays of the column's dtype and
    row shape (what the writer would store unconverted); its items leave the per-source dicts.
    None when nothing qualifies or the file cannot be written (e.g. /dev/shm full): the items
    then go through the result pipe as they are.
    """
    good = [(items, crcs) for _, items, crcs, *_ in out if items is not None]
    # A feature still awaiting its first item (h5s.Array()) has no spec: the parent fixes it.
    specs = {name: feat.spec() for name, feat in features.items() if feat.is_fixed}
    plan: dict[str, list[int]] = {}
    refused: set[str] = set()
    for j, (items, _) in enumerate(good):
        for name, x in items.items():
            if name in refused or name not in specs:
                continue
            spec = specs[name]
            shape = getattr(x, "shape", None)
            fits = shape is not None and (
                (spec.layout == "fixed" and shape == spec.inner)
                or (spec.layout == "ragged" and len(shape) == len(spec.inner) + 1 and shape[1:] == spec.inner))
            if not fits or x.dtype != spec.np_dtype:
                refused.add(name)
                plan.pop(name, None)
            else:
                plan.setdefault(name, []).append(j)
    if not plan:
        return None
    path = os.path.join(folder, f"{uuid.uuid4().hex}.rows")
    columns: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]] = {}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            offset = 0
            for name, pos in plan.items():
                arrays = [good[j][0][name] for j in pos]
                fixed = specs[name].layout == "fixed"
                lengths = np.fromiter((1 if fixed else len(x) for x in arrays), np.int64, len(arrays))
                crcs = np.fromiter((good[j][1][name] for j in pos), np.uint32, len(pos))
                columns[name] = (np.asarray(pos, np.int64), lengths, crcs, offset)
                for x in arrays:
                    if not x.nbytes:
                        continue
                    view = memoryview(np.ascontiguousarray(x)).cast("B")
                    done = 0
                    while done < len(view):
                        done += os.pwrite(fd, view[done:], offset + done)
                    offset += len(view)
        finally:
            os.close(fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    for name, pos in plan.items():
        for j in pos:
            del good[j][0][name]
    return _Spooled(path, columns, offset)


def _spool_folder(n_workers: int) -> str | None:
    """A private folder in /dev/shm for the workers' results, when they run on this machine."""
    if n_workers <= 1 or not os.path.isdir(_SPOOL_ROOT) or not os.access(_SPOOL_ROOT, os.W_OK):
        return None
    import joblib.parallel

    backend, _ = joblib.parallel.get_active_backend()
    # Dask, Ray or any other backend may run workers on other machines, or without this
    # /dev/shm: their results keep going through joblib.
    if type(backend).__name__ not in ("LokyBackend", "MultiprocessingBackend"):
        return None
    # Folders of creates that died without cleaning up (SIGKILL, OOM): their files hold RAM.
    # A live create changes its folder with every chunk; the age guards against a pid that
    # only looks dead (another pid namespace sharing this /dev/shm).
    with contextlib.suppress(OSError):
        for name in os.listdir(_SPOOL_ROOT):
            pid = name[len(_SPOOL_PREFIX):].split("-", 1)[0]
            if name.startswith(_SPOOL_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                folder = os.path.join(_SPOOL_ROOT, name)
                if time.time() - os.stat(folder).st_mtime > _SPOOL_STALE_SECONDS:
                    shutil.rmtree(folder, ignore_errors=True)
    try:
        return tempfile.mkdtemp(prefix=f"{_SPOOL_PREFIX}{os.getpid()}-", dir=_SPOOL_ROOT)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _load_chunk(features: dict[str, Feature], chunk: list[tuple[Source, list[str]]],
                spool: str | None = None) -> tuple[list[tuple[Any, ...]], _Spooled | None]:
    """Worker side: load every accepting feature of every source of a chunk.

    Returns, per source, ``(id, items or None, crcs, failures, seconds, warnings)``; never
    raises for a bad source, so one bad file cannot abort the run. Warnings a feature raises
    (librosa's "n_fft too large") are recorded as ``(category, message)`` and summarised once
    by the parent, not printed by every worker. The items' CRC-32s are computed here,
    in parallel, not by the one writer. With a ``spool`` folder, the items it can take move
    to a file there (see :func:`_spool`), returned second.
    """
    out = []
    for source, names in chunk:
        t0 = time.perf_counter()
        items: dict[str, Any] = {}
        crcs: dict[str, int] = {}
        failed: list[tuple[str, str, str]] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in names:
                feat = features[name]
                try:
                    items[name] = feat.encode(feat.load(source))
                    crcs[name] = item_crc(feat.fixed_by(items[name]).spec().layout, items[name])
                except Exception as e:  # noqa: BLE001 - every failure is reported, none aborts the run
                    failed.append((name, type(e).__name__, str(e) or repr(e)))
        said = sorted({(w.category.__name__, str(w.message)) for w in caught})
        out.append((source.id, None if failed else items, crcs, failed, time.perf_counter() - t0, said))
    return out, _spool(features, out, spool) if spool is not None else None


def _chunks(work: list[tuple[Source, list[str]]], n_workers: int) -> list[list[tuple[Source, list[str]]]]:
    # Enough chunks to balance the workers, few enough to amortise dispatch (and the
    # features' pickling) over several sources.
    size = int(np.clip(len(work) // max(n_workers * 16, 1), 1, 32))
    return [work[i : i + size] for i in range(0, len(work), size)]


def _run_parallel(features: dict[str, Feature], chunks: list[list[tuple[Source, list[str]]]],
                  n_workers: int, spool: str | None = None) -> Iterator[tuple[list[tuple[Any, ...]], _Spooled | None]]:
    """Yield each chunk's results in order; isolate sources whose load kills a worker."""
    import joblib

    done = 0
    while done < len(chunks):
        if n_workers == 1:
            for chunk in chunks[done:]:
                yield _load_chunk(features, chunk)
                done += 1
            return
        try:
            par = joblib.Parallel(n_jobs=n_workers, return_as="generator", pre_dispatch="2*n_jobs")
            for result in par(joblib.delayed(_load_chunk)(features, c, spool) for c in chunks[done:]):
                yield result
                done += 1
        except Exception as e:
            if type(e).__name__ not in ("TerminatedWorkerError", "BrokenProcessPool"):
                raise
            # A worker died (segfault, os._exit): run the first unfinished chunk one source
            # at a time in a fresh process each, to name the culprit and keep the others.
            yield [_isolated(features, item) for item in chunks[done]], None
            done += 1


def _isolated(features: dict[str, Feature], item: tuple[Source, list[str]]) -> tuple[Any, ...]:
    import joblib

    source, names = item
    try:
        return joblib.Parallel(n_jobs=2)([joblib.delayed(_load_chunk)(features, [item])])[0][0][0]
    except Exception as e:  # noqa: BLE001
        return (source.id, None, {}, [(n, "WorkerDied", f"the worker process died loading this source ({type(e).__name__})") for n in names], 0.0, [])


# ----------------------------------------------------------------------------- create
def _partial_path(path: str) -> str:
    d, name = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{name}.partial")


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _store_failures(tf: TypedFile, failures: Sequence[Failure]) -> None:
    h5 = tf.h5
    old: list[dict[str, str]] = []
    if FAILURES_PATH in h5:
        old = json.loads(h5[FAILURES_PATH][()].tobytes().decode("utf-8"))
        del h5[FAILURES_PATH]
    fresh = [asdict(f) for f in failures]
    keep = {(f["id"], f["feature"]) for f in fresh}
    merged = [f for f in old if (f["id"], f["feature"]) not in keep and f["id"] not in tf] + fresh
    h5.create_dataset(FAILURES_PATH, data=np.frombuffer(json.dumps(merged).encode("utf-8"), np.uint8))


def stored_failures(tf: TypedFile) -> list[Failure]:
    """The failures recorded in a file by the creates and appends that built it."""
    h5 = tf.h5
    if FAILURES_PATH not in h5:
        return []
    return [Failure(**d) for d in json.loads(h5[FAILURES_PATH][()].tobytes().decode("utf-8"))]


def create(cls: type[TypedFile], path: str | os.PathLike[str], sources: Any, *, n_workers: int | None = None,
           mode: str | None = None, overwrite: bool = False, resume: bool = False, on_error: str = "skip",
           progress: bool = True, root: str | None = None) -> TypedFile:
    """Build (or extend) a file from raw sources in parallel.

    Parameters
    ----------
    cls : TypedFile subclass
        The schema; features with a ``pattern`` are filled from the sources they accept.
    path : str or Path
        The file to create. It appears only when complete. A symlink is followed: the file it
        points to is the one created, replaced or extended, and the link stays.
    sources : str, Path or list
        A folder (recursive), a glob, CSV manifests, paths, or a list of these.
    n_workers : int, optional
        joblib workers (default: all cores). 1 runs in this process.
    mode : {None, "w", "a"}
        What to do with a file already at ``path``. None (default, also "x"): create it, and
        refuse with :class:`~h5store.errors.TargetExistsError` when it exists. "w": replace it once the new
        one is complete. "a": add the sources whose ids it does not hold yet, working on a
        copy, so a crash loses nothing; the declared features must have the parameters they
        were stored with (parameters a feature learns in ``prepare``, such as a label
        vocabulary, may grow), else :class:`~h5store.errors.SchemaError` is raised before
        anything is written.
    overwrite : bool
        ``overwrite=True`` is ``mode="w"``.
    resume : bool
        Continue an interrupted create from its partial file, loading only what it lacks
        (no ``mode`` needed). A partial file built with other parameters is refused, one
        damaged by a kill is rebuilt; without a partial file, ``mode`` applies as usual.
    on_error : {"skip", "raise"}
        "skip" stores every good source and reports the others. "raise" publishes nothing
        when any source fails: every source is still tried, then one
        :class:`~h5store.errors.SourceError` lists all the bad ones (``.failures``). The good
        ones stay in the partial file, so ``resume=True`` after a fix loads only what failed.
    progress : bool
        Show a tqdm bar (items, items/s, ETA, failures so far).
    root : str, optional
        The folder ids are relative to (default: the common root of the sources).

    Returns
    -------
    TypedFile
        The finished file, open read-only, with the run's :class:`IngestReport` as ``.report``.

    Notes
    -----
    A source is a failure of its own, reported with the others while the rest is stored,
    when its load fails, when its name makes no valid id (a newline in a file name), and
    when another source has the same id (``a.wav`` and ``a.flac``; ids are compared after
    Unicode NFC normalisation): then none of them is stored, so an id never holds the
    content of a source other than the one it names. In an append or a resume, an id the
    file holds already is skipped, however many sources have it.

    Examples
    --------
    >>> f = Speech.create("speech.h5", sources="wavs/", n_workers=8)  # doctest: +SKIP
    >>> f.report.summary()  # doctest: +SKIP
    '13100 stored, 0 already present, 2 failed of 13102 sources in 95.3 s (writer 4.1 s)'
    >>> f = Speech.create("speech.h5", sources="more_wavs/", mode="a")  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    mode = _check_mode(mode, overwrite)
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    path = os.fspath(path)
    if os.path.islink(path):
        # Publish where the link points (and build beside it): replacing the link itself
        # would leave the file it names stale and turn the link into a file of its own.
        path = os.path.realpath(path)
    n_workers = n_workers or len(os.sched_getaffinity(0))
    partial = _partial_path(path)
    report = IngestReport()

    all_sources, root = expand_sources(sources, root)
    declared = {n: f for n, f in cls.schema.groups[""].items() if f.pattern is not None or type(f).accepts is not Feature.accepts}
    if not declared:
        raise SourceError(f"{cls.__name__} has no feature that loads sources (give a feature a pattern)")

    # Everything is checked before anything is written: the file to continue from (a partial
    # file to resume, the target to append to) is only read until the checks have passed.
    base, action = _open_base(cls, path, partial, mode, resume)
    try:
        seen, work = _plan(declared, all_sources, base, report)
        if report.n_sources == 0:
            patterns = {n: f.pattern for n, f in declared.items()}
            raise SourceError(f"no source under {root} matches any feature of {cls.__name__} (patterns: {patterns})")
        # Dataset-wide parameters, learned once over every accepted source.
        prepared = _prepare(cls, declared, list(seen.values()), base, action)
    finally:
        if base is not None:
            base.close()

    # Start from the partial file (resume), a copy of the target (append), or nothing.
    if action != "resume":
        _discard(partial)  # a stale or damaged partial file: ours, never published
    try:
        if action == "append":
            _copy_file(path, partial)
        out = cls(partial, mode="a")
    except OSError as e:
        if _disk_failed(e):
            raise _disk_error(path, partial, e, report) from None
        raise
    try:
        out._learn(prepared)
    except BaseException as e:
        out.close()
        if _disk_failed(e):
            raise _disk_error(path, partial, e, report) from None
        raise
    bar = tqdm(total=len(work), unit="item", disable=not progress, dynamic_ncols=True,
               desc=f"h5store create {os.path.basename(path)}")
    if n_workers > 1 and work:
        # Starting workers takes seconds (each imports numpy, librosa...): say so, rather
        # than show 0% with an ETA computed from the start-up time.
        bar.set_postfix_str(f"starting {n_workers} workers", refresh=True)
    spool = _spool_folder(n_workers)
    # Features declared without dtype or shape (h5s.Array()): the first item stored fixes them.
    undeclared = sorted(n for n, f in prepared.items() if not f.is_fixed)
    try:
        last_commit = time.perf_counter()
        started = False
        for results, spooled in _run_parallel(prepared, _chunks(work, n_workers), n_workers, spool):
            if not started:
                started = True
                bar.reset(total=len(work))  # items/s and the ETA count from the first results
                bar.set_postfix_str("", refresh=False)
            t0 = time.perf_counter()
            good, sums = [], []
            for id, items, crcs, failed, seconds, said in results:
                report.load_seconds += seconds
                for w in said:
                    report._warn(w, id)
                if items is None:
                    src = str(seen[id])
                    report.failures.extend(Failure(id, n, t, m, src) for n, t, m in failed)
                else:
                    good.append((id, items))
                    sums.append(crcs)
            lost = spooled.check() if spooled is not None and good else None
            if lost is not None:
                # Checked before any id is added: a record is stored whole or not at all.
                report.failures.extend(Failure(id, "*", "SpoolError", lost, str(seen[id])) for id, _ in good)
                with contextlib.suppress(OSError):
                    os.unlink(spooled.path)  # type: ignore[union-attr]
                good = []
            if good and undeclared:
                good, sums = _fit_undeclared(out, prepared, undeclared, good, sums, seen, report)
            if good:
                with spooled.opened() if spooled is not None else contextlib.nullcontext() as packed:
                    out.group().extend(good, encoded=True, checksums=sums, packed=packed)
                report.n_stored += len(good)
            if time.perf_counter() - last_commit > _COMMIT_SECONDS:
                out.flush()
                last_commit = time.perf_counter()
            report.writer_seconds += time.perf_counter() - t0
            bar.update(len(results))
            if report.failures:
                bar.set_postfix(failed=len(report.failures), refresh=False)
        t0 = time.perf_counter()
        _store_failures(out, report.failures)
        out.close()
        if on_error == "raise" and report.failures:
            # Every source was tried, so the error lists them all; the good ones stay committed
            # in the partial file, and resume=True after fixing the bad ones loads only those.
            raise _raise_error(path, report)
        _fsync_file(partial)
        os.replace(partial, path)
        _fsync_dir(path)
        report.writer_seconds += time.perf_counter() - t0
    except BaseException as e:
        out.close()  # the partial file stays: resume=True continues from it
        if _disk_failed(e):
            raise _disk_error(path, partial, e, report) from None  # ... unless the disk refused it
        raise
    finally:
        bar.close()
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
    report.wall_seconds = time.perf_counter() - t_start
    if progress and report.warnings:
        for line in report.lines():
            if line.startswith("  warning"):
                tqdm.write(f"h5store create:{line[1:]}", file=sys.stderr)
    result = cls(path, mode="r")
    result.report = report  # type: ignore[attr-defined]
    return result


def _fit_undeclared(out: TypedFile, prepared: dict[str, Feature], names: list[str], good: list[tuple[str, dict[str, Any]]],
                    sums: list[dict[str, int]], seen: dict[str, Source],
                    report: IngestReport) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, int]]]:
    """Check the items of features declared without dtype or shape, in the parent.

    The first good item fixes the feature (its column is created and the file's schema
    records it); each later item must fit it (converted within its kind, as ``encode`` does),
    else its source fails with the message naming both shapes, and its record is not stored.
    The fixed feature replaces the open one in ``prepared``, so chunks dispatched afterwards
    are encoded (and spooled) by the workers with it. Returns the records to store.
    """
    kept, kept_sums = [], []
    for (id, items), crcs in zip(good, sums):
        fixing: dict[str, Feature] = {}
        try:
            for name in (n for n in names if n in items):
                feat = fixing.get(name) or prepared[name]
                if not feat.is_fixed:
                    feat = fixing[name] = feat.fixed_by(items[name])
                x = feat.encode(items[name])
                if x is not items[name]:
                    items[name] = x
                    crcs[name] = item_crc(feat.spec().layout, x)
        except SchemaError as e:
            report.failures.append(Failure(id, name, "SchemaError", str(e), str(seen[id])))
            continue
        if fixing:
            out.group().fix(fixing)
            prepared.update(fixing)  # same keys: a dispatch pickling it meanwhile sees old or new
        kept.append((id, items))
        kept_sums.append(crcs)
    return kept, kept_sums


def _disk_failed(e: BaseException) -> bool:
    """A write the OS refused: disk full, quota, I/O error, file too large."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG)


def _disk_error(path: str, partial: str, e: BaseException, report: IngestReport) -> WriteError:
    """The disk refused the partial file: remove it (it would keep the disk full, and it holds
    nothing published), and say so in one error naming the target."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(partial)
    code = getattr(e, "errno", None) or errno.EIO
    kept = f"{path} is unchanged" if os.path.exists(path) else f"no file was created at {path}"
    err = WriteError(code, f"{path}: {os.strerror(code)} while writing {partial}, so it was removed and nothing "
                     f"was published ({report.n_stored} new records had been added to it); {kept}. Free space "
                     "on that filesystem (a create needs room for the whole new file beside the old one) and run again")
    err.filename = path
    err.report = report  # type: ignore[attr-defined]
    return err


def _raise_error(path: str, report: IngestReport) -> SourceError:
    """on_error="raise": one error that lists every bad source (``.failures`` holds them)."""
    fails = report.failures
    lines = "\n".join(f"  {_shown(f.source)} [{f.feature}] {f.error}: {f.message}" for f in fails)
    err = SourceError(
        f"{len(fails)} of {report.n_sources} sources failed; {path} was not written "
        f"(fix them and run again with resume=True to load only what is missing):\n{lines}"
    )
    err.failures = list(fails)  # type: ignore[attr-defined]
    err.report = report  # type: ignore[attr-defined]
    return err


def _check_mode(mode: str | None, overwrite: bool) -> str | None:
    """The mode create() runs in: None (refuse an existing target), "w" or "a"."""
    if mode not in (None, "x", "w", "a"):
        raise ValueError(f'mode must be None, "w" (replace an existing file) or "a" (append to it), got {mode!r}')
    if overwrite:
        if mode == "a":
            raise ValueError('overwrite=True replaces the file, mode="a" appends to it: pass one of them')
        return "w"
    return None if mode == "x" else mode


def _plain_class(cls: type[TypedFile]) -> type[TypedFile]:
    """TypedFile itself (this layer may not import it): opens a file with the schema it stores."""
    return next(k for k in cls.__mro__ if k.__name__ == "TypedFile" and k.__module__ == "h5store.typed_file")


def _open_base(cls: type[TypedFile], path: str, partial: str, mode: str | None,
               resume: bool) -> tuple[TypedFile | None, str]:
    """The file a create continues from, open read-only, and how: ``"resume"`` (the partial
    file), ``"append"`` (the target, copied once the checks passed) or ``""`` (nothing).

    Refuses an existing target without a mode, and a target to append to that cannot be read:
    only a partial file damaged by a kill is ever started over, never the target.
    """
    plain = _plain_class(cls)
    damaged = ""
    if resume and os.path.exists(partial):
        try:
            return plain(partial, mode="r"), "resume"
        except LockedError:
            raise  # another create is writing it
        except (FormatError, OSError) as e:
            # Damaged by a kill before its first commit or mid-flush: it is rebuilt, from the
            # target when appending; the target itself is never started over.
            damaged = f" and its partial file cannot be resumed ({e}), so the run starts over"
    if os.path.isdir(path):
        raise TargetExistsError(f"{path} is a folder: give the path of the .h5 file to write")
    if not os.path.lexists(path):
        return None, ""
    if mode is None:
        raise TargetExistsError(
            f'{path} already exists{damaged}: pass mode="w" to replace it, or mode="a" to add the sources it '
            "does not hold yet"
        )
    if mode == "w":
        return None, ""
    try:
        return plain(path, mode="r"), "append"
    except LockedError:
        raise
    except (H5StoreError, OSError) as e:
        raise FormatError(
            f'{path}: cannot append: it is not a readable h5store file ({e}); it was left as it is '
            '(check it with `h5store verify`, or replace it with mode="w")'
        ) from None


def _plan(declared: dict[str, Feature], all_sources: list[Source], base: TypedFile | None,
          report: IngestReport) -> tuple[dict[str, Source], list[tuple[Source, list[str]]]]:
    """Which features load which source, dropping ids ``base`` holds already.

    Returns the sources that keep their id (by their id as given) and the work to load. A
    source whose name makes no valid id, and every source of an id more than one source has,
    go to ``report.failures`` instead; content features create ids, annotations (labels, CSV
    columns) only add to them, unless nothing else loads.
    """
    content = {n for n, f in declared.items() if not f.annotation} or set(declared)
    by_id: dict[str, list[tuple[Source, list[str]]]] = {}
    listed: set[tuple[str, str]] = set()
    for s in all_sources:
        names = [n for n, f in declared.items() if f.accepts(s)]
        if not content.intersection(names):
            continue
        again = (str(s), json.dumps(s.meta, sort_keys=True))
        if again in listed:
            continue  # the same file given twice (a folder and a glob over it): one source
        listed.add(again)
        report.n_sources += 1
        try:
            key = normalize_id(s.id)
        except ValueError as e:
            report.failures.append(Failure(s.id, "*", "InvalidIdError", f"{e}: rename the source", str(s)))
            continue
        by_id.setdefault(key, []).append((s, names))
    seen: dict[str, Source] = {}
    work: list[tuple[Source, list[str]]] = []
    for key, group in by_id.items():
        if base is not None and key in base:
            report.n_skipped += len(group)  # stored already: nothing is loaded
            seen.update((s.id, s) for s, _ in group)
            continue
        if len(group) > 1:
            # Storing any one of them would put that source's content under an id the others
            # name too: all are reported, none is stored, until all but one are renamed.
            for s, _ in group:
                others = ", ".join(_shown(str(o)) for o, _ in group if o is not s)
                report.failures.append(Failure(
                    key, "*", "DuplicateIdError", f"{_shown(str(s))} has the same id as {others}: none of them "
                    "is stored; rename or remove all but one", str(s)))
            continue
        seen[group[0][0].id] = group[0][0]
        work.append(group[0])
    return seen, work


def _prepare(cls: type[TypedFile], declared: dict[str, Feature], sources: list[Source], base: TypedFile | None,
             action: str) -> dict[str, Feature]:
    """Each declared feature's :meth:`~h5store.schema.Feature.prepare`; with a ``base`` file,
    first refuse a feature stored with other parameters than the class declares.

    Parameters that ``prepare`` learns (a label vocabulary, an ``sr=None`` audio rate) may
    differ, and ``pattern`` (which sources a feature takes, not how it computes an item).
    """
    stored = base.features if base is not None else {}
    out = {}
    for name, feat in declared.items():
        accepted = [s for s in sources if feat.accepts(s)]
        old = stored.get(name)
        if old is None:
            out[name] = feat.prepare(accepted, None)
            continue
        if old.type_name != feat.type_name:
            raise SchemaError(_refusal(base, action, name, f"was stored as {old.type_name}, "  # type: ignore[arg-type]
                                       f"{cls.__name__} declares {feat.type_name}"))
        mine, theirs = _plain_params(feat), _plain_params(old)
        own = [f.name for f in dataclasses.fields(feat) if f.name not in _BASE_FIELDS]
        diff = [k for k in own + sorted(_BASE_FIELDS) if k in mine and k in theirs and k != "pattern"
                and mine[k] != theirs[k]  # the class's own parameters first
                and not (k in ("dtype", "shape") and mine[k] is None)]  # undeclared: fixed by the stored items
        try:
            new = feat.prepare(accepted, old)
        except SchemaError:
            if not diff:
                raise
            new = None
        if new is not None:
            learned = _plain_params(new)
            diff = [k for k in diff if learned.get(k) == mine[k]]
        if diff:
            # The class's own parameters first: a base one (shape) often only follows from them.
            diff = [k for k in diff if k not in _BASE_FIELDS] or diff
            was = " and ".join(f"{k}={getattr(old, k)!r}" for k in diff)
            now = " and ".join(f"{k}={getattr(feat, k)!r}" for k in diff)
            raise SchemaError(_refusal(base, action, name, f"was stored with {was}, {cls.__name__} declares {now}"))  # type: ignore[arg-type]
        if not new.is_fixed and old.is_fixed:  # type: ignore[union-attr]
            if new.conflict(old.spec()):  # type: ignore[union-attr]
                raise SchemaError(_refusal(base, action, name, f"is stored as {old.describe_storage()}, "  # type: ignore[arg-type]
                                           f"{cls.__name__} declares {new.describe_storage()}"))  # type: ignore[union-attr]
            new = new.fixed_as(old.spec())  # type: ignore[union-attr]
        if not (new.is_fixed and old.is_fixed):  # type: ignore[union-attr]
            out[name] = new  # type: ignore[assignment]
            continue  # the stored feature awaits its first item too: the first stored fixes it
        a, b = old.spec(), new.spec()  # type: ignore[union-attr]
        if (a.dtype, a.shape, a.layout) != (b.dtype, b.shape, b.layout):
            raise SchemaError(_refusal(base, action, name, f"is stored as {a.dtype} {a.shape} ({a.layout}), "  # type: ignore[arg-type]
                                       f"{cls.__name__} declares {b.dtype} {b.shape} ({b.layout})"))
        out[name] = new  # type: ignore[assignment]
    return out


_BASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Feature))


def _plain_params(feat: Feature) -> dict[str, Any]:
    """``feat.params()`` as stored (JSON), so a tuple and the list it is read back as compare equal."""
    return json.loads(json.dumps(feat.params(), default=str))


def _refusal(base: TypedFile, action: str, name: str, what: str) -> str:
    if action == "resume":
        return (f"{base.path}: cannot resume: feature {name!r} {what}; resume with the parameters it was "
                "built with, or start over without resume=True")
    return (f"{base.path}: cannot append: feature {name!r} {what}; append with the stored parameters "
            'or create a new file (mode="w")')


def _discard(partial: str) -> None:
    """Remove a partial file and its rollback journal (which would not fit the next one)."""
    for p in (partial, journal_path(partial)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def _copy_file(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` (fsynced), or leave nothing when the copy fails (a full disk)."""
    tmp = dst + ".copying"
    try:
        shutil.copyfile(src, tmp)
        _fsync_file(tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def merge(cls: type[TypedFile], shards: Sequence[str | os.PathLike[str]], path: str | os.PathLike[str], *,
          overwrite: bool = False, block: int = 256, progress: bool = True) -> TypedFile:
    """Merge complete h5store files (e.g. shards built on different nodes) into one.

    Stored items are copied as they are, never decoded and loaded again. Ids must be unique
    across shards, and parameters learned at create (a label vocabulary) must agree, or the
    merged labels would silently mean different things: both raise. The result appears at
    ``path`` only when complete, like :func:`create`; a file already there is refused with
    :class:`~h5store.errors.TargetExistsError` unless ``overwrite=True``.

    Examples
    --------
    >>> f = merge(Speech, ["shard-0.h5", "shard-1.h5"], "speech.h5")  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    from h5store.errors import SchemaError

    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise TargetExistsError(f"{path} already exists: pass overwrite=True to replace it with the merged file")
    partial = _partial_path(path)
    _discard(partial)
    out = cls(partial, mode="w")
    failures: list[Failure] = []
    try:
        first: dict[str, Any] | None = None
        for shard in shards:
            with cls(shard) as src:
                feats = src.features
                params = {n: f.params() for n, f in feats.items()}
                if first is None:
                    first = params
                    out._learn(feats)
                elif params != first:
                    bad = sorted(n for n in params if params[n] != first.get(n))
                    raise SchemaError(f"{shard}: features {bad} were created with other parameters than {shards[0]}")
                g = src.group()
                cols = {n: g.store.columns[n] for n in feats if n in g.store.columns}  # not: no item yet
                n_ids = len(src)
                bar = tqdm(total=n_ids, unit="item", disable=not progress, desc=f"merge {os.path.basename(os.fspath(shard))}")
                for a in range(0, n_ids, block):
                    rows = np.arange(a, min(a + block, n_ids))
                    ids = [src.ids[int(r)] for r in rows]
                    records: list[tuple[str, dict[str, Any]]] = [(i, {}) for i in ids]
                    for name, col in cols.items():
                        have = rows[col.index[rows, 0] >= 0]
                        for r, item in zip(have.tolist(), col.read_items(have, verify=True)):
                            records[r - a][1][name] = item
                    out.group().extend(records, encoded=True)
                    bar.update(len(rows))
                bar.close()
                failures.extend(stored_failures(src))
        _store_failures(out, failures)
        out.close()
        _fsync_file(partial)
        os.replace(partial, path)
        _fsync_dir(path)
    except BaseException:
        out.close()
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    return cls(path, mode="r")
