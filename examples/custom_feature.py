"""A user-defined Feature: its own parameters, its own `pattern`, its own `load`.

Run: python examples/custom_feature.py [--out DIR] [--n 40]

The feature here computes a frame-wise RMS loudness curve from audio files. Parameters are
annotated class attributes: they are validated when the schema class is defined, stored in the
file, and restored by `h5store.open` (once this module is imported, the type is registered).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

import h5store as h5s


class Loudness(h5s.Feature):
    """Frame-wise RMS in dB of an audio file: shape (frames,), float32."""

    type_name = "examples.Loudness"  # stable name, stored in the file
    frame: int = 1024  # samples per frame
    floor_db: float = -80.0
    dtype: str = "float32"
    shape: tuple = (None,)
    pattern: str = r"(?i)\.(wav|flac)$"  # which sources this feature loads
    finite: bool = True  # refuse NaN/inf

    def problems(self) -> list[str]:
        out = super().problems()
        if self.frame <= 0:
            out.append(f"frame must be > 0, got {self.frame}")
        return out

    def load(self, source: str) -> np.ndarray:
        x, _ = sf.read(source, dtype="float32", always_2d=True)
        x = x.mean(axis=1)
        n = len(x) // self.frame
        if n == 0:
            raise h5s.SourceError(f"{source}: shorter than one frame ({len(x)} < {self.frame} samples)")
        rms = np.sqrt((x[: n * self.frame].reshape(n, self.frame) ** 2).mean(axis=1))
        return np.maximum(20 * np.log10(rms + 1e-12), self.floor_db)


class Clips(h5s.TypedFile):
    loudness = Loudness(frame=512)
    label = h5s.DirLabel(pattern=r"(?i)\.(wav|flac)$")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--n", type=int, default=40)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-custom-"))
    rng = np.random.default_rng(0)
    for i in range(args.n):
        kind = ("loud", "quiet")[i % 2]
        (out / "clips" / kind).mkdir(parents=True, exist_ok=True)
        gain = 0.8 if kind == "loud" else 0.05
        sf.write(out / "clips" / kind / f"c{i:03d}.wav", (gain * rng.uniform(-1, 1, 8000)).astype("float32"), 16000)
    (out / "clips" / "quiet" / "tiny.wav").write_bytes(b"")  # a broken source: reported, not fatal

    f = Clips.create(out / "clips.h5", out / "clips", n_workers=2, mode="w", progress=False)
    print(f.report.summary())
    for failure in f.report.failures:
        print("  failed:", failure)
    loud = [f.loudness[i].mean() for i in f.ids if f.label[i] == f.features["label"].classes.index("loud")]
    quiet = [f.loudness[i].mean() for i in f.ids if f.label[i] == f.features["label"].classes.index("quiet")]
    print(f"mean loudness: loud {np.mean(loud):.1f} dB, quiet {np.mean(quiet):.1f} dB")
    assert np.mean(loud) > np.mean(quiet)
    f.close()
    with h5s.open(out / "clips.h5") as g:  # no class needed: the schema is in the file
        print("reopened without the class:", type(g.features["loudness"]).__name__, g.features["loudness"].frame)


if __name__ == "__main__":
    main()
