"""What checking every served item's CRC-32 costs (issue 11, point 7).

Serving checks each item it delivers against its stored CRC-32 by default (``verify=True``);
``verify=False`` turns it off. This measures the cost on uncompressed mel items (float32,
100-600 frames x 80) read from the page cache, mostly in this process (``FileDataset.fetch``,
no workers, so nothing else hides it):

* whole items, ``Item("mel")``, batch 16: the first time the loader serves an item the CRC-32
  runs over the bytes the batch read (flags in shared memory remember it); later reads are not
  checked; ``verify="always"`` checks at every read;
* the same through ``serve()`` with 2 DataLoader workers (the check runs in the workers);
* 64-frame windows, ``Window("mel", 64)``, batch 32: the first time any part of an item is
  served the whole item is read and checked; later windows of it are not checked.

"first epoch" uses a fresh dataset per run (every item checked), "later epochs" a dataset whose
items were all checked already (8 epochs per timed run).

Runs of ``verify=False`` and ``verify=True`` are interleaved (off, on, off, on...), the best
of each kept; the figure is the ratio on/off. Also recorded: ``zlib.crc32``'s and memcpy's
speed here, and the load average (the machine is shared).

Run from the repository root::

    .venv/bin/python benchmarks/bench_crc.py                  # ~1 min, writes RESULTS.md
    .venv/bin/python benchmarks/bench_crc.py --quick --no-write
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import h5store as h5s
from benchmarks import _common as C
from h5store.checksum import crc32 as _crc32
from h5store.serving import FileDataset

HEADING = "Serving with CRC-32 checks (issue 11)"


class Crc(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, C.N_MELS))


def crc_gbps(crc32: Callable[[memoryview], int] = zlib.crc32, nbytes: int = 64 << 20, times: int = 5) -> float:
    """Best speed of a CRC-32 function over an ``nbytes`` buffer (GB/s)."""
    buf = memoryview(np.random.default_rng(0).standard_normal(nbytes // 8)).cast("B")
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        crc32(buf)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


EPOCHS = 8  # epochs per timed run of a kept dataset


def epoch(ds: FileDataset, batch_size: int, order: np.ndarray) -> tuple[int, int]:
    items = payload = 0
    for a in range(0, len(order), batch_size):
        b = ds.fetch(order[a : a + batch_size], epoch=0)
        items += len(b["x"])
        payload += b["x"].nbytes
    return items, payload


def measure(path: Path, getter: h5s.Getter, batch_size: int, rounds: int, fresh: bool,
            on: bool | str = True) -> tuple[C.Timing, C.Timing]:
    """One epoch of in-process fetches per run, verify off and ``on`` in interleaved rounds.

    ``fresh``: a new dataset per run (made before the clock starts), whose items are all
    checked anew; else one dataset per setting, kept across runs.
    """
    f = Crc(path)
    kept = {v: FileDataset(f, dict(x=getter), verify=v) for v in (False, on)}
    order = np.random.default_rng(1).permutation(len(kept[False]))

    def run(v: bool | str) -> C.Run:
        ds = FileDataset(f, dict(x=getter), verify=v) if fresh else kept[v]
        if fresh:
            return C.timed(lambda: epoch(ds, batch_size, order))

        def epochs() -> tuple[int, int]:  # a run of one epoch (~10 ms) is at the mercy of the scheduler
            done = [epoch(ds, batch_size, order) for _ in range(EPOCHS)]
            return sum(d[0] for d in done), sum(d[1] for d in done)

        return C.timed(epochs)

    # The warm-up run opens descriptors, reads tables and checks the items of the kept datasets.
    timings = C.rounds({f"verify={v}": (lambda v=v: run(v)) for v in (False, on)}, rounds, "fetch",
                       keep_going=False)
    f.close()
    return timings["verify=False"], timings[f"verify={on}"]


def measure_loader(path: Path, rounds: int) -> tuple[C.Timing, C.Timing]:
    """Whole items through ``serve()`` with 2 persistent workers (checks in the workers)."""
    f = Crc(path)
    loaders = {v: f.serve(dict(x=h5s.Item("mel")), batch_size=16, shuffle=True, num_workers=2,
                          persistent_workers=True, verify=v) for v in (False, True)}

    def run(v: bool) -> C.Run:
        return C.time_batches(lambda: loaders[v], min_seconds=0.0, whole_epochs=True,
                              size=lambda b: (len(b["x"]), b["x"].numel() * 4))

    # The warm-up run starts the workers and opens the files.
    timings = C.rounds({f"verify={v}": (lambda v=v: run(v)) for v in (False, True)}, rounds, "serve()",
                       keep_going=False)
    loaders.clear()  # shuts the workers down
    f.close()
    return timings["verify=False"], timings["verify=True"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small file and 2 rounds (a smoke run)")
    ap.add_argument("--no-write", action="store_true", help="do not update benchmarks/RESULTS.md")
    ap.add_argument("--items", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--cache-dir", default=None, help="where the test file is written (default: a temporary folder)")
    args = ap.parse_args()
    n = args.items or (60 if args.quick else 600)
    rounds = args.rounds or (2 if args.quick else 7)
    load = C.LoadAverage()
    with tempfile.TemporaryDirectory(dir=args.cache_dir) as tmp:
        path = Path(tmp) / "crc.h5"
        with C.step(f"write {n} mel items"):
            data, offsets = C.make_mels(n, seed=0)
            with Crc(path, mode="w") as f:
                f.extend(list(zip(C.item_ids(n), ({"mel": m} for m in C.split(data, offsets)))))
            del data
        C.warm_page_cache([path])
        size = path.stat().st_size
        rows = []
        cases = [("whole items, Item('mel'), batch 16, first epoch", h5s.Item("mel"), 16, True, True),
                 ("whole items, Item('mel'), batch 16, later epochs", h5s.Item("mel"), 16, False, True),
                 ("whole items, Item('mel'), batch 16, verify=\"always\" (every epoch)", h5s.Item("mel"), 16, False,
                  "always"),
                 ("64-frame windows, batch 32, first epoch", h5s.Window("mel", 64), 32, True, True),
                 ("64-frame windows, batch 32, later epochs", h5s.Window("mel", 64), 32, False, True)]
        for label, getter, bs, fresh, mode in cases:
            with C.step(label):
                off, on = measure(path, getter, bs, rounds, fresh, mode)
            rows.append([label, C.fmt_rate(off.rate), C.fmt_rate(on.rate), C.fmt_ratio(on.rate / off.rate),
                         f"{(1 - on.rate / off.rate) * 100:.0f}%"])
        with C.step("whole items, 2-worker DataLoader"):
            off, on = measure_loader(path, rounds)
        rows.append(["whole items, batch 16, serve() with 2 workers, later epochs", C.fmt_rate(off.rate), C.fmt_rate(on.rate),
                     C.fmt_ratio(on.rate / off.rate), f"{(1 - on.rate / off.rate) * 100:.0f}%"])
        crc = crc_gbps()
        served = crc_gbps(_crc32)
        mem = C.memcpy_gbps()
    load.stop()
    table = C.md_table(["pipeline (in-process fetch unless said)", "verify=False items/s", "verify on items/s",
                        "ratio", "cost"], rows)
    body = "\n".join([
        f"`.venv/bin/python benchmarks/bench_crc.py` ({C.today()}; {n} items, {size / 2**20:.0f} MiB in the page "
        f"cache, best of {rounds} interleaved rounds).",
        "",
        table,
        "",
        f"The CRC-32 serving computes ({_crc32.__module__}.crc32, the same checksum as zlib's): {served:.1f} GB/s "
        f"here; zlib.crc32: {crc:.2f} GB/s; single-core memcpy: {mem:.1f} GB/s. 'verify on' is verify=True unless "
        "the row says otherwise. Whole items pay one pass of the CRC over the bytes read the first time the loader "
        "serves them (verify=\"always\": every time); a window's item is read whole once (first epoch); later "
        "reads cost one flag lookup per item (the flags are in shared memory: the workers share them).",
        "",
        C.load_note(load.span),
        "",
        C.machine_info(),
    ])
    print(body)
    if not args.no_write:
        C.write_section(HEADING, body)


if __name__ == "__main__":
    main()
