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

from h5store.journal import JournaledFile, has_hot_journal, journal_path, rollback

ROOT = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent("""
    import sys, h5py, numpy as np
    sys.path.insert(0, {root!r})
    from h5store.journal import JournaledFile
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
