"""The HDF5 superblock, read with plain file I/O (no HDF5): where a file says it ends.

Layouts: HDF5 File Format Specification, "Superblock" (versions 0-3); versions 2 and 3 carry
a lookup3 checksum. :func:`h5store.integrity.verify` uses the recorded end of file to tell a
truncated file from a damaged one before HDF5 opens it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

__all__ = ["Superblock", "read_superblock"]

_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class Superblock:
    """What the superblock says about a file, read with plain file I/O (no HDF5).

    ``eof`` is the end-of-file address HDF5 recorded, relative to the start of the file;
    a file shorter than that was truncated. ``checksum_ok`` is None for versions 0 and 1,
    which carry no checksum.
    """

    version: int
    offset: int
    eof: int
    checksum_ok: bool | None


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & 0xFFFFFFFF


def _lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``, the checksum of HDF5's v2/v3 superblocks."""
    m = 0xFFFFFFFF
    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & m
    k = 0
    while n > 12:
        a = (a + int.from_bytes(data[k : k + 4], "little")) & m
        b = (b + int.from_bytes(data[k + 4 : k + 8], "little")) & m
        c = (c + int.from_bytes(data[k + 8 : k + 12], "little")) & m
        a = (a - c) & m; a ^= _rot(c, 4); c = (c + b) & m  # noqa: E702 - lookup3's mix(), as published
        b = (b - a) & m; b ^= _rot(a, 6); a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= _rot(b, 8); b = (b + a) & m  # noqa: E702
        a = (a - c) & m; a ^= _rot(c, 16); c = (c + b) & m  # noqa: E702
        b = (b - a) & m; b ^= _rot(a, 19); a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= _rot(b, 4); b = (b + a) & m  # noqa: E702
        n -= 12
        k += 12
    if n == 0:
        return c
    tail = data[k:] + bytes(12 - n)
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + int.from_bytes(tail[8:12], "little")) & m
    c ^= b; c = (c - _rot(b, 14)) & m  # noqa: E702 - lookup3's final(), as published
    a ^= c; a = (a - _rot(c, 11)) & m  # noqa: E702
    b ^= a; b = (b - _rot(a, 25)) & m  # noqa: E702
    c ^= b; c = (c - _rot(b, 16)) & m  # noqa: E702
    a ^= c; a = (a - _rot(c, 4)) & m  # noqa: E702
    b ^= a; b = (b - _rot(a, 14)) & m  # noqa: E702
    c ^= b; c = (c - _rot(b, 24)) & m  # noqa: E702
    return c


def read_superblock(path: str | os.PathLike[str]) -> Superblock | str:
    """The superblock of ``path``, or a sentence saying why there is none.

    HDF5 looks for its signature at offsets 0, 512, 1024, 2048, ... (after a user block).
    Layouts: HDF5 File Format Specification, "Superblock" (versions 0-3).

    Examples
    --------
    >>> read_superblock(__file__)  # doctest: +ELLIPSIS
    '...no HDF5 signature...'
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        offset = 0
        while offset + len(_SIGNATURE) <= size:
            fh.seek(offset)
            head = fh.read(128)
            if head.startswith(_SIGNATURE):
                return _parse_superblock(head, offset, size)
            offset = 512 if offset == 0 else offset * 2
    if size < len(_SIGNATURE):
        return f"{size} bytes: too short to hold an HDF5 superblock (truncated, or not HDF5)"
    return "no HDF5 signature at offset 0, 512, 1024, ...: not an HDF5 file"


def _parse_superblock(head: bytes, offset: int, size: int) -> Superblock | str:
    if len(head) < 9:
        return f"the file ends inside its superblock (at byte {size}): truncated"
    version = head[8]
    if version in (0, 1):
        if len(head) < 16:
            return f"the file ends inside its superblock (at byte {size}): truncated"
        so = head[13]
        at = 24 if version == 0 else 28  # base address follows the fixed fields (+4 in v1)
    elif version in (2, 3):
        so = head[9]
        at = 12
    else:
        return f"unknown superblock version {version}"
    if so not in (2, 4, 8):
        return f"superblock declares {so}-byte addresses: damaged"
    need = at + 4 * so + (4 if version >= 2 else 0)
    if len(head) < need:
        return f"the file ends inside its superblock (at byte {size}): truncated"
    # The stored end-of-file address is absolute (HDF5 compares it with the file size plus
    # the base address, then subtracts that again): no base offset to add.
    eof_at = at + 2 * so
    eof = int.from_bytes(head[eof_at : eof_at + so], "little")
    checksum_ok = None
    if version >= 2:
        body = head[: at + 4 * so]
        stored = struct.unpack_from("<I", head, at + 4 * so)[0]
        checksum_ok = _lookup3(body) == stored
    return Superblock(version, offset, eof, checksum_ok)

