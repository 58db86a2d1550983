"""Serving while a SEPARATE writer process appends and commits (issue 11, point 6).

A DataLoader with 2 workers (fork and spawn) serves a file that another process keeps
appending to and committing. The schema mixes the read paths: a ragged float feature read
with ``preadv``, an lzf-compressed ragged one read through HDF5 (under the commit lock,
rebound after each commit), and a fixed-layout scalar label (read whole into memory by
each worker), served side by side.

What must hold: no exception of any kind, in the parent or a worker; every served item's
values are those the writer wrote for its position; an epoch serves exactly ``len()`` of
the snapshot the dataset was made from, which is the served file's own snapshot
(``len(f)``), also after the file reopened itself because of a commit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s

ROOT = Path(__file__).resolve().parents[1]
WRITE_SECONDS = 6.0


class Live(h5s.TypedFile):
    vals = h5s.Array(dtype="float32", shape=(None,))
    zvals = h5s.Array(dtype="int32", shape=(None, 3), compression="lzf")
    label = h5s.Scalar(dtype="int64")


def record(i: int) -> dict[str, object]:
    return dict(vals=np.arange(i % 9 + 1, dtype=np.float32) + i,
                zvals=np.full((i % 4 + 1, 3), i, np.int32),
                label=i)


BATCH = dict(x=h5s.Item("vals"), z=h5s.Item("zvals"), y=h5s.Item("label"), pos=h5s.Position())

WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.test_serving_consistency import Live, record
    f = Live({path!r}, mode="a")
    n = len(f)
    end = time.monotonic() + {seconds!r}
    commits = 0
    while time.monotonic() < end:
        f.extend([(f"r{{i:07d}}", record(i)) for i in range(n, n + 20)])
        n += 20
        f.commit()
        commits += 1
        time.sleep(0.005)
    f.close()
    print(commits, n, flush=True)
""")


def start_writer(path: Path, seconds: float = WRITE_SECONDS) -> subprocess.Popen[str]:
    script = WRITER.format(root=str(ROOT), path=str(path), seconds=seconds)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def make_file(path: Path, n: int = 100) -> None:
    with Live(path, mode="w") as f:
        f.extend([(f"r{i:07d}", record(i)) for i in range(n)])


def wait_for_commit(path: Path, n: int) -> None:
    """Until the writer has committed records beyond the first ``n``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with Live(path) as g:
            if len(g) > n:
                return
        time.sleep(0.05)
    raise AssertionError("the writer committed nothing in 30 s")


def wrong(batch: dict) -> int:
    """Served items whose values differ from what the writer wrote at their position."""
    bad = 0
    pos = np.asarray(batch["pos"])
    y = np.asarray(batch["y"])
    xl, zl = np.asarray(batch["x_lengths"]), np.asarray(batch["z_lengths"])
    x, z = np.asarray(batch["x"]), np.asarray(batch["z"])
    for j, p in enumerate(pos.tolist()):
        want = record(p)
        bad += int(y[j] != p)
        bad += not np.array_equal(x[j, : xl[j]], want["vals"])
        bad += not np.array_equal(z[j, : zl[j]], want["zvals"])
    return bad


def finish(writer: subprocess.Popen[str]) -> tuple[int, int]:
    out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    commits, final = (int(v) for v in out.split())
    return commits, final


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_serve_one_commit_while_a_writer_commits(tmp_path, method):
    """Persistent workers serve epoch after epoch while the writer commits under them."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "live.h5"
    make_file(path)
    f = Live(path)
    writer = start_writer(path)
    try:
        wait_for_commit(path, len(f))
        f.vals[0]  # a read under the commit lock: the open follows the commit, the snapshot stays
        n = len(f)
        assert n == 100
        loader = f.serve(BATCH, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context=method,
                         persistent_workers=True)
        assert len(loader.dataset) == n
        epochs = bad = 0
        while writer.poll() is None or epochs < 2:
            loader.batch_sampler.set_epoch(epochs)
            served = []
            for b in loader:
                bad += wrong(b)
                served.append(b["pos"].numpy())
            got = np.sort(np.concatenate(served))
            assert np.array_equal(got, np.arange(n)), f"epoch {epochs}: {len(got)} served, len(f) == {n}"
            epochs += 1
        del loader
        assert torch is not None
    finally:
        if writer.poll() is None:
            writer.kill()
    commits, final = finish(writer)
    assert bad == 0
    assert commits >= 10 and final > n


def test_fresh_loaders_follow_refresh_while_a_writer_commits(tmp_path):
    """A new forked loader per round, the file refreshed (or implicitly reopened) between rounds."""
    pytest.importorskip("torch")
    path = tmp_path / "live.h5"
    make_file(path)
    f = Live(path)
    writer = start_writer(path)
    rounds = bad = 0
    sizes = set()
    try:
        # Until the writer is done, at least 3 rounds, and a round that saw its commits (under a
        # heavy load one round can outlast all of the writer's commits: the next one sees them).
        while (writer.poll() is None or rounds < 3 or len(sizes) < 2) and rounds < 40:
            if rounds % 2:
                f.refresh()
            else:
                f.label[f.ids[0]]  # an implicit reopen after a commit: the snapshot stays
            n = len(f)
            loader = f.serve(BATCH, batch_size=32, num_workers=2, multiprocessing_context="fork")
            served = 0
            for b in loader:
                bad += wrong(b)
                served += len(b["pos"])
            assert served == n == len(loader.dataset), f"round {rounds}: served {served}, len(f) == {n}"
            sizes.add(n)
            rounds += 1
    finally:
        if writer.poll() is None:
            writer.kill()
    finish(writer)
    assert bad == 0
    assert len(sizes) >= 2, sizes  # the rounds did follow the writer


def test_in_process_reads_after_reopen_agree_with_len(tmp_path):
    """numpy iteration in the parent: the dataset's len, ids and tables are f's snapshot."""
    path = tmp_path / "live.h5"
    make_file(path)
    f = Live(path)
    n = len(f)
    writer = start_writer(path, 2.0)
    try:
        wait_for_commit(path, n)
        f.vals[0]  # reopens under the lock: generation moves, the snapshot does not
        served = 0
        for b in f.iter_batches(BATCH, batch_size=16, shuffle=False, threads=2):
            assert wrong(b) == 0
            served += len(b["pos"])
        assert served == len(f) == n
    except BaseException:
        writer.kill()
        raise
    finish(writer)
    f.refresh()
    assert sum(len(b["pos"]) for b in f.iter_batches(BATCH, batch_size=64, threads=0)) == len(f) > n
