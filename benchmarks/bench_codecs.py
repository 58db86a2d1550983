"""Compressed features served against the same feature uncompressed (issue 13, point 5).

The same log-mel items are stored uncompressed and with every codec (gzip+shuffle,
lzf+shuffle, zstd (shuffled), blosc:lz4, blosc:zstd, in 64 KiB chunks; blosc:lz4 and zstd
also in 16/32/256 KiB chunks: the sweep behind the default chunk size), in one h5store file. Each codec's serving rate is reported as a ratio to the
UNCOMPRESSED h5store feature (U) of the same file, measured in the same interleaved
rounds, with the same getter, batch size and worker count:

* whole items, batch 16, and 64-frame windows, batch 32;
* ``f.serve`` in-process (workers=0) and with 2 DataLoader workers (fork, persistent);
* ``f.iter_batches`` with 2 reader threads (the numpy/tf.data thread readers' path);
* in-process, zstd decoded by 1 thread (``set_decode_threads(1)``): what the thread pool adds.

Data: log-mels (80 bands, 16 kHz, hop 160, n_fft 512, librosa) of synthetic speech-like
audio (a harmonic source with a gliding pitch through three moving formants, syllable-rate
envelope, pauses and a little noise; items are crops of 40 such utterances (4 with ``--quick``), each with its
own level and spectral tilt), rounded to float16 precision and stored as float32: what a
pipeline that keeps half-precision features produces. Full float32 mantissas
compress ~1.2x with any lossless codec (reported too); the file sizes table gives both.

Run from the repository root::

    .venv/bin/python benchmarks/bench_codecs.py                  # full run (~6 min), writes RESULTS.md
    .venv/bin/python benchmarks/bench_codecs.py --quick --no-write   # < 60 s smoke run
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import h5py
import numpy as np

import h5store as h5s
from benchmarks import _common as C
from h5store.chunk_reader import decode_threads, set_decode_threads

WINDOW = 64
ITEM_BATCH = 16
WINDOW_BATCH = 32
SETTLE_SECONDS = 0.2
SR, HOP, N_FFT = 16000, 160, 512
ROW = C.N_MELS * 4  # bytes per frame


def rows_of(kib: int) -> int:
    """Rows of a chunk of ``kib`` KiB."""
    return (kib << 10) // ROW


#: feature -> (label, Array keywords); "mel" is the uncompressed reference (U). Chunk sizes
#: are explicit, so that the sweep (16-256 KiB) does not depend on the default (32 KiB).
CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    "mel": ("U (uncompressed)", {}),
    "mel_gzip": ("gzip-4 + shuffle, 64 KiB", dict(compression="gzip", compression_opts=4, shuffle=True,
                                                  chunk_rows=rows_of(64))),
    "mel_lzf": ("lzf + shuffle, 64 KiB", dict(compression="lzf", shuffle=True, chunk_rows=rows_of(64))),
    "mel_zstd": ("zstd-3, 64 KiB", dict(compression="zstd", chunk_rows=rows_of(64))),
    "mel_blosc": ("blosc:lz4, 64 KiB", dict(compression="blosc", chunk_rows=rows_of(64))),
    "mel_bloscz": ("blosc:zstd, 64 KiB", dict(compression="blosc:zstd", chunk_rows=rows_of(64))),
    "mel_blosc16": ("blosc:lz4, 16 KiB", dict(compression="blosc", chunk_rows=rows_of(16))),
    "mel_blosc32": ("blosc:lz4, 32 KiB", dict(compression="blosc", chunk_rows=rows_of(32))),
    "mel_zstd32": ("zstd-3, 32 KiB", dict(compression="zstd", chunk_rows=rows_of(32))),
    "mel_zstd256": ("zstd-3, 256 KiB", dict(compression="zstd", chunk_rows=rows_of(256))),
    "mel_blosc256": ("blosc:lz4, 256 KiB", dict(compression="blosc", chunk_rows=rows_of(256))),
}
#: The features whose rates are checked against the 0.8x target.
TARGETED = [k for k in CODECS if k.startswith(("mel_zstd", "mel_blosc"))]


class Codecs(h5s.TypedFile):
    """The same mel items under every codec."""

    locals().update({name: h5s.Array(dtype="float32", shape=(None, C.N_MELS), **kw)
                     for name, (_, kw) in CODECS.items()})


@dataclass
class Config:
    n_items: int = 1500
    repeat: int = 3
    min_batches: int = 60
    min_seconds: float = 0.4
    max_seconds: float = 1.5
    workers: tuple[int, ...] = (0, 2)
    quick: bool = False


# The smoke run (tests/test_benchmarks_smoke.py): every block and pipeline, tiny: 40 items (crops
# of 4 utterances), one timed run each and no warm-up (C.rounds), no settling pause, and no
# garbage collection after each loader (0.3 s each with torch loaded; the workers are stopped
# explicitly all the same).
QUICK = Config(n_items=40, repeat=1, min_batches=2, min_seconds=0.0, max_seconds=0.3, quick=True)


# --------------------------------------------------------------------------- data
def speech_like(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """A voiced, syllabic, speech-like signal: harmonics of a gliding f0 through 3 formants."""
    n = int(SR * seconds)
    t = np.arange(n) / SR
    f0 = rng.uniform(90, 220) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.2, 1.0) * t + rng.uniform(0, 6)))
    phase = 2 * np.pi * np.cumsum(f0) / SR
    formants = [rng.uniform(lo, hi) * (1 + 0.2 * np.sin(2 * np.pi * rng.uniform(1, 4) * t + rng.uniform(0, 6)))
                for lo, hi in ((300, 800), (900, 2200), (2300, 3200))]
    y = np.zeros(n)
    for k in range(1, int(4000 / 90)):
        fk = k * f0
        amp = sum(np.exp(-(((fk - fm) / 150.0) ** 2)) for fm in formants) + 0.02
        y += np.where(fk < SR / 2, amp * np.sin(k * phase), 0.0)
    syll = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, 6)), 0, None) ** 1.5
    pauses = (np.sin(2 * np.pi * 0.3 * t + rng.uniform(0, 6)) > -0.7).astype(float)
    return (y * syll * pauses + 0.003 * rng.standard_normal(n)).astype(np.float32)


def make_items(n: int, seed: int = 0, pool: int = 40) -> list[np.ndarray]:
    """``n`` log-mels of 150-500 frames x 80 of speech-like audio (full float32 precision).

    ``pool`` utterances of 6 s are synthesised and analysed (librosa's STFT and mel filters);
    each item is a crop of one of them with its own level (an offset in the log domain, as a
    louder or quieter recording) and spectral tilt, so no two items hold the same values.
    """
    import librosa

    rng = np.random.default_rng(seed)
    basis = librosa.filters.mel(sr=SR, n_fft=N_FFT, n_mels=C.N_MELS)
    utterances = []
    for _ in range(max(1, min(pool, n // 10))):
        spec = np.abs(librosa.stft(speech_like(rng, 6.0), n_fft=N_FFT, hop_length=HOP)) ** 2
        utterances.append(np.log(basis @ spec + 1e-6).T.astype(np.float32))
    out = []
    bands = np.linspace(-1.0, 1.0, C.N_MELS, dtype=np.float32)
    for _ in range(n):
        u = utterances[int(rng.integers(len(utterances)))]
        frames = int(rng.integers(150, 501))
        a = int(rng.integers(0, len(u) - frames + 1))
        level, tilt = np.float32(rng.uniform(-3, 3)), np.float32(rng.uniform(-0.5, 0.5))
        out.append(np.ascontiguousarray(u[a : a + frames] + level + tilt * bands))
    return out


# --------------------------------------------------------------------------- timing
def real_frames(batch: dict[str, Any]) -> tuple[int, int]:
    x = batch["x"]
    lengths = batch.get("x_lengths")
    frames = int(lengths.sum()) if lengths is not None else x.shape[0] * x.shape[1]
    return int(x.shape[0]), frames * ROW


def shutdown(loader: Any, collect: bool = True) -> None:
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    if collect:
        gc.collect()


def getter(kind: str, feature: str) -> Any:
    return h5s.Item(feature) if kind == "item" else h5s.Window(feature, WINDOW)


def block(f: Any, kind: str, how: str, feats: list[str], cfg: Config, serial: bool = False) -> dict[str, C.Timing]:
    """Interleaved rounds of one getter and one entry point over ``feats`` (+ zstd on 1 thread)."""
    bs = ITEM_BATCH if kind == "item" else WINDOW_BATCH
    loaders: dict[str, Any] = {}

    def make(feat: str) -> Any:
        batch = dict(x=getter(kind, feat))
        if how == "threads":
            return lambda: f.iter_batches(batch, batch_size=bs, shuffle=True, threads=2)
        w = int(how.split("=")[1])
        return f.serve(batch, batch_size=bs, shuffle=True, num_workers=w, persistent_workers=w > 0)

    def runner(name: str, feat: str, threads: int | None) -> Callable[[], C.Run]:
        def run() -> C.Run:
            if name not in loaders:
                loaders[name] = make(feat)
            ld = loaders[name]
            set_decode_threads(threads)
            try:
                if how == "threads":
                    r = C.time_batches(ld, min_seconds=cfg.min_seconds, max_seconds=cfg.max_seconds,
                                       min_batches=cfg.min_batches, size=real_frames)
                else:
                    r = C.time_batches(lambda: ld, min_seconds=cfg.min_seconds, max_seconds=cfg.max_seconds,
                                       min_batches=cfg.min_batches, started=iter(ld), size=real_frames)
            finally:
                set_decode_threads(None)
            if getattr(ld, "num_workers", 0) and not cfg.quick:
                time.sleep(SETTLE_SECONDS)
            return r

        return run

    runs = {feat: runner(feat, feat, None) for feat in feats}
    if serial:
        runs["mel_zstd/1 thread"] = runner("mel_zstd/1 thread", "mel_zstd", 1)
    try:
        return C.rounds(runs, cfg.repeat, f"{kind} {how}", warm_up=not cfg.quick)
    finally:
        for ld in loaders.values():
            shutdown(ld, collect=not cfg.quick)


def sizes(path: str, raw_bytes: int, full_path: str | None) -> list[list[str]]:
    """Stored bytes of every feature: ratio to uncompressed and to gzip."""
    rows = []
    stored: dict[str, int] = {}
    full: dict[str, int] = {}
    with h5py.File(path, "r") as f:
        for name in CODECS:
            stored[name] = f[f"{name}/data"].id.get_storage_size()
    if full_path is not None:
        with h5py.File(full_path, "r") as f:
            for name in CODECS:
                full[name] = f[f"{name}/data"].id.get_storage_size()
    for name, (label, _) in CODECS.items():
        row = [label, f"{stored[name] / 1e6:,.1f}", f"{raw_bytes / stored[name]:.2f}x",
               f"{stored[name] / stored['mel_gzip']:.2f}"]
        row.append(f"{raw_bytes / full[name]:.2f}x" if full else "-")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- report
def render(res: dict[str, Any], cfg: Config, cmd: str) -> str:
    out = [f"Measured {C.today()} on {C.machine_info()}; decode threads per process: {res['threads']} "
           "(`min(4, os.cpu_count())`).", "", C.load_note(res["load"]), "",
           f"Reproduce: `{cmd}` (run twice for this section: both runs are below).", "",
           res["data_note"], "",
           "Each figure is the best of the timed runs of a pipeline (interleaved rounds, "
           f"{'no warm-up: --quick' if cfg.quick else 'one untimed warm-up each'}); vs U is the ratio to the uncompressed feature of the same file, same getter, batch and "
           "workers, in the same rounds. Payload counts real frames (no padding).", ""]
    out += ["### File size", "",
            C.md_table(["feature", "stored MB", "ratio (float16-precision mels)", "size vs gzip",
                        "ratio (full float32 mantissas)"], res["sizes"]), ""]
    targets = []
    for (kind, how), timings in res["blocks"].items():
        u = timings.get("mel")
        rows = []
        for name, t in timings.items():
            label = CODECS[name][0] if name in CODECS else "zstd-3, 64 KiB, decoded by 1 thread"
            ratio = t.rate / u.rate if u is not None and u.rate else float("nan")
            rows.append([label, C.fmt_rate(t.rate), f"{t.mb_per_s:,.0f}", C.fmt_ratio(ratio)])
            if name in TARGETED and how != "threads":
                targets.append([f"{label}: {kind}s, {how}", C.fmt_ratio(ratio), "met" if ratio >= 0.8 else "**missed**"])
        what = "whole items, batch 16" if kind == "item" else "64-frame windows, batch 32"
        entry = "f.iter_batches, 2 reader threads" if how == "threads" else f"f.serve, {how}"
        out += [f"### {what}: {entry}", "", C.md_table(["feature", "items/s", "payload MB/s", "vs U"], rows), ""]
    out[out.index("### File size"):out.index("### File size")] = [
        "### Targets (>= 0.8x the uncompressed feature)", "", C.md_table(["codec, getter, entry", "vs U", ""],
                                                                          targets), ""]
    return "\n".join(out)



def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, "unused")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    cmd = ".venv/bin/python benchmarks/bench_codecs.py" + (" --quick" if args.quick else "")
    t_start = time.perf_counter()
    load = C.LoadAverage()
    res: dict[str, Any] = {"threads": decode_threads()}
    with tempfile.TemporaryDirectory(prefix="h5store-bench-codecs-") as tmp:
        with C.step(f"make {cfg.n_items:,} log-mels of speech-like audio"):
            full = make_items(cfg.n_items)
        half = [m.astype(np.float16).astype(np.float32) for m in full]
        raw = sum(m.nbytes for m in half)
        ids = C.item_ids(cfg.n_items)
        path, full_path = str(Path(tmp) / "codecs.h5"), str(Path(tmp) / "codecs_f32.h5")
        with C.step("write both files"):
            for p, items in ((path, half), (full_path, full)):
                with Codecs(p, mode="w") as f:
                    f.extend(ids, {name: items for name in CODECS})
        lengths = np.array([len(m) for m in half])
        pool = max(1, min(40, cfg.n_items // 10))
        res["data_note"] = (f"Data: {cfg.n_items:,} log-mel items of {lengths.min()}-{lengths.max()} frames x 80 "
                            f"(mean {lengths.mean():.0f}; {raw / 1e6:,.0f} MB uncompressed), crops of {pool} "
                            "synthesised 6 s utterances, each with its own level and spectral tilt, seed 0, in "
                            f"the page cache; chunks as labelled (32 KiB = {rows_of(32)} frames, h5store's default "
                            "for compressed features, chosen by this sweep), 512 KiB uncompressed.")
        res["sizes"] = sizes(path, raw, full_path)
        del full, half
        C.warm_page_cache([path])
        blocks: dict[tuple[str, str], dict[str, C.Timing]] = {}
        f = h5s.open(path)
        for kind in ("item", "window"):
            for w in cfg.workers:
                blocks[(kind, f"workers={w}")] = block(f, kind, f"workers={w}", list(CODECS), cfg, serial=w == 0)
            blocks[(kind, "threads")] = block(f, kind, "threads", ["mel", "mel_zstd", "mel_blosc", "mel_gzip"], cfg)
        f.close()
        res["blocks"] = blocks
        res["load"] = load.stop()
    C.publish("Compressed features (issue 13)", render(res, cfg, cmd), not args.no_write, t_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
