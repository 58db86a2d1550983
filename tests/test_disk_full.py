"""Disk full during create, append and commit: one clear error, nothing committed lost, no crash.

Each test mounts a real size-limited tmpfs (``mount -t tmpfs -o size=...``: needs root; skipped
with the reason where mounting is impossible) and runs the writer as a real child process that
fills it, catches the error, closes the file and exits. The test then checks what a user would:
the exception (a :class:`h5store.WriteError`, also an ``OSError`` with ``errno.ENOSPC``, naming
the file and what was kept), that ``close()`` raised nothing more and released the writer lock
(the child opens the file for writing again), the files left in the folder (no partial, journal,
``.writer`` note, nor a file at the target that was not there before), that every committed
record reads back equal, and the child's exit status: 0, where it used to be 139 (a segfault at
interpreter exit).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = textwrap.dedent("""
    import errno, json, os, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import numpy as np
    import h5store as h5s

    class T(h5s.TypedFile):
        x = h5s.Array(dtype="float32", shape=(None,))

    def record(i):
        return dict(x=np.arange(1000, dtype="float32") + i)

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def err(e):
        return dict(type=type(e).__name__, oserror=isinstance(e, OSError), errno=getattr(e, "errno", None),
                    h5store=isinstance(e, h5s.H5StoreError), message=str(e))

    def fill(folder):
        fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, bytes(4096))
        except OSError:
            pass
        finally:
            os.close(fd)
""")


@pytest.fixture
def disk(small_disk: Path) -> Path:
    """A 2 MiB tmpfs mounted for this test (``small_disk`` in conftest.py), unmounted after it."""
    return small_disk


def run(script: str, *args: str) -> tuple[int, list[dict], str]:
    """Run ``PRELUDE + script`` in a child; its exit status, its ``say()`` lines, its stderr."""
    code = PRELUDE.format(root=str(ROOT), tests=str(ROOT / "tests")) + textwrap.dedent(script)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args],
                          capture_output=True, text=True, timeout=120)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return proc.returncode, lines, proc.stderr


def said(lines: list[dict], key: str) -> dict:
    found = [x for x in lines if key in x]
    assert found, f"the child never reported {key!r}: {lines}"
    return found[-1]


def assert_write_error(e: dict, path: Path) -> None:
    assert e["type"] == "WriteError" and e["h5store"] and e["oserror"], e
    assert e["errno"] == errno.ENOSPC, e
    assert str(path) in e["message"] and "No space left on device" in e["message"], e["message"]


APPEND = """
    path, fresh = sys.argv[1], sys.argv[2] == "fresh"
    if not fresh:
        with T(path, mode="w") as f:
            for i in range(10):
                f.add(f"c{i}", record(i))
    f = T(path, mode="a")
    rng = np.random.default_rng(0)
    try:
        for i in range(10_000):
            f.add(f"n{i}", dict(x=rng.random(50_000).astype("float32")))
        say(add="no error")
    except Exception as e:
        say(add=err(e))
    try:
        f.commit()
        say(commit="ok")
    except Exception as e:
        say(commit=err(e))
    if not fresh:
        try:
            f.x["c0"]
            say(read="ok")
        except Exception as e:
            say(read=err(e))
    for n in (1, 2):
        try:
            f.close()
            say(**{f"close{n}": "ok"})
        except Exception as e:
            say(**{f"close{n}": err(e)})
    say(left=sorted(os.listdir(os.path.dirname(path))))
    if not fresh:
        with T(path, mode="a") as g:  # the writer lock is free again in this very process
            say(reopened=len(g), equal=all(np.array_equal(g.x[f"c{i}"], record(i)["x"]) for i in range(10)))
"""


def test_append_until_disk_full_keeps_last_commit_releases_lock_and_exits_cleanly(disk):
    path = disk / "log.h5"
    rc, lines, stderr = run(APPEND, str(path), "existing")
    assert rc == 0, f"exit status {rc} (-11 or 139: a segfault at exit)\n{stderr[-3000:]}"
    add = said(lines, "add")["add"]
    assert_write_error(add, path)
    assert "its last commit is intact (10 records)" in add["message"], add["message"]
    assert "were not written" in add["message"] and "close()" in add["message"]
    commit = said(lines, "commit")["commit"]
    assert commit != "ok" and commit["type"] == "WriteError", commit  # no commit happened: never silent
    read = said(lines, "read")["read"]  # a read on the failed writer names the failure, not "damaged data"
    assert read["type"] == "WriteError" and "an earlier write failed" in read["message"], read
    assert said(lines, "close1")["close1"] == "ok" and said(lines, "close2")["close2"] == "ok"
    assert said(lines, "left")["left"] == ["log.h5"]  # no journal, no .writer note
    assert said(lines, "reopened") == {"reopened": 10, "equal": True}
    assert "Exception ignored" not in stderr, stderr[-3000:]


def test_new_file_whose_first_commit_fails_leaves_no_file(disk):
    path = disk / "new.h5"
    rc, lines, stderr = run(APPEND, str(path), "fresh")
    assert rc == 0, f"exit status {rc} (-11 or 139: a segfault at exit)\n{stderr[-3000:]}"
    add = said(lines, "add")["add"]
    assert_write_error(add, path)
    assert "nothing was committed" in add["message"] and "no file is left" in add["message"], add["message"]
    assert said(lines, "close1")["close1"] == "ok" and said(lines, "close2")["close2"] == "ok"
    assert said(lines, "left")["left"] == []  # no 0-byte file blocking a later open


def test_rewrite_with_mode_w_that_does_not_fit_releases_the_file(disk):
    path = disk / "log.h5"
    rc, lines, stderr = run("""
        path = sys.argv[1]
        with T(path, mode="w") as f:
            f.add("old", record(0))
        f = T(path, mode="w")  # truncates the old file, as h5py's "w" does
        rng = np.random.default_rng(0)
        try:
            for i in range(10_000):
                f.add(f"n{i}", dict(x=rng.random(50_000).astype("float32")))
        except Exception as e:
            say(add=err(e))
        for n in (1, 2):
            try:
                f.close()
                say(**{f"close{n}": "ok"})
            except Exception as e:
                say(**{f"close{n}": err(e)})
        say(left=sorted(os.listdir(os.path.dirname(path))))
        with T(path, mode="a") as g:  # the lock is free, and no empty or half-written file is in the way
            g.add("new", record(1))
        say(after=len(T(path)))
    """, str(path))
    assert rc == 0, f"exit status {rc} (-11 or 139: a segfault at exit)\n{stderr[-3000:]}"
    add = said(lines, "add")["add"]
    assert_write_error(add, path)
    assert "nothing was committed" in add["message"], add["message"]
    assert said(lines, "close1")["close1"] == "ok" and said(lines, "close2")["close2"] == "ok"
    assert said(lines, "left")["left"] == []
    assert said(lines, "after")["after"] == 1


def test_open_for_writing_on_a_full_disk_creates_nothing(disk):
    path = disk / "new.h5"
    rc, lines, stderr = run("""
        folder = sys.argv[1]
        fill(folder)
        path = os.path.join(folder, "new.h5")
        for attempt in range(2):  # the first failure must not block the second attempt
            try:
                T(path, mode="a").close()
                say(**{f"open{attempt}": "ok"})
            except Exception as e:
                say(**{f"open{attempt}": err(e)})
        os.unlink(os.path.join(folder, "filler"))
        with T(path, mode="a") as f:  # space freed: it works, the lock was released
            f.add("a", record(0))
        with h5s.open(path) as f:
            say(after=len(f))
    """, str(disk))
    assert rc == 0, f"exit status {rc}\n{stderr[-3000:]}"
    for attempt in range(2):
        e = said(lines, f"open{attempt}")[f"open{attempt}"]
        assert_write_error(e, path)
        assert "no file is left" in e["message"], e["message"]
    assert said(lines, "after")["after"] == 1
    assert sorted(os.listdir(disk)) == ["new.h5"]


def test_commit_refused_while_journaling_keeps_last_commit(disk):
    path = disk / "log.h5"
    rc, lines, stderr = run("""
        path = sys.argv[1]
        with T(path, mode="w") as f:
            for i in range(10):
                f.add(f"c{i}", record(i))
            f.h5.attrs["note"] = np.int64(1)
        f = T(path, mode="a")
        f.add("extra", dict(x=np.ones(10, "float32")))
        f.h5.flush()  # the transaction (and its journal) is open; then the disk fills up
        fill(os.path.dirname(path))
        f.h5.attrs["note"] = np.int64(2)  # a committed page, rewritten: journaled at the commit
        try:
            f.commit()
            say(commit="ok")
        except Exception as e:
            say(commit=err(e))
        f.close()
        say(closed=True)
        os.unlink(os.path.join(os.path.dirname(path), "filler"))
        with T(path, mode="a") as g:
            say(reopened=len(g), note=int(g.h5.attrs["note"]),
                equal=all(np.array_equal(g.x[f"c{i}"], record(i)["x"]) for i in range(10)))
    """, str(path))
    assert rc == 0, f"exit status {rc}\n{stderr[-3000:]}"
    commit = said(lines, "commit")["commit"]
    # The journal could not take the page's original (a short write, then ENOSPC): the commit
    # must not go on to overwrite that committed page.
    assert commit != "ok", "commit overwrote a committed page whose original the journal could not hold"
    assert_write_error(commit, path)
    assert "while committing" in commit["message"] and "(10 records)" in commit["message"], commit["message"]
    assert "the 1 record added since was not written" in commit["message"], commit["message"]
    assert said(lines, "closed")
    assert said(lines, "reopened") == {"reopened": 10, "note": 1, "equal": True}
    assert sorted(os.listdir(disk)) == ["log.h5"]


@pytest.fixture
def lazy_disk(tmp_path: Path):
    """An ext4 filesystem that looks 64 MiB big, on a loop device over a 4 MiB tmpfs: writes
    succeed into the page cache, and the error comes later, from ``fsync`` (writeback fails).
    That is how a thin-provisioned volume, a network filesystem or a failing disk reports it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    back, mnt = tmp_path / "back", tmp_path / "ext4"
    back.mkdir()
    mnt.mkdir()
    undo: list[list[str]] = []

    def sh(*cmd: str) -> str:
        res = subprocess.run(list(cmd), capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot set up a loop-mounted filesystem here: {' '.join(cmd)}: {res.stderr.strip()}")
        return res.stdout.strip()

    try:
        sh("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(back))
        undo.append(["umount", "-l", str(back)])
        img = back / "img"
        sh("truncate", "-s", "64M", str(img))
        sh("mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(img))
        loop = sh("losetup", "-f", "--show", str(img))
        undo.append(["losetup", "-d", loop])
        sh("mount", loop, str(mnt))
        undo.append(["umount", "-l", str(mnt)])
        yield mnt
    finally:
        for cmd in reversed(undo):
            subprocess.run(cmd, capture_output=True, check=False)


def test_fsync_refused_after_the_writes_succeeded_keeps_last_commit(lazy_disk):
    path = lazy_disk / "log.h5"
    rc, lines, stderr = run("""
        path = sys.argv[1]
        with T(path, mode="w") as f:
            for i in range(10):
                f.add(f"c{i}", record(i))
        f = T(path, mode="a")
        rng = np.random.default_rng(0)
        for i in range(60):  # 12 MB: every write succeeds, into the page cache
            f.add(f"n{i}", dict(x=rng.random(50_000).astype("float32")))
        try:
            f.commit()
            say(commit="ok")
        except Exception as e:
            say(commit=err(e))
        try:
            f.close()
            say(close="ok")
        except Exception as e:
            say(close=err(e))
        with T(path, mode="a") as g:  # the lock is free; a journal left by a failed rollback is applied
            say(reopened=len(g), equal=all(np.array_equal(g.x[f"c{i}"], record(i)["x"]) for i in range(10)))
    """, str(path))
    assert rc == 0, f"exit status {rc}\n{stderr[-3000:]}"
    commit = said(lines, "commit")["commit"]
    assert commit != "ok", "a commit whose fsync failed must not pass for durable"
    assert commit["type"] == "WriteError" and commit["oserror"], commit
    assert commit["errno"] in (errno.ENOSPC, errno.EIO), commit  # the loop device reports ENOSPC
    assert str(path) in commit["message"] and "while committing" in commit["message"], commit["message"]
    assert "(10 records)" in commit["message"], commit["message"]
    assert said(lines, "close")["close"] == "ok"
    assert said(lines, "reopened") == {"reopened": 10, "equal": True}


CREATE = """
    from ingest_schemas import Nums
    target, sources, mode = sys.argv[1:4]
    if mode == "a":
        base = Nums.create(target, sorted(os.path.join(sources, n) for n in os.listdir(sources))[:3],
                           n_workers=1, progress=False)
        say(base=len(base))
        base.close()
    try:
        f = Nums.create(target, sources, n_workers=1, mode=mode, progress=False)
        say(create="no error", n=len(f))
    except Exception as e:
        say(create=err(e))
    say(left=sorted(os.listdir(os.path.dirname(target))))
"""


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """30 sources of 20,000 float32 numbers: 2.4 MB of data, more than the 2 MiB disk holds."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(1)
    for i in range(30):
        (src / f"s{i:02d}.txt").write_text(" ".join(f"{v:.3f}" for v in rng.random(20_000)))
    return src


def test_create_that_does_not_fit_leaves_no_partial_and_no_target(disk, sources):
    target = disk / "data.h5"
    rc, lines, stderr = run(CREATE, str(target), str(sources), "w")
    assert rc == 0, f"exit status {rc} (-11 or 139: a segfault at exit)\n{stderr[-3000:]}"
    e = said(lines, "create")["create"]
    assert_write_error(e, target)
    assert "no file was created" in e["message"] and "removed" in e["message"], e["message"]
    assert said(lines, "left")["left"] == []  # nor .data.h5.partial, its journal or .writer note


def test_append_that_does_not_fit_leaves_the_target_unchanged(disk, sources):
    from tests.ingest_schemas import Nums

    target = disk / "data.h5"
    rc, lines, stderr = run(CREATE, str(target), str(sources), "a")
    assert rc == 0, f"exit status {rc} (-11 or 139: a segfault at exit)\n{stderr[-3000:]}"
    assert said(lines, "base")["base"] == 3
    e = said(lines, "create")["create"]
    assert_write_error(e, target)
    assert f"{target} is unchanged" in e["message"], e["message"]
    assert said(lines, "left")["left"] == ["data.h5"]
    with Nums(target) as f:
        assert len(f) == 3
        for i in range(3):
            want = np.array((sources / f"s{i:02d}.txt").read_text().split(), dtype="float32")
            assert np.array_equal(f.nums[f"s{i:02d}"], want)
