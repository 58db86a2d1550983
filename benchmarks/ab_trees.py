"""Serving speed of two h5store trees on one file, in interleaved rounds: did a change cost speed?

Usage: python benchmarks/ab_trees.py FILE.h5 BEFORE_TREE AFTER_TREE [ROUNDS]

Each measurement is a fresh process importing h5store from the tree named (PYTHONPATH), serving
the file's float32 feature ``mel`` in-process (whole items, batch 16; 64-row windows, batch 32)
and with 2 DataLoader workers, for 3 s after a warm-up epoch; the two trees alternate order from
round to round. Make a file with ``python benchmarks/ab_trees.py --make FILE.h5``.
"""
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, time
import numpy as np
import h5store as h5s
path, which, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
f = h5s.open(path)
if which == "item":
    kw = dict(batch=dict(x=h5s.Item("mel")), batch_size=16, num_workers=0)
elif which == "window":
    kw = dict(batch=dict(x=h5s.Window("mel", 64)), batch_size=32, num_workers=0)
else:
    kw = dict(batch=dict(x=h5s.Item("mel")), batch_size=16, num_workers=2, persistent_workers=True)
loader = f.serve(kw.pop("batch"), shuffle=True, **kw)
n = 0
for b in loader:  # warm-up epoch
    pass
t0 = time.perf_counter()
while time.perf_counter() - t0 < seconds:
    for b in loader:
        n += b["x"].shape[0]
print(json.dumps(dict(rate=n / (time.perf_counter() - t0))))
'''

MAKE = r'''
import sys
import numpy as np
import h5store as h5s
class S(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 80))
    label = h5s.Scalar()
rng = np.random.default_rng(0)
with S(sys.argv[1], "w") as f:
    f.extend({f"u{i:05d}": {"mel": rng.standard_normal((int(rng.integers(100, 500)), 80)).astype("float32"),
                            "label": i % 10} for i in range(4000)})
'''


def main():
    if sys.argv[1] == "--make":
        subprocess.run([sys.executable, "-c", MAKE, sys.argv[2]], check=True)
        return
    path = sys.argv[1]
    trees = {"before": sys.argv[2], "after": sys.argv[3]}
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    res = {w: {t: [] for t in trees} for w in ("item", "window", "workers2")}
    for r in range(rounds):
        for w in res:
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for t in order:
                env = dict(os.environ, PYTHONPATH=trees[t])
                out = subprocess.run([sys.executable, "-c", CHILD, path, w, "3"], env=env, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(path)))
                if out.returncode:
                    sys.exit(out.stderr[-2000:])

                res[w][t].append(json.loads(out.stdout.strip().splitlines()[-1])["rate"])
        print(f"round {r} load {os.getloadavg()[0]:.2f}", flush=True)
    for w, d in res.items():
        b, a = statistics.median(d["before"]), statistics.median(d["after"])
        ratios = [x / y for x, y in zip(d["after"], d["before"])]
        print(f"{w:9s} before {b:9.0f}/s  after {a:9.0f}/s  after/before median {a/b:.3f}  per-round {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
