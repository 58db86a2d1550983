"""What only a GPU shows (issues 13 and 17): run on a machine with CUDA and torchvision.

1. **Encoded clips decoded on the GPU.** ``h5s.Clips("video", 8, encoded=True)`` served by
   DataLoader workers, decoded by nvJPEG through ``torchvision.io.decode_jpeg(device="cuda")``
   (the example of ``docs/tf_numpy.md``), against h5store's own CPU decode of the same clips
   (``h5s.Clips("video", 8)``, same seed): shapes equal, pixels within nvJPEG's IDCT rounding
   (max and mean absolute difference reported; nvJPEG's IDCT is not libjpeg-turbo's).
2. **Pinned batches.** ``serve(..., pin_memory=True)`` with workers: every tensor of every batch
   is pinned, its values equal the unpinned loader's, and a ``non_blocking`` copy to the GPU
   equals them there. Host-to-device bandwidth of a pinned batch against a pageable one.
3. **Rates** (ratios in one run, interleaved rounds): 8-frame clips/s decoded on the CPU in
   0/2/4/8 workers against encoded clips decoded on the GPU with 0/2 workers; numpy
   ``iter_batches`` with 1 and 2 reader threads; on this machine's idle cores (the 2-core CI
   machine cannot show how the readers scale).

Not one of ``run_all.py``'s scripts (it needs CUDA). Run from the repository root on a machine
with a GPU, h5store importable (``--out FILE`` also writes the report to FILE; ``--no-write``
leaves RESULTS.md alone)::

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import h5store as h5s
from benchmarks import _common as C
from benchmarks.bench_video import Config, make_files

HEADING = "What only a GPU shows (gpu_check.py, issues 13 and 17)"


def _flatten_clips(x: Any, lengths: Any) -> list[Any]:
    import torch

    out = []
    for clip, n in zip(x, np.asarray(lengths).tolist()):
        for j in clip[:n]:
            out.append(torch.frombuffer(bytearray(j), dtype=torch.uint8))
    return out


def gpu_frames(b: dict[str, Any], length: int) -> Any:
    """The doc's example: a batch of encoded clips -> (B, length, H, W, 3) uint8 on the GPU."""
    import torch
    import torchvision

    jpegs = _flatten_clips(b["x"], b["x_lengths"])
    frames = torchvision.io.decode_jpeg(jpegs, device="cuda")
    x = torch.stack(frames)  # (B * length, 3, H, W)
    return x.view(len(b["x"]), length, *x.shape[1:]).permute(0, 1, 3, 4, 2)


def check_decode(paths: list[str], cfg: Config, lines: list[str]) -> None:
    import torch

    f = h5s.concat(paths)
    enc = f.serve(dict(x=h5s.Clips("video", cfg.clip, encoded=True, pad="skip"), p=h5s.Position()),
                  batch_size=cfg.batch, shuffle=True, seed=7, num_workers=2)
    cpu = f.serve(dict(x=h5s.Clips("video", cfg.clip, pad="skip"), p=h5s.Position()),
                  batch_size=cfg.batch, shuffle=True, seed=7, num_workers=2)
    import torchvision

    worst, total, count, over2, batches, cpu_worst, misplaced, psnr_min = 0, 0.0, 0, 0, 0, 0, 0, 1e9
    for be, bc in zip(enc, cpu):
        assert torch.equal(torch.as_tensor(be["p"]), torch.as_tensor(bc["p"])), "same clips in the same order"
        g = gpu_frames(be, cfg.clip)
        c = bc["x"].cuda()
        assert g.shape == c.shape, (g.shape, c.shape)
        d = (g.int() - c.int()).abs()
        # each GPU frame is its own CPU frame (closer to it than to the next clip's same frame)
        per = d.float().flatten(2).mean(-1)
        other = (g.int() - c.roll(1, 0).int()).abs().float().flatten(2).mean(-1)
        misplaced += int((per >= other).sum()) if len(c) > 1 else 0
        psnr_min = min(psnr_min, float((10 * torch.log10(255.0**2 / (d.float() ** 2).flatten(2).mean(-1)
                                                         .clamp_min(1e-9))).min()))
        worst = max(worst, int(d.max()))
        total += float(d.float().sum())
        over2 += int((d > 2).sum())
        count += d.numel()
        # the same bytes through libjpeg-turbo on the CPU (torchvision): h5store's pixels exactly
        t = torch.stack(torchvision.io.decode_jpeg(_flatten_clips(be["x"], be["x_lengths"])))
        t = t.view(len(be["x"]), cfg.clip, *t.shape[1:]).permute(0, 1, 3, 4, 2)
        cpu_worst = max(cpu_worst, int((t.int() - bc["x"].int()).abs().max()))
        batches += 1
    lines.append(f"- Clips(encoded=True) bytes decoded by libjpeg-turbo on the CPU (torchvision.io.decode_jpeg) "
                 f"against h5store's CPU decode (simplejpeg) of the same clips: {batches} batches, max abs diff "
                 f"{cpu_worst} (the served bytes are the stored frames)")
    lines.append(f"- the same bytes decoded on the GPU (nvJPEG, decode_jpeg(device='cuda')): shapes equal, max abs "
                 f"diff {worst}, mean abs diff {total / max(count, 1):.4f}, {100 * over2 / max(count, 1):.3f}% of "
                 f"values off by more than 2, lowest PSNR of a frame {psnr_min:.1f} dB; {misplaced} frames closer to "
                 "another clip's frame than to their own (nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's)")
    assert batches > 0 and cpu_worst == 0 and misplaced == 0 and psnr_min > 25, (cpu_worst, misplaced, psnr_min)


def check_pinned(paths: list[str], cfg: Config, lines: list[str]) -> None:
    import torch

    f = h5s.concat(paths)
    spec = dict(x=h5s.Clips("video", cfg.clip), y=h5s.Label("label"), p=h5s.Position())
    n = 0
    for pinned_workers in (0, 2):
        pinned = f.serve(spec, batch_size=cfg.batch, shuffle=True, seed=3, num_workers=pinned_workers,
                         pin_memory=True)
        plain = f.serve(spec, batch_size=cfg.batch, shuffle=True, seed=3, num_workers=2)
        for bp, bq in zip(pinned, plain):
            for k, v in bp.items():
                if isinstance(v, torch.Tensor):
                    assert v.is_pinned(), f"{k} is not pinned (workers={pinned_workers})"
                    assert torch.equal(v, bq[k]), k
                    g = v.to("cuda", non_blocking=True)
                    torch.cuda.synchronize()
                    assert torch.equal(g.cpu(), bq[k]), k
            n += 1
    lines.append(f"- serve(pin_memory=True) with 0 and 2 workers: {n} batches, every tensor pinned, equal to the "
                 "unpinned loader's, and equal after a non_blocking copy to the GPU")
    # host-to-device: one batch-sized buffer, pinned against pageable
    x = next(iter(plain))["x"]
    big = x.repeat(32, *([1] * (x.dim() - 1))).contiguous()
    pin = big.pin_memory()
    rates = {}
    for name, t in (("pageable", big), ("pinned", pin)):
        best = float("inf")
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        rates[name] = big.numel() * big.element_size() / best / 1e9
    lines.append(f"- host-to-device copy of {big.numel() * big.element_size() / 1e6:.0f} MB: pageable "
                 f"{rates['pageable']:.1f} GB/s, pinned {rates['pinned']:.1f} GB/s "
                 f"({rates['pinned'] / rates['pageable']:.2f}x)")


def _rate(it: Any, clip: int, seconds: float) -> float:
    t0 = time.perf_counter()
    n = 0
    while True:
        for b in it():
            x = b["x"]
            n += len(x)
            if time.perf_counter() - t0 > seconds:
                return n / (time.perf_counter() - t0)


def rates(paths: list[str], cfg: Config, lines: list[str], seconds: float, rounds: int) -> None:
    import torch

    f = h5s.concat(paths)
    dec = dict(x=h5s.Clips("video", cfg.clip, pad="skip"))
    enc = dict(x=h5s.Clips("video", cfg.clip, encoded=True, pad="skip"))

    def torch_cpu(w: int) -> Any:
        loader = f.serve(dec, batch_size=cfg.batch, shuffle=True, num_workers=w, persistent_workers=w > 0)

        def run() -> Any:
            for b in loader:
                b["x"].to("cuda", non_blocking=True)
                yield b
            torch.cuda.synchronize()
        return run

    def torch_gpu(w: int) -> Any:
        loader = f.serve(enc, batch_size=cfg.batch, shuffle=True, num_workers=w, persistent_workers=w > 0)

        def run() -> Any:
            for b in loader:
                gpu_frames(b, cfg.clip)
                yield b
            torch.cuda.synchronize()
        return run

    def numpy_threads(t: int) -> Any:
        def run() -> Any:
            yield from f.iter_batches(dec, batch_size=cfg.batch, shuffle=True, threads=t)
        return run

    cases = {"torch, CPU decode, 0 workers": torch_cpu(0), "torch, CPU decode, 2 workers": torch_cpu(2),
             "torch, CPU decode, 4 workers": torch_cpu(4), "torch, CPU decode, 8 workers": torch_cpu(8),
             "torch, encoded + GPU decode, 0 workers": torch_gpu(0),
             "torch, encoded + GPU decode, 2 workers": torch_gpu(2),
             "numpy iter_batches, 1 thread": numpy_threads(1), "numpy iter_batches, 2 threads": numpy_threads(2)}
    for run in cases.values():  # warm: workers started, pages cached, CUDA initialised
        _rate(run, cfg.clip, 0.5)
    got: dict[str, list[float]] = {k: [] for k in cases}
    load0 = os.getloadavg()[0]
    for _ in range(rounds):
        for k, run in cases.items():
            got[k].append(_rate(run, cfg.clip, seconds))
    load1 = os.getloadavg()[0]
    base = float(np.median(got["torch, CPU decode, 0 workers"]))
    lines.append("")
    lines.append(f"Clips/s, median of {rounds} interleaved rounds of {seconds:.0f} s; {os.cpu_count()} cores; "
                 f"load average {load0:.1f} -> {load1:.1f}")
    lines.append("")
    lines.append("| loader | clips/s | vs torch CPU decode, 0 workers |")
    lines.append("|---|---|---|")
    for k, v in got.items():
        m = float(np.median(v))
        lines.append(f"| {k} | {m:,.0f} | {m / base:.2f}x |")
    med = {k: float(np.median(v)) for k, v in got.items()}
    lines.append("")
    lines.append(f"- torch 2 workers / 0 workers: {med['torch, CPU decode, 2 workers'] / base:.2f}x (target 1.8x); "
                 f"numpy 2 threads / 1: {med['numpy iter_batches, 2 threads'] / med['numpy iter_batches, 1 thread']:.2f}x "
                 "(target 1.7x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="do not write the RESULTS.md section")
    args = ap.parse_args()
    import torch
    import torchvision

    cfg = Config(n_files=2, per_file=24) if args.quick else Config()
    folder = Path(tempfile.mkdtemp(prefix="h5store-gpu-"))
    t0 = time.perf_counter()
    paths = make_files(cfg, folder)
    lines = [f"Device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}, torchvision "
             f"{torchvision.__version__}; {len(paths)} files x {cfg.per_file} videos of {cfg.lo}-{cfg.hi} frames "
             f"({cfg.width}x{cfg.height} JPEG, q{cfg.quality}), clips of {cfg.clip}, batch {cfg.batch}; files made in "
             f"{time.perf_counter() - t0:.1f} s", ""]
    failed = []
    for name, step in (("decode", lambda: check_decode(paths, cfg, lines)),
                       ("pinned", lambda: check_pinned(paths, cfg, lines)),
                       ("rates", lambda: rates(paths, cfg, lines, 0.5 if args.quick else args.seconds,
                                               1 if args.quick else args.rounds))):
        try:
            step()
        except Exception:  # noqa: BLE001 - one failed check must not hide the others' results
            traceback.print_exc()
            failed.append(name)
        print("\n".join(lines), flush=True)
    lines += ["", f"Command: `python benchmarks/gpu_check.py` ({time.strftime('%Y-%m-%d')})."]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not failed:
        C.publish(HEADING, text, not args.no_write and not args.quick)
    if failed:
        sys.exit(f"gpu_check: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
