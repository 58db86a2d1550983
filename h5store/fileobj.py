"""The file objects HDF5 runs on (h5py's ``driver="fileobj"``): positioned I/O on a descriptor
of their own; :class:`JournaledFile` holds overwrites of committed pages and journals them at
each commit (the protocol: :mod:`h5store.journal`).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import gc
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

from h5store.commit_lock import CommitLock
from h5store.errors import WriteError
from h5store.journal import (
    PAGE,
    check_links,
    encode_batch,
    encode_header,
    file_identity,
    journal_path,
    rollback,
)
from h5store.objstore import RemoteObject
from h5store.pio import fsync_dir, read_into, write_all

__all__ = ["OVERLAY_BYTES", "JournaledFile", "ReadOnlyFile", "RemoteFile"]

OVERLAY_BYTES = 64 << 20  # committed pages held in memory before a transaction spills


class _Positioned(io.RawIOBase):
    """A seekable file object for h5py's ``fileobj`` driver that keeps its own position and
    names its file (h5py reports its repr as the name); ``_end()`` is the file's size."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._pos = 0

    def __repr__(self) -> str:
        return self.path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    @abc.abstractmethod
    def _end(self) -> int:
        """The file's size: where ``seek(0, SEEK_END)`` lands."""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = self._end() + offset
        return self._pos


class _PositionedFile(_Positioned):
    """A file on a descriptor of its own: positioned I/O only (``pread``/``pwrite`` at a
    position kept here), so a descriptor offset shared across a fork never moves."""

    def __init__(self, path: str, fd: int) -> None:
        super().__init__(path)
        self._fd = fd
        self._pid = os.getpid()

    def fileno(self) -> int:
        return self._fd

    def _end(self) -> int:
        return os.fstat(self._fd).st_size


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


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while HDF5 waits here for s3fs's event-loop thread.

    HDF5 calls :meth:`RemoteFile.readinto` holding h5py's global lock, and the read waits
    for fsspec's loop thread. A collection that starts on that thread and frees an h5py
    object (garbage left by the parent's files, in a forked worker above all) needs the same
    lock: both threads would wait forever (measured: most DataLoader workers forked while
    the parent read remotely in threads hung this way). Only one thread holds h5py's lock,
    so only one is ever here; the collector's state is restored on the way out.
    """
    global _paused
    was = gc.isenabled()
    gc.disable()
    _paused = _paused or was
    try:
        yield
    finally:
        if was:
            _paused = False
            gc.enable()


_paused = False  # the collector is disabled by _collector_paused (and is to be enabled again)


def _enable_collector_in_child() -> None:
    # A process forked while another thread was inside _collector_paused (a DataLoader
    # worker forked during a remote read) inherits the collector disabled, and that thread,
    # which would enable it again, does not exist in the child.
    global _paused
    if _paused:
        _paused = False
        gc.enable()


os.register_at_fork(after_in_child=_enable_collector_in_child)


class RemoteFile(_Positioned):
    """A read-only remote object for h5py's ``fileobj`` driver: HDF5's metadata reads served
    from aligned blocks of the object, each fetched once (a ranged GET, or the cache folder).

    HDF5 reads its metadata in many small pieces (object headers, B-tree nodes, heaps); one
    GET each would make an open cost hundreds of round trips. Reads here go by aligned blocks
    of ``block_bytes`` kept in memory (at most ``keep_bytes``, least recently used dropped), so
    an open costs a handful of requests (measured: ``benchmarks/bench_remote.py``). Data rows
    never come through here: the remote readers fetch them by the offsets HDF5 reports.

    Examples
    --------
    >>> f = RemoteFile(RemoteObject("s3://bucket/speech.h5"))  # doctest: +SKIP
    >>> h5py.File(f, "r")  # doctest: +SKIP
    """

    def __init__(self, obj: RemoteObject, block_bytes: int = 1 << 20, keep_bytes: int = 64 << 20) -> None:
        super().__init__(obj.url)
        self.obj = obj
        self.block_bytes = block_bytes
        self._keep = max(1, keep_bytes // block_bytes)
        self._blocks: dict[int, Any] = {}  # block number -> bytes, in use order
        self._size = obj.size  # one HEAD; a missing object or a refused key raises here, naming the URL

    def _end(self) -> int:
        return self._size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        a = self._pos
        z = min(self._size, a + len(view))
        if z <= a:
            return 0
        B = self.block_bytes
        blocks = range(a // B, (z - 1) // B + 1)
        missing = [b for b in blocks if b not in self._blocks]
        if missing:
            with _collector_paused():
                got = self.obj.read([b * B for b in missing], [min(self._size, (b + 1) * B) for b in missing])
            for b, data in zip(missing, got):
                self._blocks[b] = data
        o = 0
        for b in blocks:
            data = self._blocks.pop(b)
            self._blocks[b] = data  # most recently used last
            lo, hi = max(a, b * B), min(z, (b + 1) * B)
            view[o : o + hi - lo] = memoryview(data)[lo - b * B : hi - b * B]
            o += hi - lo
        while len(self._blocks) > self._keep:
            del self._blocks[next(iter(self._blocks))]
        self._pos = z
        return z - a

    def write(self, data: Any) -> int:
        raise OSError(f"{self.path}: a remote file is read-only")


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
        check_links(path)
        rollback(path)
        super().__init__(path, os.open(path, os.O_RDWR))
        # The journal belongs to the file, not to the name: beside the real file, its header
        # naming the file's device, inode and inode generation.
        self._jpath = journal_path(path)
        self._identity = file_identity(self._fd)
        self._batch = 0  # batches in the journal: one per journal fsync
        self._on_commit = on_commit
        # The first write, fsync or commit the OS refused (ENOSPC, EIO, ...): from then on the
        # file takes no more writes (HDF5's state no longer matches the disk); see fail().
        self.failure: WriteError | None = None
        self.describe_kept: Callable[[], str] | None = None  # "what was kept", for the message
        self._discard = False
        self.lock = CommitLock(self._fd, path)
        self._overlay: dict[int, bytearray] = {}  # page -> its new bytes (committed pages only)
        self._direct = False  # spilled: holding the commit lock, overwriting in place
        self._saved: set[int] = set()  # pages journaled in this transaction (direct mode)
        self._jfd: int | None = None
        self._journal_synced = False
        if fresh:
            os.ftruncate(self._fd, 0)
            self._committed = 0
            try:
                self._open_journal()
                self._sync_journal()
            except OSError as e:
                self.close()  # the caller removes the file it created
                raise self.fail(e, "starting its journal") from None
        else:
            self._committed = os.fstat(self._fd).st_size

    # -- io.RawIOBase -------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.failure is not None and not self._discard:
            raise self.refused()  # the bytes HDF5 would read may never have reached the disk
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
        if os.getpid() != self._pid or self._discard:
            return n  # an inherited copy in a forked child, or a failed file closing: discard
        if self.failure is not None:
            raise self.refused()
        try:
            self._write(view, n)
        except OSError as e:
            raise self.fail(e, "writing") from None
        return n

    def _write(self, view: memoryview, n: int) -> None:
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

    def _pwrite(self, view: memoryview, pos: int) -> None:
        write_all(self._fd, view, pos)

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if os.getpid() != self._pid or self._discard:
            return size
        if self.failure is not None:
            raise self.refused()
        try:
            if self._jfd is None:
                self._open_journal()
            if size < self._committed:
                self._spill()
                self._protect(size, self._committed)
            os.ftruncate(self._fd, size)
        except OSError as e:
            raise self.fail(e, "truncating") from None
        return size

    def flush(self) -> None:
        pass  # every write is already a pwrite or staged; durability is commit()'s job

    # -- the overlay and the journal ------------------------------------------------
    def _stage(self, view: memoryview, pos: int) -> None:
        stop = pos + len(view)
        for p in range(pos // PAGE, (stop - 1) // PAGE + 1):
            page = self._overlay.get(p)
            if page is None:
                page = self._overlay[p] = self._committed_page(p)
            a = max(pos, p * PAGE)
            b = min(stop, p * PAGE + len(page))
            page[a - p * PAGE : b - p * PAGE] = view[a - pos : b - pos]
        if len(self._overlay) * PAGE > OVERLAY_BYTES:
            self._spill()

    def _committed_page(self, p: int) -> bytearray:
        """The bytes of page ``p`` on disk, up to the committed size (the last page may be short)."""
        page = bytearray(min(PAGE, self._committed - p * PAGE))
        del page[read_into(self._fd, page, p * PAGE):]  # shorter only where the file ends first
        return page

    def _journal_pages(self, pages: list[int]) -> None:
        """Append the committed bytes of ``pages`` to the journal and make them durable."""
        assert self._jfd is not None
        saved = [(p * PAGE, self._committed_page(p)) for p in pages]
        batch = encode_batch(self._batch, saved)
        self._batch += 1
        write_all(self._jfd, batch)  # a short write must not pass for a whole one
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
        self._jfd = os.open(self._jpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_all(self._jfd, encode_header(self._committed, self._identity))
        self._batch = 0
        self._journal_synced = False

    def _sync_journal(self) -> None:
        assert self._jfd is not None
        os.fsync(self._jfd)
        if not self._journal_synced:
            fsync_dir(self._jpath)  # the journal's name survives a power loss too
            self._journal_synced = True

    @property
    def in_transaction(self) -> bool:
        return self._jfd is not None

    def commit(self) -> None:
        """Make everything written so far durable; delete the journal (the commit point).

        Raises :class:`~h5store.errors.WriteError` when the OS refuses a write or an fsync
        (then, or at any earlier write): the file stays as of its last commit.
        """
        if os.getpid() != self._pid or self._discard:
            return  # a forked child's copy, or a failed file closing
        if self.failure is not None:
            raise self.refused()
        if self._jfd is None:
            return  # nothing written since the last commit
        try:
            self._commit()
        except OSError as e:
            # Before the commit point: the journal holds every page overwritten so far, so
            # the rollback at close (or at the next open) restores the last commit.
            raise self.fail(e, "committing") from None

    def _commit(self) -> None:
        assert self._jfd is not None
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
            os.unlink(self._jpath)
            fsync_dir(self.path)
            self._overlay.clear()
            self._saved.clear()
            self._committed = os.fstat(self._fd).st_size
        finally:
            self._direct = False
            self.lock.release_exclusive()

    def disown(self) -> None:
        """In a forked child: make this inherited object inert without touching the files."""
        self._pid = -1

    def fail(self, e: OSError, doing: str) -> WriteError:
        """Record a write the OS refused; the first one is the file's ``failure``.

        After it the file refuses reads and writes (HDF5's state no longer matches the
        disk) until :meth:`discard_writes`, which lets HDF5 close without touching the disk.
        """
        if self.failure is None:
            kept = "everything committed before is intact; what was written since was not kept"
            if self.describe_kept is not None:
                with contextlib.suppress(Exception):
                    kept = self.describe_kept()
            code = e.errno or errno.EIO
            why = e.strerror or os.strerror(code)
            self.failure = WriteError(code, f"{self.path}: {why} while {doing}; {kept}")
            self.failure.filename = self.path
        return self.failure

    def refused(self) -> WriteError:
        """The error for any use of the file after its ``failure``."""
        assert self.failure is not None
        err = WriteError(self.failure.errno, f"{self.path}: an earlier write failed, so this open file takes "
                         f"no more reads or writes; close() it and reopen it (the error was: {self.failure})")
        err.filename = self.path
        return err

    def discard_writes(self) -> None:
        """From now on drop every write: HDF5 can then close a failed file without error."""
        self._discard = True

    def close(self) -> None:
        if not self.closed and os.getpid() == self._pid:
            if self._jfd is not None:
                os.close(self._jfd)  # uncommitted: the journal stays, the next open rolls back
                self._jfd = None
            os.close(self._fd)  # also drops a commit lock still held by a spilled transaction
        super().close()

