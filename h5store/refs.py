"""The refs table: a group's ids, and id <-> row lookup without per-item Python objects.

On disk a group's ids are a ragged uint8 column (utf-8 bytes concatenated, an ``(N, 2)``
``[start, stop)`` index) plus ``checksum``, the CRC-32 of each id's bytes. In memory the
lookup is flat numpy arrays: the ids' bytes with ``N + 1`` offsets, the CRC-32 values
sorted, and the rows in that order. A lookup hashes the query with :func:`zlib.crc32`,
binary-searches the sorted hashes and confirms the bytes, so a million ids of 11 bytes cost
~27 MB (measured: a forked reader that opens such a file and looks up 10,000 ids adds
~40 MB, HDF5 and allocator included), shared by forked workers, instead of a
million-entry dict that every worker would copy.

Ids are normalised to Unicode NFC, must be non-empty and may hold no control characters
(a NUL would be silently cut by HDF5 names elsewhere; here ids are data, never names).
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from h5store.errors import CorruptRecordError, DuplicateIdError, NotFound

__all__ = ["Refs", "crc32_many", "normalize_id"]

# Unicode category Cc is exactly these 65 code points; a regex scans them in C.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def normalize_id(value: object) -> str:
    """Return ``value`` as a valid id (NFC) or raise ``ValueError`` saying why not."""
    if not isinstance(value, str):
        raise ValueError(f"an id must be a str, got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError("an id must not be empty")
    # ASCII is already NFC: skipping normalize() keeps batched lookups at ~1 us per id.
    nfc = value if value.isascii() else unicodedata.normalize("NFC", value)
    bad = _CONTROL.search(nfc)
    if bad is not None:
        raise ValueError(f"id {value!r} holds control character {bad.group()!r}")
    return nfc


def crc32_many(blobs: Iterable[bytes]) -> np.ndarray:
    """CRC-32 of each blob, as uint32."""
    return np.fromiter((zlib.crc32(b) for b in blobs), dtype=np.uint32)


def _key_or_empty(value: object) -> bytes:
    # b"" matches no stored id (ids are non-empty), so an invalid id reads as absent.
    try:
        return normalize_id(value).encode("utf-8")
    except ValueError:
        return b""


def _narrow(bounds: np.ndarray) -> np.ndarray:
    # int32 offsets whenever the ids' bytes fit (2 GiB): 4 MB per million ids instead of 8.
    return bounds.astype(np.int32) if bounds[-1] < 2**31 else bounds.astype(np.int64)


def _compact(index: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(bounds, data)`` with id ``i`` at ``data[bounds[i]:bounds[i + 1]]``.

    h5store writes ids back to back, so this keeps ``data`` and turns the ``(N, 2)`` index
    into ``N + 1`` offsets (a third of its memory). Ids stored otherwise are gathered into a
    fresh contiguous buffer first.
    """
    lengths = index[:, 1] - index[:, 0]
    bounds = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    contiguous = not len(index) or (index[0, 0] == 0 and np.array_equal(index[1:, 0], index[:-1, 1]))
    if not contiguous:
        pos = np.repeat(index[:, 0] - bounds[:-1], lengths) + np.arange(int(bounds[-1]), dtype=np.int64)
        data = data[pos]
    return _narrow(bounds), data[: int(bounds[-1])]


class Refs:
    """Id <-> row mapping of one group.

    Parameters
    ----------
    index : (N, 2) int64
        ``[start, stop)`` of each id in ``data``.
    data : (B,) uint8
        The ids' utf-8 bytes, concatenated.
    crc : (N,) uint32
        CRC-32 of each id's bytes.
    where : str
        Names the file and group in error messages.

    Examples
    --------
    >>> r = Refs.empty("demo.h5:/")
    >>> r.add(["a", "b"])
    array([0, 1])
    >>> r.row("b"), r.id(0), "c" in r
    (1, 'a', False)
    """

    def __init__(self, index: np.ndarray, data: np.ndarray, crc: np.ndarray, where: str = "") -> None:
        index = np.asarray(index, dtype=np.int64).reshape(-1, 2)
        data = np.asarray(data, dtype=np.uint8).reshape(-1)
        self._crc = np.asarray(crc, dtype=np.uint32).reshape(-1)
        if not (len(index) == len(self._crc)):
            raise ValueError(f"{where}: ids index and crc32 differ in length")
        self._bounds, self._data = _compact(index, data)
        self.where = where
        self._order: np.ndarray | None = None  # rows sorted by crc, built on first lookup
        self._sorted: np.ndarray | None = None
        # Ids added since the last merge (writer side only): bytes -> row.
        self._pending: dict[bytes, int] = {}
        self._pending_list: list[bytes] = []

    @classmethod
    def empty(cls, where: str = "") -> Refs:
        return cls(np.zeros((0, 2), np.int64), np.zeros(0, np.uint8), np.zeros(0, np.uint32), where)

    # ------------------------------------------------------------------ reading
    @property
    def has_pending(self) -> bool:
        """Whether ids were added since the last :meth:`take_pending` (a writer's unflushed ids)."""
        return bool(self._pending_list)

    def __len__(self) -> int:
        return len(self._bounds) - 1 + len(self._pending_list)

    @property
    def merged(self) -> int:
        """Ids held in the lookup arrays; the rest (``len(self) - merged``) await :meth:`take_pending`."""
        return len(self._bounds) - 1

    def id(self, row: int) -> str:
        """The id at ``row`` (negative rows count from the end)."""
        n = len(self)
        if row < 0:
            row += n
        if not 0 <= row < n:
            raise NotFound(f"{self.where}: position {row} out of range for {n} ids")
        base = self.merged
        if row >= base:
            return self._pending_list[row - base].decode("utf-8")
        a, b = self._bounds.item(row), self._bounds.item(row + 1)
        key = self._data[a:b].tobytes()
        # Lookups confirm bytes and hash together; a listing must check the stored CRC-32 itself.
        if zlib.crc32(key) != self._crc.item(row):
            raise CorruptRecordError(f"{self.where}: the id at position {row} fails its checksum")
        try:
            return key.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptRecordError(f"{self.where}: the id at position {row} is not utf-8") from None

    def __iter__(self) -> Iterator[str]:
        for row in range(len(self)):
            yield self.id(row)

    def _lookup_table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._order is None or self._sorted is None:
            order = np.argsort(self._crc, kind="stable")
            # int32 rows halve the table (4 MB per million ids) whenever they fit.
            self._order = order.astype(np.int32) if len(order) < 2**31 else order
            self._sorted = self._crc[self._order]
        return self._order, self._sorted

    def _find(self, key: bytes) -> int:
        row = self._pending.get(key) if self._pending else None
        if row is not None:
            return row
        order, hashes = self._order, self._sorted
        if order is None or hashes is None:
            order, hashes = self._lookup_table()
        # A uint32 query: a Python int would make searchsorted cast the whole table (~1 ms at 1M ids).
        h = zlib.crc32(key)
        k = int(hashes.searchsorted(np.uint32(h)))
        n = hashes.size
        bounds, data = self._bounds, self._data
        # .item() and memoryview comparisons: no numpy scalar per step (~2 us per lookup).
        while k < n and hashes.item(k) == h:
            r = order.item(k)
            a, b = bounds.item(r), bounds.item(r + 1)
            if b - a == len(key) and memoryview(data)[a:b] == key:
                return r
            k += 1
        return -1

    def find(self, id: str) -> int:
        """Row of ``id``, or -1 when absent."""
        try:
            key = normalize_id(id).encode("utf-8")
        except ValueError:
            return -1
        return self._find(key)

    def row(self, id: str) -> int:
        """Row of ``id``; raises :class:`~h5store.errors.NotFound` when absent."""
        r = self.find(id)
        if r < 0:
            raise NotFound(f"{self.where}: no id {id!r}")
        return r

    def rows(self, ids: Iterable[str]) -> np.ndarray:
        """Rows of many ids at once (vectorised search); raises ``NotFound`` naming the first missing."""
        ids = list(ids)
        keys = [_key_or_empty(i) for i in ids]
        out = self._rows_of(keys)
        if out.size and out.min() < 0:
            raise NotFound(f"{self.where}: no id {ids[int(np.argmin(out))]!r}")
        return out

    def _rows_of(self, keys: list[bytes]) -> np.ndarray:
        """Rows of encoded ids, -1 where absent: hash, search and byte-compare as whole arrays."""
        out = np.full(len(keys), -1, dtype=np.int64)
        order, hashes = self._lookup_table()
        if keys and hashes.size:
            h = crc32_many(keys)
            k = np.minimum(hashes.searchsorted(h), hashes.size - 1)
            cand = order[k]
            first = self._bounds[cand].astype(np.int64)
            qlen = np.fromiter((len(x) for x in keys), dtype=np.int64, count=len(keys))
            hit = np.flatnonzero((hashes[k] == h) & (self._bounds[cand + 1] - first == qlen) & (qlen > 0))
            if hit.size:
                n = qlen[hit]
                heads = np.zeros(hit.size, dtype=np.int64)
                np.cumsum(n[:-1], out=heads[1:])
                pos = np.repeat(first[hit] - heads, n) + np.arange(int(n.sum()), dtype=np.int64)
                query = np.frombuffer(b"".join([keys[j] for j in hit.tolist()]), dtype=np.uint8)
                differs = np.logical_or.reduceat(self._data[pos] != query, heads)
                ok = hit[~differs]
                out[ok] = cand[ok]
        # Hash collisions, ids added since the last flush, and misses: one by one.
        for j in np.flatnonzero(out < 0).tolist():
            out[j] = self._find(keys[j])
        return out

    def __contains__(self, id: object) -> bool:
        return isinstance(id, str) and self.find(id) >= 0

    # ------------------------------------------------------------------ writing
    def add(self, ids: Iterable[str]) -> np.ndarray:
        """Append new ids; returns their rows. A duplicate (in the table or the batch) raises."""
        keys = []
        for i in ids:
            try:
                keys.append(normalize_id(i).encode("utf-8"))
            except ValueError as e:
                raise ValueError(f"{self.where}: {e}") from None
        seen: set[bytes] = set()
        for key in keys:
            if key in seen:
                raise DuplicateIdError(f"{self.where}: id {key.decode('utf-8')!r} given twice in one call")
            if self._find(key) >= 0:
                raise DuplicateIdError(f"{self.where}: id {key.decode('utf-8')!r} is already stored")
            seen.add(key)
        first = len(self)
        for j, key in enumerate(keys):
            self._pending[key] = first + j
            self._pending_list.append(key)
        return np.arange(first, first + len(keys))

    def take_pending(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Merge the ids added since the last call into the lookup arrays.

        Returns ``(lengths, data, crc)`` of those ids for the writer to store.
        """
        keys = self._pending_list
        lengths = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
        data = np.frombuffer(b"".join(keys), dtype=np.uint8)
        crc = crc32_many(keys)
        if keys:
            stops = int(self._bounds[-1]) + np.cumsum(lengths)
            self._bounds = _narrow(np.concatenate([self._bounds.astype(np.int64), stops]))
            self._data = np.concatenate([self._data, data])
            self._crc = np.concatenate([self._crc, crc])
            self._order = self._sorted = None
        self._pending = {}
        self._pending_list = []
        return lengths, data, crc

    def to_numpy(self) -> np.ndarray:
        """All ids as one numpy unicode array (materialises them: for inspection, not lookups)."""
        return np.array(list(self), dtype=str)
