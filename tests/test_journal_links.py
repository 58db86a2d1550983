"""The rollback journal belongs to the file, not to the name used to open it (issue 11, point 3).

A writer that dies mid-commit leaves a hot journal. Whatever name opens the file next (the real
path, a symlink, a hard link, a relative path, a bind mount of its folder) must find that
journal, roll it back, and never apply it to another file. Every test here uses real processes
killed with SIGKILL while their commit is hot: the new pages are written and fsynced, the
journal not yet deleted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.errors import JournalError
from h5store.journal import find_journal

ROOT = Path(__file__).resolve().parents[1]


class Log(h5s.TypedFile):
    x = h5s.Array(dtype="float32", shape=(None, 4))
    step = h5s.Scalar(dtype="int64")


def record(i: int) -> dict[str, np.ndarray]:
    return dict(x=np.full((i % 7 + 1, 4), i, np.float32), step=np.int64(i))


def make_log(path: Path, n: int) -> None:
    with Log(path, mode="w") as f:
        f.extend([(f"r{i:06d}", record(i)) for i in range(n)])


def check_log(path: str | Path, n: int) -> None:
    """``path`` opens (a reader: rolling a dead writer's journal back) and holds exactly records 0..n-1."""
    with Log(path) as f:
        assert len(f) == n, f"{path}: {len(f)} records, expected {n}"
        assert list(f.ids) == [f"r{i:06d}" for i in range(n)]
        xs = f.x.read_many(range(n), verify=True)
        steps = f.step.read_many(range(n), verify=True)
    for i in range(n):
        np.testing.assert_array_equal(xs[i], record(i)["x"])
        assert steps[i] == i


# A real writer process: appends records through the name it is given, commits after each
# block, and at its last commit stops at the commit point (pages written and fsynced, journal
# not deleted yet), says "hot" and waits for its SIGKILL.
HOT_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    os.chdir({cwd!r})
    import h5store.handle as hh
    from tests.test_journal_links import Log, record
    blocks = {blocks!r}
    orig = hh.FileHandle._published
    def published(self):
        orig(self)
        if self._commits == len(blocks):
            print("hot", flush=True)
            time.sleep(600)
    hh.FileHandle._published = published
    f = Log({name!r}, mode="a")
    i = len(f)
    for b in blocks:
        for _ in range(b):
            f.add(f"r{{i:06d}}", record(i))
            i += 1
        f.commit()
        print("committed", i, flush=True)
""")


def kill_while_hot(name: str | Path, blocks: list[int], cwd: str | Path | None = None) -> list[str]:
    """Run HOT_WRITER through ``name``; SIGKILL it at its last commit point. Returns its output lines."""
    script = HOT_WRITER.format(root=str(ROOT), cwd=str(cwd or os.getcwd()), blocks=blocks, name=str(name))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == "hot":
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert lines and lines[-1] == "hot", f"the writer did not reach its commit point: {lines}"
    return lines


def _bind(src: Path, dst: Path) -> None:
    dst.mkdir()
    res = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot bind-mount a folder here ({res.stderr.strip() or 'mount failed'}); needs root")


@pytest.mark.parametrize("how", ["symlink", "symlinked-folder", "hardlink", "relative", "bind-mount"])
def test_a_journal_left_through_any_name_is_found_through_every_other(tmp_path, how):
    """The issue's story: a writer through an alias dies mid-commit; a writer through the real
    path must find its journal, roll back and commit more; an open through the alias must then
    keep every record committed through the real path."""
    data = tmp_path / "data"
    data.mkdir()
    real = data / "log.h5"
    make_log(real, 100)
    cwd = tmp_path
    mounted = None
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir()
        alias: str | Path = tmp_path / "elsewhere" / "link.h5"
        os.symlink(real, alias)
    elif how == "symlinked-folder":
        os.symlink(data, tmp_path / "alias")
        alias = tmp_path / "alias" / "log.h5"
    elif how == "hardlink":
        alias = data / "hard.h5"
        os.link(real, alias)
    elif how == "relative":
        alias = os.path.join("data", "..", "data", "log.h5")
    else:
        mounted = tmp_path / "mnt"
        _bind(data, mounted)
        alias = mounted / "log.h5"
    try:
        kill_while_hot(alias, [50, 50], cwd=cwd)  # 150 committed, the commit to 200 is hot
        assert find_journal(real) is not None, "the real path does not see the alias's journal"
        with Log(real, mode="a") as f:  # rolls back to 150, then commits 50 more
            assert len(f) == 150
            f.extend([(f"r{i:06d}", record(i)) for i in range(150, 200)])
        assert find_journal(real) is None
        prev = os.getcwd()
        os.chdir(cwd)
        try:
            assert find_journal(alias) is None, "the alias still sees a journal after the real path committed"
            check_log(alias, 200)  # nothing committed through the real path is rolled back
        finally:
            os.chdir(prev)
        check_log(real, 200)
        assert not [p for p in data.iterdir() if p.name.endswith(("-journal", ".writer"))]
    finally:
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=True)


def test_a_reader_through_a_symlink_rolls_back_a_journal_left_through_the_real_path(tmp_path):
    real = tmp_path / "log.h5"
    make_log(real, 40)
    (tmp_path / "other").mkdir()
    link = tmp_path / "other" / "link.h5"
    os.symlink(real, link)
    kill_while_hot(real, [10, 10])
    check_log(link, 50)  # not the half-committed 60
    assert find_journal(real) is None


def test_a_writer_refuses_a_file_hard_linked_from_another_folder(tmp_path):
    """A journal is kept beside the name; an open through a link in another folder could not
    find it, so writing such a file is refused loudly (reading it is fine)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    real = tmp_path / "a" / "log.h5"
    make_log(real, 20)
    os.link(real, tmp_path / "b" / "copy.h5")
    with pytest.raises(JournalError) as err:
        Log(real, mode="a").close()
    msg = str(err.value)
    assert str(real) in msg and "hard link" in msg and "another folder" in msg
    check_log(tmp_path / "b" / "copy.h5", 20)


def test_a_journal_of_a_replaced_file_is_never_applied(tmp_path):
    """A writer died mid-commit, then another file was moved to the name (as a finished create
    does): the journal belongs to the old inode and must not touch the new file."""
    path = tmp_path / "log.h5"
    make_log(path, 30)
    kill_while_hot(path, [5, 5])
    fresh = tmp_path / "fresh.h5"
    make_log(fresh, 7)
    os.replace(fresh, path)
    before = path.read_bytes()
    journal = find_journal(path)
    assert journal is not None
    jbytes = Path(journal).read_bytes()
    for mode in ("r", "a"):
        with pytest.raises(JournalError) as err:
            Log(path, mode=mode).close()
        msg = str(err.value)
        assert str(path) in msg and journal in msg and "h5store recover" in msg and "another file" in msg
    assert path.read_bytes() == before and Path(journal).read_bytes() == jbytes  # nothing applied or deleted
    from h5store.cli import main

    assert main(["recover", str(path)]) != 0  # says what it would do, does nothing
    assert Path(journal).read_bytes() == jbytes
    assert main(["recover", str(path), "--apply"]) == 0  # sets the foreign journal aside
    assert find_journal(path) is None and path.read_bytes() == before
    assert [p for p in tmp_path.iterdir() if ".foreign-" in p.name]
    check_log(path, 7)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_reader_through_a_link_sees_the_commits_of_a_writer_through_another_name(tmp_path, how):
    """The writer's note (its commit counter, which readers poll) belongs to the file too: a
    stale note that a killed writer left beside the alias must not hide later commits."""
    real = tmp_path / "log.h5"
    make_log(real, 30)
    alias = tmp_path / ("a-link.h5" if how == "symlink" else "a-hard.h5")  # sorts before log.h5
    if how == "symlink":
        os.symlink(real, alias)
    else:
        os.link(real, alias)
    kill_while_hot(alias, [5, 5])  # leaves its note and its journal behind
    with Log(real, mode="a") as w:  # rolls back to 35
        reader = Log(alias)
        assert len(reader) == 35 and not reader.changed()
        w.extend([(f"r{i:06d}", record(i)) for i in range(35, 45)])
        w.commit()
        assert reader.changed(), "a reader through the alias does not see the commit"
        assert reader.refresh() == 10
        reader.close()
    check_log(alias, 45)


def test_a_writer_refuses_a_bind_mounted_file(tmp_path):
    """A file bind-mounted onto another name: its journal would sit beside the mount, where
    an open through the original name would not find it. Writing through the mount is refused."""
    real = tmp_path / "log.h5"
    make_log(real, 10)
    (tmp_path / "other").mkdir()
    target = tmp_path / "other" / "mounted.h5"
    target.write_bytes(b"")
    res = subprocess.run(["mount", "--bind", str(real), str(target)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot bind-mount a file here ({res.stderr.strip() or 'mount failed'}); needs root")
    try:
        with pytest.raises(JournalError) as err:
            Log(target, mode="a").close()
        assert str(target) in str(err.value) and "bind mount" in str(err.value)
        check_log(target, 10)  # reading through it is fine
        with Log(real, mode="a") as f:  # writing through the original name too
            f.add("r000010", record(10))
        check_log(target, 11)
    finally:
        subprocess.run(["umount", str(target)], check=True)
