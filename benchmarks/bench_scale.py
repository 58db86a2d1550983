"""Cost that grows the right way (issue 13, point 6): per-item rate and peak RSS from 2k to 200k items.

The same kind of item (20-120 frames x 80 float32, ~22 KB on average) in files of 2,000,
20,000 and 200,000 items (the last ~4.5 GB). For each size, in-process and shuffled:

* the serving rate of whole items (batch 16) and of random 64-frame windows (batch 32),
  the six loaders timed in interleaved rounds in one process, the files in the page cache;
  each size's rate is reported as a ratio to the 2,000-item rate (flat = 1.0x);
* the peak RSS of a fresh process that imports h5store and torch, opens the file, makes the
  loader and serves 400 batches of each kind (``VmHWM``, the high-water RSS), and its growth over the same
  process's RSS after the imports. Growth that rises with the item count is per-item state
  (index tables: 16 bytes per item and feature; checksums: 4; the ids table).

Files are built once and cached in ``--cache-dir``.

Run from the repository root::

    .venv/bin/python benchmarks/bench_scale.py                 # ~6 min plus the first build, writes RESULTS.md
    .venv/bin/python benchmarks/bench_scale.py --quick --no-write
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchmarks import _common as C

ITEM_BATCH = 16
WINDOW = 64
WINDOW_BATCH = 32
FRAMES = (20, 120)
BUILD_SLICE = 10_000
RSS_BATCHES = 400


@dataclass
class Config:
    sizes: tuple[int, ...] = (2_000, 20_000, 200_000)
    repeat: int = 5
    min_batches: int = 150
    min_seconds: float = 0.4
    max_seconds: float = 1.5
    rss_batches: int = RSS_BATCHES
    quick: bool = False


# The smoke run (tests/test_benchmarks_smoke.py): two small files, one timed run of each loader
# without a warm-up (C.rounds), and the fresh processes of the RSS table started together
# (each imports torch, ~2 s; their peaks are their own, whatever runs beside them).
QUICK = Config(sizes=(500, 2_000), repeat=1, min_batches=4, min_seconds=0.0, max_seconds=0.3,
               rss_batches=40, quick=True)


def build(cache: Path, n: int) -> Path:
    """The cached file of ``n`` items (built in slices of 10,000, published by rename)."""
    path = cache / f"scale{n}.h5"
    if path.exists():
        try:
            with C.Small(path) as f:
                if len(f) == n:
                    return path
        except Exception:  # noqa: BLE001 - a stale cache from an older format: rebuild it
            pass
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    need = int(n * (sum(FRAMES) / 2) * C.N_MELS * 4 * 1.1)
    if need > free - (2 << 30):
        raise SystemExit(f"{cache}: {n:,} items need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free; "
                         "pass --cache-dir on a larger disk or --quick")
    tmp = path.with_suffix(".tmp.h5")
    ids = C.item_ids(n)
    with C.step(f"build the cached {n:,}-item file"), C.Small(tmp, mode="w") as f:
        for k, a in enumerate(range(0, n, BUILD_SLICE)):
            b = min(n, a + BUILD_SLICE)
            data, offsets = C.make_mels(b - a, seed=100 + k, lo=FRAMES[0], hi=FRAMES[1])
            f.extend(ids[a:b], {"mel": C.split(data, offsets)})
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- rates
def rates(paths: dict[int, Path], cfg: Config) -> dict[tuple[str, int], C.Timing]:
    """Items/s of whole items and windows at every size, all in interleaved rounds."""
    import h5store as h5s

    files = {n: C.Small(p) for n, p in paths.items()}
    loaders: dict[tuple[str, int], Any] = {}
    for n, f in files.items():
        loaders[("item", n)] = f.serve(dict(x=h5s.Item("mel")), ITEM_BATCH, shuffle=True)
        loaders[("window", n)] = f.serve(dict(x=h5s.Window("mel", WINDOW)), WINDOW_BATCH, shuffle=True)

    def runner(loader: Any) -> Callable[[], C.Run]:
        return lambda: C.time_batches(lambda: loader, min_seconds=cfg.min_seconds, max_seconds=cfg.max_seconds,
                                      min_batches=cfg.min_batches)

    try:
        res = C.rounds({f"{g} {n}": runner(lo) for (g, n), lo in loaders.items()}, cfg.repeat, "scale",
                       warm_up=not cfg.quick)
    finally:
        for f in files.values():
            f.close()
    return {(g, n): res[f"{g} {n}"] for (g, n) in loaders if f"{g} {n}" in res}


# --------------------------------------------------------------------------- memory
def rss_child(path: str, batches: int) -> dict[str, float]:
    """In a fresh process: RSS after the imports, then peak RSS after open + serving."""
    import torch  # noqa: F401 - what a training process has imported anyway

    import h5store as h5s

    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def parts() -> tuple[int, int]:
        """(RssAnon, RssFile + RssShmem) now: private memory, and pages of files mapped."""
        got = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    key, value = line.split(":")
                    got[key] = int(value.split()[0]) * 1024
        return got.get("RssAnon", 0), got.get("RssFile", 0) + got.get("RssShmem", 0)

    base = rss()
    base_anon, base_file = parts()
    peak_anon, peak_file = base_anon, base_file
    f = C.Small(path)
    for getter, bs in ((h5s.Item("mel"), ITEM_BATCH), (h5s.Window("mel", WINDOW), WINDOW_BATCH)):
        loader = f.serve(dict(x=getter), bs, shuffle=True)
        served = 0
        while served < batches:  # epochs follow each other until enough batches were served
            for _ in loader:
                served += 1
                anon, mapped = parts()
                peak_anon, peak_file = max(peak_anon, anon), max(peak_file, mapped)
                if served >= batches:
                    break
        del loader
    opened = rss()
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so a child would report
    # its parent's RSS at fork time.
    with open("/proc/self/status") as fh:
        peak = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    f.close()
    return {"base": base, "after": opened, "peak": peak, "base_anon": base_anon, "peak_anon": peak_anon,
            "base_file": base_file, "peak_file": peak_file}


def memory(paths: dict[int, Path], cfg: Config) -> dict[int, dict[str, float]]:
    out = {}
    if cfg.quick:  # the children side by side
        with C.step(f"peak RSS, fresh processes, {', '.join(f'{n:,}' for n in paths)} items at once (--quick)"):
            procs = {n: subprocess.Popen([sys.executable, __file__, "--rss-child", str(p), str(cfg.rss_batches)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for n, p in paths.items()}
            for n, proc in procs.items():
                stdout, stderr = proc.communicate(timeout=600)
                if proc.returncode:
                    raise subprocess.CalledProcessError(proc.returncode, proc.args, stdout, stderr)
                out[n] = json.loads(stdout.strip().splitlines()[-1])
        return out
    for n, p in paths.items():
        with C.step(f"peak RSS, fresh process, {n:,} items"):
            proc = subprocess.run([sys.executable, __file__, "--rss-child", str(p), str(cfg.rss_batches)],
                                  capture_output=True, text=True, check=True, timeout=600)
            out[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# --------------------------------------------------------------------------- report
def render(paths: dict[int, Path], tp: dict[tuple[str, int], C.Timing], mem: dict[int, dict[str, float]],
           cfg: Config, cmd: str, loads: dict[str, tuple[float, float]]) -> str:
    sizes = list(paths)
    first = sizes[0]
    lines = [
        f"Measured {C.today()} on {C.machine_info()}.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        f"Items of {FRAMES[0]}-{FRAMES[1]} frames x 80 float32 (mean {sum(FRAMES) / 2 * 320 / 1e3:.0f} KB), "
        f"files of {', '.join(f'{n:,}' for n in sizes)} items "
        f"({', '.join(f'{paths[n].stat().st_size / 2**20:,.0f} MiB' for n in sizes)}), built once and cached; "
        "in the page cache while timed (read once before). In-process `f.serve(..., shuffle=True)`, "
        f"the {2 * len(sizes)} loaders timed in {cfg.repeat} interleaved rounds in one process (best run each; "
        "'per round' is the median and range of the ratio to the smallest file over the rounds). Target: flat "
        "(every ratio near 1.0x).",
        "",
        f"### Rate ({C.table_load(loads['rates'])})",
        "",
    ]
    rows = []
    for g, label in (("item", f"whole items, batch {ITEM_BATCH}"), ("window", f"{WINDOW}-frame windows, batch "
                                                                             f"{WINDOW_BATCH}")):
        base = tp.get((g, first))
        for n in sizes:
            t = tp.get((g, n))
            if t is None:
                continue
            r = t.rate / base.rate if base is not None else float("nan")
            rows.append([label, f"{n:,}", C.fmt_rate(t.rate), f"{t.mb_per_s:,.0f}", C.fmt_ratio(r),
                         C.fmt_round_ratios(C.round_ratios(t, base))])
    lines += [C.md_table(["workload", "items", "items/s", "MB/s", f"vs {first:,}", "per round"], rows), ""]
    lines += [f"### Peak RSS, fresh process ({C.table_load(loads['memory'])})", "",
              f"A fresh process imports torch and h5store (RSS 'after imports'), opens the file, serves "
              f"{cfg.rss_batches} batches of whole items and {cfg.rss_batches} of windows; 'peak' is its "
              "`VmHWM` (high-water RSS), 'growth' the peak over the RSS after imports. RSS counts two kinds "
              "of pages, sampled after every batch: private memory (`RssAnon`: tables, buffers, Python "
              "objects: what the process costs) and pages of files it maps (`RssFile` + `RssShmem`: the "
              "data file's pages that reads copied from its mapping, which are the page cache's, shared "
              "with every process and reclaimable, plus the shared checked flags).", ""]
    rows = []

    def per_item(m: dict[str, float], key: str, n: int) -> str:
        f0 = mem.get(first)
        if n == first or f0 is None or f"peak_{key}" not in m:
            return "-"
        g, g0 = m[f"peak_{key}"] - m[f"base_{key}"], f0[f"peak_{key}"] - f0[f"base_{key}"]
        return f"{(g - g0) / max(n - first, 1):,.0f}"

    for n in sizes:
        m = mem.get(n)
        if m is None:
            continue
        growth = m["peak"] - m["base"]
        anon = m.get("peak_anon", float("nan")) - m.get("base_anon", float("nan"))
        mapped = m.get("peak_file", float("nan")) - m.get("base_file", float("nan"))
        rows.append([f"{n:,}", f"{m['base'] / 2**20:,.0f}", f"{m['peak'] / 2**20:,.0f}", f"{growth / 2**20:,.1f}",
                     f"{anon / 2**20:,.1f}", per_item(m, "anon", n), f"{mapped / 2**20:,.1f}", per_item(m, "file", n)])
    lines += [C.md_table(["items", "RSS after imports MiB", "peak RSS MiB", "growth MiB", "private growth MiB",
                          f"private bytes per item beyond {first:,}", "mapped file growth MiB",
                          "mapped bytes per item"], rows), ""]
    flat = [tp[(g, sizes[-1])].rate / tp[(g, first)].rate for g in ("item", "window")
            if (g, sizes[-1]) in tp and (g, first) in tp]
    if flat:
        lines += [f"Largest file against the smallest: rate {', '.join(f'{x:.2f}x' for x in flat)} "
                  f"(whole items, windows); a rate below ~0.8x at {sizes[-1]:,} items means a cost that grows "
                  "with the file (random access over a larger page-cache footprint: TLB and cache misses, "
                  "the index tables themselves).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rss-child":
        print(json.dumps(rss_child(argv[1], int(argv[2]))))
        return 0
    ap = C.parser(__doc__, "where the files of every size are cached between runs")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    cmd = ".venv/bin/python benchmarks/bench_scale.py" + (" --quick" if args.quick else "")
    t_start = time.perf_counter()
    cache = Path(args.cache_dir)
    paths = {n: build(cache, n) for n in cfg.sizes}
    with C.step("warm the page cache"):
        C.warm_page_cache(paths.values())
    loads: dict[str, tuple[float, float]] = {}
    with C.LoadAverage() as load:
        tp = rates(paths, cfg)
    loads["rates"] = load.span
    with C.LoadAverage() as load:
        mem = memory(paths, cfg)
    loads["memory"] = load.span
    C.publish("Scaling: 2k to 200k items (issue 13)", render(paths, tp, mem, cfg, cmd, loads), not args.no_write,
              t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
