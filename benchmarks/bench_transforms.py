"""Batches sized by duration and transforms in workers (issue 15, point 5).

On an LJSpeech-like length distribution (1-10 s of 80-bin mel frames at 100 frames/s), one
epoch of whole items is served four ways, in interleaved rounds, in one process:

(F)  fixed batches of ``B`` items, shuffled (DataLoader's way);
(FB) fixed batches of ``B`` items, length-bucketed (``bucket=True``);
(M)  batches filled up to ``max_frames = B x mean length`` real frames (``max_frames=``);
(MP) the same budget counted in padded frames (``max_frames=, padded=True``).

For each: padding (zero frames over all frames the batches hold), the largest batch in
padded frames (what a GPU must fit), batches per epoch, and real frames/s as a ratio to (F).

Then the cost of transforms: one epoch with 2 DataLoader workers with no transform, with an
identity :class:`~h5store.serving.transforms.Transform` (the per-batch machinery: reading
seeding a generator), and with SpecAugment + gain; and the cost of a reassignment
(``loader.transform = other``: the transform rides with the next batches' index messages),
timed directly.

Run from the repository root::

    .venv/bin/python benchmarks/bench_transforms.py            # writes RESULTS.md
    .venv/bin/python benchmarks/bench_transforms.py --quick --no-write
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import h5store as h5s
from benchmarks import _common as C
from h5store import benchmark as hb
from h5store.serving import transforms as T

HEADING = "Batches sized by duration, transforms in workers (issue 15)"
BATCH = 16


class Mels(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 80))


class Identity(T.Transform):
    """Does nothing, through the whole transform machinery (slot read, generator seeded)."""

    def apply(self, batch: Any, rng: np.random.Generator) -> Any:
        return batch


def ljspeech_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Frames of ``n`` utterances: LJSpeech-like durations (mean ~6.6 s, 1-10 s) at 100 frames/s."""
    rng = np.random.default_rng(seed)
    secs = np.clip(rng.normal(6.6, 2.2, n), 1.0, 10.1)
    return np.round(secs * 100).astype(np.int64)


def build(path: Path, n: int) -> np.ndarray:
    lengths = ljspeech_lengths(n)
    if not path.exists():
        rng = np.random.default_rng(1)
        tmp = path.with_suffix(".tmp.h5")
        with Mels(tmp, mode="w") as f:
            for a in range(0, n, 200):
                f.extend([(f"LJ{i:06d}", {"mel": rng.standard_normal((int(t), 80), dtype=np.float32)})
                          for i, t in zip(range(a, min(n, a + 200)), lengths[a : a + 200].tolist())])
        tmp.rename(path)
    return lengths


def epoch_stats(loader: Any) -> dict[str, float]:
    real = padded = biggest = batches = 0
    for b in loader:
        n = b["x_lengths"].numpy()
        real += int(n.sum())
        size = len(n) * int(b["x"].shape[1])
        padded += size
        biggest = max(biggest, size)
        batches += 1
    return {"padding": 1 - real / padded, "biggest": biggest, "batches": batches, "real": real}


def frames(batch: Any) -> tuple[int, int]:
    """Timed unit: real frames (not items: batches differ in items)."""
    return int(batch["x_lengths"].sum()), int(batch["x"].nbytes)


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, "where the test file is cached")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    n = 300 if args.quick else 1500
    repeat = 1 if args.quick else 5
    # --quick: one timed run of each loader, no warm-up (C.rounds), as short as it can be
    warm = not args.quick
    min_seconds, min_batches = (0.0, 2) if args.quick else (0.5, 40)
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"ljspeech_like_{n}.h5"
    with hb.step(f"build {path}"):
        lengths = build(path, n)
    C.warm_page_cache([path])
    f = h5s.open(path)
    batch = dict(x=h5s.Item("mel"))
    budget = int(BATCH * lengths.mean())
    kinds = {
        "F": dict(batch_size=BATCH),
        "FB": dict(batch_size=BATCH, bucket=True),
        "M": dict(max_frames=budget),
        "MP": dict(max_frames=budget, padded=True),
    }
    loaders = {k: f.serve(batch, shuffle=True, **kw) for k, kw in kinds.items()}
    stats = {k: epoch_stats(ld) for k, ld in loaders.items()}

    with hb.LoadAverage() as load_a:
        timings = C.rounds({k: (lambda ld=ld: hb.time_batches(lambda: ld, min_seconds=min_seconds, whole_epochs=True,
                                                              size=frames))
                            for k, ld in loaders.items()}, repeat, "duration batches", warm_up=warm)

    # -- transforms with 2 workers
    tkinds = {"none": None, "identity": Identity(), "SpecAugment+Gain": T.Compose([
        T.Gain("x", -6, 6, power=True), T.SpecAugment("x", freq_width=15, time_width=40)])}
    tloaders = {k: f.serve(batch, BATCH, shuffle=True, num_workers=2, persistent_workers=True, transform=t)
                for k, t in tkinds.items()}
    with hb.LoadAverage() as load_b:
        ttimings = C.rounds({k: (lambda ld=ld: hb.time_batches(lambda: ld, min_seconds=min_seconds,
                                                               min_batches=min_batches, size=frames))
                             for k, ld in tloaders.items()}, repeat, "transforms, 2 workers", warm_up=warm)

    # -- a reassignment: a new transform rides with the next batches' indices (DataLoader's own
    # index queue pickles them to the worker): its cost is the larger index message.
    import pickle

    from h5store.serving import EpochIndices

    plain = EpochIndices(list(range(BATCH)), 0, 0)
    carrying = EpochIndices(list(range(BATCH)), 0, 0)
    carrying.transform = (1, T.Compose([T.Gain("x", -6, 6, power=True), T.SpecAugment("x")]))
    reps = 20_000 if not args.quick else 2_000

    def round_trip(idx: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            pickle.loads(pickle.dumps(idx))
        return (time.perf_counter() - t0) / reps * 1e6

    plain_us, carry_us = round_trip(plain), round_trip(carrying)
    carry_bytes = len(pickle.dumps(carrying)) - len(pickle.dumps(plain))
    for ld in tloaders.values():
        del ld
    f.close()

    base = timings["F"].rate
    rows = []
    names = {"F": f"(F) fixed {BATCH} items, shuffled", "FB": f"(FB) fixed {BATCH} items, length-bucketed",
             "M": f"(M) max_frames={budget:,} real frames", "MP": f"(MP) max_frames={budget:,} padded frames"}
    for k in kinds:
        s, t = stats[k], timings[k]
        rows.append([names[k], s["batches"], f"{100 * s['padding']:.1f}%", f"{s['biggest']:,}",
                     hb.fmt_rate(t.rate), hb.fmt_ratio(t.rate / base)])
    trows = []
    tbase = ttimings["none"].rate
    for k in tkinds:
        t = ttimings[k]
        trows.append([k, hb.fmt_rate(t.rate), hb.fmt_ratio(t.rate / tbase)])
    cmd = "`.venv/bin/python benchmarks/bench_transforms.py" + (" --quick`" if args.quick else "`")
    text = "\n".join([
        f"Measured {hb.today()}; {C.machine_info()}.",
        "",
        f"Reproduce: {cmd}",
        "",
        f"Data: {n} whole items of 80-bin float32 mel frames, LJSpeech-like lengths (normal, mean 6.6 s, sd 2.2 s, "
        f"clipped to 1-10.1 s, at 100 frames/s: {int(lengths.min())}-{int(lengths.max())} frames, mean "
        f"{lengths.mean():.0f}), in the page cache. In-process (`num_workers=0`), `shuffle=True`; the budget of "
        f"(M) and (MP) is {BATCH} x the mean length, so the batches hold as many frames as (F)'s on average. "
        f"Rates are real (unpadded) frames per second, best of {repeat} interleaved whole epochs, as a ratio to (F).",
        "",
        hb.load_note(load_a.span),
        "",
        hb.md_table(["batches", "per epoch", "padding", "largest batch (padded frames)", "real frames/s", "vs F"],
                    rows),
        "",
        "Padding is the share of zero frames in what the batches hold; the largest batch is what the "
        "accelerator must fit (with fixed batches it is set by the epoch's unluckiest draw of long items).",
        "",
        f"### Transforms in 2 DataLoader workers (batch {BATCH}, whole items, shuffled)",
        "",
        hb.load_note(load_b.span),
        "",
        hb.md_table(["transform", "real frames/s", "vs none"], trows),
        "",
        "The cost of changing the transform during training (`loader.transform = other`): the new transform "
        "travels with the indices of the next batches (at least one per worker), through DataLoader's own index "
        "queue; no file, no extra message:",
        "",
        hb.md_table(["what", "cost"], [
            ["a batch's index message, pickled and unpickled (what DataLoader does per batch)", f"{plain_us:.1f} us"],
            ["the same carrying a new SpecAugment+Gain transform (the next 2 x num_workers batches)",
             f"{carry_us:.1f} us (+{carry_bytes} bytes)"],
            ["a Manager round trip, for comparison (see Serving: shared parameter)", "~64 us per read, every batch"],
        ]),
    ])
    C.publish(HEADING, text, not args.no_write, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
