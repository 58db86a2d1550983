"""Parallel create / append: joblib workers compute, the parent alone writes.

``Speech.create("speech.h5", sources="wavs/", n_workers=8)``:

1. **Sources** are expanded (a folder, recursively; a glob; a list of paths; CSV manifests)
   into :class:`~h5store.schema.Source` objects with stable ids: the path relative to the
   common root, without extension, ``/``-separated, sorted.
2. **Prepare**: each feature sees all the sources it accepts once, in the parent, and may
   learn dataset-wide parameters (a label vocabulary, a CSV table).
3. **Load**: sources go to worker processes in small chunks; each worker runs
   ``feature.encode(feature.load(source))`` for every feature that accepts the source.
   The workers are forked when ``create`` is called, before the scan (on Linux, in a
   single-threaded caller; else joblib runs them: :mod:`h5store.ingest_workers`). Results
   stream back *in order*, at most ``2 * n_workers`` chunks in flight, to the parent, the one
   writer, which appends them in large blocks.
4. **Publish**: everything is written to a temporary sibling ``.<name>.partial``, flushed
   and fsynced every few seconds (the resume point), and moved into place with
   ``os.replace`` only when complete; the directory is fsynced after. An interrupted
   create leaves the previous file at ``path`` untouched, and ``resume=True`` continues
   from the partial file, loading only the sources it does not hold yet. An existing file
   at ``path`` is replaced only with ``mode="w"`` and extended only with ``mode="a"``
   (after checking, before anything is written, that the declared features have the
   parameters they were stored with); without a mode it is refused.

A source whose load fails is not stored, the others are; failures come back in the
:class:`~h5store.ingest_report.IngestReport` and are stored in the file (``/_h5store/failures``, JSON).

A chosen joblib backend runs the workers instead, so the same create runs on a Dask or Ray
cluster (``with joblib.parallel_config(backend="dask"): Speech.create(...)``).

The parts: :mod:`h5store.sources` expands the sources, :mod:`h5store.ingest_workers` loads
them, :mod:`h5store.ingest_report` reports (and stores) what failed; this module plans,
writes and publishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
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
from h5store.ingest_report import Failure, IngestReport, shown, store_failures, stored_failures
from h5store.ingest_workers import ForkPool, chunk_work, run_parallel, spool_folder, start_workers
from h5store.journal import journal_path
from h5store.objstore import is_remote
from h5store.pio import fsync_dir, fsync_file
from h5store.publish import create_remote
from h5store.refs import normalize_id
from h5store.schema import Feature, Source
from h5store.sources import check_paths, expand_sources, source_id

if TYPE_CHECKING:
    from h5store.typed_file import TypedFile

__all__ = ["Failure", "IngestReport", "create", "expand_sources", "merge", "plan_sources", "source_id",
           "stored_failures"]

_COMMIT_SECONDS = 5.0


# ----------------------------------------------------------------------------- create
def _partial_path(path: str) -> str:
    d, name = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{name}.partial")



def create(cls: type[TypedFile], path: str | os.PathLike[str], sources: Any, *, n_workers: int | None = None,
           mode: str | None = None, overwrite: bool = False, resume: bool = False, on_error: str = "skip",
           progress: bool = True, root: str | None = None,
           prepared: dict[str, Feature] | None = None,
           storage_options: dict[str, Any] | None = None) -> TypedFile:
    """Build (or extend) a file from raw sources in parallel.

    Parameters
    ----------
    cls : TypedFile subclass
        The schema; features with a ``pattern`` are filled from the sources they accept.
    path : str or Path
        The file to create. It appears only when complete. A symlink is followed: the file it
        points to is the one created, replaced or extended, and the link stays. An
        ``s3://bucket/key`` URL is built in a temporary folder (``TMPDIR``) and uploaded,
        appearing only when whole (:func:`h5store.publish.create_remote`; ``mode="a"`` and
        ``resume`` are refused there).
    sources : str, Path or list
        A folder (recursive), a glob, CSV manifests, paths, or a list of these.
    n_workers : int, optional
        Worker processes (default: all cores); 1 loads in this process. On Linux they are
        forked at once, before the sources are scanned; where that is unsafe (other threads
        running here) or a joblib backend was chosen (Dask, Ray), joblib runs them.
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
    prepared : dict, optional
        The declared features already prepared (``Feature.prepare``) over a larger set of
        sources: a sharded create (:mod:`h5store.shards`) prepares once over all its
        sources, so every shard stores the same label vocabulary. Default: prepared here.
    storage_options : dict, optional
        An ``s3://`` target's s3fs arguments (``endpoint_url``, ``key``...), over the
        ``AWS_*`` environment (``docs/remote.md``).

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
    if is_remote(path):  # built locally, then uploaded whole (h5store.publish)
        return create_remote(cls, path, lambda local: create(cls, local, sources, n_workers=n_workers, root=root,
                                                             on_error=on_error, progress=progress,
                                                             prepared=prepared),
                             mode=mode, resume=resume, storage_options=storage_options)
    if storage_options is not None:
        raise TypeError(f"{path}: storage_options apply to s3:// targets only")
    if os.path.islink(path):
        # Publish where the link points (and build beside it): replacing the link itself
        # would leave the file it names stale and turn the link into a file of its own.
        path = os.path.realpath(path)
    n_workers = n_workers or len(os.sched_getaffinity(0))
    check_paths(sources)  # values in memory are not sources: the message says to extend()
    declared = {n: f for n, f in cls.schema.groups[""].items() if f.pattern is not None or type(f).accepts is not Feature.accepts}
    if not declared:
        raise SourceError(f"{cls.__name__} has no feature that loads sources (give a feature a pattern)")
    # The workers start first, forked before any file is opened (they inherit no writer's
    # descriptor) and before the bar's monitor thread: they are ready when the scan is done.
    pool = start_workers(n_workers)
    bar = tqdm(total=None, unit="item", disable=not progress, dynamic_ncols=True,
               desc=f"h5store create {os.path.basename(path)}")
    bar.set_postfix_str("scanning sources", refresh=True)  # the first line, at once
    report = IngestReport()
    try:
        out, work, seen, prepared, partial = _begin(cls, path, sources, mode, resume, root, declared, report,
                                                     prepared)
        bar.reset(total=len(work))
        if work and n_workers > 1 and pool is None:
            # joblib's workers start now (fresh interpreters importing numpy, h5py, the
            # features' modules): say so, rather than show 0% with an ETA from the start-up.
            bar.set_postfix_str(f"starting {n_workers} workers", refresh=True)
        else:
            bar.set_postfix_str("", refresh=True)
        _fill(out, work, seen, prepared, report, n_workers, pool, bar, path, partial, on_error)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
    report.wall_seconds = time.perf_counter() - t_start
    if progress and report.warnings:
        for line in report.lines():
            if line.startswith("  warning"):
                tqdm.write(f"h5store create:{line[1:]}", file=sys.stderr)
    result = cls(path, mode="r")
    result.report = report  # type: ignore[attr-defined]
    return result


def plan_sources(cls: type[TypedFile], sources: Any, root: str | None = None,
                 ) -> tuple[list[list[Source]], str, dict[str, Feature]]:
    """The sources of a create grouped by id, in the order a create stores them, with their
    common root and the declared features prepared over them once (a sharded create's plan).

    Each group holds the sources of one id (more than one: a duplicate id, which the create
    of the group's shard reports). Only sources a content feature accepts are kept, as
    :func:`create` does; ``prepare`` sees the sources it would see (duplicates and invalid
    ids left out), so every shard gets the parameters an unsharded create learns.

    Examples
    --------
    >>> groups, root, prepared = plan_sources(Speech, "wavs/")  # doctest: +SKIP
    >>> [s.id for s in groups[0]], sorted(prepared)  # doctest: +SKIP
    (['spk1/utt-001'], ['label', 'mel'])
    """
    check_paths(sources)
    declared = {n: f for n, f in cls.schema.groups[""].items() if f.pattern is not None or type(f).accepts is not Feature.accepts}
    if not declared:
        raise SourceError(f"{cls.__name__} has no feature that loads sources (give a feature a pattern)")
    all_sources, root = expand_sources(sources, root)
    report = IngestReport()
    seen, _ = _plan(declared, all_sources, None, report)
    if report.n_sources == 0:
        patterns = {n: f.pattern for n, f in declared.items()}
        raise SourceError(f"no source under {root} matches any feature of {cls.__name__} (patterns: {patterns})")
    prepared = _prepare(cls, declared, list(seen.values()), None, "")
    content = {n for n, f in declared.items() if not f.annotation} or set(declared)
    groups: dict[str, list[Source]] = {}
    for s in all_sources:
        if content.intersection(n for n, f in declared.items() if f.accepts(s)):
            try:
                key = normalize_id(s.id)
            except ValueError:
                key = s.id  # reported by its shard's create
            groups.setdefault(key, []).append(s)
    return list(groups.values()), root, prepared


def _begin(cls: type[TypedFile], path: str, sources: Any, mode: str | None, resume: bool, root: str | None,
           declared: dict[str, Feature], report: IngestReport,
           given: dict[str, Feature] | None = None) -> tuple[Any, list[tuple[Source, list[str]]],
                                                             dict[str, Source], dict[str, Feature], str]:
    """Scan, plan, prepare, check; then open the partial file to fill (``create``'s first half).

    Returns the open partial file, the work (sources to load and their features), the
    sources by id, the prepared features and the partial file's path.
    """
    partial = _partial_path(path)
    all_sources, root = expand_sources(sources, root)
    # Everything is checked before anything is written: the file to continue from (a partial
    # file to resume, the target to append to) is only read until the checks have passed.
    base, action = _open_base(cls, path, partial, mode, resume)
    try:
        seen, work = _plan(declared, all_sources, base, report)
        if report.n_sources == 0:
            patterns = {n: f.pattern for n, f in declared.items()}
            raise SourceError(f"no source under {root} matches any feature of {cls.__name__} (patterns: {patterns})")
        # Dataset-wide parameters, learned once over every accepted source.
        if given is None:
            prepared = _prepare(cls, declared, list(seen.values()), base, action)
        else:  # prepared once over every shard's sources (h5store.shards)
            prepared = {n: given[n] for n in declared}
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
    return out, work, seen, prepared, partial


def _fill(out: TypedFile, work: list[tuple[Source, list[str]]], seen: dict[str, Source], prepared: dict[str, Feature],
          report: IngestReport, n_workers: int, pool: ForkPool | None, bar: Any, path: str, partial: str,
          on_error: str) -> None:
    """Load ``work`` in the workers, write their results, publish (``create``'s second half)."""
    spool = spool_folder(n_workers, pool)
    # Features declared without dtype or shape (h5s.Array()): the first item stored fixes them.
    undeclared = sorted(n for n, f in prepared.items() if not f.is_fixed)
    try:
        last_commit = time.perf_counter()
        started = False
        for results, spooled in run_parallel(prepared, chunk_work(work, n_workers), n_workers, spool, pool):
            if not started:
                started = True
                if pool is None and n_workers > 1:
                    bar.reset(total=len(work))  # items/s and the ETA count from the first results
                    bar.set_postfix_str("", refresh=False)
            t0, c0 = time.perf_counter(), time.thread_time()
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
            report.writer_cpu_seconds += time.thread_time() - c0
            bar.update(len(results))
            if report.failures:
                bar.set_postfix(failed=len(report.failures), refresh=False)
        if pool is not None:
            pool.close()  # before the file closes: no worker outlives the writer's descriptors
        t0, c0 = time.perf_counter(), time.thread_time()
        store_failures(out, report.failures)
        out.close()
        if on_error == "raise" and report.failures:
            # Every source was tried, so the error lists them all; the good ones stay committed
            # in the partial file, and resume=True after fixing the bad ones loads only those.
            raise _raise_error(path, report)
        fsync_file(partial)
        os.replace(partial, path)
        fsync_dir(path)
        report.writer_seconds += time.perf_counter() - t0
        report.writer_cpu_seconds += time.thread_time() - c0
    except BaseException as e:
        out.close()  # the partial file stays: resume=True continues from it
        if _disk_failed(e):
            raise _disk_error(path, partial, e, report) from None  # ... unless the disk refused it
        raise
    finally:
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)


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
    lines = "\n".join(f"  {shown(f.source)} [{f.feature}] {f.error}: {f.message}" for f in fails)
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
                others = ", ".join(shown(str(o)) for o, _ in group if o is not s)
                report.failures.append(Failure(
                    key, "*", "DuplicateIdError", f"{shown(str(s))} has the same id as {others}: none of them "
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
        fsync_file(tmp)
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
        store_failures(out, failures)
        out.close()
        fsync_file(partial)
        os.replace(partial, path)
        fsync_dir(path)
    except BaseException:
        out.close()
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    return cls(path, mode="r")
