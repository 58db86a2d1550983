"""The refs table: a group's ids, and id <-> row lookup without per-item Python objects.

On disk a group's ids are a ragged uint8 column (utf-8 bytes concatenated, an ``(N, 2)``
``[start, stop)`` index) plus ``crc32``, the CRC-32 of each id's bytes. In memory the
lookup is three numpy arrays: the crc32 values sorted, the rows in that order, and the
ids' bytes. A lookup hashes the query with :func:`zlib.crc32`, binary-searches the sorted
hashes and confirms the bytes, so a million ids cost ~40 MB of flat arrays that forked
workers share, instead of a million-entry dict that every worker would copy.

Ids are normalised to Unicode NFC, must be non-empty and may hold no control characters
(a NUL would be silently cut by HDF5 names elsewhere; here ids are data, never names).
"""

from __future__ import annotations

import unicodedata
import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from h5store.errors import DuplicateIdError, NotFound

__all__ = ["Refs", "crc32_many", "normalize_id"]


def normalize_id(value: object) -> str:
    """Return ``value`` as a valid id (NFC) or raise ``ValueError`` saying why not."""
    if not isinstance(value, str):
        raise ValueError(f"an id must be a str, got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError("an id must not be empty")
    nfc = unicodedata.normalize("NFC", value)
    bad = next((c for c in nfc if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise ValueError(f"id {value!r} holds control character {bad!r}")
    return nfc


def crc32_many(blobs: Iterable[bytes]) -> np.ndarray:
    """CRC-32 of each blob, as uint32."""
    return np.fromiter((zlib.crc32(b) for b in blobs), dtype=np.uint32)


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
        self._index = np.asarray(index, dtype=np.int64).reshape(-1, 2)
        self._data = np.asarray(data, dtype=np.uint8).reshape(-1)
        self._crc = np.asarray(crc, dtype=np.uint32).reshape(-1)
        if not (len(self._index) == len(self._crc)):
            raise ValueError(f"{where}: ids index and crc32 differ in length")
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
    def __len__(self) -> int:
        return len(self._index) + len(self._pending_list)

    def id(self, row: int) -> str:
        """The id at ``row`` (negative rows count from the end)."""
        n = len(self)
        if row < 0:
            row += n
        if not 0 <= row < n:
            raise NotFound(f"{self.where}: position {row} out of range for {n} ids")
        base = len(self._index)
        if row >= base:
            return self._pending_list[row - base].decode("utf-8")
        a, b = self._index[row]
        return self._data[a:b].tobytes().decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        for row in range(len(self)):
            yield self.id(row)

    def _lookup_table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._order is None or self._sorted is None:
            self._order = np.argsort(self._crc, kind="stable")
            self._sorted = self._crc[self._order]
        return self._order, self._sorted

    def _find(self, key: bytes) -> int:
        row = self._pending.get(key) if self._pending else None
        if row is not None:
            return row
        order, hashes = self._lookup_table()
        h = zlib.crc32(key)
        k = int(hashes.searchsorted(h))
        n = hashes.size
        while k < n and hashes[k] == h:
            r = int(order[k])
            a, b = self._index[r]
            if b - a == len(key) and self._data[a:b].tobytes() == key:
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
        keys = []
        for i in ids:
            try:
                keys.append(normalize_id(i).encode("utf-8"))
            except ValueError:
                keys.append(b"")  # matches no stored id: reported as missing below
        out = np.full(len(keys), -1, dtype=np.int64)
        if not keys:
            return out
        order, hashes = self._lookup_table()
        h = crc32_many(keys)
        k = hashes.searchsorted(h)
        for j, key in enumerate(keys):
            kj = int(k[j])
            hj = int(h[j])
            while kj < hashes.size and hashes[kj] == hj:
                r = int(order[kj])
                a, b = self._index[r]
                if b - a == len(key) and self._data[a:b].tobytes() == key:
                    out[j] = r
                    break
                kj += 1
            if out[j] < 0 and self._pending:
                out[j] = self._pending.get(key, -1)
            if out[j] < 0:
                raise NotFound(f"{self.where}: no id {ids[j]!r}")
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
            if key in seen or self._find(key) >= 0:
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
            base = int(self._index[-1, 1]) if len(self._index) else 0
            stops = base + np.cumsum(lengths)
            new_index = np.stack([stops - lengths, stops], axis=1)
            self._index = np.concatenate([self._index, new_index])
            self._data = np.concatenate([self._data, data])
            self._crc = np.concatenate([self._crc, crc])
            self._order = self._sorted = None
        self._pending = {}
        self._pending_list = []
        return lengths, data, crc

    def to_numpy(self) -> np.ndarray:
        """All ids as one numpy unicode array (materialises them: for inspection, not lookups)."""
        return np.array(list(self), dtype=str)
