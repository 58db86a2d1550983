"""tf.data and numpy serving benchmark (issue 5): h5store's tf.data pipeline and numpy iterator
against what users write today, and what a second reader thread adds.

Pipelines, all shuffled, all giving the same batches (whole mel items zero-padded, with lengths):

(G) ``tf.data.Dataset.from_generator`` over h5py, the pattern of the seed questions: the
    generator opens the file and yields one example per call (read with h5py from the same
    h5store file: ``/mel/data`` rows given by ``/mel/index``), then ``padded_batch``.
    G runs in a child process: a GeneratorDataset changes the process's malloc settings
    (tensorflow logs "Memory patch applied: M_TRIM_THRESHOLD=128 kb"), which would slow
    every pipeline measured after it in the same process (measured below).
(T) ``f.to_tf_dataset(...)`` with ``num_parallel_calls`` 1, 2 and AUTOTUNE.
(N) ``f.iter_batches(...)`` (numpy, no framework) with ``threads`` 1 and 2.

Also: the same batches from tf, the numpy iterator and the PyTorch path (``serve``,
``num_workers=0``) for the same seed; a profile of one thread's reads (how much of a batch
runs with the GIL released); and the cost of from_generator's malloc change.

Run from the repository root::

    .venv/bin/python benchmarks/bench_tf.py                       # full run (~5 min), writes RESULTS.md
    .venv/bin/python benchmarks/bench_tf.py --quick --no-write    # < 60 s smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import h5store as h5s
from benchmarks import _common as C

NAN = float("nan")


@dataclass
class Config:
    """Sizes of one run (``--quick`` shrinks everything to a smoke run)."""

    n_items: int = 2000
    small_batch: int = 16  # the from_generator comparison
    big_batch: int = 64  # thread scaling: the copy dominates
    repeat: int = 5
    min_seconds: float = 1.0  # a timed run is whole epochs until this has passed...
    max_seconds: float = 3.0  # ...or, mid-epoch, this (the slow baseline)
    pause: float = 0.3  # between timed runs
    check_batches: int = 10
    quick: bool = False


# The smoke run (tests/test_benchmarks_smoke.py): every table and pipeline, tiny, one timed run each
# without a warm-up (C.rounds) or pauses; the (G) child starts at once, so that its import of
# tensorflow (~7 s) overlaps this process's.
QUICK = Config(n_items=100, big_batch=32, repeat=1, min_seconds=0.0, max_seconds=0.4, pause=0.0, check_batches=3,
               quick=True)


# --------------------------------------------------------------------------- runs
Run = C.Run  # with the process's CPU seconds, minor page faults and batches (C.time_batches)
Timing = C.Timing


def timed(epochs: Callable[[], Iterable[Any]], min_seconds: float, max_seconds: float) -> Run:
    """Consume whole epochs of batches (dicts with ``x``) until ``min_seconds`` have passed.

    ``epochs()`` gives the next epoch's batches. A run stops early, mid-epoch, at
    ``max_seconds`` (the slow baseline). Epoch starts (threads, iterators, the first batch's
    latency) are part of the cost, as in training.
    """
    return C.time_batches(epochs, min_seconds=min_seconds, max_seconds=max_seconds, whole_epochs=True,
                          size=lambda b: (int(b["x"].shape[0]), 0))


# --------------------------------------------------------------------------- baseline (child process)
def generator_dataset(path: str, batch_size: int, seed: int) -> Any:
    """(G) from_generator over h5py: the file opened in the generator, one example per call."""
    import h5py
    import tensorflow as tf

    epochs = {"next": 0}

    def examples() -> Any:
        e = epochs["next"]
        epochs["next"] += 1
        with h5py.File(path, "r") as hf:
            data = hf["mel/data"]
            index = hf["mel/index"][...]
            for i in np.random.default_rng([seed, e]).permutation(len(index)).tolist():
                a, b = index[i]
                yield data[a:b], np.int64(b - a)

    sig = (tf.TensorSpec((None, C.N_MELS), tf.float32), tf.TensorSpec((), tf.int64))
    ds = tf.data.Dataset.from_generator(examples, output_signature=sig)
    ds = ds.padded_batch(batch_size).map(lambda x, n: {"x": x, "x_lengths": n})
    return ds.prefetch(tf.data.AUTOTUNE)


def child_main(path: str, batch_size: int, min_seconds: float, max_seconds: float) -> int:
    """Serve timed runs of (G) on request: one line "run" in, one JSON line out."""
    ds = generator_dataset(path, batch_size, seed=0)
    timed(lambda: ds, min_seconds, max_seconds)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        r = timed(lambda: ds, min_seconds, max_seconds)
        print(json.dumps(r.__dict__), flush=True)
    return 0


class Baseline:
    """The (G) child process, driven one timed run at a time (so that its runs interleave with ours)."""

    def __init__(self, path: str, batch_size: int, min_seconds: float, max_seconds: float, wait: bool = True) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", path, str(batch_size), str(min_seconds), str(max_seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the child is ready for its timed runs."""
        line = self._line()
        if line != "ready":
            raise RuntimeError(f"baseline child did not start: {line!r}")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def run(self) -> Run:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return Run(**json.loads(self._line()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --------------------------------------------------------------------------- data
def build_file(cache: Path, n: int) -> Path:
    """The benchmark's file (``n`` mel items stored plain, lzf and gzip), cached between runs."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"tf-mels-{n}.h5"
    if path.exists():
        try:
            with C.Mels(path) as f:
                if len(f) == n:
                    return path
        except Exception:  # noqa: BLE001 - a stale or partial cache: rebuild it
            pass
    with C.step(f"build the {n:,}-item file"):
        data, offsets = C.make_mels(n, seed=0)
        items = C.split(data, offsets)
        tmp = path.with_suffix(".tmp.h5")
        with C.Mels(tmp, mode="w") as f:
            f.extend(C.item_ids(n), {"mel": items, "mel_lzf": items, "mel_gz": items})
        os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- measurements
def rounds(pipes: dict[str, Callable[[], Run]], cfg: Config, label: str) -> dict[str, Timing]:
    """One warm-up run each, then ``cfg.repeat`` interleaved rounds of timed runs.

    A short pause separates runs: tensorflow's thread pools spin for a while after their
    work ends, which would otherwise take the second core from the next run.
    """
    return C.rounds(pipes, cfg.repeat, label, pause=cfg.pause, keep_going=False, warm_up=not cfg.quick)


def tf_pipes(f: Any, feature: str, batch_size: int, cfg: Config, calls: dict[str, Any]) -> dict[str, Callable[[], Run]]:
    spec = {"x": h5s.Item(feature)}
    pipes: dict[str, Callable[[], Run]] = {}
    for name, npc in calls.items():
        ds = f.to_tf_dataset(spec, batch_size, shuffle=True, seed=0, num_parallel_calls=npc)
        pipes[name] = lambda ds=ds: timed(lambda: ds, cfg.min_seconds, cfg.max_seconds)
    return pipes


def numpy_pipes(f: Any, feature: str, batch_size: int, cfg: Config, threads: Iterable[int],
                pool: bool = True) -> dict[str, Callable[[], Run]]:
    from h5store.serving import FileDataset, iter_batches
    from h5store.serving.numpy_iter import aligned_empty

    ds = FileDataset(f, {"x": h5s.Item(feature)})
    if not pool:
        ds.files.alloc = aligned_empty  # a new buffer per batch, as without h5store's BufferPool
    epochs = iter(range(1 << 30))
    suffix = "" if pool else " (no buffer pool)"
    return {f"N threads={t}{suffix}": (lambda t=t: timed(
                lambda: iter_batches(ds, None, batch_size, shuffle=True, threads=t, prefetch=2 * t, epoch=next(epochs)),
                cfg.min_seconds, cfg.max_seconds))
            for t in threads}


def preadv_pipes(path: Path, n_items: int, batch_size: int, cfg: Config,
                 threads: Iterable[int]) -> dict[str, Callable[[], Run]]:
    """The machine's own ceiling: threads doing nothing but ``os.preadv`` of batch-sized blocks.

    No Python between calls to speak of, no GIL held during them: what two threads get over
    one here is what the scheduler gives this process right now (on a shared machine, Linux's
    autogroup scheduling splits the cores between sessions, whatever their thread counts).
    "Items" are blocks of ``batch_size`` average items.
    """
    size = os.path.getsize(path)
    block = max(1 << 16, (size // 3) // max(n_items, 1) * batch_size)  # one copy of the data is a third

    def run(k: int) -> Run:
        fd = os.open(path, os.O_RDONLY)
        stop = threading.Event()
        counts = [0] * k

        def reader(j: int) -> None:
            buf = bytearray(block)
            off = j * block
            while not stop.is_set():
                os.preadv(fd, [buf], off)
                counts[j] += 1
                off = off + block if off + 2 * block <= size else 0

        workers = [threading.Thread(target=reader, args=(j,)) for j in range(k)]
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0, t0 = time.process_time(), time.perf_counter()
        for t in workers:
            t.start()
        time.sleep(max(cfg.min_seconds, 0.02))  # (--quick: min_seconds 0, but a run must read something)
        stop.set()
        for t in workers:
            t.join()
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        os.close(fd)
        n = sum(counts)
        return Run(n * batch_size, dt, cpu=time.process_time() - c0, faults=r1.ru_minflt - r0.ru_minflt, batches=n)

    return {f"preadv only, threads={k}": (lambda k=k: run(k)) for k in threads}


def same_batches(f: Any, cfg: Config) -> dict[str, Any]:
    """tf, the numpy iterator and torch's serve(num_workers=0) give equal batches for seed 0."""
    import tensorflow as tf

    spec = {"x": h5s.Item("mel"), "w": h5s.Window("mel", 64), "n": h5s.Position()}
    k = cfg.check_batches
    tf_b = [{key: v.numpy() for key, v in b.items()} for b in f.to_tf_dataset(spec, 16, shuffle=True, seed=0).take(k)]
    np_b = []
    for b in f.iter_batches(spec, 16, shuffle=True, seed=0, threads=2):
        np_b.append(dict(b))
        if len(np_b) == k:
            break
    torch_b = []
    for b in f.serve(spec, batch_size=16, shuffle=True, seed=0, num_workers=0):
        torch_b.append({key: v.numpy() for key, v in b.items()})
        if len(torch_b) == k:
            break
    equal = len(tf_b) == len(np_b) == len(torch_b) == k and all(
        a.keys() == b.keys() == c.keys()
        and all(np.array_equal(a[key], b[key]) and np.array_equal(b[key], c[key]) and a[key].dtype == c[key].dtype
                for key in a)
        for a, b, c in zip(tf_b, np_b, torch_b))
    del tf
    return {"batches": k, "keys": sorted(tf_b[0]) if tf_b else [], "equal": bool(equal)}


def read_profile(f: Any, batch_size: int, repeat: int) -> dict[str, Any]:
    """One thread reading one epoch of batches: how much of it runs without the GIL.

    ``os.preadv`` releases the GIL for the copy; its time is measured by wrapping it (a
    ~0.2 us timer around calls of ~100 us). The rest (planning, numpy calls, the Python of
    the read loop) holds the GIL, except numpy's zero-fill of the padding, which releases it
    too but is counted as held here: the GIL-free share is a lower bound. Amdahl's law then
    bounds the speed-up of two threads by ``1 / (s + (1 - s) / 2)``, ``s`` the GIL-held share.
    """
    from h5store.serving import FileDataset
    from h5store.serving.numpy_iter import make_sampler, prepare_for_threads

    ds = prepare_for_threads(FileDataset(f, {"x": h5s.Item("mel")}))
    batches = make_sampler(ds, batch_size, seed=0).batches(0)
    for b in batches[:3]:
        ds.fetch(b)
    spent = [0.0]
    real = os.preadv

    def timed_preadv(*args: Any) -> int:
        t = time.perf_counter()
        try:
            return real(*args)
        finally:
            spent[0] += time.perf_counter() - t

    best: tuple[float, float] | None = None
    os.preadv = timed_preadv  # type: ignore[assignment]
    try:
        for _ in range(repeat):
            spent[0] = 0.0
            t0 = time.perf_counter()
            for b in batches:
                ds.fetch(b, epoch=0)
            total = time.perf_counter() - t0
            if best is None or total < best[0]:
                best = (total, spent[0])
    finally:
        os.preadv = real  # type: ignore[assignment]
    assert best is not None
    total, pread = best
    free = min(1.0, pread / total) if total > 0 else NAN
    s = 1 - free
    return {"seconds": total, "preadv": pread, "free": free, "bound2": 1 / (s + (1 - s) / 2),
            "table": C.profile_top(lambda: [ds.fetch(b, epoch=0) for b in batches], 10)}


def gil_probe(path: Path, quick: bool) -> dict[str, tuple[float, int, float]]:
    """Does a call release the GIL? A Python thread's longest pause while another thread is in it.

    A second thread runs a Python loop, time-stamping every few hundred iterations, while
    this thread makes one long call. If the call holds the GIL, the loop stops for the whole
    call (its longest pause is the call's duration); if it releases the GIL, the loop keeps
    running (pauses of a few ms: scheduling, the interpreter's switch interval). This holds
    on a loaded machine too: it needs no free core, only that the loop is scheduled at all.
    Returns name -> (call ms, time stamps taken during the call, longest pause ms).
    """
    mb = 8 if quick else 256
    fd = os.open(path, os.O_RDONLY)
    buf = np.empty(mb << 20, np.uint8)
    buf[:] = 1  # fault the pages in: the calls below copy, not allocate
    blob = zlib.compress(np.frombuffer(os.pread(fd, min(mb, 32) << 20, 0), np.uint8).tobytes(), 1)

    def probe(call: Callable[[], Any]) -> tuple[float, int, float]:
        stamps: list[float] = []
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                stamps.append(time.perf_counter())
                for _ in range(200):
                    pass

        t = threading.Thread(target=loop)
        t.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        stop.set()
        t.join()
        inside = np.array([x for x in stamps if t0 < x < t1])
        gaps = np.diff(np.concatenate([[t0], inside, [t1]]))
        return 1e3 * (t1 - t0), len(inside), 1e3 * float(gaps.max())

    try:
        return {
            f"os.preadv of {mb} MiB (the direct read path)": probe(lambda: os.preadv(fd, [memoryview(buf)], 0)),
            f"numpy zero-fill of {mb} MiB in 1 MiB rows (the padding)":
                probe(lambda: [row.fill(0) for row in buf.reshape(-1, 1 << 20)]),
            f"zlib.decompress of {len(blob) >> 20} MiB (the gzip chunk reader)": probe(lambda: zlib.decompress(blob)),
            f"control: bytes() copy of {mb} MiB (holds the GIL)": probe(lambda: bytes(memoryview(buf))),
        }
    finally:
        os.close(fd)


def malloc_patch_cost(f: Any, cfg: Config, before: set[str]) -> dict[str, Timing]:
    """The same h5store pipelines after a from_generator dataset ran in this process."""
    import tensorflow as tf

    g = tf.data.Dataset.from_generator(lambda: iter([0]), output_signature=tf.TensorSpec((), tf.int64))
    for _ in g:
        pass
    pipes = {**tf_pipes(f, "mel", cfg.small_batch, cfg, {"T calls=2": 2}),
             **numpy_pipes(f, "mel", cfg.small_batch, cfg, [2]),
             **numpy_pipes(f, "mel", cfg.small_batch, cfg, [2], pool=False)}
    after = rounds(pipes, cfg, "after a from_generator dataset")
    return {f"{name} (after from_generator)": t for name, t in after.items() if name in before}


# --------------------------------------------------------------------------- report
def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else NAN


def table(timings: dict[str, Timing], base: str | None = None) -> str:
    rows = []
    for name, t in timings.items():
        rows.append([name, C.fmt_rate(t.rate), f"{t.cores:.2f}", f"{t.cpu_us_per_item:,.0f}",
                     f"{t.faults_per_batch:,.0f}",
                     C.fmt_ratio(ratio(t.rate, timings[base].rate)) if base in timings else "-"])
    return C.md_table(["pipeline", "items/s", "CPU cores used", "CPU us / item", "page faults / batch",
                       f"vs {base}" if base else ""], rows)


def report(cfg: Config, res: dict[str, Any]) -> str:
    small, big, gz = res["small"], res["big"], res["gzip"]
    g = small.get("G from_generator")
    best_t = max((t for n, t in small.items() if n.startswith("T ")), key=lambda t: t.rate)
    targets = [
        ("tf pipeline (best of calls=1/2/AUTOTUNE) >= 5x from_generator, batch "
         f"{cfg.small_batch}", ratio(best_t.rate, g.rate if g else NAN), 5.0),
        (f"to_tf_dataset num_parallel_calls=2 >= 1.6x =1, uncompressed, batch {cfg.big_batch}",
         ratio(big["T calls=2"].rate, big["T calls=1"].rate), 1.6),
        (f"iter_batches threads=2 >= 1.6x threads=1, uncompressed, batch {cfg.big_batch}",
         ratio(big["N threads=2"].rate, big["N threads=1"].rate), 1.6),
    ]
    ceiling = ratio(big["preadv only, threads=2"].rate, big["preadv only, threads=1"].rate)
    same = res["same"]
    prof = res["profile"]
    lines = [
        f"Measured {C.today()} on {C.machine_info()}; tensorflow {res['tf_version']}.",
        "",
        C.load_note(res["load"]),
        "",
        f"Reproduce: `.venv/bin/python benchmarks/bench_tf.py`{' --quick' if cfg.quick else ''}",
        "",
        f"Data: {cfg.n_items:,} mel items of 100-600 frames x 80 float32 (seed 0; `benchmarks/_common.py`), "
        f"{res['bytes'] / 1e6:.0f} MB per copy, in the page cache; stored plain, lzf and gzip (level 4 + shuffle) "
        "in one h5store file. Every pipeline serves whole items, shuffled, zero-padded with lengths. A timed run "
        f"is whole epochs until {cfg.min_seconds:g} s have passed (or, mid-epoch, {cfg.max_seconds:g} s); each figure is the best of {cfg.repeat} runs "
        f"{'without a warm-up (--quick)' if cfg.quick else 'after one untimed warm-up'}, the pipelines of a table timed in interleaved rounds. 'CPU cores used' is process CPU "
        "time / wall time during the best run (2.0 = both cores busy) and 'CPU us / item' the process CPU time per "
        "item (what the pipeline costs, whatever the machine's load); page faults are minor faults of the whole "
        "process per batch.",
        "",
        "(G) `tf.data.Dataset.from_generator` over h5py: the generator opens the file and yields one example per "
        "call, then `padded_batch` (run in a child process, see below). (T) `f.to_tf_dataset(dict(x=h5s.Item(\"mel\")), "
        "batch_size)`: one `tf.numpy_function` per batch, `num_parallel_calls` as shown. (N) `f.iter_batches(...)`: "
        "numpy batches from background threads, `prefetch=2*threads`.",
        "",
        "### Targets",
        "",
        C.md_table(["target", "measured", ""],
                   [[name, C.fmt_ratio(v), "met" if v == v and v >= want else "**missed**"] for name, v, want in targets]
                   + [["(ceiling: threads doing nothing but `os.preadv`, 2 vs 1, same rounds)", C.fmt_ratio(ceiling),
                       ""]]),
        "",
        "The ceiling row is what this machine gave a second thread during the same rounds: threads that only "
        "copy with `os.preadv` (GIL released, no Python in between). A ratio of h5store's readers near the "
        "ceiling means they scale as far as the machine lets any threads scale; the gap to 2.0 is the "
        "machine's (other sessions' load), not the readers'.",
        "",
        f"Same batches: the first {same['batches']} batches (keys {', '.join(same['keys'])}; whole items, 64-frame "
        "random windows, positions) from `to_tf_dataset`, `iter_batches` and `serve(num_workers=0)` with seed 0: "
        f"**{'equal' if same['equal'] else 'DIFFERENT'}**.",
        "",
        f"### Whole items, batch {cfg.small_batch}: h5store against from_generator",
        "",
        table(small, "G from_generator"),
        "",
        f"### Whole items, batch {cfg.big_batch}, uncompressed: one reader thread against two",
        "",
        table(big, "T calls=1"),
        "",
        f"### Whole items, batch {cfg.big_batch}, gzip (level 4 + shuffle): reads through HDF5",
        "",
        table(gz, "T calls=1"),
        "",
        "### What limits a second reader thread",
        "",
        f"Two reader threads kept {big['N threads=2'].cores:.2f} cores busy (numpy iterator) and "
        f"{big['T calls=2'].cores:.2f} (tf pipeline), where threads that only call preadv kept "
        f"{big['preadv only, threads=2'].cores:.2f}. "
        f"With two threads the numpy iterator's CPU time per item goes from {big['N threads=1'].cpu_us_per_item:.0f} "
        f"to {big['N threads=2'].cpu_us_per_item:.0f} us ({ratio(big['N threads=2'].cpu_us_per_item, big['N threads=1'].cpu_us_per_item):.2f}x), "
        f"the tf pipeline's from {big['T calls=1'].cpu_us_per_item:.0f} to {big['T calls=2'].cpu_us_per_item:.0f} us, "
        f"while threads that only call preadv stay at {big['preadv only, threads=1'].cpu_us_per_item:.0f} / "
        f"{big['preadv only, threads=2'].cpu_us_per_item:.0f} us. The copy itself scales; what does not is the "
        "handing over of the GIL: a padded batch is read with about two GIL-releasing calls per item (one "
        "`os.preadv` per item or chunk piece, one numpy zero-fill per item shorter than the longest), each "
        "separated by a few microseconds of Python (`FileSet.read_padded` / `_pread_scatter`), so two threads "
        "keep handing the GIL to each other and wait for it. Reading a batch with fewer, larger GIL-free calls "
        "(one masked zero-fill per batch instead of one per item, a vectorised piece plan) is the fix, in the "
        "read engine (`h5store/serving/files.py`).",
        "",
        "### Where one reader thread's time goes",
        "",
        f"One thread reading one epoch with `FileDataset.fetch` (batch {cfg.big_batch}, no tensorflow; best of "
        f"{cfg.repeat}): {prof['seconds']:.3f} s, of which {prof['preadv']:.3f} s in `os.preadv` (GIL released: "
        f"{100 * prof['free']:.0f}%, a lower bound: numpy's zero-fill of the padding releases it too). With the "
        f"rest serialised on the GIL, two threads can be at most {prof['bound2']:.2f}x one (Amdahl), on two free "
        "cores.",
        "",
"GIL probe: a Python thread's longest pause while another thread is in one long call (it needs no free "
        "core, only that the Python thread is scheduled at all):",
        "",
        C.md_table(["call", "ms", "Python time stamps during the call", "longest pause ms"],
                   [[name, f"{ms:,.0f}", f"{n:,}", f"{gap:,.1f}"] for name, (ms, n, gap) in res["gil"].items()]),
        "",
        "The copy of the direct read path, the zero-fill of the padding and gzip's inflate let Python run "
        "meanwhile; the control stops it for the whole call. Note the zero-fill's duration: 256 separate 1 MiB "
        "fills, each GIL-free, but between two of them the filling thread must take the GIL back from the Python "
        "loop, which keeps it up to the interpreter's 5 ms switch interval. Many short GIL-free calls separated "
        "by Python pay that hand-over each time: the effect that limits two reader threads (above).",
        "",
        "<details><summary>cProfile of one thread's reads (top functions by own time)</summary>",
        "",
        "```",
        prof["table"],
        "```",
        "</details>",
        "",
        "### from_generator changes the process's malloc",
        "",
        "Once a `from_generator` dataset has run, tensorflow has set glibc's `M_TRIM_THRESHOLD` to 128 kB for the "
        "whole process (it logs 'Memory patch applied'), which also freezes malloc's mmap threshold: large "
        "buffers freed and allocated again can then be fresh mappings, faulted in page by page. The same h5store "
        "pipelines, measured again in this process after one:",
        "",
        table({**{k: small[k] for k in ("T calls=2", "N threads=2", "N threads=2 (no buffer pool)") if k in small},
               **res["patched"]}),
        "",
        "h5store's threaded pipelines take their batch buffers from a `BufferPool` (buffers reused once nothing "
        "refers to them), so their pages stay mapped whatever malloc does; the row without the pool allocates a "
        "new buffer per batch, as most code does: compare its page faults before and after (how many depends on "
        "the sizes malloc sees, so it varies between runs: up to several hundred per batch were measured here). "
        "h5store's own `interleave` does not use from_generator; the baseline (G) runs in a child process so that "
        "it does not change the malloc of the process measuring the others.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, "where the benchmark's file is cached between runs")
    ap.add_argument("--child", nargs=4, metavar=("PATH", "BATCH", "MIN", "MAX"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child[0], int(args.child[1]), float(args.child[2]), float(args.child[3]))
    cfg = QUICK if args.quick else Config()
    load = C.LoadAverage()
    path = build_file(Path(args.cache_dir), cfg.n_items)
    nbytes = C.warm_page_cache([path]) // 3
    early = None
    if cfg.quick:  # started now, waited for below
        early = Baseline(str(path), cfg.small_batch, cfg.min_seconds, cfg.max_seconds, wait=False)
    with C.step("import tensorflow"):
        import tensorflow as tf
    f = C.Mels(path)
    res: dict[str, Any] = {"tf_version": tf.__version__, "bytes": nbytes}
    with C.step("same batches from tf, numpy and torch"):
        res["same"] = same_batches(f, cfg)
    with C.step("start the from_generator child"):
        if early is None:
            baseline = Baseline(str(path), cfg.small_batch, cfg.min_seconds, cfg.max_seconds)
        else:
            baseline = early
            baseline.wait()
    try:
        small = {"G from_generator": baseline.run,
                 **tf_pipes(f, "mel", cfg.small_batch, cfg, {"T calls=1": 1, "T calls=2": 2, "T calls=AUTOTUNE": -1}),
                 **numpy_pipes(f, "mel", cfg.small_batch, cfg, [1, 2]),
                 **numpy_pipes(f, "mel", cfg.small_batch, cfg, [2], pool=False)}
        res["small"] = rounds(small, cfg, f"batch {cfg.small_batch}")
    finally:
        baseline.close()
    big = {**tf_pipes(f, "mel", cfg.big_batch, cfg, {"T calls=1": 1, "T calls=2": 2}),
           **numpy_pipes(f, "mel", cfg.big_batch, cfg, [1, 2]),
           **preadv_pipes(path, cfg.n_items, cfg.big_batch, cfg, [1, 2])}
    res["big"] = rounds(big, cfg, f"batch {cfg.big_batch}")
    gz = {**tf_pipes(f, "mel_gz", cfg.big_batch, cfg, {"T calls=1": 1, "T calls=2": 2}),
          **numpy_pipes(f, "mel_gz", cfg.big_batch, cfg, [1, 2])}
    res["gzip"] = rounds(gz, cfg, f"gzip batch {cfg.big_batch}")
    with C.step("profile of one reader thread"):
        res["profile"] = read_profile(f, cfg.big_batch, cfg.repeat)
    with C.step("GIL probe"):
        res["gil"] = gil_probe(path, cfg.quick)
    res["patched"] = malloc_patch_cost(f, cfg, {"T calls=2", "N threads=2", "N threads=2 (no buffer pool)"})
    res["load"] = load.stop()
    C.publish("tf.data and numpy (issue 5)", report(cfg, res), not args.no_write)
    if not res["same"]["equal"]:
        print("FAILED: tf, numpy and torch batches differ", file=sys.stderr)
    f.close()
    return 0 if res["same"]["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
