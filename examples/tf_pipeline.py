"""The same h5store files served to tf.data: one file to Keras `fit`, and many files interleaved.

Run: python examples/tf_pipeline.py [--out DIR] [--files 4] [--items 300] [--epochs 2]

What people write by hand (`tf.py_function` reading one example per call, reopening the
file) pays a Python call, an HDF5 call and a tensor conversion per example. Here each
tf.data element is a whole batch read in one planned read, by parallel threads:

- `f.to_tf_dataset(batch, batch_size=32, shuffle=True)`: batches of one file (or of `h5s.concat([...])`),
  reshuffled at every iteration (every Keras epoch), random crops reproducible from the seed;
- `h5s.interleave(paths, batch, ...)`: every batch mixes `cycle_length` files (tf.data's
  interleave order), read concurrently by `num_parallel_calls` threads, each file opened once
  per pass (`mix="batches"`: batches of one file each).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

import h5store as h5s

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before tensorflow is imported: no start-up banner


class Features(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 40))  # (frames, 40)
    label = h5s.Scalar(dtype="int64")  # 3 classes; each shifts the mel's mean


def write_file(path: Path, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    mels = [rng.standard_normal((int(rng.integers(80, 240)), 40)).astype(np.float32) + y for y in labels]
    with Features(path, mode="w") as w:
        w.extend([f"s{seed}/utt{i:04d}" for i in range(n)], {"mel": mels, "label": labels.tolist()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--items", type=int, default=300, help="items per file")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-tf-"))
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"part{k}.h5" for k in range(args.files)]
    for k, path in enumerate(paths):
        write_file(path, k, args.items)

    import keras
    import tensorflow as tf

    # 1. One file to Keras: 64-frame windows and labels, batches of 32, read by tf.data threads.
    f = Features(paths[0])
    ds = f.to_tf_dataset(dict(x=h5s.Window("mel", 64), y=h5s.Label("label")), batch_size=32, shuffle=True,
                         drop_last=True)
    print("element spec:", {k: (v.shape.as_list(), v.dtype.name) for k, v in ds.element_spec.items()})
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((64, 40)), keras.layers.Conv1D(16, 5, activation="relu"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    # h5store reshuffles every epoch itself (from the seed): Keras must not try to.
    history = model.fit(ds.map(lambda b: (b["x"], b["y"])), epochs=args.epochs, shuffle=False, verbose=2)
    print(f"keras: accuracy {history.history['accuracy'][-1]:.2f} after {args.epochs} epochs")

    # 2. Many files, interleaved: every batch mixes 3 files, read by 3 threads; `file` says where each example came from.
    many = h5s.interleave([str(q) for q in paths], dict(x=h5s.Window("mel", 64), y=h5s.Label("label")),
                          batch_size=32, shuffle=True, cycle_length=3, num_parallel_calls=3, file_key="file")
    per_file: Counter[int] = Counter()
    examples = 0
    for b in many:  # one pass over every file
        assert b["x"].shape[1:] == (64, 40) and b["x"].dtype == tf.float32
        per_file.update(b["file"].numpy().tolist())
        examples += int(b["x"].shape[0])
    assert examples == args.files * args.items and sorted(per_file) == list(range(args.files))
    print(f"interleave: {examples} examples from {args.files} files in one pass: "
          f"{dict(sorted(per_file.items()))} per file")


if __name__ == "__main__":
    main()
