"""Read paths (issue 13, points 2 and 3): h5store's serving against the memmap reference, in-process and with workers.

Four DataLoaders per workload, timed in interleaved rounds (R and H, in-process and with 2
workers), on a file of ragged mel items (100-600 x 80 float32) stored as bench_serve
stores them (three features written in turn, so chunks of ``mel`` are mostly, not always,
end to end):

(R) the reference: a torch DataLoader over a numpy memmap of the raw float32 data plus an
    offsets table, per-item ``np.array(mm[a:b])``; whole items pad-collated into a numpy
    buffer (``bench_serve.pad_collate``), fixed-size windows collated with ``np.stack``
    (the strongest fair form of each).
(H) ``f.serve`` with ``h5s.Item("mel")`` (batch 16) or ``h5s.Window("mel", 64)`` (batch 32),
    CRC-32 checks on (the default: each item checked the first time the loader serves it).
(H, verify="always") the same, re-checking every whole item each time it is served (what
    the default did before; windows are checked once either way).
(H, np.empty) the same in-process loader with a fresh ``np.empty`` per batch buffer instead
    of the reused buffers of :class:`h5store.serving.buffers.BatchPool` (what the pool buys).

Payload (real frames, padding left out) is reported as a fraction of single-core memcpy
bandwidth measured in the same run. Run from the repository root::

    .venv/bin/python benchmarks/bench_read_paths.py              # full run (~2 min), writes RESULTS.md
    .venv/bin/python benchmarks/bench_read_paths.py --quick --no-write   # smoke run
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch.utils.data import DataLoader

import h5store as h5s
from benchmarks import _common as C
from benchmarks.bench_serve import MemmapDataset, pad_collate, real_frames, shutdown

HEADING = "Read paths (issue 13)"
WINDOW = 64
BATCH = {"item": 16, "window": 32}
WORKERS = 2


@dataclass
class Config:
    n_items: int = 2000
    repeat: int = 5
    min_batches: int = 100
    min_seconds: float = 0.6
    max_seconds: float = 1.5
    quick: bool = False


# The smoke run (tests/test_benchmarks_smoke.py): every loader, one short timed run each without a
# warm-up (C.rounds) or pauses, no garbage collection after each loader, a small memcpy.
QUICK = Config(n_items=200, repeat=1, min_batches=2, min_seconds=0.0, max_seconds=0.3, quick=True)


def stack_collate(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """R's collate for fixed-size windows: one ``np.stack``."""
    return {"x": torch.from_numpy(np.stack([np.asarray(t) for t in items]))}


def build(tmp: str, n: int) -> tuple[str, str, np.ndarray]:
    """The raw float32 file + offsets (R) and the h5store file (H) of the same ``n`` items."""
    data, offsets = C.make_mels(n, seed=0)
    raw = os.path.join(tmp, "mels.f32")
    data.tofile(raw)
    store = os.path.join(tmp, "mels.h5")
    items = C.split(data, offsets)
    with C.Mels(store, mode="w") as f:
        f.extend(C.item_ids(n), {"mel": items, "mel_lzf": items, "mel_gz": items})
    return raw, store, offsets


def loaders(getter: str, raw: str, offsets: np.ndarray, f: h5s.TypedFile) -> dict[str, Any]:
    bs = BATCH[getter]
    win = None if getter == "item" else WINDOW
    collate = pad_collate if getter == "item" else stack_collate
    g = h5s.Item("mel") if getter == "item" else h5s.Window("mel", WINDOW)

    def r(w: int) -> DataLoader:
        return DataLoader(MemmapDataset(raw, offsets, win), batch_size=bs, shuffle=True, num_workers=w,
                          collate_fn=collate, persistent_workers=w > 0)

    def h(w: int, verify: bool | str = True) -> Any:
        kw = {"persistent_workers": True} if w else {}
        return f.serve(dict(x=g), batch_size=bs, shuffle=True, num_workers=w, verify=verify, **kw)

    plain = h(0)
    plain.dataset.files.alloc = np.empty  # the same loader without reused buffers
    out = {"R": r(0), "H": h(0), "H, np.empty": plain}
    if getter == "item":
        out['H, verify="always"'] = h(0, "always")
    out.update({f"R, {WORKERS} workers": r(WORKERS), f"H, {WORKERS} workers": h(WORKERS)})
    if getter == "item":
        out[f'H, {WORKERS} workers, verify="always"'] = h(WORKERS, "always")
    return out


def measure(cfg: Config, raw: str, store: str, offsets: np.ndarray) -> dict[str, dict[str, C.Timing]]:
    f = C.Mels(store)
    out = {}
    for getter in BATCH:
        ls = loaders(getter, raw, offsets, f)
        runs = {name: (lambda lo=lo: C.time_batches(lambda: lo, min_seconds=cfg.min_seconds,
                                                     max_seconds=cfg.max_seconds, min_batches=cfg.min_batches,
                                                     started=iter(lo), size=real_frames))
                for name, lo in ls.items()}
        out[getter] = C.rounds(runs, cfg.repeat, getter, pause=0.0 if cfg.quick else 0.05, warm_up=not cfg.quick)
        for lo in ls.values():
            shutdown(lo, collect=not cfg.quick)
    f.close()
    return out


def ratio(a: C.Timing | None, b: C.Timing | None) -> float:
    return a.rate / b.rate if a is not None and b is not None and b.rate > 0 else float("nan")


def render(res: dict[str, dict[str, C.Timing]], memcpy: float, load: tuple[float, float], cmd: str,
           cfg: Config) -> str:
    w = WORKERS
    lines = [f"Measured {C.today()} with `{cmd}` ({C.machine_info()}). {C.load_note(load)}", "",
             f"{cfg.n_items:,} ragged mel items (100-600 x 80 float32); single-core memcpy {memcpy:.1f} GB/s. "
             f"{cfg.repeat} interleaved rounds of every loader of a workload; best run of each. R: a DataLoader over a "
             "numpy memmap of the raw data (pad-collate for whole items, `np.stack` for windows); H: `f.serve` with "
             "CRC-32 checks on (the default: each item checked the first time the loader serves it; the workers share "
             "what was checked); 'H, verify=\"always\"': every whole item re-checked each time it is served; "
             "'H, np.empty': H in-process with a fresh buffer per batch (no BatchPool).", ""]
    rows = []
    for getter, t in res.items():
        label = f"whole items, batch {BATCH[getter]}" if getter == "item" else f"{WINDOW}-frame windows, batch {BATCH[getter]}"
        for name, tim in t.items():
            base = t.get(f"R, {w} workers") if "workers" in name else t.get("R")
            rows.append([label, name, C.fmt_rate(tim.rate), C.fmt_ratio(ratio(tim, base)),
                         f"{tim.mb_per_s / 1e3:.2f}", f"{tim.mb_per_s / 1e3 / memcpy:.2f}",
                         f"{tim.cores:.2f}", f"{tim.cpu_us_per_item:.1f}", f"{tim.faults_per_batch:.0f}"])
    lines += [C.md_table(["workload", "loader", "items/s", "vs R (same workers)", "payload GB/s",
                          "of memcpy", "main-process cores", "main-process CPU us/item", "faults/batch"], rows), "",
              "Main-process cores below 1 in-process runs mean the run got less than a core (other jobs): "
              "CPU us per item is then the steadier measure of in-process cost (lower is better). R's in-process "
              "cost depends on the allocator: when glibc hands its 3 MB collate buffer back to the kernel after each "
              "batch, every batch faults it in again (faults/batch ~150-230, measured at 53-59 us per whole item in "
              "other processes on this machine); when glibc keeps it (0 faults/batch, as usually in this script's "
              "process), R is at its strongest. H's batch buffers are pooled, so it pays no faults either way.", ""]
    targets = []

    def add(what: str, value: float, goal: float) -> None:
        if value == value:
            targets.append([what, f"{value:.2f}", "met" if value >= goal else "**missed**"])

    for getter, t in res.items():
        label = "whole items" if getter == "item" else "windows"
        add(f"{label}, in-process: H >= 1.5x R", ratio(t.get("H"), t.get("R")), 1.5)
        h = t.get("H")
        if h is not None:
            add(f"{label}, in-process: payload >= 0.4 of memcpy", h.mb_per_s / 1e3 / memcpy, 0.4)
        add(f"{label}, {w} workers: H >= 0.8x H in-process", ratio(t.get(f"H, {w} workers"), t.get("H")), 0.8)
        add(f"{label}, {w} workers: H >= 2.5x R", ratio(t.get(f"H, {w} workers"), t.get(f"R, {w} workers")), 2.5)
    lines += ["Targets (issue 13, points 2 and 3):", "", C.md_table(["target", "measured", ""], targets), ""]
    t = res.get("item", {})
    gains = [[f"whole items, {where}", C.fmt_ratio(ratio(t.get(a), t.get(b)))]
             for where, a, b in (("in-process", "H", 'H, verify="always"'),
                                 (f"{w} workers", f"H, {w} workers", f'H, {w} workers, verify="always"'))
             if a in t and b in t]
    if gains:
        lines += ['What checking each item once per loader gains (H against H, verify="always", same rounds):', "",
                  C.md_table(["workload", "H / H always"], gains), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, "unused")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    cmd = ".venv/bin/python benchmarks/bench_read_paths.py" + (" --quick" if args.quick else "")
    t_start = time.perf_counter()
    load = C.LoadAverage()
    with tempfile.TemporaryDirectory(prefix="h5store-bench-read-") as tmp:
        with C.step(f"build {cfg.n_items:,} items"):
            raw, store, offsets = build(tmp, cfg.n_items)
        C.warm_page_cache([raw, store])
        with C.step("memcpy"):
            memcpy = C.memcpy_gbps(16 << 20, 2) if cfg.quick else C.memcpy_gbps()
        res = measure(cfg, raw, store, offsets)
        span = load.stop()
    C.publish(HEADING, render(res, memcpy, span, cmd, cfg), not args.no_write, t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
