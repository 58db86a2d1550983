"""A/B: an epoch of ``iter_batches`` with the read-only copies kept from the last one (B) against
copies opened afresh each epoch (A, as before 2026-11-27), in interleaved rounds.

Usage: python benchmarks/ab_kept_copies.py [CACHE_DIR] [ROUNDS]

The video benchmark's files (4 x 100 videos, ``benchmarks/bench_video.py``, built in CACHE_DIR
once); ``h5s.concat(paths).iter_batches(dict(x=h5s.Clips("video", 8), y=h5s.Label("label")), 16,
shuffle=True, threads=T, epoch=e)`` called once per epoch for 3 s after a warm-up epoch, T = 1
and 2. A disables the keeping (``FileSet._kept_files`` returns None); B is the library as it is.
Prints clips/s and CPU ms per clip of every run, then the best of each and B/A per round.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import h5store as h5s
import h5store.serving.files as files_module
from benchmarks.bench_video import Config, make_files


def run(paths: list[str], keep: bool, threads: int, seconds: float = 3.0) -> tuple[float, float]:
    """clips/s and CPU ms per clip of ``iter_batches`` once per epoch for ``seconds``."""
    files_module.FileSet._kept_files = KEPT if keep else (lambda self, files: None)  # type: ignore[method-assign]
    clip = dict(x=h5s.Clips("video", 8), y=h5s.Label("label"))
    multi = h5s.concat(paths)
    for _ in multi.iter_batches(clip, 16, shuffle=True, threads=threads):
        pass  # a warm-up epoch: every item checked once
    n = epoch = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        for b in multi.iter_batches(clip, 16, shuffle=True, threads=threads, epoch=epoch):
            n += len(b["y"])
        epoch += 1
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n * 1e3


KEPT = files_module.FileSet._kept_files

if __name__ == "__main__":
    cache = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "h5store-bench-cache"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    paths = make_files(Config(), cache)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for threads in (1, 2):
            for mode in ("A", "B") if r % 2 == 0 else ("B", "A"):
                rate, cpu = run(paths, mode == "B", threads)
                rates.setdefault((mode, threads), []).append(rate)
                print(f"round {r} threads={threads} {mode}: {rate:,.0f} clips/s, {cpu:.3f} ms CPU per clip, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    for threads in (1, 2):
        a, b = np.array(rates[("A", threads)]), np.array(rates[("B", threads)])
        print(f"threads={threads}: best A {a.max():,.0f}, best B {b.max():,.0f} clips/s, B/A {b.max() / a.max():.2f}x; "
              f"per round {', '.join(f'{x:.2f}x' for x in b / a)}")
