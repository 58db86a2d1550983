"""The h5store demo: the whole story on your machine, with no downloads.

1. Make a small speech-like corpus: wavs at 22.05 kHz in class folders (tones, chirps, noise)
   plus an LJSpeech-style metadata.csv.
2. Pack it in parallel with `h5store create` into one file: mel + magnitude + label + text.
3. Print `h5store info`.
4. Train a tiny classifier through `f.serve(...)` with 2 DataLoader workers.
5. Append the loss curve and a checkpoint to the same file (logs / checkpoints groups).

A second run reuses the corpus and the packed file (the create only adds what is missing).
Usage: python examples/demo.py [--out demo-data] [--n-wavs 300] [--steps 300]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SR = 22050
CLASSES = ("chirps", "noise", "tones")


def make_corpus(root: Path, n: int, seed: int = 0) -> None:
    """n wavs of 1-6 s in one folder per class, and metadata.csv (id|text|normalized text)."""
    import soundfile as sf

    if (root / "metadata.csv").exists() and len(list(root.rglob("*.wav"))) >= n:
        print(f"corpus: reusing {root}")
        return
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        kind = CLASSES[i % 3]
        dur = rng.uniform(1.0, 6.0)
        t = np.arange(int(dur * SR)) / SR
        if kind == "tones":
            f0 = rng.uniform(110, 440)
            x = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 5))
            text = f"a tone at {f0:.0f} hertz"
        elif kind == "chirps":
            f0, f1 = rng.uniform(100, 500), rng.uniform(1000, 4000)
            x = np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * dur)))
            text = f"a chirp from {f0:.0f} to {f1:.0f} hertz"
        else:
            x = np.convolve(rng.standard_normal(t.size), np.ones(8) / 8, mode="same")
            text = "soft noise"
        x = 0.3 * x / np.max(np.abs(x))
        uid = f"{kind}-{i:04d}"
        (root / kind).mkdir(parents=True, exist_ok=True)
        sf.write(root / kind / f"{uid}.wav", x.astype(np.float32), SR, subtype="PCM_16")
        rows.append(f"{uid}|{text}|{text}")
    (root / "metadata.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    print(f"corpus: {n} wavs in {root}")


def pack(corpus: Path, out: Path) -> None:
    """`h5store create` in 2 workers; an existing file only gets what it lacks."""
    cmd = [sys.executable, "-m", "h5store.cli", "create", "speech_schema:Speech", str(out), str(corpus),
           "--workers", "2"]
    if out.exists():
        cmd.append("--append")
    print("$", " ".join(["h5store", *cmd[3:]]))
    subprocess.run(cmd, cwd=HERE, check=True)
    print("$ h5store info", out)
    subprocess.run([sys.executable, "-m", "h5store.cli", "info", str(out)], check=True)


def train(out: Path, steps: int) -> None:
    import torch
    from speech_schema import Speech
    from torch import nn

    import h5store as h5s

    torch.manual_seed(0)
    f = Speech(out)
    batch_size = min(32, len(f))  # drop_last with fewer items than a batch would give no batch at all
    loader = f.serve(dict(x=h5s.Window("mel", 64), y=h5s.Item("label")), batch_size=batch_size, shuffle=True,
                     num_workers=2, persistent_workers=True, drop_last=True)
    model = nn.Sequential(
        nn.Conv1d(80, 64, 5, padding=2), nn.ReLU(), nn.Conv1d(64, 64, 5, padding=2), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, len(CLASSES)),
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses: list[float] = []
    step, seen, t0 = 0, 0, time.perf_counter()
    print(f"train: {steps} steps, batch {batch_size}, 2 workers, {len(f)} items")
    while step < steps:
        for batch in loader:
            x = (batch["x"].transpose(1, 2) + 40.0) / 40.0  # (B, 80, 64), dB scaled to ~[-1, 1]
            loss = nn.functional.cross_entropy(model(x), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            seen += len(batch["y"])
            if step % 50 == 0 or step == steps:
                rate = seen / (time.perf_counter() - t0)
                acc = float((model(x).argmax(1) == batch["y"]).float().mean())
                print(f"  step {step:4d}  loss {np.mean(losses[-50:]):.3f}  batch acc {acc:.2f}  {rate:,.0f} items/s")
            if step == steps:
                break
    del loader
    f.close()

    # Append the run to the same file: one writer, committed on close.
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    with Speech(out, mode="a") as w:
        run = f"run-{len(w.logs) + 1}"
        w.logs.add(run, dict(loss=np.array(losses, dtype=np.float32)))
        w.checkpoints.add(run, dict(state=np.frombuffer(buf.getvalue(), dtype=np.uint8)))
    with Speech(out) as r:
        state = torch.load(io.BytesIO(r.checkpoints.state[run].tobytes()), weights_only=True)
        print(f"logs: {run} stored {len(r.logs.loss[run])} losses and a checkpoint of {len(state)} tensors "
              f"in {out.name} (runs so far: {', '.join(r.logs.ids)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="demo-data", help="folder for the corpus and the packed file")
    p.add_argument("--n-wavs", type=int, default=300)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE))
    out_dir = Path(args.out).resolve()
    t0 = time.perf_counter()
    make_corpus(out_dir / "corpus", args.n_wavs)
    pack(out_dir / "corpus", out_dir / "speech.h5")
    train(out_dir / "speech.h5", args.steps)
    print(f"demo: done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
