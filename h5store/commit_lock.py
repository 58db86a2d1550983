"""The commit lock: SQLite's PENDING and SHARED bytes as Linux open-file-description locks.

A reader holds it shared while it reads HDF5 metadata; the committing writer first takes
PENDING (no new reader may start), then waits for the readers in progress to finish. The
locked bytes lie far past any real data (locks beyond a file's end are allowed), and
open-file-description locks belong to the descriptor, not the process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time

__all__ = ["CommitLock"]

# The commit lock's bytes: far past any real file size (locks beyond the end are allowed).
_PENDING = 1 << 62
_SHARED = _PENDING + 1
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid


class CommitLock:
    """The commit lock of one open file description (``fd``), shared or exclusive.

    Readers hold it shared while they read HDF5 metadata; a writer holds it exclusive while
    it changes committed bytes. Open-file-description locks belong to the descriptor, not
    the process, so a reader and a writer in one process exclude each other too.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def _set(self, kind: int, start: int, wait: bool) -> bool:
        cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        try:
            fcntl.fcntl(self.fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0))
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def acquire_shared(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until no commit is in progress, then hold the lock shared."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            if self._set(fcntl.F_RDLCK, _PENDING, wait=False):
                got = self._set(fcntl.F_RDLCK, _SHARED, wait=False)
                self._set(fcntl.F_UNLCK, _PENDING, wait=False)
                if got:
                    return
            if time.monotonic() > deadline:
                from h5store.errors import LockedError

                raise LockedError(f"{self.path}: a commit has held the file for more than {timeout:g} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def writer_waiting(self) -> bool:
        """Whether a writer waits to commit (it holds PENDING): readers should let it in."""
        if self._set(fcntl.F_RDLCK, _PENDING, wait=False):
            self._set(fcntl.F_UNLCK, _PENDING, wait=False)
            return False
        return True

    def join_shared(self) -> None:
        """Take the shared lock while another descriptor of this process already holds it."""
        if not self._set(fcntl.F_RDLCK, _SHARED, wait=False):
            raise RuntimeError(f"{self.path}: commit lock lost while held")  # pragma: no cover

    def release_shared(self) -> None:
        self._set(fcntl.F_UNLCK, _SHARED, wait=False)

    def acquire_exclusive(self) -> None:
        """Stop new readers, then wait for the readers in progress (their reads are short)."""
        self._set(fcntl.F_WRLCK, _PENDING, wait=True)
        self._set(fcntl.F_WRLCK, _SHARED, wait=True)

    def release_exclusive(self) -> None:
        self._set(fcntl.F_UNLCK, _SHARED, wait=False)
        self._set(fcntl.F_UNLCK, _PENDING, wait=False)
