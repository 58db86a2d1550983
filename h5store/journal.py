"""A rollback journal beneath HDF5: crash-safe writes to a file that already holds data.

Measured here (RELIABILITY.md): an interrupted in-place append can make the records that were
already in an HDF5 file unreadable, and ``flush()`` issues no fsync. h5store protects a committed
file the way SQLite protects its pages. HDF5 runs on a :class:`JournaledFile` (h5py's
``driver="fileobj"``), which sees every write HDF5 makes:

* Bytes past the committed size are written freely: a rollback truncates them away.
* Overwrites of committed pages are **held in memory** (a write-back overlay; HDF5's own reads
  see them) until the commit, so between commits the committed part of the file never
  changes: readers in other processes keep reading the last commit while a writer works.
* **Commit** (``TypedFile.commit()``/``close()``): the original bytes of every overwritten page
  are appended to ``<file>-journal`` (offset, length, CRC-32, bytes) and the journal is
  fsynced; then, holding the exclusive *commit lock*, the pages are written, the file is
  fsynced, the journal deleted and the directory fsynced. The deletion is the commit point.
  One journal fsync per commit, however many pages HDF5 rewrote.
* **Rollback**: opening a file that has a journal (a "hot" journal: its writer died) first
  writes the saved pages back, truncates the file to the committed size, fsyncs, and deletes
  the journal. A torn journal record (the crash hit while journaling) is ignored: its page
  was never overwritten, because overwrites wait for the journal's fsync.
* A transaction that rewrites more than ``OVERLAY_BYTES`` of committed pages spills: it takes
  the commit lock early, journals and writes the pages, and holds the lock until it commits.

So a kill or power loss at any moment leaves either the last committed state or, after the
commit point, the new one; never a mix. The journal exists only while a transaction is open.

The commit lock is a pair of byte-range locks (Linux open-file-description locks, far past
any real data) used the way SQLite uses its PENDING and SHARED bytes: a reader holds the
shared lock while it reads HDF5 metadata; the committing writer first takes PENDING (no new
reader may start), then waits for the readers in progress to finish.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["JournaledFile", "ReadOnlyFile", "has_hot_journal", "journal_path", "rollback", "CommitLock"]

PAGE = 4096
_MAGIC = b"H5SJRNL1"
_HEADER = struct.Struct("<8sQI")  # magic, committed size, crc32 of the first two fields
_RECORD = struct.Struct("<QII")  # offset, length, crc32 of the page bytes
OVERLAY_BYTES = 64 << 20  # committed pages held in memory before a transaction spills

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


def journal_path(path: str) -> str:
    return path + "-journal"


def has_hot_journal(path: str) -> bool:
    return os.path.exists(journal_path(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rollback(path: str) -> bool:
    """Undo an interrupted transaction on ``path``; True when there was one to undo.

    The caller must hold the writer lock (nobody else may be writing the file).
    """
    jpath = journal_path(path)
    try:
        with open(jpath, "rb") as j:
            raw = j.read()
    except FileNotFoundError:
        return False
    if len(raw) >= _HEADER.size:
        magic, committed, crc = _HEADER.unpack_from(raw, 0)
        if magic == _MAGIC and crc == zlib.crc32(raw[:16]):
            fd = os.open(path, os.O_RDWR)
            lock = CommitLock(fd, path)
            lock.acquire_exclusive()  # readers must not read the pages being restored
            try:
                pos = _HEADER.size
                while pos + _RECORD.size <= len(raw):
                    offset, length, rcrc = _RECORD.unpack_from(raw, pos)
                    data = raw[pos + _RECORD.size : pos + _RECORD.size + length]
                    if len(data) != length or zlib.crc32(data) != rcrc:
                        break  # torn tail: that page was never overwritten
                    os.pwrite(fd, data, offset)
                    pos += _RECORD.size + length
                os.ftruncate(fd, committed)
                os.fsync(fd)
            finally:
                lock.release_exclusive()
                os.close(fd)
    # A journal without a valid header was torn before any page was overwritten.
    os.unlink(jpath)
    _fsync_dir(path)
    return True


class _PositionedFile(io.RawIOBase):
    """A file for h5py's ``fileobj`` driver on a descriptor of its own: positioned I/O only
    (``pread``/``pwrite`` at a position kept here), so a descriptor offset shared across a
    fork never moves, and the object names the file (h5py reports its repr as the name)."""

    def __init__(self, path: str, fd: int) -> None:
        super().__init__()
        self.path = path
        self._fd = fd
        self._pid = os.getpid()
        self._pos = 0

    def __repr__(self) -> str:
        return self.path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = os.fstat(self._fd).st_size + offset
        return self._pos


class ReadOnlyFile(_PositionedFile):
    """A read-only file for h5py's ``fileobj`` driver, reading with ``os.preadv``.

    HDF5 shares one in-memory file object (and its metadata cache) between all opens of the
    same path through its default driver, so a reopen in the same process, or in a forked
    child that inherited an open file, sees stale metadata. Each ``ReadOnlyFile`` is a file
    of its own to HDF5. Positioned reads never move a descriptor offset shared across fork.
    """

    def __init__(self, path: str, fd: int | None = None) -> None:
        super().__init__(path, os.open(path, os.O_RDONLY) if fd is None else fd)

    @classmethod
    def duplicate(cls, other: ReadOnlyFile) -> ReadOnlyFile:
        """Another object on the same open file (the same inode, whatever the path holds now).

        ``/proc/self/fd`` reopens it as a new open file description, so its locks are its own.
        """
        return cls(other.path, os.open(f"/proc/self/fd/{other.fileno()}", os.O_RDONLY))

    def readinto(self, buffer: Any) -> int:
        n = os.preadv(self._fd, [memoryview(buffer).cast("B")], self._pos)
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed and os.getpid() == self._pid:
            os.close(self._fd)
        super().close()


class JournaledFile(_PositionedFile):
    """A read/write file for h5py's ``fileobj`` driver that journals committed pages.

    Parameters
    ----------
    path : str
        An existing file (rolled back first if it has a hot journal).
    fresh : bool
        The file was just created: its committed state is "empty", so a crash before the
        first commit rolls back to an empty file rather than leaving half an HDF5 file.
    on_commit : callable, optional
        Called at each commit, just before its commit point, while the commit lock is held
        (the file handle publishes a commit counter for readers there).

    Notes
    -----
    The object belongs to the process that opened it: in a forked child every write is
    discarded (a child must never touch its parent's file or journal).
    """

    def __init__(self, path: str, fresh: bool = False, on_commit: Callable[[], None] | None = None) -> None:
        rollback(path)
        super().__init__(path, os.open(path, os.O_RDWR))
        self._on_commit = on_commit
        self.lock = CommitLock(self._fd, path)
        self._overlay: dict[int, bytearray] = {}  # page -> its new bytes (committed pages only)
        self._direct = False  # spilled: holding the commit lock, overwriting in place
        self._saved: set[int] = set()  # pages journaled in this transaction (direct mode)
        self._jfd: int | None = None
        self._journal_synced = False
        if fresh:
            os.ftruncate(self._fd, 0)
            self._committed = 0
            self._open_journal()
            self._sync_journal()
        else:
            self._committed = os.fstat(self._fd).st_size

    # -- io.RawIOBase -------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        pos = self._pos
        n = os.preadv(self._fd, [view], pos)
        if self._overlay and pos < self._committed and n:
            stop = min(pos + n, self._committed)
            for p in range(pos // PAGE, (stop - 1) // PAGE + 1):
                page = self._overlay.get(p)
                if page is not None:
                    a = max(pos, p * PAGE)
                    b = min(stop, p * PAGE + len(page))
                    view[a - pos : b - pos] = page[a - p * PAGE : b - p * PAGE]
        self._pos += n
        return n

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if os.getpid() != self._pid:
            return n  # an inherited copy in a forked child: discard
        if self._jfd is None:
            self._open_journal()  # a crash from now on rolls back (truncates what we add)
        pos = self._pos
        if pos < self._committed:
            k = min(n, self._committed - pos)
            if self._direct:
                self._protect(pos, pos + k)
                self._pwrite(view[:k], pos)
            else:
                self._stage(view[:k], pos)
            view, pos = view[k:], pos + k
        if len(view):
            self._pwrite(view, pos)
        self._pos += n
        return n

    def _pwrite(self, view: memoryview, pos: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], pos + done)

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if os.getpid() != self._pid:
            return size
        if self._jfd is None:
            self._open_journal()
        if size < self._committed:
            self._spill()
            self._protect(size, self._committed)
        os.ftruncate(self._fd, size)
        return size

    def flush(self) -> None:
        pass  # every write is already a pwrite or staged; durability is commit()'s job

    # -- the overlay and the journal ------------------------------------------------
    def _stage(self, view: memoryview, pos: int) -> None:
        stop = pos + len(view)
        for p in range(pos // PAGE, (stop - 1) // PAGE + 1):
            page = self._overlay.get(p)
            if page is None:
                page = self._overlay[p] = bytearray(os.pread(self._fd, min(PAGE, self._committed - p * PAGE), p * PAGE))
            a = max(pos, p * PAGE)
            b = min(stop, p * PAGE + len(page))
            page[a - p * PAGE : b - p * PAGE] = view[a - pos : b - pos]
        if len(self._overlay) * PAGE > OVERLAY_BYTES:
            self._spill()

    def _journal_pages(self, pages: list[int]) -> None:
        """Append the committed bytes of ``pages`` to the journal and make them durable."""
        assert self._jfd is not None
        records = []
        for p in pages:
            offset = p * PAGE
            data = os.pread(self._fd, min(PAGE, self._committed - offset), offset)
            records.append(_RECORD.pack(offset, len(data), zlib.crc32(data)) + data)
        os.write(self._jfd, b"".join(records))
        self._sync_journal()  # the originals are durable before anything overwrites them
        self._saved.update(pages)

    def _spill(self) -> None:
        """Write the overlay in place now, holding the commit lock until the commit."""
        if self._direct:
            return
        self.lock.acquire_exclusive()
        self._direct = True
        pages = sorted(self._overlay)
        self._journal_pages(pages)
        for p in pages:
            self._pwrite(memoryview(self._overlay[p]), p * PAGE)
        self._overlay.clear()

    def _protect(self, start: int, stop: int) -> None:
        pages = [p for p in range(start // PAGE, (stop - 1) // PAGE + 1) if p not in self._saved]
        if pages:
            self._journal_pages(pages)

    def _open_journal(self) -> None:
        jpath = journal_path(self.path)
        self._jfd = os.open(jpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        head = struct.pack("<8sQ", _MAGIC, self._committed)
        os.write(self._jfd, _HEADER.pack(_MAGIC, self._committed, zlib.crc32(head)))
        self._journal_synced = False

    def _sync_journal(self) -> None:
        assert self._jfd is not None
        os.fsync(self._jfd)
        if not self._journal_synced:
            _fsync_dir(journal_path(self.path))  # the journal's name survives a power loss too
            self._journal_synced = True

    @property
    def in_transaction(self) -> bool:
        return self._jfd is not None

    def commit(self) -> None:
        """Make everything written so far durable; delete the journal (the commit point)."""
        if os.getpid() != self._pid or self._jfd is None:
            return  # a forked child's copy, or nothing written since the last commit
        pages = sorted(self._overlay)
        unsaved = [p for p in pages if p not in self._saved]
        if unsaved:
            self._journal_pages(unsaved)
        if not self._direct:
            self.lock.acquire_exclusive()
        try:
            for p in pages:
                self._pwrite(memoryview(self._overlay[p]), p * PAGE)
            os.fsync(self._fd)  # new bytes and rewritten pages, before the journal goes
            if self._on_commit is not None:
                # Before the commit point: if we die between the two, readers see a new
                # counter and reopen a file that is rolled back to the old state (harmless);
                # the other order could leave them on stale metadata of a changed file.
                self._on_commit()
            os.close(self._jfd)
            self._jfd = None
            os.unlink(journal_path(self.path))
            _fsync_dir(self.path)
            self._overlay.clear()
            self._saved.clear()
            self._committed = os.fstat(self._fd).st_size
        finally:
            self._direct = False
            self.lock.release_exclusive()

    def disown(self) -> None:
        """In a forked child: make this inherited object inert without touching the files."""
        self._pid = -1

    def close(self) -> None:
        if not self.closed and os.getpid() == self._pid:
            if self._jfd is not None:
                os.close(self._jfd)  # uncommitted: the journal stays, the next open rolls back
                self._jfd = None
            os.close(self._fd)  # also drops a commit lock still held by a spilled transaction
        super().close()
