"""The writer's note: a small file beside the one the writer holds (``<file>.writer``) naming
the writer (its pid and session) and its commit counter, which readers watch to learn of a
new commit; and the probe of the writer's lock (its exclusive ``flock`` on the file).

The note belongs to the file, not to the name: it sits beside the real file (symlinks
resolved) and, for a file with hard links in its folder, beside the first of them by name.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from h5store.pio import write_all

__all__ = ["commit_token_of", "note_holder", "note_path", "write_note", "writer_alive"]


def write_note(path: str, session: str, commits: int) -> None:
    """Write the note of the writer of ``path`` (this process): its pid, session and commit counter."""
    fd = os.open(note_path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, f"pid {os.getpid()}\nsession {session}\ncommit {commits}\n".encode())
    finally:
        os.close(fd)


def commit_token_of(path: str, st: os.stat_result) -> tuple[Any, ...]:
    """What a reader compares to learn of a new commit: the writer's note while a writer
    holds the file, else the file's inode, size and modification time (``st``)."""
    try:
        fd = os.open(note_path(path), os.O_RDONLY)
    except FileNotFoundError:
        return ("idle", st.st_ino, st.st_size, st.st_mtime_ns)
    try:
        return ("writer", st.st_ino, os.read(fd, 256))
    finally:
        os.close(fd)


def writer_alive(path: str) -> bool:
    """Whether a writer holds the file (its exclusive flock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the probe's shared flock, if it got one


def note_path(path: str) -> str:
    """The writer's note (its pid and commit counter) belongs to the file, not to the name:
    beside the real file (symlinks resolved) and, for a file with hard links in its folder,
    beside the first of them by name, so a reader through any link sees every commit."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        if st.st_nlink > 1:
            folder = os.path.dirname(real)
            names = [e.name for e in os.scandir(folder) if e.inode() == st.st_ino and not e.is_symlink()]
            if names:
                real = os.path.join(folder, min(names))
    except OSError:
        pass
    return real + ".writer"


def note_holder(path: str) -> str:
    """Who holds ``path`` for writing ("pid N"), as its note says, or "another process"."""
    try:
        lines = Path(note_path(path)).read_text().splitlines()  # "pid N", session, commit
        return lines[0].strip() if lines and lines[0].strip() else "another process"
    except OSError:
        return "another process"
