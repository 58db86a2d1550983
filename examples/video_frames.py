"""Videos as sequences of JPEG frames; training reads random clips of K consecutive frames.

Run: python examples/video_frames.py [--out DIR] [--n-videos 100] [--frames 48] [--clip 16] [--steps 20] [--workers 2]

Each video is a folder of frame files (what `ffmpeg -i v.mp4 v/%05d.jpg` writes). The file
keeps every frame's JPEG bytes apart ("blobs" layout), so a clip reads and decodes only
its K frames, never the whole video. `h5s.Window("video", K)` draws a random clip per
example, reproducible from (seed, epoch, index): a new clip every epoch, the same clip
when the epoch is replayed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

import h5store as h5s


class Videos(h5s.TypedFile):
    video = h5s.EncodedFrames()  # a folder of frames -> one item of JPEG blobs; decoded (K, H, W, 3) uint8
    label = h5s.DirLabel()  # left/ -> 0, right/ -> 1 (the folder holding the video's folder)


def make_videos(root: Path, n: int, frames: int, height: int = 72, width: int = 96, seed: int = 0) -> None:
    """n videos of about `frames` frames: a bright square moving left or right over noise."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        kind = ("left", "right")[i % 2]
        folder = root / kind / f"clip{i:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        k = int(rng.integers(frames * 3 // 4, frames * 5 // 4 + 1))
        x, y, step = rng.uniform(0, width), rng.uniform(8, height - 24), rng.uniform(1, 3)
        for t in range(k):
            frame = rng.integers(0, 60, (height, width, 3), dtype=np.uint8)
            col = int(x + (step if kind == "right" else -step) * t) % width
            frame[int(y) : int(y) + 16, col : col + 16] = (250, 220, 60)
            Image.fromarray(frame).save(folder / f"{t + 1:05d}.jpg", quality=85)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--n-videos", type=int, default=100)
    p.add_argument("--frames", type=int, default=48, help="about this many frames per video")
    p.add_argument("--clip", type=int, default=16, help="K: frames per training clip")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-video-"))
    torch.manual_seed(0)
    make_videos(out / "videos", args.n_videos, args.frames)

    f = Videos.create(out / "videos.h5", out / "videos", n_workers=args.workers, mode="w", progress=False)
    print(f.report.summary())
    first = f.ids[0]
    print(f"{len(f)} videos, {int(f.video.lengths.sum()):,} frames, {os.path.getsize(f.path) / 1e6:.1f} MB; "
          f"{first!r}: {f.video.lengths[0]} frames")
    clip = np.stack(f.video.blobs(first, 5, 5 + args.clip))  # reads and decodes frames 5..5+K-1 only
    print(f"frames 5-{4 + args.clip} of {first!r}: {clip.shape} {clip.dtype}")

    # One random clip of K consecutive frames per example, decoded in the workers.
    batch = dict(clip=h5s.Window("video", args.clip), label=h5s.Label("label"))
    loader = f.serve(batch, batch_size=8, shuffle=True, drop_last=True, num_workers=args.workers,
                     persistent_workers=args.workers > 0)

    # Clips are reproducible: the same (seed, epoch) gives the same clips, another epoch others.
    ds = loader.dataset
    a, b, c = ds.fetch([0, 1], epoch=0), ds.fetch([0, 1], epoch=0), ds.fetch([0, 1], epoch=1)
    assert np.array_equal(a["clip"], b["clip"]) and a["clip"].shape == (2, args.clip, 72, 96, 3)
    moved = not np.array_equal(a["clip"], c["clip"])
    print(f"epoch 0 twice: the same clips; epoch 1: {'new' if moved else 'the same'} clips")

    model = nn.Sequential(nn.Conv3d(3, 8, (3, 5, 5), stride=(1, 2, 2)), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
                          nn.Flatten(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    seen, t0 = 0, time.perf_counter()
    while seen < args.steps:
        for batch in loader:
            clips = batch["clip"]  # (8, K, H, W, 3) uint8
            assert clips.dtype == torch.uint8 and clips.shape[1] == args.clip
            x = clips.permute(0, 4, 1, 2, 3).float() / 255.0  # (batch, channels, K, H, W)
            loss = nn.functional.cross_entropy(model(x), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += 1
            if seen == args.steps:
                break
    elapsed = time.perf_counter() - t0
    print(f"{args.steps} batches of 8 clips x {args.clip} frames in {elapsed:.1f} s "
          f"({args.steps * 8 / elapsed:,.0f} clips/s incl. training), last loss {loss.item():.2f}")


if __name__ == "__main__":
    main()
