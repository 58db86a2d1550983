"""Datasets as shards: several complete h5store files plus a manifest, built in parallel
(on a Dask cluster: each worker writes whole shards) and opened as one dataset.

``Speech.create("speech", sources="wavs/", shard_size=10_000)`` makes a folder::

    speech/index.json                 the manifest, written last
    speech/shard-00000-of-00004.h5    ordinary h5store files (h5py reads each one)
    ...

The layout is the one LitData and MosaicML Streaming users know (a folder holding
``index.json`` and its shards, moved or uploaded as one unit), with Hugging Face's
``-00000-of-00004`` names, which say at a glance whether a shard is missing.

1. **Plan** (in the caller): the sources are expanded and grouped by id, in the order an
   unsharded create stores them (sorted ids); the features are prepared once over all of
   them (a label vocabulary is the same in every shard); the ids are cut into contiguous
   runs of ``shard_size`` ids.
2. **Build**: each shard is an ordinary :func:`~h5store.ingest.create` of its sources (one
   process, no writer to funnel through), written to a partial file beside its final name
   and renamed into place when complete. On Dask (an active ``dask.distributed.Client``,
   or ``joblib.parallel_config(backend="dask")``) the cluster's workers run them, each
   writing its shards itself to the shared folder; else a local process pool does.
3. **Record**: as each shard completes, the caller records it (file, id range, item count,
   byte size, CRC-32 of its bytes, schema hash) in a draft (``.index.draft.json``); once
   all are done, ``index.json`` is written atomically (temp file, fsync, rename, fsync of
   the folder), so a reader never sees a manifest naming a missing shard.
4. **Resume**: ``resume=True`` keeps every shard the draft records whose size and CRC-32
   still match, and builds the others again (a shard killed midway continues from its own
   partial file).

:func:`open_sharded` (``h5s.open(folder)``) checks the manifest against the files (each
shard present, of its recorded size, of the recorded schema hash) and returns a
:class:`ShardedDataset`: one dataset (ids, items by id, features, ``serve`` /
``iter_batches`` / ``to_tf_dataset``), a :class:`~h5store.serving.MultiFile` whose ids are
unique across its shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from h5store import publish
from h5store.errors import FormatError, H5StoreError, RemoteError, SchemaError, TargetExistsError
from h5store.handle import REMOTE_OPTIONS
from h5store.ingest import IngestReport, create, plan_sources
from h5store.objstore import RemoteObject, is_remote, register, split_url
from h5store.pio import fsync_dir
from h5store.schema import Feature, Source
from h5store.serving.files import release_kept
from h5store.serving.multifile import MultiFile, schema_hash

if TYPE_CHECKING:
    from h5store.typed_file import TypedFile

__all__ = ["MANIFEST", "ShardedDataset", "ShardedVerifyReport", "create_sharded", "create_sharded_remote",
           "dataset_urls", "file_crc32", "is_sharded", "open_sharded", "push_sharded", "read_manifest",
           "verify_sharded"]

MANIFEST = "index.json"
_DRAFT = ".index.draft.json"
_FORMAT = "h5store-shards"
_VERSION = 1
_CRC_BLOCK = 8 << 20


# ----------------------------------------------------------------------------- small parts
def file_crc32(path: str) -> int:
    """CRC-32 (zlib's, the items' checksum) of a whole file, read in 8 MiB blocks.

    About 1 GB/s per core on this machine's page cache: a 1 GB shard costs ~1 s in the
    worker that wrote it (its bytes are still cached), and again on ``resume=True``.

    Examples
    --------
    >>> "%08x" % file_crc32("speech/shard-00000-of-00004.h5")  # doctest: +SKIP
    '9a3c01fe'
    """
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def shard_name(k: int, n: int) -> str:
    """``shard-00003-of-00016.h5``."""
    return f"shard-{k:05d}-of-{n:05d}.h5"


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync of the folder."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path)


def _folder(path: str) -> str:
    """The dataset's folder from its folder or its manifest's path."""
    return os.path.dirname(path) if os.path.basename(path) == MANIFEST else path


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded dataset: its folder (holding ``index.json``) or that manifest
    (an ``s3://`` one: its URL ending in ``/index.json`` or ``/``).

    Examples
    --------
    >>> is_sharded("speech/"), is_sharded("speech/index.json"), is_sharded("speech.h5")  # doctest: +SKIP
    (True, True, False)
    >>> is_sharded("s3://bucket/speech/index.json"), is_sharded("s3://bucket/speech.h5")
    (True, False)
    """
    p = os.fspath(path)
    if is_remote(p):
        return p.endswith("/") or p.rsplit("/", 1)[-1] == MANIFEST
    if os.path.isdir(p):
        return os.path.isfile(os.path.join(p, MANIFEST))
    return os.path.basename(p) == MANIFEST


# ----------------------------------------------------------------------------- build
def create_sharded(cls: type[TypedFile], path: str | os.PathLike[str], sources: Any, *,
                   shard_size: int | None = None, shards: int | None = None, n_workers: int | None = None,
                   mode: str | None = None, overwrite: bool = False, resume: bool = False,
                   on_error: str = "skip", progress: bool = True, root: str | None = None,
                   shard_processes: bool = False, storage_options: dict[str, Any] | None = None) -> ShardedDataset:
    """Build a sharded dataset: a folder of complete h5store files and its ``index.json``.

    Called by ``Speech.create(path, sources, shard_size=...)`` (or ``shards=``).

    Parameters
    ----------
    cls : TypedFile subclass
        The schema. On Dask it is pickled to the workers: by reference when it is defined in
        a module they can import, by value (cloudpickle) when it is defined in ``__main__``.
    path : str or Path
        The folder to create (it holds ``index.json`` and ``shard-KKKKK-of-NNNNN.h5``).
    sources : str, Path or list
        As for :func:`~h5store.ingest.create`.
    shard_size : int, optional
        Ids per shard (the last shard holds the rest).
    shards : int, optional
        Number of shards (ids split as evenly as contiguous runs allow). One of the two.
    n_workers : int, optional
        Without Dask: the worker processes of each shard's create, the shards built one
        after another (default: all cores), as an unsharded create's; with
        ``shard_processes=True``, the number of shards built at once, one process each. On
        Dask, the cluster's workers decide (each shard is built in one worker).
    shard_processes : bool
        Without Dask, build shards in parallel processes (loky; one per shard at a time)
        rather than one after another with ``n_workers`` forked workers each. Measured on 2
        cores (``benchmarks/bench_shards.py``): one after another is as fast at best and
        steadier (fresh interpreters start for the processes), hence the default.
    mode, overwrite
        As for create: an existing dataset at ``path`` is refused unless ``mode="w"``
        (``overwrite=True``); appending to a sharded dataset (``mode="a"``) is not supported.
        Replacing keeps the old dataset whole, and opening, until the new manifest replaces
        it in one rename (a replacement killed or failed midway leaves the old one as it was;
        ``resume=True`` finishes it); then the old shards go. The new shards are named
        ``shard-KKKKK-of-NNNNN.<tag>.h5``, a tag of this build's own, so that no new shard
        ever takes an old shard's name. Onto ``s3://`` likewise (:func:`push_sharded`).
    resume : bool
        Keep the shards the draft manifest records as complete (size and CRC-32 checked
        again) and build the others; a shard killed midway continues from its partial file.
    on_error : {"skip", "raise"}
        As for create, per shard; with "raise" a failed source stops its shard (and the
        manifest is not written: fix and resume).
    progress : bool
        A bar of shards done.
    root : str, optional
        The folder ids are relative to.
    storage_options : dict, optional
        An ``s3://`` target's s3fs arguments (``endpoint_url``, ``key``...), over the
        ``AWS_*`` environment.

    Returns
    -------
    ShardedDataset
        The dataset, open read-only, with the shards' reports merged as ``.report`` (and,
        onto ``s3://``, the upload's :class:`~h5store.publish.ShardedUpload` as ``.upload``).

    Notes
    -----
    An ``s3://bucket/prefix`` target (or ``s3://bucket/prefix/index.json``) is built as a
    local folder in ``TMPDIR``, then uploaded shard by shard with ``index.json`` last, and
    returned open from the store (:func:`create_sharded_remote`); an existing
    dataset there is replaced only with ``mode="w"``, ``resume=True`` is refused, and a build
    whose upload failed is kept in ``TMPDIR`` for ``h5store push FOLDER URL``.

    Examples
    --------
    >>> ds = Speech.create("speech", sources="wavs/", shard_size=5000)  # doctest: +SKIP
    >>> with joblib.parallel_config(backend="dask"):  # doctest: +SKIP
    ...     ds = Speech.create("speech", sources="wavs/", shards=16, resume=True)
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    if mode not in (None, "x", "w"):
        raise ValueError(f'a sharded create takes mode=None or "w" (replace), got {mode!r}: shards are not '
                         "appended to; create a new sharded dataset and concat both (h5s.concat)")
    replace = overwrite or mode == "w"
    if (shard_size is None) == (shards is None):
        raise ValueError("give one of shard_size= (ids per shard) or shards= (number of shards)")
    count = shard_size if shard_size is not None else shards
    if isinstance(count, bool) or int(count) < 1:  # type: ignore[arg-type]
        raise ValueError(f"shard_size and shards must be ints >= 1, got {count!r}")
    if is_remote(os.fspath(path)):  # built in TMPDIR, then uploaded: the shards first, index.json last
        kw: dict[str, Any] = dict(shard_size=shard_size, shards=shards, n_workers=n_workers, on_error=on_error,
                                  progress=progress, root=root, shard_processes=shard_processes)
        return create_sharded_remote(os.fspath(path), lambda local: create_sharded(cls, local, sources, **kw),
                                     mode=mode, overwrite=overwrite, resume=resume, storage_options=storage_options,
                                     opener=cls)  # type: ignore[no-any-return]
    if storage_options is not None:
        raise TypeError(f"{path}: storage_options apply to s3:// targets only")
    folder = os.path.abspath(os.fspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise TargetExistsError(f"{folder} is a file: a sharded dataset is a folder; give a new folder's path")
    manifest_path = os.path.join(folder, MANIFEST)
    if os.path.exists(manifest_path) and not replace:
        raise TargetExistsError(f'{folder} already holds a sharded dataset: pass mode="w" to replace it')

    groups, root, prepared = plan_sources(cls, sources, root)
    per = int(shard_size) if shard_size is not None else math.ceil(len(groups) / int(shards))  # type: ignore[arg-type]
    n = math.ceil(len(groups) / per)
    plan = []
    for k in range(n):
        part = groups[k * per : (k + 1) * per]
        plan.append((shard_name(k, n), [s for g in part for s in g], part[0][0].id, part[-1][0].id))
    plan_key = [[name, len(srcs), first, last] for name, srcs, first, last in plan]
    os.makedirs(folder, exist_ok=True)
    old: Any = None
    if os.path.exists(manifest_path):
        try:
            old = read_manifest(manifest_path, check=False)
        except FormatError:
            old = {}  # unreadable: replaced all the same
    draft_path = os.path.join(folder, _DRAFT)
    done, token, tagged = _kept_shards(folder, draft_path, plan_key, prepared) if resume else ({}, "", False)
    # This build's shards are written under hidden names of their own (".<token>.shard-..."),
    # and renamed to their final names here, once recorded: a task that Dask runs again
    # (its worker died after the result was fetched) never rewrites a published shard.
    token = token or uuid.uuid4().hex[:12]
    # Replacing: the old manifest and its shards stay whole until the new manifest replaces
    # them (one rename), so a replacement killed or failed at any point leaves the old dataset
    # opening as before. The new shards take names of this build's own
    # ("shard-00000-of-00002.<token>.h5"), which no old shard has.
    tagged = tagged or old is not None
    published = {name: _upload_name(name, token) if tagged else name for name, *_ in plan}
    # The replaced dataset's shard names, kept in the draft: once the new manifest is in place
    # (at once, or after a resume), the old shards it does not name are removed.
    replaces = {str(e.get("file")) for e in (old or {}).get("shards", []) if isinstance(e, dict)}
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        with open(draft_path) as f:
            replaces.update(str(x) for x in json.load(f).get("replaces", []))
    draft = {"format": _FORMAT, "version": _VERSION, "plan": plan_key, "params": _params(prepared),
             "token": token, "tagged": tagged, "replaces": sorted(replaces), "done": done}
    _write_json(draft_path, draft)

    todo = [(name, srcs) for name, srcs, _, _ in plan if published[name] not in done]
    bar = tqdm(total=n, initial=n - len(todo), unit="shard", disable=not progress, desc=f"h5store create {folder}")
    reports: dict[str, IngestReport] = {}
    try:
        for entry, report in _build_all(cls, folder, token, todo, root, prepared, resume, on_error, n_workers,
                                        shard_processes):
            hidden = os.path.join(folder, _hidden(token, entry["file"]))
            entry["file"] = published[entry["file"]]
            os.replace(hidden, os.path.join(folder, entry["file"]))
            fsync_dir(os.path.join(folder, entry["file"]))
            done[entry["file"]] = entry
            reports[entry["file"]] = report
            _write_json(draft_path, draft)  # the resume point: this shard is complete
            bar.update(1)
    finally:
        bar.close()

    entries = [done[published[name]] for name, *_ in plan]
    hashes = {e["schema_hash"] for e in entries}
    if len(hashes) > 1:
        first = entries[0]
        odd = next(e for e in entries if e["schema_hash"] != first["schema_hash"])
        raise SchemaError(f"{os.path.join(folder, odd['file'])}: its schema differs from "
                          f"{os.path.join(folder, first['file'])} (a feature declared without dtype or shape was fixed "
                          "differently by its first item?); declare the feature's dtype and shape and create again")
    manifest = {"format": _FORMAT, "version": _VERSION, "schema_hash": entries[0]["schema_hash"],
                "class": cls.__name__, "items": sum(e["items"] for e in entries), "checksum": "crc32",
                "shards": [{k: e[k] for k in ("file", "first", "last", "items", "bytes", "crc32")} for e in entries]}
    _write_json(manifest_path, manifest)  # last: every shard it names is in place
    os.unlink(draft_path)
    fsync_dir(draft_path)
    for leftover in os.listdir(folder):  # shards of killed runs or of tasks run twice, never published
        if leftover.startswith(".") and ".shard-" in leftover:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, leftover))
    keep = {e["file"] for e in entries}
    for name in replaces - keep:  # a replaced dataset's shards that the new one does not name
        if name.startswith("shard-") and "/" not in name and "\\" not in name:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
    result = open_sharded(folder, opener=cls)
    result.report = _merged([reports[published[name]] for name, *_ in plan if published[name] in reports],
                            time.perf_counter() - t0)
    return result


def _params(prepared: dict[str, Feature]) -> str:
    """The prepared features' parameters as one string (what a resumed build must share)."""
    return json.dumps({n: f.params() for n, f in sorted(prepared.items())}, sort_keys=True, default=str)


def _kept_shards(folder: str, draft_path: str, plan_key: list[list[Any]],
                 prepared: dict[str, Feature]) -> tuple[dict[str, dict[str, Any]], str, bool]:
    """The shards a previous run completed that are still intact, by file name, its token
    (whose partial files the shards still to build continue from), and whether its shards
    take names tagged with that token (it was replacing a dataset).

    A draft of another plan (other sources, another shard size) or other prepared
    parameters (a vocabulary that grew) keeps nothing: every shard is built again.
    """
    try:
        with open(draft_path) as f:
            draft = json.load(f)
    except (OSError, ValueError):
        return {}, "", False
    if not isinstance(draft, dict) or draft.get("plan") != plan_key or draft.get("params") != _params(prepared):
        return {}, "", False
    kept = {}
    for name, entry in draft.get("done", {}).items():
        p = os.path.join(folder, name)
        try:
            intact = os.path.getsize(p) == entry["bytes"] and file_crc32(p) == int(entry["crc32"], 16)
        except (OSError, KeyError, TypeError, ValueError):
            intact = False
        if intact:
            kept[name] = entry
    token = draft.get("token")
    if not (isinstance(token, str) and token.isalnum()):
        return kept, "", False
    return kept, token, draft.get("tagged") is True


def _hidden(token: str, name: str) -> str:
    """Where a build writes a shard before the caller publishes it under ``name``."""
    return f".{token}.{name}"


def build_shard(cls: type[TypedFile], folder: str, name: str, token: str, sources: list[Source], root: str,
                prepared: dict[str, Feature], resume: bool, on_error: str,
                n_workers: int = 1) -> tuple[dict[str, Any], IngestReport]:
    """Build one shard (in a Dask worker or a pool process): an ordinary create of its sources
    in this process, to ``folder/.<token>.<name>`` (the caller renames it to ``name`` once
    recorded), then its manifest entry (id range, count, size, CRC-32, schema hash).

    Examples
    --------
    >>> entry, report = build_shard(Speech, "ds", "shard-00000-of-00001.h5", "3fa2", srcs, root, prepared,
    ...                             False, "skip")  # doctest: +SKIP
    """
    target = os.path.join(folder, _hidden(token, name))
    f = create(cls, target, sources, n_workers=n_workers, mode="w", resume=resume, on_error=on_error, progress=False,
               root=root, prepared=prepared)
    try:
        n = len(f)
        entry = {"file": name, "items": n, "first": f.ids[0] if n else None,
                 "last": f.ids[n - 1] if n else None, "schema_hash": schema_hash(f.file_schema)}
        report = f.report  # type: ignore[attr-defined]
    finally:
        f.close()
    entry["bytes"] = os.path.getsize(target)
    entry["crc32"] = f"{file_crc32(target):08x}"
    return entry, report


def _dask_client() -> Any:
    """The Dask client shards run on: joblib's dask backend's, or the active one; else None."""
    import sys

    if "distributed" not in sys.modules:
        return None
    if "joblib" in sys.modules:
        import joblib.parallel

        backend, _ = joblib.parallel.get_active_backend()
        client = getattr(backend, "client", None)
        if client is not None:
            return client
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        return None


def _build_all(cls: type[TypedFile], folder: str, token: str, todo: list[tuple[str, list[Source]]], root: str,
               prepared: dict[str, Feature], resume: bool, on_error: str,
               n_workers: int | None, processes: bool) -> Iterator[tuple[dict[str, Any], IngestReport]]:
    """Build the shards of ``todo``, yielding each one's entry and report as it completes."""
    if not todo:
        return
    args = [(cls, folder, name, token, srcs, root, prepared, resume, on_error) for name, srcs in todo]
    client = _dask_client()
    if client is not None:
        from distributed import as_completed

        # Each worker writes whole shards to the shared folder; a worker that dies is
        # replaced and its shard run again by the scheduler (the create resumes its partial file).
        futures = [client.submit(build_shard, *a, pure=False) for a in args]
        pending = as_completed(futures)
        del futures
        for fut in pending:
            result = fut.result()
            fut.release()  # no longer wanted: the scheduler does not run it again if its worker dies
            yield result
        return
    n = n_workers or len(os.sched_getaffinity(0))
    if not processes or n <= 1 or len(args) == 1:
        for a in args:  # one after another, each with the forked workers of an ordinary create
            yield build_shard(*a, n_workers=n)
        return
    n = min(n, len(args))
    import joblib

    par = joblib.Parallel(n_jobs=n, return_as="generator_unordered", backend="loky")
    yield from par(joblib.delayed(build_shard)(*a) for a in args)


def _merged(reports: Sequence[IngestReport], wall: float) -> IngestReport:
    out = IngestReport(wall_seconds=wall)
    for r in reports:
        out.n_sources += r.n_sources
        out.n_stored += r.n_stored
        out.n_skipped += r.n_skipped
        out.failures.extend(r.failures)
        out.warnings.extend(r.warnings)
        out.writer_seconds += r.writer_seconds
        out.load_seconds += r.load_seconds
        out.writer_cpu_seconds += r.writer_cpu_seconds
    return out


# ----------------------------------------------------------------------------- in object storage
def dataset_urls(url: str) -> tuple[str, str]:
    """``(folder URL, manifest URL)`` of a sharded dataset in a store, from either.

    Examples
    --------
    >>> dataset_urls("s3://bucket/speech")
    ('s3://bucket/speech', 's3://bucket/speech/index.json')
    >>> dataset_urls("s3://bucket/speech/index.json")
    ('s3://bucket/speech', 's3://bucket/speech/index.json')
    """
    if not is_remote(url):
        raise ValueError(f"{url}: not an object URL; write s3://BUCKET/PREFIX")
    folder = url.rstrip("/")
    if folder.rsplit("/", 1)[-1] == MANIFEST:
        folder = folder.rsplit("/", 1)[0]
    manifest = f"{folder}/{MANIFEST}"
    split_url(manifest)  # a bucket
    return folder, manifest


def _local_shards(path: str, deep: bool, files: bool = True) -> tuple[str, str, dict[str, Any]]:
    """The folder, manifest path and manifest of a local sharded dataset, every shard checked
    against it (present, its size; with ``deep`` its CRC-32) and, with ``files``, as a file
    (:func:`h5store.publish.push`'s check)."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    manifest_path = os.path.join(folder, MANIFEST)
    manifest = read_manifest(manifest_path)
    for e in manifest["shards"]:
        p = os.path.join(folder, e["file"])
        if not os.path.isfile(p):
            raise FormatError(f"{p}: missing ({manifest_path} lists it); not uploaded")
        if os.path.getsize(p) != e["bytes"]:
            raise FormatError(f"{p}: {os.path.getsize(p)} bytes, {manifest_path} records {e['bytes']}; not uploaded")
        if deep and e.get("crc32") is not None and file_crc32(p) != int(e["crc32"], 16):
            raise FormatError(f"{p}: its bytes' CRC-32 is not the manifest's: the shard was changed or damaged; "
                              "not uploaded")
        if files:
            publish._check_local(p, deep)
    return folder, manifest_path, manifest


_TAGGED = re.compile(r"(shard-\d+-of-\d+)\.[0-9a-f]+(\.h5)")


def _upload_name(name: str, tag: str) -> str:
    """A shard's name for one build or upload: ``shard-00000-of-00004.<tag>.h5`` (a name that
    carries another build's tag, as a replaced local folder's shards do, takes this one's)."""
    m = _TAGGED.fullmatch(name)
    if m:
        return f"{m.group(1)}.{tag}{m.group(2)}"
    stem, dot, ext = name.rpartition(".")
    return f"{stem}.{tag}.{ext}" if dot else f"{name}.{tag}"


def _send_sharded(folder: str, manifest_path: str, manifest: dict[str, Any], url: str, overwrite: bool,
                  how: str, part_bytes: int, concurrency: int, storage_options: dict[str, Any] | None,
                  timeout: float, retries: int) -> publish.ShardedUpload:
    """Upload a checked local sharded dataset: the shards under names of this upload's own, then
    ``index.json`` naming them.

    Each upload's shards get a tag of their own (``shard-00000-of-00004.<tag>.h5``): two
    uploads to one URL never write the same key, so a second publisher cannot replace the
    shards a first one's manifest names, and a replacement leaves the old dataset whole (its
    manifest and shards) until the new manifest replaces the old in one PUT. Then the old
    shards go. An upload that fails, or finds that another was published first, removes its own
    shards (best effort: an orphan shard is never named by a manifest).
    """
    t0 = time.perf_counter()
    prefix, murl = dataset_urls(url)
    mobj = publish._remote(murl, storage_options, timeout, retries)
    publish._target(murl, overwrite, mobj, how)
    old: set[str] = set()
    if mobj._head is not None:  # replacing a dataset (overwrite): its shards go once the new manifest is up
        with contextlib.suppress(RemoteError, FormatError, ValueError, TypeError, AttributeError):
            old = {str(e.get("file")) for e in read_manifest(murl, check=False,
                                                             storage_options=storage_options).get("shards", [])
                   if isinstance(e, dict)}
    tag = uuid.uuid4().hex[:10]
    named = {e["file"]: _upload_name(e["file"], tag) for e in manifest["shards"]}
    sent: list[str] = []
    uploads = []
    try:
        for e in manifest["shards"]:
            shard = publish._remote(f"{prefix}/{named[e['file']]}", storage_options, timeout, retries)
            sent.append(named[e["file"]])
            uploads.append(publish._upload(os.path.join(folder, e["file"]), shard, part_bytes, concurrency,
                                           if_absent=True))
        remote = dict(manifest, shards=[dict(e, file=named[e["file"]]) for e in manifest["shards"]])
        fd, tmp = tempfile.mkstemp(prefix=".h5store-manifest-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(remote, fh, indent=1)
            # Last: every shard it names is there (S3 is strongly consistent: a reader that
            # sees the manifest sees the shards). Replacing, one PUT swaps old for new.
            uploads.append(publish._upload(tmp, mobj, part_bytes, concurrency, if_absent=not overwrite))
        finally:
            os.unlink(tmp)
    except BaseException:
        for name in sent:  # this upload's shards, never named by a published manifest
            with contextlib.suppress(Exception):
                publish._delete(publish._remote(f"{prefix}/{name}", storage_options, timeout, retries),
                                "removing a shard of a failed upload")
        raise
    for name in sorted(old - set(named.values())):  # the replaced dataset's shards
        if name.startswith("shard-") and "/" not in name and "\\" not in name:
            with contextlib.suppress(RemoteError):  # left behind, never named by a manifest again
                publish._delete(publish._remote(f"{prefix}/{name}", storage_options, timeout, retries),
                                "removing an old shard")
    return publish.ShardedUpload(murl, tuple(uploads), time.perf_counter() - t0)


def push_sharded(path: str | os.PathLike[str], url: str, *, overwrite: bool = False, deep: bool = False,
                 part_bytes: int = publish.PART_BYTES, concurrency: int = 4,
                 storage_options: dict[str, Any] | None = None, timeout: float = 120.0,
                 retries: int = 4) -> publish.ShardedUpload:
    """Upload a local sharded dataset (its folder or ``index.json``) to ``url``, a folder in a
    store (``s3://bucket/speech`` or ``s3://bucket/speech/index.json``): ``h5store push FOLDER URL``.

    Every shard is checked against the manifest (present, its size; with ``deep`` its CRC-32
    and every item's) and as a file (:func:`h5store.publish.push`'s check), then uploaded to
    ``URL/<shard>.<tag>.h5`` (a tag of this upload's own) as :func:`h5store.publish.upload`
    does, and ``index.json`` naming them last: a reader never sees a manifest naming a shard that
    is not there yet, and two uploads to one URL never write the same shard. Replacing a dataset
    (``overwrite``) leaves the old one whole until the new manifest replaces it (one PUT), then
    deletes the old shards. The parameters are :func:`h5store.publish.push`'s.

    Examples
    --------
    >>> push_sharded("speech/", "s3://bucket/speech").summary()  # doctest: +SKIP
    's3://bucket/speech/index.json: uploaded 4 shards, then the manifest, 412.0 MB in 10 requests in 6.1 s (...)'
    """
    folder, manifest_path, manifest = _local_shards(os.fspath(path), deep)
    return _send_sharded(folder, manifest_path, manifest, url, overwrite, "overwrite=True", part_bytes, concurrency,
                         storage_options, timeout, retries)


def create_sharded_remote(url: str, build: Callable[[str], Any], *, mode: str | None, overwrite: bool,
                          resume: bool, storage_options: dict[str, Any] | None = None, opener: Any = None) -> Any:
    """A sharded ``create`` onto ``s3://``: ``build(local_folder)`` in ``TMPDIR``, then the
    shards uploaded and ``index.json`` last (:func:`push_sharded`), opened from the store.

    Called by :func:`create_sharded` for an ``s3://`` target. As for one file
    (:func:`h5store.publish.create_remote`): an existing dataset (its manifest) is replaced
    only with ``mode="w"``, checked before anything is built; the build folder is removed afterwards,
    unless its upload failed: then it is kept in ``TMPDIR`` (``h5store-unpublished-*``) and the
    error says how to push it. ``resume=True`` is refused (its partial shards would live in
    the removed folder): build locally with ``resume=True``, then ``h5store push FOLDER URL``.
    On a Dask cluster of several machines the workers write the shards into that folder:
    ``TMPDIR`` must then be a folder they all reach (a shared filesystem).

    Returns
    -------
    ShardedDataset
        The uploaded dataset opened read-only from the store, with ``.report`` (the
        create's) and ``.upload`` (:class:`~h5store.publish.ShardedUpload`).
    """
    replace = overwrite or mode == "w"
    if resume:
        raise ValueError(f"{url}: resume=True is not supported for an s3:// target (its partial shards live in a "
                         "temporary folder removed when create ends): create the sharded dataset in a local folder "
                         f"with resume=True, then `h5store push FOLDER {url}`")
    prefix, murl = dataset_urls(url)
    obj = publish._remote(murl, storage_options, 120.0, 4)
    publish._target(murl, replace, obj, 'mode="w"')  # before the build: a refusal costs nothing

    def upload(local: str) -> Any:
        folder, manifest_path, manifest = _local_shards(local, deep=False, files=False)  # just built
        return _send_sharded(folder, manifest_path, manifest, murl, replace, 'mode="w"', publish.PART_BYTES, 4,
                             storage_options, 120.0, 4)

    report, done = publish._build_and_upload(prefix.rsplit("/", 1)[-1] or "dataset", build, upload, prefix,
                                            f"{murl}'s shards are built whole", "the whole dataset")
    out = open_sharded(murl, opener=opener, **({"storage_options": storage_options} if storage_options else {}))
    out.report = report
    out.upload = done
    return out


# ----------------------------------------------------------------------------- open
def read_manifest(path: str | os.PathLike[str], check: bool = True,
                  storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of a sharded dataset (its folder or ``index.json``, local or ``s3://``), its
    fields checked.

    Examples
    --------
    >>> m = read_manifest("speech/")  # doctest: +SKIP
    >>> m["items"], [s["file"] for s in m["shards"]][:1]  # doctest: +SKIP
    (13100, ['shard-00000-of-00004.h5'])
    """
    p = os.fspath(path)
    try:
        if is_remote(p):
            p = p + MANIFEST if p.endswith("/") else p
            obj = RemoteObject(p, storage_options=storage_options)
            data = json.loads(b"".join(bytes(b) for b in obj.read([0], [obj.size])))
        else:
            p = os.path.join(p, MANIFEST) if os.path.isdir(p) else p
            with open(p) as f:
                data = json.load(f)
    except ValueError as e:
        raise FormatError(f"{p}: not a readable sharded-dataset manifest ({e})") from None
    if not check:
        return data
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise FormatError(f"{p}: not an h5store sharded-dataset manifest (no \"format\": \"{_FORMAT}\")")
    if data.get("version") != _VERSION:
        raise FormatError(f"{p}: manifest version {data.get('version')!r}; this h5store reads version {_VERSION}: "
                          "upgrade h5store")
    shards = data.get("shards")
    if not isinstance(shards, list) or not shards:
        raise FormatError(f"{p}: the manifest lists no shards")
    for e in shards:
        if (not isinstance(e, dict) or not isinstance(e.get("file"), str) or not isinstance(e.get("bytes"), int)
                or not isinstance(e.get("items"), int)):
            raise FormatError(f"{p}: a shard entry lacks file, bytes or items: {e!r}")
        if "/" in e["file"] or "\\" in e["file"] or e["file"] in ("", ".", ".."):
            raise FormatError(f"{p}: shard {e['file']!r} is not a file name in the manifest's folder")
    return data


@dataclasses.dataclass
class ShardedVerifyReport:
    """What :func:`verify_sharded` found: the manifest's problems and each shard's report.
    Falsy when anything is wrong."""

    path: str
    problems: list[str] = dataclasses.field(default_factory=list)
    shards: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # (file, VerifyReport)

    def __bool__(self) -> bool:
        return not self.problems and all(bool(r) for _, r in self.shards)

    def lines(self) -> list[str]:
        """A summary, the manifest's problems, then each shard's report."""
        bad = sum(1 for _, r in self.shards if not r)
        head = (f"{self.path}: sharded dataset, {len(self.shards)} shard(s) checked: "
                f"{'OK' if self else f'{bad} bad shard(s), {len(self.problems)} problem(s) against the manifest'}")
        out = [head, *(f"  {p}" for p in self.problems)]
        for name, r in self.shards:
            out += [f"  {name}: {line}" if k == 0 else f"  {line}" for k, line in enumerate(r.lines())]
        return out


def verify_sharded(path: str | os.PathLike[str], deep: bool = True, max_errors: int = 1000) -> ShardedVerifyReport:
    """Check a local sharded dataset: every shard against the manifest (present, byte size,
    CRC-32 of the whole file, item count, first and last ids, schema) and with :func:`h5store.integrity.verify`.

    Examples
    --------
    >>> report = verify_sharded("speech/")  # doctest: +SKIP
    >>> bool(report), report.lines()[0]  # doctest: +SKIP
    (True, 'speech/: sharded dataset, 4 shard(s) checked: OK')
    """
    from h5store.integrity import verify

    p = os.path.abspath(os.fspath(path))
    folder = p if os.path.isdir(p) else _folder(p)
    manifest = read_manifest(p)
    report = ShardedVerifyReport(os.fspath(path))
    for e in manifest["shards"]:
        sp = os.path.join(folder, e["file"])
        try:
            size = os.path.getsize(sp)
        except OSError:
            report.problems.append(f"{sp}: missing (the manifest lists it)")
            continue
        if size != e["bytes"]:
            report.problems.append(f"{sp}: {size} bytes, the manifest records {e['bytes']}")
        elif deep and e.get("crc32") is not None and file_crc32(sp) != int(e["crc32"], 16):
            report.problems.append(f"{sp}: its bytes' CRC-32 is not the manifest's: the shard was changed or damaged")
        r = verify(sp, deep=deep, max_errors=max_errors)
        report.shards.append((e["file"], r))
        if r.fatal is None:
            with contextlib.suppress(H5StoreError, OSError):  # what would stop an open, verify reported
                import importlib

                with importlib.import_module("h5store.typed_file").open(sp) as f:
                    report.problems.extend(str(err) for err in _against_entry(sp, f, e, manifest))
    return report


def _against_entry(sp: str, f: Any, e: dict[str, Any], manifest: dict[str, Any]) -> list[H5StoreError]:
    """What disagrees between an open shard and its manifest entry: its item count, its first
    and last ids, its schema (the errors, for an open to raise and ``verify`` to list)."""
    out: list[H5StoreError] = []
    n = len(f)
    if n != e["items"]:
        out.append(FormatError(f"{sp}: holds {n} items, the manifest records {e['items']}"))
    ends = (f.ids[0], f.ids[n - 1]) if n else (None, None)
    if ends != (e.get("first"), e.get("last")):
        # Same size and count, other items: a shard of another build (a second publisher's,
        # or copied from another folder) must not be served as this one.
        out.append(FormatError(f"{sp}: its ids run {ends[0]!r}..{ends[1]!r}, the manifest records "
                               f"{e.get('first')!r}..{e.get('last')!r}: the shard is from another build; "
                               "copy the whole folder again, or rebuild it (create with resume=True)"))
    h = schema_hash(f.file_schema)
    if h != manifest.get("schema_hash"):
        out.append(SchemaError(f"{sp}: its schema (hash {h[:12]}) is not the dataset's "
                               f"({str(manifest.get('schema_hash'))[:12]}): this shard was built with other "
                               "features or parameters; rebuild it"))
    return out


def open_sharded(path: str | os.PathLike[str], *, opener: Any = None, **options: Any) -> ShardedDataset:
    """Open a sharded dataset (its folder or its ``index.json``) as one read-only dataset.

    An ``s3://`` manifest (``s3://bucket/speech/index.json``, or the folder's URL ending in
    ``/``) is read through the object store, its shards opened as the ``s3://`` objects beside
    it (``storage_options=``, ``cache_dir=`` apply to all). Every shard named by the manifest
    must be there with its recorded byte size, item count, first and last ids and schema hash, or
    the error names it (a shard's bytes are checked in full by ``h5store verify`` on it, or by a
    ``resume=True`` create; an open only stats them). An open that races with the end of a
    replacement (the old shards go once the new manifest is up) opens the new manifest instead.

    Parameters
    ----------
    opener : callable, optional
        Opens one shard (``TypedFile`` subclass or ``h5store.open``); default ``h5store.open``.
    **options
        Passed to each shard's open (``untrusted``, ``allow_external``...).

    Examples
    --------
    >>> ds = open_sharded("speech/")  # doctest: +SKIP
    >>> len(ds), ds.ids[0], ds.mel[ds.ids[0]].shape  # doctest: +SKIP
    (13100, 'spk1/utt-001', (212, 80))
    """
    import importlib

    if opener is None:
        opener = importlib.import_module("h5store.typed_file").open  # the façade, above this layer
    if not is_remote(path):
        p = os.path.abspath(os.fspath(path))
        folder = _folder(p) if not os.path.isdir(p) else p
        manifest = read_manifest(p)
        return ShardedDataset(_open_shards(folder, manifest, False, opener, options), folder, manifest)
    # s3://bucket/speech/index.json or s3://bucket/speech/: shards beside the manifest
    p = os.fspath(path)
    p = p + MANIFEST if p.endswith("/") else p
    folder = p.rsplit("/", 1)[0]
    so = options.get("storage_options")
    manifest: dict[str, Any] = {}
    for attempt in range(3):
        try:
            manifest = read_manifest(p, storage_options=so)
            return ShardedDataset(_open_shards(folder, manifest, True, opener, options), folder, manifest)
        except (FileNotFoundError, RemoteError):
            # A replacement finished between reading the manifest and opening its shards (the
            # old shards go once the new manifest is up), or replaced the manifest as it was
            # read: open the new one. The same manifest again: the error stands.
            if attempt == 2:
                raise
            if read_manifest(p, storage_options=so) == manifest:
                raise
    raise AssertionError("unreachable")


def _open_shards(folder: str, manifest: dict[str, Any], remote: bool, opener: Any,
                 options: dict[str, Any]) -> list[Any]:
    """Open every shard ``manifest`` names, each checked against its entry (closed again on error)."""
    files = []
    try:
        for e in manifest["shards"]:
            sp = f"{folder}/{e['file']}" if remote else os.path.join(folder, e["file"])
            try:
                # Remote: the object the open below reads (registered with the same options), so
                # one HEAD per shard gives both the size checked here and the version opened.
                size = (register(sp, **{k: options[k] for k in REMOTE_OPTIONS if k in options}).size if remote
                        else os.path.getsize(sp))
            except FileNotFoundError:
                raise FileNotFoundError(f"{sp}: shard missing ({folder}/{MANIFEST} lists it); "
                                        "copy the whole folder, or rebuild it with create(..., resume=True)") from None
            if size != e["bytes"]:
                raise FormatError(f"{sp}: {size} bytes, the manifest records {e['bytes']}: the shard was cut or "
                                  "replaced; rebuild it (create with resume=True) or copy it again")
            f = opener(sp, **options)
            files.append(f)
            problems = _against_entry(sp, f, e, manifest)
            if problems:
                raise problems[0]
    except BaseException:
        for f in files:
            f.close()
        raise
    return files


class ShardedDataset(MultiFile):
    """A sharded dataset open as one: ids, items by id, features, and the serving methods.

    Made by :func:`open_sharded` (``h5s.open(folder)``) and a sharded create. Positions and
    ids run through the shards in order (the order of an unsharded create); ids are unique
    across shards, so ``h5s.Id()`` serves them bare. ``serve(..., by_shard=True)`` with
    ranks gives each rank whole shards.

    Examples
    --------
    >>> ds = h5s.open("speech/")  # doctest: +SKIP
    >>> ds.mel["spk1/utt-001"].shape, ds[0]["label"]  # doctest: +SKIP
    ((212, 80), 0)
    >>> loader = ds.serve(dict(x=h5s.Window("mel", 64)), batch_size=32, distributed=True, by_shard=True)  # doctest: +SKIP
    """

    unique_ids = True

    def __init__(self, files: Sequence[Any], folder: str, manifest: dict[str, Any]) -> None:
        super().__init__(files)
        self.folder = folder
        self.manifest = manifest
        self._last = [e.get("last") for e in manifest["shards"]]

    @property
    def path(self) -> str:
        return self.folder

    @property
    def starts(self) -> Any:
        """Global position of each shard's first item, and the total last."""
        import numpy as np

        out = np.zeros(len(self.files) + 1, dtype=np.int64)
        np.cumsum(self.sizes(), out=out[1:])
        return out

    @property
    def file_schema(self) -> Any:
        return self.files[0].file_schema

    @property
    def features(self) -> dict[str, Feature]:
        return self.files[0].features

    @property
    def ids(self) -> ShardIds:
        return ShardIds(self)

    def locate(self, key: str | int) -> tuple[int, int]:
        """``(shard, row)`` of an id or a global position; KeyError / IndexError when absent."""
        if not isinstance(key, str):
            n = len(self)
            i = int(key)
            if not -n <= i < n:
                raise IndexError(f"{self.folder}: position {i} out of range for {n} items")
            i %= n
            starts = self.starts
            k = int(starts.searchsorted(i, "right")) - 1
            return k, i - int(starts[k])
        # The shards hold sorted runs of ids: the shard whose range may hold the id is tried first.
        import bisect

        order = list(range(len(self.files)))
        if all(isinstance(x, str) for x in self._last):
            k0 = bisect.bisect_left(self._last, key)
            if k0 < len(order):
                order.insert(0, order.pop(k0))
        for k in order:
            f = self.files[k]
            if key in f:
                return k, f.ids.index(key)
        raise KeyError(f"{key!r}: no such id in {self.folder}")

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and any(key in f for f in self.files)

    def __getitem__(self, key: str | int) -> dict[str, Any]:
        k, row = self.locate(key)
        return self.files[k][row]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("files", "folder", "manifest"):
            raise AttributeError(name)
        if name in self.files[0].features:
            return ShardedFeature(self, name)
        raise AttributeError(f"{type(self).__name__} has no attribute or feature {name!r}")

    def close(self) -> None:
        release_kept(self)  # the copies its last iter_batches left open for the next
        for f in self.files:
            f.close()

    def __enter__(self) -> ShardedDataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ShardedDataset {self.folder!r}: {len(self.files)} shards, {len(self)} items>"


class ShardIds:
    """The ids of a sharded dataset, in order: ``len``, ``[i]``, ``in``, iteration, ``index``."""

    def __init__(self, ds: ShardedDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> str:
        k, row = self.ds.locate(int(i))
        return self.ds.files[k].ids[row]

    def __iter__(self) -> Iterator[str]:
        for f in self.ds.files:
            yield from f.ids

    def __contains__(self, id: object) -> bool:
        return id in self.ds

    def index(self, id: str) -> int:
        """The global position of ``id``."""
        k, row = self.ds.locate(id)
        return int(self.ds.starts[k]) + row


class ShardedFeature:
    """One feature across the shards: ``ds.mel[id]``, ``ds.mel[i]``, ``ds.mel.read_many(positions)``."""

    def __init__(self, ds: ShardedDataset, name: str) -> None:
        self.ds = ds
        self.name = name

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key: str | int) -> Any:
        k, row = self.ds.locate(key)
        return getattr(self.ds.files[k], self.name)[row]

    @property
    def lengths(self) -> Any:
        """Rows of every item, in order (as ``f.mel.lengths``)."""
        import numpy as np

        return np.concatenate([getattr(f, self.name).lengths for f in self.ds.files])

    def __iter__(self) -> Iterator[Any]:
        for f in self.ds.files:
            yield from getattr(f, self.name)

    def read_many(self, keys: Sequence[int | str]) -> list[Any]:
        """Items of ids or global positions, in the order given (one planned read per shard)."""
        import numpy as np

        where_of = [self.ds.locate(k if isinstance(k, str) else int(k)) for k in keys]
        shard = np.array([k for k, _ in where_of], dtype=np.int64)
        rows = np.array([r for _, r in where_of], dtype=np.int64)
        out: list[Any] = [None] * len(where_of)
        for k in np.unique(shard).tolist():
            where = np.flatnonzero(shard == k)
            got = getattr(self.ds.files[k], self.name).read_many(rows[where])
            for j, x in zip(where.tolist(), got):
                out[j] = x
        return out
