"""A rollback journal beneath HDF5: crash-safe writes to a file that already holds data.

Measured here (RELIABILITY.md): an interrupted in-place append can make the records that were
already in an HDF5 file unreadable, and ``flush()`` issues no fsync. h5store protects a committed
file the way SQLite protects its pages. HDF5 runs on a :class:`~h5store.fileobj.JournaledFile` (h5py's
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

import dataclasses
import fcntl
import os
import re
import struct
import time
import zlib

from h5store.commit_lock import CommitLock
from h5store.objstore import REMOTE_SCHEMES
from h5store.pio import fsync_dir, write_all

__all__ = [
    "PAGE",
    "RecoveryReport",
    "check_links",
    "encode_batch",
    "encode_header",
    "file_identity",
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


def journal_path(path: str | os.PathLike[str]) -> str:
    """Where a writer of ``path`` keeps its journal: beside the real file (symlinks resolved).

    Examples
    --------
    >>> journal_path("/tmp/x.h5")
    '/tmp/x.h5-journal'
    """
    return os.path.realpath(path) + "-journal"


def file_identity(fd: int) -> tuple[int, int, int]:
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
            write_all(fd, data, offset)  # a short write (a full disk) must not pass for a whole one
        if j.committed is not None:
            os.ftruncate(fd, j.committed)
        os.fsync(fd)
    finally:
        lock.release_exclusive()




def _remove(jpath: str) -> None:
    os.unlink(jpath)
    fsync_dir(jpath)


def encode_header(committed: int, identity: tuple[int, int, int]) -> bytes:
    """A format-2 journal header: the file's committed size and identity, with its CRC-32."""
    head = struct.pack("<8sQQQQ", _MAGIC, committed, *identity)
    return head + struct.pack("<I", zlib.crc32(head))


def encode_batch(number: int, pages: list[tuple[int, bytes]]) -> bytes:
    """Batch ``number`` of a format-2 journal: the saved bytes of ``pages`` ((file offset,
    bytes) each), every record and the batch header with their CRC-32s."""
    records = []
    for offset, data in pages:
        head = struct.pack("<QII", offset, len(data), zlib.crc32(data))
        records.append(head + struct.pack("<I", zlib.crc32(head)))
        records.append(data)
    body = b"".join(records)
    bhead = struct.pack("<4sIIQ", _BATCH_MAGIC, number, len(pages), len(body))
    return bhead + struct.pack("<I", zlib.crc32(bhead)) + body


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
        if not problems and parsed.identity is not None and not _same_file(parsed.identity, ident := file_identity(fd)):
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
    if isinstance(path, str) and path.startswith(REMOTE_SCHEMES):
        from h5store.errors import ReadOnlyError

        raise ReadOnlyError(f"{path}: recover writes to the file it restores; an object in a store is read-only "
                            "and never has a journal (it was uploaded whole): check it with `h5store verify`, "
                            "and if it is damaged, upload a good copy again (`h5store push FILE URL --overwrite`)")
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
    ident = file_identity(fd)
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
        fsync_dir(jpath)
    done = plan
    for now, past in (("restore ", "restored "), ("truncate ", "truncated "), ("keep the", "kept the"),
                      ("delete the", "deleted the"), ("change nothing", "changed nothing")):
        done = done.replace(now, past, 1)
    lines.append(f"  done: {done}")
    return RecoveryReport(path, jpath, lines, ok=ok, changed=True)

