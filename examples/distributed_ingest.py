"""The same create, run on a Dask cluster through joblib's dask backend.

Run: python examples/distributed_ingest.py [--out DIR] [--n 24] [--workers 2]

Here the cluster is a LocalCluster; on a real one, pass the scheduler address to Client and make
sure the workers see the sources (a shared filesystem) and can import your features.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import joblib
import numpy as np
import soundfile as sf
from dask.distributed import Client, LocalCluster

import h5store as h5s


class Speech(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=16000, n_fft=512, hop_length=128, n_mels=40)
    label = h5s.DirLabel(pattern=r"(?i)\.wav$")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-dask-"))
    rng = np.random.default_rng(0)
    for i in range(args.n):
        kind = ("tone", "noise")[i % 2]
        (out / "wavs" / kind).mkdir(parents=True, exist_ok=True)
        t = np.arange(8000) / 16000
        x = np.sin(2 * np.pi * 440 * t) if kind == "tone" else rng.uniform(-1, 1, t.size)
        sf.write(out / "wavs" / kind / f"u{i:03d}.wav", (0.3 * x).astype("float32"), 16000)

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client, joblib.parallel_config(backend="dask"):
        print("dask:", client)
        f = Speech.create(out / "speech.h5", out / "wavs", n_workers=args.workers, mode="w", progress=False)
    print(f.report.summary())
    local = Speech.create(out / "local.h5", out / "wavs", n_workers=1, mode="w", progress=False)
    same = all(np.array_equal(a, b) for a, b in zip(f.mel, local.mel))
    print("identical to a local run:", same)
    assert same and list(f.ids) == list(local.ids)


if __name__ == "__main__":
    main()
