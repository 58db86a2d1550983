"""The rollback journal beneath HDF5: kills at random times never damage committed data."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5store.fileobj import JournaledFile
from h5store.journal import has_hot_journal, journal_path, rollback

ROOT = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent("""
    import sys, h5py, numpy as np
    sys.path.insert(0, {root!r})
    from h5store.fileobj import JournaledFile
    jf = JournaledFile({path!r})
    f = h5py.File(jf, "r+")
    d = f["d"]
    n = d.shape[0]
    i = 0
    while True:
        d.resize(n + 100, axis=0)
        d[n:n + 100] = np.arange(n, n + 100)
        n += 100
        f.attrs["n"] = n
        i += 1
        if i % 5 == 0:
            f.flush()
            jf.commit()
            print(n, flush=True)
""")


def make_file(path: Path) -> None:
    with h5py.File(path, "w", libver=("v110", "latest")) as f:
        f.create_dataset("d", data=np.arange(1000), maxshape=(None,), chunks=(256,))
        f.attrs["n"] = 1000


def committed_state_ok(path: Path, last: int) -> bool:
    """The file holds exactly the last commit the writer reported (or the one it was making)."""
    with h5py.File(path, "r", locking=False) as f:
        n = f["d"].shape[0]
        return n in (last, last + 500) and f.attrs["n"] == n and np.array_equal(f["d"][:], np.arange(n))


@pytest.mark.slow
def test_sigkill_at_random_times_never_damages_committed_data(tmp_path):
    rng = random.Random(1)
    for trial in range(20):
        path = tmp_path / f"f{trial}.h5"
        make_file(path)
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), path=str(path))],
                                stdout=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0.3, 1.2))
        os.kill(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0].split()
        last = int(out[-1]) if out else 1000
        rollback(str(path))
        assert not has_hot_journal(str(path))
        assert committed_state_ok(path, last), f"trial {trial}: committed state lost (last commit {last})"


def test_uncommitted_writes_roll_back(tmp_path):
    path = tmp_path / "f.h5"
    make_file(path)
    before = path.read_bytes()
    jf = JournaledFile(str(path))
    f = h5py.File(jf, "r+")
    f["d"][:10] = -1  # overwrite committed bytes
    f["d"].resize(5000, axis=0)  # and grow
    f.attrs["n"] = 5000
    f.flush()  # flushed to disk but NOT committed
    assert has_hot_journal(str(path))
    # Simulate a crash: drop the objects without commit (the journal stays).
    jf._pid = -1  # writes of the close below are discarded, as in a dead process
    f.close()
    assert rollback(str(path))
    assert path.read_bytes() == before


def test_commit_deletes_the_journal_and_keeps_the_data(tmp_path):
    path = tmp_path / "f.h5"
    make_file(path)
    jf = JournaledFile(str(path))
    with h5py.File(jf, "r+") as f:
        f["d"][:10] = -1
        f.flush()
        jf.commit()
        assert not has_hot_journal(str(path))
    jf.commit()
    jf.close()
    with h5py.File(path, "r", locking=False) as f:
        assert (f["d"][:10] == -1).all() and f["d"].shape == (1000,)


def test_a_torn_journal_record_is_ignored(tmp_path):
    path = tmp_path / "f.h5"
    make_file(path)
    before = path.read_bytes()
    jf = JournaledFile(str(path))
    f = h5py.File(jf, "r+")
    f["d"][:] = -1
    f.flush()
    jf._pid = -1
    f.close()
    # A crash while appending the next record: a torn record at the journal's tail (its
    # page was never overwritten, since overwrites wait for the journal's fsync).
    with open(journal_path(str(path)), "ab") as j:
        j.write(b"\x00\x10\x00\x00\x00\x00\x00\x00\x00\x10\x00\x00garbage")
    assert rollback(str(path))
    assert path.read_bytes() == before


def test_a_fresh_file_rolls_back_to_empty(tmp_path):
    path = tmp_path / "new.h5"
    path.write_bytes(b"")
    jf = JournaledFile(str(path), fresh=True)
    f = h5py.File(jf, "w")
    f.create_dataset("x", data=np.arange(10))
    f.flush()
    jf._pid = -1
    f.close()
    assert rollback(str(path))
    assert path.stat().st_size == 0


def test_writes_from_a_forked_child_are_discarded(tmp_path):
    path = tmp_path / "f.h5"
    make_file(path)
    jf = JournaledFile(str(path))
    pid = os.fork()
    if pid == 0:  # child: an inherited object must not touch the file or the journal
        try:
            jf.seek(0)
            jf.write(b"\0" * 4096)
            jf.truncate(10)
            jf.commit()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    jf.close()
    assert not has_hot_journal(str(path))
    with h5py.File(path, "r", locking=False) as f:
        np.testing.assert_array_equal(f["d"][:], np.arange(1000))


# ----------------------------------------------------------------------------- TypedFile appends
import h5store as h5s  # noqa: E402


class Log(h5s.TypedFile):
    x = h5s.Array(dtype="float32", shape=(None, 4))
    step = h5s.Scalar(dtype="int64")


def record(i: int) -> dict[str, np.ndarray]:
    return dict(x=np.full((i % 7, 4), i, np.float32), step=np.int64(i))


def check_log(path: Path, allowed: tuple[int, ...], what: str) -> None:
    with Log(path) as f:  # a reader finding a dead writer's journal rolls it back
        n = len(f)
        assert n in allowed, f"{what}: {n} records, expected one of {allowed}"
        assert list(f.ids) == [f"r{i:06d}" for i in range(n)]
        xs = f.x.read_many(range(n), verify=True)
        steps = f.step.read_many(range(n), verify=True)
        for i in range(n):
            np.testing.assert_array_equal(xs[i], record(i)["x"])
            assert steps[i] == i
    assert not has_hot_journal(str(path))


def _append_forever(path: str, wfd: int) -> None:
    """Child: append records to a committed file, committing every 50, reporting each commit."""
    f = Log(path, mode="a")
    i = len(f)
    while True:
        f.add(f"r{i:06d}", record(i))
        i += 1
        if i % 50 == 0:
            f.commit()
            os.write(wfd, f"{i}\n".encode())


@pytest.mark.slow
def test_appends_killed_at_random_times_keep_every_commit_and_nothing_else(tmp_path):
    base = tmp_path / "base.h5"
    with Log(base, mode="w") as f:
        f.extend([(f"r{i:06d}", record(i)) for i in range(200)])
    rng = random.Random(7)
    for trial in range(100):
        path = tmp_path / "log.h5"
        path.write_bytes(base.read_bytes())
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                _append_forever(str(path), w)
            finally:
                os._exit(1)
        os.close(w)
        time.sleep(rng.uniform(0.02, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(r) as pipe:
            reported = [int(x) for x in pipe.read().split()]
        last = reported[-1] if reported else 200
        # Every reported commit is there; at most the commit being reported when the kill
        # came is there too; nothing uncommitted is visible.
        check_log(path, (last, last + 50), f"trial {trial}")


class _CrashAt(JournaledFile):
    """Fault injection: the process dies just before its k-th write to the file."""

    countdown = 0

    def write(self, data):  # type: ignore[override]
        _CrashAt.countdown -= 1
        if _CrashAt.countdown == 0:
            os._exit(0)
        return super().write(data)

    def truncate(self, size=None):  # type: ignore[override]
        _CrashAt.countdown -= 1
        if _CrashAt.countdown == 0:
            os._exit(0)
        return super().truncate(size)


def _commit_once(path: str, crash_at: int) -> None:
    import h5store.handle

    h5store.handle.JournaledFile = _CrashAt  # type: ignore[misc]
    _CrashAt.countdown = crash_at
    f = Log(path, mode="a")
    for i in range(len(f), len(f) + 50):
        f.add(f"r{i:06d}", record(i))
    f.close()  # commit
    os._exit(3)  # finished without reaching the crash point


@pytest.mark.slow
def test_a_crash_at_every_write_of_a_commit_leaves_the_old_or_the_new_state(tmp_path):
    """Exhaustive crash points (the replay method of RELIABILITY.md, at the file-object level)."""
    base = tmp_path / "base.h5"
    with Log(base, mode="w") as f:
        f.extend([(f"r{i:06d}", record(i)) for i in range(200)])
    outcomes = []
    k = 1
    while True:
        path = tmp_path / "log.h5"
        path.write_bytes(base.read_bytes())
        pid = os.fork()
        if pid == 0:
            try:
                _commit_once(str(path), k)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        assert code in (0, 3), f"child failed with exit code {code}"
        check_log(path, (200, 250), f"crash before write {k}")
        outcomes.append(code)
        if code == 3:  # the commit made fewer than k writes: every crash point was tried
            break
        k += 1
    assert len(outcomes) > 10  # the commit really wrote (and was interrupted) many times


def test_a_journal_of_the_older_format_is_refused_and_recover_applies_it(tmp_path):
    """Format 1 (before issue 11) cannot tell a torn record from a damaged one: an open refuses
    it, naming the file and the journal; `h5store recover --apply` applies it as the older
    h5store would have (its records up to the first that fails), keeping a copy."""
    import struct
    import zlib

    from h5store.cli import main
    from h5store.errors import JournalError

    path = tmp_path / "log.h5"
    with Log(path, mode="w") as f:
        f.extend([(f"r{i:06d}", record(i)) for i in range(20)])
    before = path.read_bytes()
    page = before[:4096]
    head = struct.pack("<8sQ", b"H5SJRNL1", len(before))
    journal = head + struct.pack("<I", zlib.crc32(head)) + struct.pack("<QII", 0, len(page), zlib.crc32(page)) + page
    Path(journal_path(str(path))).write_bytes(journal)
    with open(path, "r+b") as f:  # the page overwritten by the commit that was interrupted
        f.write(b"\xff" * 4096)
    damaged = path.read_bytes()
    with pytest.raises(JournalError) as err:
        Log(path).close()
    assert str(path) in str(err.value) and "older h5store" in str(err.value) and "h5store recover" in str(err.value)
    assert path.read_bytes() == damaged and Path(journal_path(str(path))).read_bytes() == journal
    assert main(["recover", str(path), "--apply"]) == 0
    assert path.read_bytes() == before and not has_hot_journal(str(path))
    assert [p for p in tmp_path.iterdir() if ".format1-" in p.name]
    check_log(path, (20,), "after recover")
