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
  are appended to ``<file>-journal`` as one batch (a batch header and per-page records, each
  with a CRC-32 of its header and of its bytes) and the journal is fsynced; then, holding the exclusive *commit lock*, the pages are written, the file is
  fsynced, the journal deleted and the directory fsynced. The deletion is the commit point.
  One journal fsync per commit, however many pages HDF5 rewrote.
* **Rollback**: opening a file that has a journal (a "hot" journal: its writer died) first
  checks the WHOLE journal, then writes the saved pages back, truncates the file to the
  committed size, fsyncs, and deletes the journal. A torn tail (a last batch that runs past
  the journal's end, or zeros: the crash hit while journaling) is ignored: its pages were
  never overwritten, because overwrites wait for the journal's fsync. Anything else that
  fails a CRC-32, or a journal whose header names another file, is refused
  (:class:`~h5store.errors.JournalError`): nothing applied, nothing deleted; :func:`recover`
  (``h5store recover FILE``) says what it holds and restores what checks out.
* **The journal belongs to the file**, not to the name: it sits beside the real file
  (symlinks resolved; a bind mount of the folder shows the same folder), its header names the
  file's device, inode and inode generation, and a file hard-linked within its folder finds a
  journal left beside any of its links. Writing a file hard-linked from another folder, or
  bind-mounted onto another name, is refused (:func:`check_links`).
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

import contextlib
import dataclasses
import errno
import fcntl
import io
import os
import re
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

from h5store.errors import WriteError

__all__ = [
    "CommitLock",
    "JournaledFile",
    "ReadOnlyFile",
    "RecoveryReport",
    "check_links",
    "find_journal",
    "has_hot_journal",
    "journal_path",
    "recover",
    "rollback",
]

PAGE = 4096
# Journal format 2 (docs/format.md): a header naming the file, then one batch per journal
# fsync; every header and every record carries a CRC-32, so damage is told from a torn tail.
_MAGIC = b"H5SJRNL2"
_HEADER = struct.Struct("<8sQQQQI")  # magic, committed size, st_dev, st_ino, inode generation, crc32
_BATCH_MAGIC = b"BTCH"
_BATCH = struct.Struct("<4sIIQI")  # magic, batch number, record count, bytes of its records, crc32
_RECORD = struct.Struct("<QIII")  # file offset, length, crc32 of the page bytes, crc32 of these 16 bytes
# Format 1 (h5store before issue 11): refused at open; `h5store recover` can apply it.
_MAGIC_V1 = b"H5SJRNL1"
_HEADER_V1 = struct.Struct("<8sQI")  # magic, committed size, crc32 of the first two fields
_RECORD_V1 = struct.Struct("<QII")  # offset, length, crc32 of the page bytes
_FS_IOC_GETVERSION = 0x80087601  # the inode's generation: tells a reused inode number apart
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


def journal_path(path: str | os.PathLike[str]) -> str:
    """Where a writer of ``path`` keeps its journal: beside the real file (symlinks resolved).

    Examples
    --------
    >>> journal_path("/tmp/x.h5")
    '/tmp/x.h5-journal'
    """
    return os.path.realpath(path) + "-journal"


def _identity(fd: int) -> tuple[int, int, int]:
    """(st_dev, st_ino, inode generation or 0 where the filesystem has none) of an open file."""
    st = os.fstat(fd)
    buf = bytearray(8)
    try:
        fcntl.ioctl(fd, _FS_IOC_GETVERSION, buf)
        gen = int.from_bytes(buf[:4], "little")  # the kernel writes an int
    except OSError:
        gen = 0
    return st.st_dev, st.st_ino, gen


def _same_file(journal: tuple[int, int, int], file: tuple[int, int, int]) -> bool:
    """Whether a journal's header names this file. The inode generation, where both have one,
    tells a reused inode number apart; then the device number is not required to match, as it
    may change across the reboot that follows a power loss. Without it, device + inode."""
    (jdev, jino, jgen), (dev, ino, gen) = journal, file
    if jino != ino:
        return False
    return jgen == gen if jgen and gen else jdev == dev


def find_journal(path: str | os.PathLike[str]) -> str | None:
    """The hot journal of the file ``path`` names, through whatever name or link, or None.

    The journal sits beside the real file (symlinks resolved), so every symlink, relative
    path and bind mount of the folder finds it. A file with several hard links in its folder
    may have its journal beside any of them: the folder is searched for a journal named after
    a link of the same inode, or whose header names the inode.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x.h5"); open(p, "w").close()
    >>> find_journal(p) is None
    True
    """
    real = os.path.realpath(path)
    if os.path.lexists(real + "-journal"):
        return real + "-journal"
    try:
        st = os.stat(real)
    except OSError:
        return None
    return _journal_of_links(real, st) if st.st_nlink > 1 else None


def _journal_of_links(real: str, st: os.stat_result) -> str | None:
    folder = os.path.dirname(real)
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith("-journal")]
    except OSError:
        return None
    for e in entries:
        try:
            b = os.stat(e.path[: -len("-journal")])
            if (b.st_dev, b.st_ino) == (st.st_dev, st.st_ino):
                return e.path
        except OSError:
            pass
        try:
            with open(e.path, "rb") as j:
                head = j.read(_HEADER.size)
        except OSError:
            continue
        if len(head) == _HEADER.size and head[:8] == _MAGIC and zlib.crc32(head[:-4]) == _HEADER.unpack(head)[5]:
            if _HEADER.unpack(head)[2:4] == (st.st_dev, st.st_ino):
                return e.path
    return None


def has_hot_journal(path: str | os.PathLike[str]) -> bool:
    """Whether the file ``path`` names has a journal (see :func:`find_journal`).

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x.h5"); open(p, "w").close()
    >>> has_hot_journal(p)
    False
    """
    return find_journal(path) is not None


def check_links(path: str | os.PathLike[str]) -> None:
    """Refuse to journal a file hard-linked from another folder.

    Its journal would sit beside this name, where an open through the other folder's link
    could not find it (and would read a half-committed file after a crash).

    Raises
    ------
    JournalError
        Naming the file, its link count and how many links its folder holds.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x.h5"); open(p, "w").close()
    >>> check_links(p)  # one link: fine
    """
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return
    if _is_mount_point(real):
        from h5store.errors import JournalError

        raise JournalError(
            f"{path}: the file is a bind mount of another file; h5store keeps a writer's rollback journal "
            "beside the file, where an open through the other file's name would not find it. Write through "
            "the original path; reading through the mount is fine"
        )
    if st.st_nlink <= 1:
        return
    try:
        here = sum(1 for e in os.scandir(os.path.dirname(real))
                   if e.inode() == st.st_ino and e.stat(follow_symlinks=False).st_dev == st.st_dev)
    except OSError:
        here = 0
    if here < st.st_nlink:
        from h5store.errors import JournalError

        raise JournalError(
            f"{path}: the file has {st.st_nlink} hard links, {st.st_nlink - here} of them in another folder; "
            "h5store keeps a writer's rollback journal beside the file, where an open through a link in "
            "another folder would not find it. Write through a copy (cp, not ln), or remove the other "
            "links; reading through any link is fine"
        )


def _is_mount_point(real: str) -> bool:
    """Whether ``real`` is a mount point (a file bind-mounted there), per /proc/self/mountinfo."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read().decode(errors="replace")
    except OSError:
        return False
    for line in table.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]) == real:
            return True
    return False


@dataclasses.dataclass
class _Parsed:
    """What a journal's bytes hold (see :func:`_parse`)."""

    version: int = 0
    committed: int | None = None
    identity: tuple[int, int, int] | None = None
    records: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)  # that check out
    problems: list[str] = dataclasses.field(default_factory=list)  # damage: refuse
    lost: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # file ranges not restorable
    unreadable: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # journal byte ranges
    torn: str = ""  # a tail legitimately ignored (its pages were never overwritten)
    empty: bool = False  # the header itself is torn: no page was ever overwritten
    batches: int = 0


def _next_batch(raw: bytes, pos: int) -> int | None:
    while (pos := raw.find(_BATCH_MAGIC, pos)) >= 0:
        if pos + _BATCH.size <= len(raw) and _BATCH.unpack_from(raw, pos)[4] == zlib.crc32(raw[pos : pos + _BATCH.size - 4]):
            return pos
        pos += 1
    return None


def _parse(raw: bytes) -> _Parsed:
    """Check a whole journal. Damage (a complete header, batch or record whose CRC-32 fails)
    goes to ``problems``; a torn tail (a batch running past the end, or zeros that never
    reached the disk) is ``torn``: the crash hit while journaling, before any of its pages
    was overwritten (overwrites wait for the journal's fsync)."""
    j = _Parsed()
    if raw[:8] == _MAGIC_V1:
        return _parse_v1(raw, j)
    if len(raw) < _HEADER.size or not any(raw[: _HEADER.size]):
        j.empty = True
        j.torn = f"its header is incomplete ({len(raw)} bytes): it was cut before any page was overwritten"
        return j
    magic, committed, dev, ino, gen, crc = _HEADER.unpack_from(raw)
    if magic != _MAGIC:
        j.problems.append(f"it is not an h5store journal of a known format (it starts with {raw[:8]!r})")
        return j
    if crc != zlib.crc32(raw[: _HEADER.size - 4]):
        j.problems.append("its header (committed size, file identity) fails its CRC-32")
        return j
    j.version, j.committed, j.identity = 2, committed, (dev, ino, gen)
    pos, number = _HEADER.size, 0
    while pos < len(raw):
        if not any(raw[pos:]):
            j.torn = f"journal bytes {pos}..{len(raw)} are zeros (written, never synced)"
            break
        if len(raw) - pos < _BATCH.size:
            j.torn = f"batch {number} at journal byte {pos} is cut short"
            break
        bmagic, bnum, count, nbytes, bcrc = _BATCH.unpack_from(raw, pos)
        if bmagic != _BATCH_MAGIC or bcrc != zlib.crc32(raw[pos : pos + _BATCH.size - 4]):
            nxt = _next_batch(raw, pos + 1)
            stop = len(raw) if nxt is None else nxt
            j.problems.append(f"the header of batch {number} at journal byte {pos} fails its CRC-32 "
                              f"(journal bytes {pos}..{stop} cannot be read)")
            j.unreadable.append((pos, stop))
            if nxt is None:
                break
            pos, number = nxt, _BATCH.unpack_from(raw, nxt)[1]
            continue
        if bnum != number:
            j.problems.append(f"batch {bnum} at journal byte {pos} where batch {number} was expected")
        end = pos + _BATCH.size + nbytes
        if end > len(raw):
            j.torn = f"batch {bnum} at journal byte {pos} is cut short ({len(raw) - pos} of {end - pos} bytes)"
            break
        _parse_records(raw, pos + _BATCH.size, end, count, bnum, j)
        j.batches += 1
        pos, number = end, bnum + 1
    return j


def _parse_records(raw: bytes, start: int, end: int, count: int, bnum: int, j: _Parsed) -> None:
    rp = start
    for _ in range(count):
        if rp + _RECORD.size > end:
            j.problems.append(f"batch {bnum}: its records run past its end (journal byte {end})")
            return
        off, length, pcrc, hcrc = _RECORD.unpack_from(raw, rp)
        if hcrc != zlib.crc32(raw[rp : rp + 16]) or rp + _RECORD.size + length > end:
            j.problems.append(f"batch {bnum}: the record header at journal byte {rp} fails its CRC-32 "
                              f"(journal bytes {rp}..{end} cannot be read)")
            j.unreadable.append((rp, end))
            return
        data = raw[rp + _RECORD.size : rp + _RECORD.size + length]
        if zlib.crc32(data) != pcrc:
            j.problems.append(f"the saved bytes of file range [{off}, {off + length}) (journal byte {rp}) fail their CRC-32")
            j.lost.append((off, length))
        elif j.committed is not None and off + length > j.committed:
            j.problems.append(f"a record for file range [{off}, {off + length}) lies past the committed size {j.committed}")
        else:
            j.records.append((off, data))
        rp += _RECORD.size + length
    if rp != end:
        j.problems.append(f"batch {bnum}: {end - rp} bytes after its {count} records")


def _parse_v1(raw: bytes, j: _Parsed) -> _Parsed:
    """Format 1: records until the first that fails (a torn tail, or damage: it cannot tell)."""
    j.version = 1
    j.problems.append("it was written by an older h5store (journal format 1), which cannot tell a torn "
                      "record from a damaged one")
    if len(raw) < _HEADER_V1.size:
        j.empty = True
        return j
    magic, committed, crc = _HEADER_V1.unpack_from(raw)
    if crc != zlib.crc32(raw[:16]):
        j.problems.append("its header fails its CRC-32")
        return j
    j.committed = committed
    pos = _HEADER_V1.size
    while pos + _RECORD_V1.size <= len(raw):
        off, length, rcrc = _RECORD_V1.unpack_from(raw, pos)
        data = raw[pos + _RECORD_V1.size : pos + _RECORD_V1.size + length]
        if len(data) != length or zlib.crc32(data) != rcrc:
            j.torn = f"the records from journal byte {pos} on do not check out"
            break
        j.records.append((off, data))
        pos += _RECORD_V1.size + length
    return j


def _refusal(path: str, jpath: str, problems: list[str]) -> Exception:
    from h5store.errors import JournalError

    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return JournalError(
        f"{path}: its rollback journal {jpath} does not check out: {problems[0]}{more}. Nothing was "
        f"applied and nothing deleted; the file may hold a half-finished commit. Run `h5store recover {path}` "
        "to see what the journal holds and what it can restore"
    )


def _foreign(path: str, jpath: str, journal: tuple[int, int, int], file: tuple[int, int, int]) -> str:
    return (f"the journal belongs to another file (device {journal[0]}, inode {journal[1]}, generation "
            f"{journal[2]}; {path} is device {file[0]}, inode {file[1]}, generation {file[2]}): its writer "
            "died, then the file was replaced or deleted")


def _apply(fd: int, path: str, j: _Parsed) -> None:
    lock = CommitLock(fd, path)
    lock.acquire_exclusive()  # readers must not read the pages being restored
    try:
        for offset, data in j.records:
            done = 0
            while done < len(data):  # a short write (a full disk) must not pass for a whole one
                done += os.pwrite(fd, data[done:], offset + done)
        if j.committed is not None:
            os.ftruncate(fd, j.committed)
        os.fsync(fd)
    finally:
        lock.release_exclusive()


def _remove(jpath: str) -> None:
    os.unlink(jpath)
    _fsync_dir(jpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    # A nearly full disk takes part of a write without an error; the next call raises ENOSPC.
    view = memoryview(data)
    while len(view):
        view = view[os.write(fd, view):]


def rollback(path: str) -> bool:
    """Undo an interrupted transaction on ``path``; True when there was one to undo.

    The whole journal is checked before any of it is applied: a journal that does not check
    out (a damaged header, batch or record, or one that names another file) is never applied
    in part and never deleted. The caller must hold the writer lock.

    Raises
    ------
    JournalError
        Naming the file and its journal, and saying to run ``h5store recover FILE``.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x.h5"); open(p, "w").close()
    >>> rollback(p)  # no journal: nothing to undo
    False
    """
    jpath = find_journal(path)
    if jpath is None:
        return False
    try:
        with open(jpath, "rb") as j:
            raw = j.read()
    except FileNotFoundError:
        return False
    parsed = _parse(raw)
    if parsed.empty and parsed.version != 1:
        _remove(jpath)  # torn before any page was overwritten: nothing to restore
        return True
    fd = os.open(path, os.O_RDWR)
    try:
        problems = list(parsed.problems)
        if not problems and parsed.identity is not None and not _same_file(parsed.identity, ident := _identity(fd)):
            problems.append(_foreign(path, jpath, parsed.identity, ident))
        if problems:
            raise _refusal(path, jpath, problems)
        _apply(fd, path, parsed)
    finally:
        os.close(fd)
    _remove(jpath)
    return True


@dataclasses.dataclass
class RecoveryReport:
    """What :func:`recover` found in a file's journal and what it did (or would do).

    ``ok`` is True when nothing is left to do: no journal, or one applied (or set aside)
    cleanly. ``changed`` is True when the file or its journal was changed.
    """

    path: str
    journal: str | None
    lines: list[str]
    ok: bool
    changed: bool = False


def recover(path: str, apply: bool = False) -> RecoveryReport:
    """Inspect the rollback journal of ``path`` and say what restoring it would do; with
    ``apply``, do it (``h5store recover FILE [--apply]``).

    With ``apply``: a journal that checks out is rolled back and deleted, as an open would.
    A damaged one has every record that checks out restored, the file truncated to its
    committed size, and is kept as ``<journal>.damaged-<time>`` (the byte ranges it could not
    restore are listed). One that names another file changes nothing in the file and is
    kept as ``<journal>.foreign-<time>``. A journal of a live writer is left alone.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x.h5"); open(p, "w").close()
    >>> recover(p).lines[0].endswith("no rollback journal: nothing to recover")
    True
    """
    jpath = find_journal(path)
    if jpath is None:
        return RecoveryReport(path, None, [f"{path}: no rollback journal: nothing to recover"], ok=True)
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return RecoveryReport(path, jpath, [f"{path}: a writer has the file open; {jpath} is its transaction in "
                                                "progress, not a crash's leftover: nothing to recover while it runs"],
                                  ok=False)
        with open(jpath, "rb") as jf:
            raw = jf.read()
        return _recover(fd, path, jpath, raw, apply)
    finally:
        os.close(fd)  # drops the flock


def _recover(fd: int, path: str, jpath: str, raw: bytes, apply: bool) -> RecoveryReport:
    j = _parse(raw)
    ident = _identity(fd)
    size = os.fstat(fd).st_size
    lines = [f"{path}: rollback journal {jpath} ({len(raw)} bytes, journal format {j.version or '?'})"]
    foreign = j.identity is not None and not _same_file(j.identity, ident)
    if j.identity is not None:
        lines.append(f"  file identity: the journal names device {j.identity[0]} inode {j.identity[1]} generation "
                     f"{j.identity[2]}; the file is device {ident[0]} inode {ident[1]} generation {ident[2]}: "
                     + ("ANOTHER FILE" if foreign else "the same file"))
    if j.committed is not None:
        lines.append(f"  committed size: {j.committed} bytes (the file is {size} bytes now)")
    nbytes = sum(len(d) for _, d in j.records)
    lines.append(f"  {j.batches} batch(es); {len(j.records)} saved page(s) check out ({nbytes} bytes)")
    if j.torn:
        lines.append(f"  torn tail, ignored (its pages were never overwritten): {j.torn}")
    lines += [f"  damaged: {p}" for p in j.problems]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kind = "foreign" if foreign else "damaged" if j.version != 1 else "format1"  # the kept copy's name
    damaged = bool(j.problems) and j.version != 1 or j.committed is None
    cannot = [f"file bytes [{o}, {o + n})" for o, n in j.lost]
    cannot += [f"whatever journal bytes {a}..{b} held" for a, b in j.unreadable]
    if j.empty and j.version != 1:
        plan, ok = "delete the journal: it was cut before any page was overwritten", True
    elif foreign:
        plan, ok = f"set the journal aside as {jpath}.foreign-{stamp} and change nothing in {path}", True
    elif j.committed is None:
        plan, ok = (f"restore nothing (the journal's header cannot be trusted) and keep the journal as "
                    f"{jpath}.damaged-{stamp}; {path} may hold a half-finished commit"), False
    else:
        plan = (f"restore {len(j.records)} page(s) ({nbytes} bytes), truncate {path} to {j.committed} bytes, and "
                + (f"keep the journal as {jpath}.{kind}-{stamp}" if damaged or j.version == 1 else "delete the journal"))
        ok = not damaged
    if cannot:
        plan += "; it cannot restore " + ", ".join(cannot)
    if not apply:
        lines.append(f"  would {plan}")
        lines.append("  nothing was changed; run again with --apply to do it")
        return RecoveryReport(path, jpath, lines, ok=False)
    if not (j.empty and j.version != 1) and not foreign and j.committed is not None:
        _apply(fd, path, j)
    if (j.empty and j.version != 1) or not (damaged or foreign or j.version == 1):
        _remove(jpath)
    else:
        os.rename(jpath, f"{jpath}.{kind}-{stamp}")
        _fsync_dir(jpath)
    done = plan
    for now, past in (("restore ", "restored "), ("truncate ", "truncated "), ("keep the", "kept the"),
                      ("delete the", "deleted the"), ("change nothing", "changed nothing")):
        done = done.replace(now, past, 1)
    lines.append(f"  done: {done}")
    return RecoveryReport(path, jpath, lines, ok=ok, changed=True)


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
        check_links(path)
        rollback(path)
        super().__init__(path, os.open(path, os.O_RDWR))
        # The journal belongs to the file, not to the name: beside the real file, its header
        # naming the file's device, inode and inode generation.
        self._jpath = journal_path(path)
        self._identity = _identity(self._fd)
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
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], pos + done)

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
            head = struct.pack("<QII", offset, len(data), zlib.crc32(data))
            records.append(head + struct.pack("<I", zlib.crc32(head)) + data)
        body = b"".join(records)
        bhead = struct.pack("<4sIIQ", _BATCH_MAGIC, self._batch, len(records), len(body))
        self._batch += 1
        _write_all(self._jfd, bhead + struct.pack("<I", zlib.crc32(bhead)) + body)  # a short write must not pass for a whole one
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
        head = struct.pack("<8sQQQQ", _MAGIC, self._committed, *self._identity)
        _write_all(self._jfd, head + struct.pack("<I", zlib.crc32(head)))
        self._batch = 0
        self._journal_synced = False

    def _sync_journal(self) -> None:
        assert self._jfd is not None
        os.fsync(self._jfd)
        if not self._journal_synced:
            _fsync_dir(self._jpath)  # the journal's name survives a power loss too
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
