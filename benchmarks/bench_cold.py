"""Cold-cache serving (issue 13, point 6): h5store's rate from disk against the disk's own limit.

A file of ~1 GiB (``--quick``: 16 MiB) of mel items (100-600 frames x 80 float32) is evicted
from the page cache (``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)``) before every timed
run. Each round times, in this order, after an eviction each:

* the baseline: a plain sequential read of the whole file in 1 MiB reads (``dd``-like) --
  the disk's own limit;
* ``f.serve(dict(x=h5s.Item("mel")), 16, shuffle=...)`` for one epoch (or ``--max-seconds``)
  in order (``shuffle=False``), uniformly shuffled (``True``) and quasi-random
  (``"chunks"``: shuffled blocks of ~4 MB, shuffled within windows of 8 blocks), in-process
  and with 2 workers.

Each serving rate is in bytes of item data per second and reported as a fraction of the
sequential read of the same round. The eviction is checked (``mincore`` residency of the
file's pages before and after, and the time of a read right after eviction against a warm
one); if the disk (or the host's cache beneath a VM's disk) is so fast that evicted reads
are as fast as cached ones, the report says so.

Run from the repository root::

    .venv/bin/python benchmarks/bench_cold.py                 # ~5 min plus the first build, writes RESULTS.md
    .venv/bin/python benchmarks/bench_cold.py --quick --no-write
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks import _common as C

BATCH = 16
READ_SIZE = 1 << 20
ORDERS = {"in order": False, "shuffled": True, "quasi-random": "chunks"}


@dataclass
class Config:
    target_bytes: int = 1 << 30
    repeat: int = 3
    max_seconds: float = 15.0
    workers: tuple[int, ...] = (0, 2)
    quick: bool = False


# The smoke run (tests/test_benchmarks_smoke.py): every pipeline on a small file, one timed run of
# each without a warm-up (C.rounds).
QUICK = Config(target_bytes=16 << 20, repeat=1, max_seconds=5.0, quick=True)


# --------------------------------------------------------------------------- page cache
def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (clean pages; the file is not being written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (``mincore`` on a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return float((np.frombuffer(vec, np.uint8) & 1).mean())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def sequential_read(path: Path) -> C.Run:
    """The whole file in 1 MiB reads into one reused buffer: the disk's sequential rate."""
    buf = bytearray(READ_SIZE)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            total += n
    return C.Run(1, time.perf_counter() - t0, total)


# --------------------------------------------------------------------------- data
def build(cache: Path, target: int) -> Path:
    """The cached file of ~``target`` bytes of mel items."""
    path = cache / f"cold{target >> 20}M.h5"
    mean = (100 + 600) / 2 * C.N_MELS * 4
    n = max(64, int(target / mean))
    if path.exists():
        try:
            with C.Small(path) as f:
                if len(f) == n:
                    return path
        except Exception:  # noqa: BLE001 - a stale cache from an older format: rebuild it
            pass
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.h5")
    ids = C.item_ids(n)
    with C.step(f"build the cached {n:,}-item file (~{target >> 20} MiB)"), C.Small(tmp, mode="w") as f:
        for k, a in enumerate(range(0, n, 1000)):
            b = min(n, a + 1000)
            data, offsets = C.make_mels(b - a, seed=200 + k)
            f.extend(ids[a:b], {"mel": C.split(data, offsets)})
    os.replace(tmp, path)
    return path


def item_bytes(batch: dict[str, Any]) -> tuple[int, int]:
    """Items of a padded batch and the bytes of their frames (padding left out)."""
    x, lengths = batch["x"], batch["x_lengths"]
    return len(x), int(lengths.sum()) * C.N_MELS * 4


# --------------------------------------------------------------------------- runs
def measure(path: Path, cfg: Config, residual: list[float]) -> dict[str, C.Timing]:
    """Every pipeline's timed runs; ``residual`` gets the fraction of the file's pages still
    resident right after each eviction."""
    import h5store as h5s

    f = C.Small(path)
    loaders: dict[str, Any] = {}

    def make(order: Any, w: int) -> Any:
        # Workers end with each epoch: a process that maps the file keeps its pages resident
        # (POSIX_FADV_DONTNEED leaves mapped pages alone), so none may outlive a run.
        return f.serve(dict(x=h5s.Item("mel")), BATCH, shuffle=order, num_workers=w)

    def release() -> None:
        """Every loader's readers closed in this process: their mapping of the file goes."""
        for lo in loaders.values():
            lo.dataset.close()
        gc.collect()

    def run_loader(name: str, order: Any, w: int) -> Callable[[], C.Run]:
        def run() -> C.Run:
            if name not in loaders:
                loaders[name] = make(order, w)
            release()
            evict(path)
            residual.append(resident_fraction(path))  # the eviction held, open loaders and all
            return C.time_batches(lambda: loaders[name], min_seconds=0.0, max_seconds=cfg.max_seconds,
                                  whole_epochs=True, size=item_bytes)

        return run

    def run_seq() -> C.Run:
        release()
        evict(path)
        residual.append(resident_fraction(path))
        return sequential_read(path)

    runs: dict[str, Callable[[], C.Run]] = {"sequential read": run_seq}
    for w in cfg.workers:
        for label, order in ORDERS.items():
            runs[f"{label}, {w} workers" if w else f"{label}, in-process"] = run_loader(
                f"{label} {w}", order, w)
    # The baseline again at the end of each round: a disk with a cache of its own beneath
    # (a VM's host) reads faster the second time, and this shows by how much.
    runs["sequential read, end of round"] = run_seq
    try:
        return C.rounds(runs, cfg.repeat, "cold", warm_up=not cfg.quick)
    finally:
        for lo in loaders.values():
            it = getattr(lo, "_iterator", None)
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
        f.close()
        gc.collect()


def check_eviction(path: Path) -> dict[str, float]:
    """Residency and read times: warm, right after eviction, and warm again."""
    C.warm_page_cache([path])
    out = {"resident warm": resident_fraction(path)}
    warm = sequential_read(path)
    evict(path)
    out["resident evicted"] = resident_fraction(path)
    cold = sequential_read(path)
    out["resident after read"] = resident_fraction(path)
    out["warm MB/s"] = warm.payload / warm.seconds / 1e6
    out["cold MB/s"] = cold.payload / cold.seconds / 1e6
    return out


# --------------------------------------------------------------------------- report
def per_round(t: C.Timing, base: C.Timing) -> list[float]:
    """Bytes/s of each of ``t``'s runs over the sequential read of the same round."""
    return [(a.payload / a.seconds) / (b.payload / b.seconds) for a, b in zip(t.runs, base.runs)]


def render(path: Path, res: dict[str, C.Timing], ev: dict[str, float], cfg: Config, cmd: str,
           loads: dict[str, tuple[float, float]]) -> str:
    size = path.stat().st_size
    base = res.get("sequential read")
    lines = [
        f"Measured {C.today()} on {C.machine_info()}.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        f"A file of {size / 2**20:,.0f} MiB (mel items of 100-600 frames x 80 float32, one feature, "
        "uncompressed), evicted from the page cache with `posix_fadvise(POSIX_FADV_DONTNEED)` before each "
        f"timed run; {cfg.repeat} interleaved rounds, each: a plain sequential read of the whole file in 1 MiB "
        f"reads (the disk's limit), then `f.serve(dict(x=h5s.Item(\"mel\")), {BATCH}, shuffle=...)` for one "
        f"epoch or {cfg.max_seconds:g} s, in-process and with 2 workers, then the sequential read again (a disk "
        "with a cache beneath it, such as a VM's host, reads faster the second time: this row shows how much). "
        "Serving rates are bytes of item data per second, as a fraction of the first sequential read of the "
        "same round (median and range over the rounds).",
        "",
        f"### Eviction check ({C.table_load(loads['check'])})",
        "",
        C.md_table(["", "value"], [
            ["pages resident after a full read", f"{ev['resident warm']:.0%}"],
            ["pages resident after `POSIX_FADV_DONTNEED`", f"{ev['resident evicted']:.0%}"],
            ["sequential read, warm", f"{ev['warm MB/s']:,.0f} MB/s"],
            ["sequential read right after eviction", f"{ev['cold MB/s']:,.0f} MB/s"],
            ["most pages resident right after an eviction, over every timed run",
             f"{ev.get('residual max', float('nan')):.1%}"],
        ]),
        "",
    ]
    if ev["cold MB/s"] > 0.7 * ev["warm MB/s"]:
        lines += ["**The disk is about as fast as the page cache here** (evicted reads reach "
                  f"{ev['cold MB/s'] / ev['warm MB/s']:.0%} of warm ones; a VM disk backed by the host's cache): "
                  "the orders below differ little for that reason, not because order does not matter on a real "
                  "disk or a network file system.", ""]
    lines += [f"### Serving from a cold cache ({C.table_load(loads['measure'])})", ""]
    rows = []
    for name, t in res.items():
        if base is None:
            break
        mbs = t.mb_per_s
        if name == "sequential read":
            rows.append([name, f"{mbs:,.0f}", "-", "1.00x"])
            continue
        rr = per_round(t, base)
        rows.append([name, f"{mbs:,.0f}", "-" if name.startswith("sequential") else C.fmt_rate(t.rate),
                     C.fmt_round_ratios(rr)])
    lines += [C.md_table(["pipeline", "MB/s (best run)", "items/s", "of the sequential read, per round"], rows), ""]
    gains = []
    for w in cfg.workers:
        where = f"{w} workers" if w else "in-process"
        q, s = res.get(f"quasi-random, {where}"), res.get(f"shuffled, {where}")
        if q is not None and s is not None:
            gains.append(f"{where} {C.fmt_round_ratios(C.round_ratios(q, s))}")
    if gains:
        lines += [f"Quasi-random over uniformly shuffled, per round: {'; '.join(gains)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, "where the cold-read file is cached between runs")
    ap.add_argument("--max-seconds", type=float, default=None, help="cap of one timed epoch")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.max_seconds:
        cfg.max_seconds = args.max_seconds
    if not hasattr(os, "posix_fadvise"):
        print("os.posix_fadvise is not available on this platform: no cold-cache figures", file=sys.stderr)
        return 0
    cmd = ".venv/bin/python benchmarks/bench_cold.py" + (" --quick" if args.quick else "")
    t_start = time.perf_counter()
    path = build(Path(args.cache_dir), cfg.target_bytes)
    loads: dict[str, tuple[float, float]] = {}
    with C.LoadAverage() as load, C.step("eviction check"):
        ev = check_eviction(path)
    loads["check"] = load.span
    with C.LoadAverage() as load:
        residual: list[float] = []
        res = measure(path, cfg, residual)
    loads["measure"] = load.span
    ev["residual max"] = max(residual) if residual else float("nan")
    C.publish("Cold cache: serving from disk (issue 13)", render(path, res, ev, cfg, cmd, loads), not args.no_write,
              t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
