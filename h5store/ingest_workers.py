"""The workers of a create: each loads and encodes its chunk of sources, and hands its arrays
back to the one writer through a spool file in ``/dev/shm`` (on this machine) or through the
result pipe; a source whose load kills a worker is isolated and named.

Two ways to run them:

* :class:`ForkPool` (the default on Linux): worker processes forked from the caller when
  :func:`~h5store.ingest.create` starts, before the sources are scanned. A forked worker has
  numpy, h5py and h5store already imported: it is ready in milliseconds, where a fresh
  interpreter (loky's workers) takes ~1 s to start and import them, seconds under load.
* joblib (loky, Dask, Ray...): when the caller chose a joblib backend
  (``joblib.parallel_config(backend="dask")``), when ``fork`` is not available, or when other
  threads run in the caller (forking them is unsafe).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from h5store.checksum import item_crc
from h5store.pio import pid_alive, read_into, write_all
from h5store.schema import Feature, Source

__all__ = ["ForkPool", "Spooled", "chunk_work", "load_chunk", "run_parallel", "spool_folder", "start_workers"]

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
class Spooled:
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
    done = read_into(fd, out, offset)
    if done < out.nbytes:
        raise OSError(f"{path}: spool file ends at {offset + done}, {out.nbytes - done} bytes short")


def _spool(features: dict[str, Feature], out: list[tuple[Any, ...]], folder: str) -> Spooled | None:
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
                    write_all(fd, view, offset)
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
    return Spooled(path, columns, offset)


def spool_folder(n_workers: int, pool: ForkPool | None = None) -> str | None:
    """A private folder in /dev/shm for the workers' results, when they run on this machine."""
    if n_workers <= 1 or not os.path.isdir(_SPOOL_ROOT) or not os.access(_SPOOL_ROOT, os.W_OK):
        return None
    # Dask, Ray or any other joblib backend may run workers on other machines, or without
    # this /dev/shm: their results keep going through joblib.
    if pool is None and not _local_joblib_backend():
        return None
    # Folders of creates that died without cleaning up (SIGKILL, OOM): their files hold RAM.
    # A live create changes its folder with every chunk; the age guards against a pid that
    # only looks dead (another pid namespace sharing this /dev/shm).
    with contextlib.suppress(OSError):
        for name in os.listdir(_SPOOL_ROOT):
            pid = name[len(_SPOOL_PREFIX):].split("-", 1)[0]
            if name.startswith(_SPOOL_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
                folder = os.path.join(_SPOOL_ROOT, name)
                if time.time() - os.stat(folder).st_mtime > _SPOOL_STALE_SECONDS:
                    shutil.rmtree(folder, ignore_errors=True)
    try:
        return tempfile.mkdtemp(prefix=f"{_SPOOL_PREFIX}{os.getpid()}-", dir=_SPOOL_ROOT)
    except OSError:
        return None



def load_chunk(features: dict[str, Feature], chunk: list[tuple[Source, list[str]]],
                spool: str | None = None) -> tuple[list[tuple[Any, ...]], Spooled | None]:
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


def chunk_work(work: list[tuple[Source, list[str]]], n_workers: int) -> list[list[tuple[Source, list[str]]]]:
    # Enough chunks to balance the workers, few enough to amortise dispatch (and the
    # features' pickling) over several sources.
    size = int(np.clip(len(work) // max(n_workers * 16, 1), 1, 32))
    return [work[i : i + size] for i in range(0, len(work), size)]


def run_parallel(features: dict[str, Feature], chunks: list[list[tuple[Source, list[str]]]],
                  n_workers: int, spool: str | None = None,
                  pool: ForkPool | None = None) -> Iterator[tuple[list[tuple[Any, ...]], Spooled | None]]:
    """Yield each chunk's results in order; isolate sources whose load kills a worker.

    With a ``pool`` (:func:`start_workers`), its processes load the chunks; else, with
    ``n_workers > 1``, joblib's active backend does.
    """
    if pool is not None:
        yield from pool.run(features, chunks, spool)
        return
    done = 0
    while done < len(chunks):
        if n_workers == 1:
            for chunk in chunks[done:]:
                yield load_chunk(features, chunk)
                done += 1
            return
        import joblib

        try:
            par = joblib.Parallel(n_jobs=n_workers, return_as="generator", pre_dispatch="2*n_jobs")
            for result in par(joblib.delayed(load_chunk)(features, c, spool) for c in chunks[done:]):
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
        return joblib.Parallel(n_jobs=2)([joblib.delayed(load_chunk)(features, [item])])[0][0][0]
    except Exception as e:  # noqa: BLE001
        return (source.id, None, {}, [(n, "WorkerDied", f"the worker process died loading this source ({type(e).__name__})") for n in names], 0.0, [])


# ----------------------------------------------------------------------------- the fork pool
def _local_joblib_backend() -> bool:
    """Whether joblib's active backend runs workers on this machine (loky, multiprocessing).

    Without joblib imported, nobody configured another backend: the default (loky) is local.
    """
    if "joblib" not in sys.modules:
        return True
    import joblib.parallel

    backend, _ = joblib.parallel.get_active_backend()
    return type(backend).__name__ in ("LokyBackend", "MultiprocessingBackend")


def _only_thread() -> bool:
    """No other Python thread runs here (tqdm's monitor, which only sleeps and refreshes, aside).

    A thread holding a lock when the process forks leaves that lock held forever in the child.
    """
    me = threading.current_thread()
    return all(t is me or type(t).__name__ == "TMonitor" or not t.is_alive() for t in threading.enumerate())


def start_workers(n_workers: int) -> ForkPool | None:
    """Fork ``n_workers`` worker processes now, or None where joblib must run them.

    None when ``n_workers <= 1``, off Linux (forking is unsafe on macOS), when the caller chose a joblib
    backend other than loky/multiprocessing (Dask, Ray: ``joblib.parallel_config``), when
    other threads run in this process, or when torch, tensorflow or jax is imported (their
    thread pools do not survive a fork). Call it before any file is opened for writing, so the
    workers inherit no writer's descriptors, and :meth:`ForkPool.close` it when done.

    Examples
    --------
    >>> pool = start_workers(2)  # doctest: +SKIP
    >>> for results, spooled in run_parallel(features, chunks, 2, pool=pool): ...  # doctest: +SKIP
    >>> pool.close()  # doctest: +SKIP
    """
    import multiprocessing

    # Linux only: macOS system libraries are not fork-safe (Python spawns there by default).
    if n_workers <= 1 or not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return None
    if not _local_joblib_backend() or not _only_thread() or _fork_unsafe_runtime():
        return None
    return ForkPool(n_workers)


#: Frameworks that start OS thread pools of their own (OpenMP's libgomp among them) that a
#: forked child inherits half-initialised: a feature calling into them there could hang.
_FORK_UNSAFE = ("torch", "tensorflow", "jax")


def _fork_unsafe_runtime() -> bool:
    """Whether this process has imported a framework that is not safe to fork (joblib's loky spawns)."""
    return any(name in sys.modules for name in _FORK_UNSAFE)


def _warm_up() -> int:
    """A worker's first task, run while the parent scans the sources: the audio decoder's import."""
    with contextlib.suppress(ImportError):
        import soundfile  # noqa: F401
    return os.getpid()


def _worker_init(parent: int) -> None:
    """In each forked worker: die with the parent, leave Ctrl-C to it, one BLAS thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool on KeyboardInterrupt
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the line above
    global _BLAS_LIMIT
    with contextlib.suppress(ImportError):
        from threadpoolctl import threadpool_limits

        # Two workers on two cores: a BLAS pool per worker (the mel matrix product) would
        # oversubscribe the machine. Kept for the worker's life.
        _BLAS_LIMIT = threadpool_limits(limits=1, user_api="blas")


_BLAS_LIMIT: Any = None


class ForkPool:
    """``n_workers`` processes forked from this one, loading a create's chunks.

    Started by :func:`start_workers` when a create begins: forking takes milliseconds and the
    workers inherit every module imported so far, so they are ready before the sources are
    scanned. Results come back in order, at most ``2 * n_workers`` chunks in flight. A worker
    that dies (a segfault in a decoder, ``os._exit``) breaks the pool: the first unfinished
    chunk is then loaded one source at a time, each in a process of its own, to name the
    culprit (a ``WorkerDied`` failure) and keep the others, and a fresh pool takes the rest.
    Workers die with the parent (``PR_SET_PDEATHSIG``) and ignore SIGINT.
    """

    def __init__(self, n_workers: int) -> None:
        self.n_workers = n_workers
        self._ex = self._start()

    def _start(self) -> Any:
        import concurrent.futures
        import multiprocessing

        ex = concurrent.futures.ProcessPoolExecutor(
            self.n_workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init,
            initargs=(os.getpid(),))
        with warnings.catch_warnings():
            # Python >= 3.12 warns about forking a process with threads, and counts native ones:
            # numpy's OpenBLAS threads survive fork through their own pthread_atfork handlers.
            warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
            # The executor forks every worker at its first submit: now, not after the scan.
            for _ in range(self.n_workers):
                ex.submit(_warm_up)
        return ex

    def run(self, features: dict[str, Feature], chunks: list[list[tuple[Source, list[str]]]],
            spool: str | None) -> Iterator[tuple[list[tuple[Any, ...]], Spooled | None]]:
        """Each chunk's ``load_chunk`` result, in order."""
        from concurrent.futures.process import BrokenProcessPool

        done = 0
        while done < len(chunks):
            pending: collections.deque[Any] = collections.deque()
            todo = iter(chunks[done:])
            try:
                for chunk in todo:
                    pending.append(self._ex.submit(load_chunk, features, chunk, spool))
                    if len(pending) >= 2 * self.n_workers:
                        break
                while pending:
                    result = pending.popleft().result()
                    chunk = next(todo, None)
                    if chunk is not None:  # refill first: the workers never wait for the writer
                        pending.append(self._ex.submit(load_chunk, features, chunk, spool))
                    yield result
                    done += 1
            except BrokenProcessPool:
                self._ex.shutdown(wait=True, cancel_futures=True)
                yield [_isolated_fork(features, item) for item in chunks[done]], None
                done += 1
                self._ex = self._start()

    def close(self) -> None:
        """Stop the workers (cancelling what they have not started) and wait for them."""
        self._ex.shutdown(wait=True, cancel_futures=True)


def _isolated_fork(features: dict[str, Feature], item: tuple[Source, list[str]]) -> tuple[Any, ...]:
    """``load_chunk`` of one source in a process of its own: its result, or a WorkerDied failure."""
    import concurrent.futures
    import multiprocessing

    source, names = item
    ex = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"),
                                                initializer=_worker_init, initargs=(os.getpid(),))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
            future = ex.submit(load_chunk, features, [item])
        return future.result()[0][0]
    except Exception as e:  # noqa: BLE001 - the worker died: the source is the culprit
        return (source.id, None, {}, [(n, "WorkerDied", f"the worker process died loading this source ({type(e).__name__})")
                                      for n in names], 0.0, [])
    finally:
        ex.shutdown(wait=True)
