"""Train on mel spectrograms: wavs -> one HDF5 file -> DataLoader -> model -> losses back in the file.

Run: python examples/audio_mel_training.py [--out DIR] [--n-wavs 90] [--steps 150] [--workers 2]

The whole main job of h5store, top to bottom:

1. a schema class (mel spectrogram + class label from the folder + a `logs` group);
2. `create` from a folder of wavs, in parallel worker processes;
3. `serve` random 64-frame windows with their labels to a small torch model, 2 DataLoader workers;
4. write the loss curve into the `logs` group of the same file, and read it back.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from torch import nn

import h5store as h5s

SR = 16000
WAVS = r"(?i)\.wav$"


# 1. The schema: the class is the file's layout; its parameters are stored in the file.
class Speech(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=160, n_mels=64, log="db")  # (frames, 64) per wav
    label = h5s.DirLabel(pattern=WAVS)  # tones/ -> 2, chirps/ -> 0, noise/ -> 1
    logs = h5s.Group(loss=h5s.Array(dtype="float32"))  # one loss curve per training run


def make_wavs(root: Path, n: int, seed: int = 0) -> None:
    """n wavs of 1-3 s in one folder per class: harmonic tones, rising chirps, filtered noise."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        kind = ("tones", "chirps", "noise")[i % 3]
        t = np.arange(int(rng.uniform(1.0, 3.0) * SR)) / SR
        if kind == "tones":
            f0 = rng.uniform(150, 400)
            x = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 4))
        elif kind == "chirps":
            x = np.sin(2 * np.pi * (200 * t + rng.uniform(500, 1500) * t**2))
        else:
            x = np.convolve(rng.standard_normal(t.size), np.ones(6) / 6, mode="same")
        (root / kind).mkdir(parents=True, exist_ok=True)
        sf.write(root / kind / f"{kind}-{i:04d}.wav", (0.3 * x / np.abs(x).max()).astype(np.float32), SR)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--n-wavs", type=int, default=90)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-mel-"))
    torch.manual_seed(0)
    make_wavs(out / "wavs", args.n_wavs)

    # 2. Create: worker processes compute the mels, this process alone writes; the file
    #    appears at its path only when complete. A bad wav would be reported, not fatal.
    f = Speech.create(out / "speech.h5", out / "wavs", n_workers=args.workers, mode="w", progress=False)
    print(f.report.summary())
    print(f"{len(f)} items; first id {f.ids[0]!r} has mel {f.mel[0].shape}; classes {f.features['label'].classes}")

    # 3. Serve: each example is a random 64-frame window of one item (a new offset every
    #    epoch) and its label. Workers reopen the file themselves: nothing h5py is pickled.
    loader = f.serve(dict(x=h5s.Window("mel", 64), y=h5s.Label("label")), batch_size=16, shuffle=True,
                     drop_last=True, num_workers=args.workers, persistent_workers=args.workers > 0)
    model = nn.Sequential(nn.Conv1d(64, 32, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                          nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses: list[float] = []
    t0 = time.perf_counter()
    while len(losses) < args.steps:
        for batch in loader:  # x: (16, 64, 64) float32, y: (16,) int64
            x = (batch["x"].transpose(1, 2) + 40.0) / 40.0  # (batch, mels, frames); dB scaled to about [-1, 1]
            loss = nn.functional.cross_entropy(model(x), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == args.steps:
                break
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s; loss {np.mean(losses[:10]):.2f} -> "
          f"{np.mean(losses[-10:]):.2f}")
    del loader  # stop the workers
    f.close()

    # 4. Log the run into the same file: one writer at a time, committed on close.
    with Speech(out / "speech.h5", mode="a") as w:
        run = f"run-{len(w.logs) + 1}"
        w.logs.add(run, dict(loss=np.array(losses, dtype=np.float32)))
    with Speech(out / "speech.h5") as r:
        curve = r.logs.loss[run]
        print(f"logs/{run}: {len(curve)} losses stored beside {len(r)} mels in {r.path}")
        assert len(curve) == args.steps


if __name__ == "__main__":
    main()
