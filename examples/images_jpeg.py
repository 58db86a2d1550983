"""Images kept as JPEG bytes in one file, decoded in the DataLoader workers, served as uint8 tensors.

Run: python examples/images_jpeg.py [--out DIR] [--n-images 600] [--size 64] [--steps 60] [--workers 2]

A JPEG is several times smaller than its pixels, and the file stores the JPEG bytes as they
are, so it is as small as the image folder. The decoding happens in the DataLoader's worker
processes, in parallel, and the training loop receives a (batch, H, W, 3) uint8 tensor per
batch: 4x fewer bytes to move than float32 (convert and normalise on the device).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import nn

import h5store as h5s

JPEG = r"(?i)\.jpe?g$"


class Pictures(h5s.TypedFile):
    image = h5s.EncodedImage()  # JPEG/PNG bytes stored as they are; decoded to (H, W, C) uint8 on read
    label = h5s.DirLabel(pattern=JPEG)  # circles/ -> 0, squares/ -> 1


def make_jpegs(root: Path, n: int, size: int, seed: int = 0) -> None:
    """n JPEGs: a circle or a square of random colour, place and size on a noisy background."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        kind = ("circles", "squares")[i % 2]
        background = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
        im = Image.fromarray(background)
        r = rng.uniform(0.15, 0.3) * size
        cx, cy = rng.uniform(r, size - r, 2)
        colour = tuple(int(c) for c in rng.integers(120, 256, 3))
        draw = ImageDraw.Draw(im)
        (draw.ellipse if kind == "circles" else draw.rectangle)((cx - r, cy - r, cx + r, cy + r), fill=colour)
        (root / kind).mkdir(parents=True, exist_ok=True)
        im.save(root / kind / f"{i:05d}.jpg", quality=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--n-images", type=int, default=600)
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-images-"))
    torch.manual_seed(0)
    make_jpegs(out / "images", args.n_images, args.size)

    f = Pictures.create(out / "pictures.h5", out / "images", n_workers=args.workers, mode="w", progress=False)
    print(f.report.summary())
    pixels = len(f) * args.size * args.size * 3
    print(f"{len(f)} images in {os.path.getsize(f.path) / 1e6:.1f} MB ({pixels / 1e6:.1f} MB of pixels); "
          f"f.image[0] decodes to {f.image[0].shape} {f.image[0].dtype}")

    # Item("image") reads each example's JPEG bytes and decodes them, in the worker that
    # makes the batch; the batch arrives as one uint8 tensor (no float copy over the pipe).
    loader = f.serve(dict(image=h5s.Item("image"), label=h5s.Label("label")), batch_size=32, shuffle=True,
                     drop_last=True, num_workers=args.workers, persistent_workers=args.workers > 0)
    model = nn.Sequential(nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses: list[float] = []
    t0 = time.perf_counter()
    while len(losses) < args.steps:
        for batch in loader:
            images = batch["image"]  # (32, H, W, 3) uint8
            assert images.dtype == torch.uint8 and images.shape[1:] == (args.size, args.size, 3)
            x = images.permute(0, 3, 1, 2).float() / 255.0  # to NCHW floats in the training process
            loss = nn.functional.cross_entropy(model(x), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == args.steps:
                break
    elapsed = time.perf_counter() - t0
    print(f"{args.steps} steps of 32 images in {elapsed:.1f} s ({args.steps * 32 / elapsed:,.0f} images/s incl. "
          f"training); loss {np.mean(losses[:5]):.2f} -> {np.mean(losses[-5:]):.2f}")


if __name__ == "__main__":
    main()
