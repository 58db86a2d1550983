"""Positioned I/O: every read that must fill its buffer, every write that must land whole.

``os.preadv``/``os.pwrite``/``os.write`` may transfer fewer bytes than asked (a signal, a huge
request, a nearly full disk that takes part of a write before it refuses the rest): each loop
that finishes such a call lives here once, as do the ``fsync`` of a file and of the folder
holding a name (what makes a ``rename``/``unlink`` survive a power loss).

Examples
--------
>>> import os, tempfile, numpy as np
>>> fd, path = tempfile.mkstemp()
>>> write_all(fd, b"0123456789", offset=0)
>>> buf = np.empty(4, np.uint8)
>>> read_into(fd, buf, 3)
4
>>> bytes(buf)
b'3456'
>>> os.close(fd); os.unlink(path)
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["fsync_dir", "fsync_file", "pid_alive", "read_exact", "read_into", "readv_exact", "write_all"]


def read_into(fd: int, buf: Any, offset: int) -> int:
    """Read into ``buf`` (any writable buffer) from ``offset`` until it is full or the file ends.

    Returns the bytes read: less than ``len(buf)`` only at the end of the file.
    """
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def read_exact(fd: int, buf: Any, offset: int, what: str) -> None:
    """:func:`read_into` that raises ``EOFError`` naming ``what`` when the file ends first."""
    n = read_into(fd, buf, offset)
    want = memoryview(buf).nbytes
    if n != want:
        raise EOFError(f"{what}: the file ends at byte {offset + n}, {want - n} bytes short")


def readv_exact(fd: int, iov: list[memoryview], offset: int, what: str) -> None:
    """Fill the consecutive buffers ``iov`` from ``offset`` in one ``preadv`` (finishing short
    reads buffer by buffer); ``EOFError`` naming ``what`` when the file ends first."""
    want = sum(len(v) for v in iov)
    got = os.preadv(fd, iov, offset)
    if got == want:
        return
    done = 0
    for v in iov:
        n = len(v)
        if done + n > got:
            skip = max(0, got - done)
            read_exact(fd, v[skip:], offset + done + skip, what)
        done += n


def write_all(fd: int, data: Any, offset: int | None = None) -> None:
    """Write all of ``data``: at ``offset`` (``pwrite``), or at the descriptor's position.

    A nearly full disk takes part of a write without an error; the loop's next call raises
    the ``OSError`` (ENOSPC) instead of leaving a short write behind.
    """
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        if offset is None:
            done += os.write(fd, view[done:])
        else:
            done += os.pwrite(fd, view[done:], offset + done)


def fsync_file(path: str) -> None:
    """``fsync`` the file at ``path`` (its data and size are on stable storage when this returns)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """``fsync`` the folder holding ``path``: a create, rename or unlink of that name survives a
    power loss."""
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (another user's counts as alive).

    Examples
    --------
    >>> pid_alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
