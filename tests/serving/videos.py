"""Small video corpora for the video tests: folders of JPEG frames on disk, packed into files.

Frames are textured (gradients plus noise), so a decoder that got anything wrong (channel
order, subsampling, a shifted row) shows up as a pixel difference, and the JPEG files on
disk are the ground truth: every decode path is compared with PIL's decoding of them.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

import h5store as h5s

H, W = 24, 32


class Clips(h5s.TypedFile):
    video = h5s.EncodedFrames()
    label = h5s.DirLabel()


def frame(seed: int, t: int, grey: bool = False) -> np.ndarray:
    rng = np.random.default_rng([seed, t])
    y, x = np.mgrid[0:H, 0:W]
    base = np.stack([(x * 7 + t * 5) % 256, (y * 9 + seed * 11) % 256, (x * 3 + y * 4 + t) % 256], -1)
    a = np.clip(base + rng.integers(0, 40, base.shape), 0, 255).astype(np.uint8)
    return a[..., :1] if grey else a


def write_corpus(root: Path, lengths: list[int], seed: int = 0, classes: int = 2) -> list[Path]:
    """One folder of JPEG frames per video, ``root/c{k}/v{i}/{t}.jpg``; returns the folders."""
    from PIL import Image

    folders = []
    for i, n in enumerate(lengths):
        d = root / f"c{i % classes}" / f"v{seed}_{i}"
        d.mkdir(parents=True)
        for t in range(n):
            buf = io.BytesIO()
            Image.fromarray(frame(seed * 1000 + i, t)).save(buf, format="JPEG", quality=90)
            (d / f"{t}.jpg").write_bytes(buf.getvalue())
        folders.append(d)
    return folders


def make_files(tmp: Path, lengths_per_file: list[list[int]]) -> list[Path]:
    """One h5store file per list of lengths (videos of file k have seed k)."""
    paths = []
    for k, lengths in enumerate(lengths_per_file):
        src = tmp / f"src{k}"
        write_corpus(src, lengths, seed=k)
        path = tmp / f"videos{k}.h5"
        Clips.create(path, sources=str(src), n_workers=1, progress=False).close()
        paths.append(path)
    return paths


def pil_frames(folder: Path, first: int = 0, stop: int | None = None) -> np.ndarray:
    """PIL's decoding of the source JPEG files ``first..stop-1`` of a video folder: (n, H, W, 3)."""
    from PIL import Image

    files = sorted(folder.glob("*.jpg"), key=lambda p: int(p.stem))[first:stop]
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in files])
