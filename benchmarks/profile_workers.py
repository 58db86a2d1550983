"""Where a DataLoader worker's time goes (issue 13, point 3): per-stage cost per batch, in-process vs workers.

Serves the read-path benchmark's file (ragged mel items, 100-600 x 80 float32) with
``f.serve`` and instruments the stages of a batch in the process that builds it:

- ``fetch``: ``FileDataset.__getitems__`` (slot reset, reads, CRC-32, padding), wall and
  thread CPU, and the minor page faults it takes;
- ``pack``: ``FileDataset.collate`` (in a worker: the batch laid out in its ring slot; in-process:
  ``to_torch``);
- ``pickle``: the worker queue's ``ForkingPickler.dumps`` of the batch descriptor (feeder thread);
- per process: CPU seconds, run-queue wait (``/proc/<pid>/schedstat``: time ready but not
  running, i.e. waiting for a core) and wall seconds per batch.

Run from the repository root (not part of ``run_all.py``: a diagnostic, nothing is written
to RESULTS.md)::

    .venv/bin/python benchmarks/profile_workers.py [--workers 2] [--getter item|window] [--seconds 3]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing.queues
import os
import pstats
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import h5store as h5s
from benchmarks import _common as C
from benchmarks.bench_read_paths import BATCH, WINDOW, build

_OUT = os.environ.get("H5STORE_PROFILE_DIR", "")
_PROFILE: cProfile.Profile | None = None
_CPROFILE = False


def _schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns waiting on a run queue) of this process's threads, summed."""
    run = wait = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                a, b, _ = fh.read().split()
        except (OSError, ValueError):
            continue
        run += int(a)
        wait += int(b)
    return run, wait


class Stages:
    """Per-stage counters of one process (what :func:`instrument` adds)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.n = 0
        self.fetch_ns = self.fetch_cpu_ns = self.fetch_faults = 0
        self.pack_ns = self.pack_cpu_ns = 0
        self.pickle_ns = self.pickles = 0
        self.lock = threading.Lock()
        self.start()

    def start(self) -> None:
        self.t0 = time.perf_counter_ns()
        self.c0 = time.process_time_ns()
        self.s0 = _schedstat()
        self.f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def summary(self) -> dict[str, Any]:
        n = max(self.n, 1)
        run, wait = _schedstat()
        return {
            "where": self.where, "batches": self.n,
            "wall_us": (time.perf_counter_ns() - self.t0) / n / 1e3,
            "cpu_us": (time.process_time_ns() - self.c0) / n / 1e3,
            "runq_wait_us": (wait - self.s0[1]) / n / 1e3,
            "fetch_us": self.fetch_ns / n / 1e3, "fetch_cpu_us": self.fetch_cpu_ns / n / 1e3,
            "fetch_faults": self.fetch_faults / n,
            "pack_us": self.pack_ns / n / 1e3, "pack_cpu_us": self.pack_cpu_ns / n / 1e3,
            "pickle_us": self.pickle_ns / max(self.pickles, 1) / 1e3,
            "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.f0) / n,
        }

    def dump(self) -> None:
        if _OUT:
            with open(os.path.join(_OUT, f"{self.where}-{os.getpid()}.json"), "w") as fh:
                json.dump(self.summary(), fh)
            if _PROFILE is not None:
                _PROFILE.dump_stats(os.path.join(_OUT, f"{self.where}-{os.getpid()}.prof"))
                _PROFILE.enable()  # dump_stats stops it


def instrument(ds: Any, where: str) -> Stages:
    """Wrap ``ds.__getitems__`` and ``ds.collate`` (instance attributes) with timers."""
    st = Stages(where)
    getitems, collate = ds.__getitems__, ds.collate

    def timed_getitems(indices: Any) -> Any:
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        out = getitems(indices)
        st.fetch_ns += time.perf_counter_ns() - t0
        st.fetch_cpu_ns += time.thread_time_ns() - c0
        st.fetch_faults += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
        return out

    def timed_collate(data: Any) -> Any:
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        out = collate(data)
        st.pack_ns += time.perf_counter_ns() - t0
        st.pack_cpu_ns += time.thread_time_ns() - c0
        st.n += 1
        if st.n % 200 == 0 or st.n in (10, 50, 100):  # (a file write: not every batch)
            st.dump()
        return out

    ds.__getitems__ = timed_getitems  # torch's fetcher looks it up on the instance
    ds.collate = timed_collate
    return st


class _TimedPickler(multiprocessing.queues._ForkingPickler):  # type: ignore[name-defined,misc]
    stages: Stages | None = None

    @classmethod
    def dumps(cls, obj: Any, protocol: Any = None) -> Any:
        t0 = time.perf_counter_ns()
        out = super().dumps(obj, protocol)
        st = cls.stages
        if st is not None:
            st.pickle_ns += time.perf_counter_ns() - t0
            st.pickles += 1
        return out


def worker_init(worker_id: int) -> None:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    # The collate_fn DataLoader calls is the bound method captured at construction: wrap the
    # fetcher's copy too (it was pickled/inherited with the loader).
    st = instrument(info.dataset, f"worker{worker_id}")
    if _CPROFILE:
        global _PROFILE
        _PROFILE = cProfile.Profile()
        _PROFILE.enable()
    _TimedPickler.stages = st
    multiprocessing.queues._ForkingPickler = _TimedPickler  # type: ignore[attr-defined]


def run(f: h5s.TypedFile, getter: str, workers: int, seconds: float, out: str) -> dict[str, Any]:
    g = h5s.Item("mel") if getter == "item" else h5s.Window("mel", WINDOW)
    kw: dict[str, Any] = {"persistent_workers": True, "worker_init_fn": worker_init} if workers else {}
    loader = f.serve(dict(x=g), batch_size=BATCH[getter], shuffle=True, num_workers=workers, **kw)
    # DataLoader calls the collate_fn it was given: route it through the dataset's attribute.
    ds = loader.dataset
    loader.collate_fn = lambda data, ds=ds: ds.collate(data)
    main = instrument(loader.dataset, "in-process") if not workers else Stages("main")
    items = 0
    it = iter(loader)
    for _ in range(10):  # warm: workers started, rings mapped
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
    main.start()
    main.n = 0
    for key in ("fetch_ns", "fetch_cpu_ns", "fetch_faults", "pack_ns", "pack_cpu_ns"):
        setattr(main, key, 0)
    unpack_ns = 0
    prof = cProfile.Profile() if _CPROFILE else None
    if prof is not None:
        prof.enable()
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter_ns()
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        unpack_ns += time.perf_counter_ns() - t0
        items += b["x"].shape[0]
        if workers:
            main.n += 1
        del b
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(out, f"{main.where}.prof"))
    res = main.summary()
    res["next_us"] = unpack_ns / max(main.n, 1) / 1e3
    res["items_per_s"] = items / (res["wall_us"] * main.n / 1e6)
    it = None
    from benchmarks.bench_serve import shutdown

    shutdown(loader)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--getter", choices=sorted(BATCH), default="item")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cprofile", action="store_true", help="print cProfile tops of the main process and a worker")
    args = ap.parse_args(argv)
    global _CPROFILE
    _CPROFILE = args.cprofile
    load = C.LoadAverage()
    with tempfile.TemporaryDirectory(prefix="h5store-prof-") as tmp:
        raw, store, _ = build(tmp, args.items)
        C.warm_page_cache([store])
        f = C.Mels(store)
        for r in range(args.repeat):
            for w in (0, args.workers):
                out = os.path.join(tmp, f"prof-{r}-{w}")
                os.makedirs(out)
                os.environ["H5STORE_PROFILE_DIR"] = out
                global _OUT
                _OUT = out
                res = run(f, args.getter, w, args.seconds, out)
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}))
                for name in sorted(os.listdir(out)):
                    if name.endswith(".prof"):
                        if name.startswith(("main", "in-process", "worker0")):
                            print(f"--- {name}")
                            pstats.Stats(os.path.join(out, name)).sort_stats("tottime").print_stats(25)
                        continue
                    with open(os.path.join(out, name)) as fh:
                        d = json.load(fh)
                    print("   ", json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in d.items()}))
        f.close()
    print(C.load_note(load.stop()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
