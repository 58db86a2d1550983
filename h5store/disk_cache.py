"""A cache directory of fetched blocks shared by every process on a machine: :class:`DiskCache`.

DataLoader workers, ranks and later runs on one machine read a remote file's blocks from
here instead of the network. An entry is written under a temporary name in the same folder
and renamed into place (``os.replace`` is atomic), so a reader sees a whole entry or none:
a process killed while filling leaves only a temporary file, never served and removed by a
later eviction. Each entry carries its length and CRC-32; one that does not match (a damaged
disk, a truncated copy) is deleted and fetched again, never served. The folder is bounded
(``max_bytes``): when a process's fills pass a tenth of the bound since its last look, it
scans the folder and removes the least recently used entries (hits refresh an entry's
modification time, at most every 10 s per entry and process) down to 90% of the bound.

Examples
--------
>>> import tempfile
>>> c = DiskCache(tempfile.mkdtemp(), max_bytes=1 << 20)
>>> c.put("k", b"abc"); c.get("k")
b'abc'
>>> c.get("other") is None
True
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time

from h5store.checksum import crc32

__all__ = ["DiskCache"]

_MAGIC = b"H5SC\x01\x00\x00\x00"
_HEADER = struct.Struct("<8sQI")  # magic, payload length, CRC-32 of the payload
_STALE_TMP_S = 600.0  # a temporary file older than this belongs to a killed fill


class DiskCache:
    """Blocks by key in ``folder``, at most ``max_bytes`` in all (least recently used evicted).

    Parameters
    ----------
    folder : str
        The cache directory (created if absent); share it between processes on one machine.
    max_bytes : int
        The bound on the entries' total size.
    block_bytes : int
        The usual entry size: this process remembers the entries it checked for at most
        ``max_bytes // block_bytes`` of them (as many as the folder holds).

    Examples
    --------
    >>> import tempfile
    >>> c = DiskCache(tempfile.mkdtemp(), max_bytes=10)
    >>> for k in "abcd": c.put(k, b"xxxx")
    >>> c.total() <= 10
    True
    """

    touch_every_s = 10.0  # a hit read by pread refreshes its entry's mtime at most this often

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int = 20 << 30, block_bytes: int = 4 << 20) -> None:
        if max_bytes < 1:
            raise ValueError(f"cache max_bytes must be >= 1, got {max_bytes}")
        self.folder = os.fspath(folder)
        self.max_bytes = int(max_bytes)
        os.makedirs(self.folder, exist_ok=True)
        self._since_scan = 0
        self._checked: dict[str, tuple[int, int, int]] = {}  # entry -> (inode, size, pid) checked whole
        self._touched: dict[str, float] = {}  # entry -> when this process last refreshed its mtime
        self._max_checked = max(64, self.max_bytes // max(1, int(block_bytes)) + 1)

    def read_range(self, key: str, offset: int, n: int) -> bytes | None:
        """Bytes ``[offset, offset + n)`` of the entry's payload; None when absent or bad.

        The entry is checked whole (length and CRC-32, :meth:`get`) the first time this
        process reads it; later reads of it are one ``pread`` of the bytes asked for (the
        items' own CRC-32, checked when served, covers them).
        """
        p = self.path_of(key)
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            seen = self._checked.get(p)
            now = time.monotonic()
            if seen != (st.st_ino, st.st_size, os.getpid()):
                if self.get_path(p) is None:  # checked whole; its mtime refreshed
                    return None
                if len(self._checked) >= self._max_checked:  # bounded: more than the folder holds
                    self._checked.clear()
                    self._touched.clear()
                self._checked[p] = (st.st_ino, st.st_size, os.getpid())
                self._touched[p] = now
            elif now - self._touched.get(p, -1e18) >= self.touch_every_s:
                with contextlib.suppress(OSError):
                    os.utime(fd)  # recently used: evicted last (least recently used, not first filled)
                self._touched[p] = now
            if offset + n > st.st_size - _HEADER.size:
                return None
            data = os.pread(fd, n, _HEADER.size + offset)
            return data if len(data) == n else None
        finally:
            os.close(fd)

    def path_of(self, key: str) -> str:
        return os.path.join(self.folder, hashlib.sha1(key.encode()).hexdigest() + ".blk")

    def get(self, key: str) -> bytes | None:
        """The entry's payload, checked against its length and CRC-32; None when absent or bad."""
        return self.get_path(self.path_of(key))

    def get_path(self, p: str | os.PathLike[str]) -> bytes | None:
        """The payload of the entry file ``p`` if it is whole (length and CRC-32), else None (and removed)."""
        try:
            with open(p, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return None
        if len(raw) >= _HEADER.size:
            magic, n, crc = _HEADER.unpack_from(raw)
            payload = raw[_HEADER.size :]
            if magic == _MAGIC and n == len(payload) and crc32(payload) == crc:
                with contextlib.suppress(OSError):
                    os.utime(p)  # recently used: evicted last
                return payload
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)  # damaged: never served, fetched again
        return None

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key``: written to a temporary name, then renamed into place."""
        p = self.path_of(key)
        tmp = f"{p}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        payload = memoryview(data).cast("B")
        try:
            with open(tmp, "wb") as fh:
                fh.write(_HEADER.pack(_MAGIC, len(payload), crc32(payload)))
                fh.write(payload)
            os.replace(tmp, p)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return  # a full or read-only cache disk costs a refetch, never a failed read
        self._since_scan += len(payload) + _HEADER.size
        if self._since_scan > self.max_bytes // 10:
            self.evict()

    def total(self) -> int:
        """Bytes of the entries now in the folder."""
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[float, int, str]]:
        found = []
        with os.scandir(self.folder) as it:
            for e in it:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.endswith(".tmp"):
                    if time.time() - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.path)  # left by a killed fill
                    continue
                if e.name.endswith(".blk"):
                    found.append((st.st_mtime, st.st_size, e.path))
        return found

    def evict(self) -> None:
        """Remove the least recently used entries until the folder holds <= 90% of ``max_bytes``."""
        self._since_scan = 0
        entries = self._entries()
        total = sum(s for _, s, _ in entries)
        if total <= self.max_bytes:
            return
        entries.sort()
        goal = self.max_bytes * 9 // 10
        for _, size, path in entries:
            if total <= goal:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # another process may have removed it first
            total -= size
