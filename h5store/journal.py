"""A rollback journal beneath HDF5: crash-safe writes to a file that already holds data.

Measured here (RELIABILITY.md): an interrupted in-place append can make the records that were
already in an HDF5 file unreadable, and ``flush()`` issues no fsync. h5store protects a committed
file the way SQLite protects its pages. HDF5 runs on a :class:`JournaledFile` (h5py's
``driver="fileobj"``), which sees every write HDF5 makes:

* Bytes past the committed size are written freely: a rollback truncates them away.
* Before the first overwrite of a committed page in a transaction, the page's original bytes
  are appended to ``<file>-journal`` (offset, length, CRC-32, bytes) and the journal is fsynced.
  Only then is the page overwritten.
* **Commit** (``TypedFile.commit()``/``close()``): HDF5 flushes, the file is fsynced, the
  journal is deleted and the directory fsynced. The deletion is the commit point.
* **Rollback**: opening a file that has a journal (a "hot" journal: its writer died) first
  writes the saved pages back, truncates the file to the committed size, fsyncs, and deletes
  the journal. A torn journal record (the crash hit while journaling) is ignored: its page
  was never overwritten, because overwrites wait for the journal's fsync.

So a kill or power loss at any moment leaves either the last committed state or, after the
commit point, the new one; never a mix. The journal exists only while a transaction is open.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from typing import Any

__all__ = ["JournaledFile", "has_hot_journal", "journal_path", "rollback"]

PAGE = 4096
_MAGIC = b"H5SJRNL1"
_HEADER = struct.Struct("<8sQI")  # magic, committed size, crc32 of the first two fields
_RECORD = struct.Struct("<QII")  # offset, length, crc32 of the page bytes


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
                os.close(fd)
    # A journal without a valid header was torn before any page was overwritten.
    os.unlink(jpath)
    _fsync_dir(path)
    return True


class JournaledFile(io.RawIOBase):
    """A read/write file for h5py's ``fileobj`` driver that journals committed pages.

    Parameters
    ----------
    path : str
        An existing file (rolled back first if it has a hot journal).

    Notes
    -----
    The object belongs to the process that opened it: in a forked child every write is
    discarded (a child must never touch its parent's file or journal).
    """

    def __init__(self, path: str, fresh: bool = False) -> None:
        super().__init__()
        rollback(path)
        self.path = path
        self._fd = os.open(path, os.O_RDWR)
        self._pid = os.getpid()
        self._pos = 0
        self._saved: set[int] = set()  # pages journaled in this transaction
        self._jfd: int | None = None
        if fresh:
            # A new file: the committed state is "empty", so a crash before the first
            # commit rolls back to an empty file rather than leaving half an HDF5 file.
            os.ftruncate(self._fd, 0)
            self._committed = 0
            self._open_journal()
        else:
            self._committed = os.fstat(self._fd).st_size

    # -- io.RawIOBase -------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
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

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = os.preadv(self._fd, [view], self._pos)
        self._pos += n
        return n

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if os.getpid() != self._pid:
            return n  # an inherited copy in a forked child: discard
        if self._pos < self._committed:
            self._protect(self._pos, min(self._pos + n, self._committed))
        done = 0
        while done < n:
            done += os.pwrite(self._fd, view[done:], self._pos + done)
        self._pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if os.getpid() != self._pid:
            return size
        if size < self._committed:
            self._protect(size, self._committed)
        os.ftruncate(self._fd, size)
        return size

    def flush(self) -> None:
        pass  # every write is already a pwrite; durability is commit()'s job

    # -- the journal --------------------------------------------------------------
    def _protect(self, start: int, stop: int) -> None:
        pages = [p for p in range(start // PAGE, (stop - 1) // PAGE + 1) if p not in self._saved]
        if not pages:
            return
        if self._jfd is None:
            self._open_journal()
        assert self._jfd is not None
        records = []
        for p in pages:
            offset = p * PAGE
            data = os.pread(self._fd, min(PAGE, self._committed - offset), offset)
            records.append(_RECORD.pack(offset, len(data), zlib.crc32(data)) + data)
        os.write(self._jfd, b"".join(records))
        os.fsync(self._jfd)  # the originals are durable before anything overwrites them
        self._saved.update(pages)

    def _open_journal(self) -> None:
        jpath = journal_path(self.path)
        self._jfd = os.open(jpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        head = struct.pack("<8sQ", _MAGIC, self._committed)
        os.write(self._jfd, _HEADER.pack(_MAGIC, self._committed, zlib.crc32(head)))
        os.fsync(self._jfd)
        _fsync_dir(jpath)

    @property
    def in_transaction(self) -> bool:
        return self._jfd is not None or os.fstat(self._fd).st_size != self._committed

    def commit(self) -> None:
        """Make everything written so far durable; delete the journal (the commit point)."""
        if os.getpid() != self._pid:
            return
        os.fsync(self._fd)
        if self._jfd is not None:
            os.close(self._jfd)
            self._jfd = None
            os.unlink(journal_path(self.path))
            _fsync_dir(self.path)
        self._saved.clear()
        self._committed = os.fstat(self._fd).st_size

    def disown(self) -> None:
        """In a forked child: make this inherited object inert without touching the files."""
        self._pid = -1

    def close(self) -> None:
        if not self.closed and os.getpid() == self._pid:
            if self._jfd is not None:
                os.close(self._jfd)  # uncommitted: the journal stays, the next open rolls back
                self._jfd = None
            os.close(self._fd)
        super().close()
