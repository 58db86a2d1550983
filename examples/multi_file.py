"""Several h5store files served as one dataset with `h5store.concat`.

Run: python examples/multi_file.py [--out DIR] [--shards 3] [--items 200] [--workers 2]

Shards appear when data arrives in parts (one file per recording day, per node of a
distributed create, per contributor). `h5s.concat` serves them as one: positions run
through the files in order, every worker opens each file once, lazily, and one batch may
mix items of several files. `merge` copies them into a single file when that is preferred.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import h5store as h5s


class Features(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 40))  # (frames, 40), computed elsewhere
    speaker = h5s.Scalar(dtype="int64")


def write_shard(path: Path, day: int, n: int) -> None:
    """One day of recordings: n items of 50-300 frames, written with extend (one block)."""
    rng = np.random.default_rng(day)
    ids = [f"day{day}/utt{i:04d}" for i in range(n)]
    mels = [rng.standard_normal((int(rng.integers(50, 300)), 40)).astype(np.float32) + day for _ in ids]
    with Features(path, mode="w") as w:
        w.extend(ids, {"mel": mels, "speaker": rng.integers(0, 10, n).tolist()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--items", type=int, default=200, help="items per shard (shard k holds items + 10 k)")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="h5store-shards-"))
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"day{k}.h5" for k in range(args.shards)]
    for k, path in enumerate(paths):
        write_shard(path, k, args.items + 10 * k)

    files = [Features(path) for path in paths]
    both = h5s.concat(files)
    sizes = both.sizes()
    starts = np.concatenate([[0], np.cumsum(sizes)])  # global position p is row p - starts[k] of file k
    print(f"{len(both)} items in {len(files)} files of {sizes.tolist()} items")

    batch = dict(x=h5s.Item("mel"), speaker=h5s.Label("speaker"), pos=h5s.Position())
    loader = both.serve(batch, batch_size=32, shuffle=True, num_workers=args.workers)
    seen: list[int] = []
    for b in loader:  # x: (32, longest, 40) zero-padded, x_lengths: (32,), pos: (32,)
        for j, pos in enumerate(b["pos"].tolist()):
            k = int(np.searchsorted(starts, pos, side="right")) - 1  # the file this item came from
            n = int(b["x_lengths"][j])
            assert np.array_equal(b["x"][j, :n].numpy(), files[k].mel[pos - int(starts[k])])  # served == stored
        seen += b["pos"].tolist()
    assert sorted(seen) == list(range(len(both)))  # one epoch: every item of every file, once
    mixed = len(np.unique(np.searchsorted(starts, b["pos"].numpy(), side="right")))
    print(f"one epoch: {len(seen)} items, each once, equal to the stored ones; the last batch came from {mixed} file(s)")
    del loader

    # Or copy the shards into one file (stored arrays are copied, nothing is recomputed).
    merged = Features.merge(paths, out / "all.h5", progress=False)
    last = f"day{args.shards - 1}/utt0003"
    assert len(merged) == len(both) and np.array_equal(merged.mel[last], files[-1].mel[last])
    print(f"merged into {merged.path}: {len(merged)} items, first id {merged.ids[0]!r}, last {merged.ids[-1]!r}")


if __name__ == "__main__":
    main()
