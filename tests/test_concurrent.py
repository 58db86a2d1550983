"""Readers while a writer commits: DataLoader workers (fork, spawn, forkserver) read a file that
another process appends to and commits every 50 records, for 4 s and at least 40 commits each.

What must hold (docs/reliability.md, "One writer, many readers"): 0 exceptions and 0 wrong
values in the readers; a reader's snapshot stays readable however much is appended; after
``refresh()`` a reader sees the new commits, whole (every feature of every new record);
``tail()`` yields each committed id once, in order.

The schema mixes the read paths: an uncompressed ragged float feature (direct ``preadv``
reads), a gzip-compressed one (read through HDF5, so under the commit lock) and text.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s

ROOT = Path(__file__).resolve().parents[1]
# 4 s give ~80-120 commits and readers that see ~60-110 of them on this 2-core machine, even at a
# load average of 6 (20 s gave ~5x that, and checked nothing more); MIN_COMMITS keeps the writer
# going on a slower machine, and a hold file until the readers have followed 10 commits (under a
# heavier load, 4 s once gave readers only 8).
WRITE_SECONDS = 4.0
MIN_COMMITS = 40


class Live(h5s.TypedFile):
    vals = h5s.Array(dtype="float32", shape=(None,))
    zvals = h5s.Array(dtype="int32", shape=(None, 3), compression="gzip")
    note = h5s.Text()


def record(i: int) -> dict[str, object]:
    return dict(vals=np.arange(i % 9 + 1, dtype=np.float32) + i,
                zvals=np.full((i % 4 + 1, 3), i, np.int32),
                note=f"record {i} " + "x" * (i % 13))


def rid(i: int) -> str:
    return f"r{i:07d}"


def check(f: h5s.TypedFile, positions: np.ndarray) -> int:
    """Wrong values among the records at ``positions`` (ids and every feature compared)."""
    ids = [f.ids[int(p)] for p in positions]
    vals = f.vals.read_many(positions)
    zvals = f.zvals.read_many(positions)
    notes = f.note.read_many(positions)
    bad = 0
    for p, i, v, z, t in zip(positions.tolist(), ids, vals, zvals, notes):
        want = record(p)
        bad += i != rid(p)
        bad += not np.array_equal(v, want["vals"])
        bad += not np.array_equal(z, want["zvals"])
        bad += t != want["note"]
    return bad


WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from tests.test_concurrent import Live, record, rid
    f = Live({path!r}, mode="a")
    n = len(f)
    end = time.monotonic() + {seconds!r}
    cap = time.monotonic() + 120  # the hold file keeps it going (a loaded machine), up to this
    commits = 0
    hold = {hold!r}
    while (time.monotonic() < end or commits < {min_commits!r}
           or (hold and os.path.exists(hold) and time.monotonic() < cap)):
        f.extend([(rid(i), record(i)) for i in range(n, n + 50)])
        n += 50
        f.commit()
        commits += 1
        time.sleep(0.01)
    f.close()
    print(commits, n, flush=True)
""")


def start_writer(path: Path, seconds: float, min_commits: int = 0, hold: Path | None = None) -> subprocess.Popen[str]:
    """The writer process: commits for ``seconds`` and at least ``min_commits`` times, and on while
    the file ``hold`` exists (the readers have not yet followed enough commits; 120 s at most)."""
    script = WRITER.format(root=str(ROOT), path=str(path), seconds=seconds, min_commits=min_commits,
                           hold=None if hold is None else str(hold))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def make_file(path: Path, n: int = 200) -> None:
    with Live(path, mode="w") as f:
        f.extend([(rid(i), record(i)) for i in range(n)])


class Checker:
    """A map-style dataset: each item checks a few records of the reader's snapshot.

    Every 20th item refreshes first, so each worker keeps moving to newer commits; the last
    record of the snapshot is always among those checked (the freshest data is the riskiest).
    """

    def __init__(self, path: Path) -> None:
        self.f = h5s.open(path)

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        f = self.f
        if i % 20 == 0:
            f.refresh()
        n = len(f)
        rng = np.random.default_rng(i)
        positions = np.unique(np.append(rng.integers(0, n, 6), n - 1))
        return n, check(f, positions), os.getpid()


def as_list(items: list) -> list:
    return items


@pytest.mark.slow
# The issue asks for 4 workers; torch warns that this 2-core machine suggests 2.
@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes:UserWarning")
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_read_while_a_writer_commits(tmp_path, method):
    torch = pytest.importorskip("torch")
    path = tmp_path / "live.h5"
    make_file(path)
    loader = torch.utils.data.DataLoader(
        Checker(path), batch_size=4, num_workers=4, multiprocessing_context=method,
        collate_fn=as_list, persistent_workers=False,
    )
    writer = None
    checked = mismatches = 0
    sizes: set[int] = set()
    workers: set[int] = set()
    try:
        it = iter(loader)
        next(it)  # workers are up (spawn takes seconds): now start the writer
        hold = tmp_path / "hold"  # removed once the readers have followed 10 commits
        hold.touch()
        writer = start_writer(path, WRITE_SECONDS, MIN_COMMITS, hold)
        while writer.poll() is None:
            for n, bad, pid in next(it):
                checked += 1
                mismatches += bad
                sizes.add(n)
                workers.add(pid)
            if len(sizes) >= 10:
                hold.unlink(missing_ok=True)
        for _ in range(20):  # and a little after the writer closed
            for n, bad, _pid in next(it):
                mismatches += bad
                sizes.add(n)
        del it
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
    out, err = writer.communicate()
    assert writer.returncode == 0, err
    commits, final = (int(x) for x in out.split())
    assert mismatches == 0, f"{mismatches} wrong values in {checked} checks"
    assert commits >= 20, f"the writer committed only {commits} times"
    assert len(workers) == 4
    # The readers did follow the writer: they saw many different commits, up to the last one.
    assert len(sizes) >= 10, sorted(sizes)
    assert max(sizes) == final
    with Live(path) as f:
        assert len(f) == final
        assert check(f, np.arange(final)) == 0


def test_a_snapshot_survives_commits_and_refresh_moves_it(tmp_path):
    path = tmp_path / "live.h5"
    make_file(path, 100)
    reader = Live(path)
    # Read part of the snapshot before the writer starts (tables, direct offsets, HDF5 metadata).
    assert check(reader, np.arange(0, 100, 7)) == 0
    writer = Live(path, mode="a")  # the same process: the reader must not see its open file
    for k in range(5):
        writer.extend([(rid(i), record(i)) for i in range(100 + 50 * k, 150 + 50 * k)])
        writer.commit()
        assert len(reader) == 100  # a snapshot
        assert check(reader, np.arange(100)) == 0  # still readable, every feature
        assert reader.changed()
    writer.extend([(rid(i), record(i)) for i in range(350, 360)])  # not committed
    assert reader.refresh() == 250
    assert not reader.changed() and len(reader) == 350  # committed records only
    assert check(reader, np.arange(350)) == 0
    writer.close()
    assert reader.changed()
    assert reader.refresh() == 10
    assert check(reader, np.arange(360)) == 0
    reader.close()


def test_views_taken_before_refresh_keep_reading(tmp_path):
    path = tmp_path / "live.h5"
    make_file(path, 60)
    reader = Live(path)
    zvals = reader.zvals  # a view; compressed, so its reads go through HDF5
    with Live(path, mode="a") as w:
        w.extend([(rid(i), record(i)) for i in range(60, 200)])
    reader.refresh()
    np.testing.assert_array_equal(zvals[59], record(59)["zvals"])
    np.testing.assert_array_equal(reader.zvals[199], record(199)["zvals"])
    reader.close()


def test_tail_yields_each_committed_id_once_in_order(tmp_path):
    path = tmp_path / "live.h5"
    make_file(path, 10)
    writer = start_writer(path, 2.0)
    try:
        with Live(path) as reader:
            got = list(reader.tail(start=5, timeout=3.0, poll=0.02))
    finally:
        out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    commits, final = (int(x) for x in out.split())
    assert got == [rid(i) for i in range(5, final)]
    assert commits >= 2


def test_tail_of_a_writable_file_is_refused(tmp_path):
    path = tmp_path / "live.h5"
    make_file(path, 3)
    with Live(path, mode="a") as w, pytest.raises(h5s.ReadOnlyError):
        next(w.tail(timeout=0))


def test_a_reader_waits_for_a_commit_in_progress_at_most_lock_timeout(tmp_path):
    from h5store.commit_lock import CommitLock

    path = tmp_path / "live.h5"
    make_file(path, 5)
    fd = os.open(path, os.O_RDWR)
    lock = CommitLock(fd, str(path))
    lock.acquire_exclusive()  # as a writer does while it writes its commit
    try:
        t0 = time.monotonic()
        with pytest.raises(h5s.LockedError, match="commit"):
            Live(path, lock_timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 5
    finally:
        lock.release_exclusive()
        os.close(fd)
    with Live(path, lock_timeout=0.3) as f:
        assert check(f, np.arange(5)) == 0


def test_a_reader_keeps_its_file_when_another_is_moved_to_the_path(tmp_path):
    """A finished create replaces the path with os.replace: open readers keep the file they
    opened (consistently, through HDF5 too) until refresh() moves them to the new one."""
    path = tmp_path / "live.h5"
    make_file(path, 30)
    reader = Live(path)
    assert check(reader, np.arange(0, 30, 4)) == 0
    other = tmp_path / "other.h5"
    with Live(other, mode="w") as f:  # different values under the same ids
        f.extend([(rid(i), record(i + 1000)) for i in range(40)])
    os.replace(other, path)
    assert reader.changed()
    assert len(reader) == 30 and check(reader, np.arange(30)) == 0  # the file it opened
    assert reader.refresh() == 10
    np.testing.assert_array_equal(reader.zvals[0], record(1000)["zvals"])
    reader.close()
