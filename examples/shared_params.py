"""A training schedule that reaches the DataLoader workers: the crop length doubles at epoch N.

Run: python examples/shared_params.py [--out DIR] [--epochs 4] [--double-at 2] [--workers 2]

With `num_workers > 0`, each worker holds its own copy of the dataset: setting
`dataset.duration = 2 * dataset.duration` in the training loop changes the main process's
copy only, and with `persistent_workers=True` the workers never see it. h5store's shared
parameters live in a small block of shared memory that every worker maps; a getter names
one (`h5s.Window("mel", "crop")`) and reads its current value before each batch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

import h5store as h5s


class Speech(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 20))


class Who(h5s.Getter):
    """Per example: the process that made it, and the crop length that process read."""

    features = ()

    def fetch(self, files: Any, request: h5s.serving.Request) -> np.ndarray:  # request.params: the shared values
        out = np.empty((len(request), 2), np.int64)
        out[:, 0] = os.getpid()
        out[:, 1] = request.params["crop"]
        return out

    def signature(self, files: Any) -> tuple[np.dtype, tuple[int, ...]]:
        return np.dtype("int64"), (2,)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--double-at", type=int, default=2, help="the epoch from which crops are twice as long")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-params-"))
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with Speech(out / "speech.h5", mode="w") as w:
        w.extend([f"utt{i:03d}" for i in range(64)], {"mel": [rng.standard_normal((int(n), 20)) for n in
                                                              rng.integers(100, 300, 64)]})

    f = Speech(out / "speech.h5")
    loader = f.serve(dict(x=h5s.Window("mel", "crop"), who=Who()), params=dict(crop=32), batch_size=8,
                     shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0)
    params = loader.dataset.params  # the shared block: names and types fixed here, values changeable
    workers_per_epoch = []
    for epoch in range(args.epochs):
        if epoch == args.double_at:
            params.crop *= 2  # in the main process, between epochs: every worker's next batch uses it
        batches = list(loader)
        crops = Counter(b["x"].shape[1] for b in batches)
        pids = {int(pid) for b in batches for pid in b["who"][:, 0]}
        read = {int(c) for b in batches for c in b["who"][:, 1]}
        print(f"epoch {epoch}: {len(batches)} batches of crop length {sorted(crops)}; "
              f"worker processes {sorted(pids)} read crop = {sorted(read)}")
        expected = 32 if epoch < args.double_at else 64
        assert set(crops) == {expected} and read == {expected}
        workers_per_epoch.append(pids)
    if args.workers > 0:
        # Persistent workers: the same processes served every epoch, and changed crop length.
        assert all(p == workers_per_epoch[0] for p in workers_per_epoch) and os.getpid() not in workers_per_epoch[0]
        print(f"the same {len(workers_per_epoch[0])} worker processes served all {args.epochs} epochs")


if __name__ == "__main__":
    main()
