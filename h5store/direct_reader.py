"""Unfiltered rows read with ``os.preadv`` at byte offsets HDF5 reported once: :class:`DirectReader`."""

from __future__ import annotations

import os

import h5py
import numpy as np

from h5store.errors import CorruptRecordError
from h5store.layout import ReadPlan, byte_offsets, piece_spans
from h5store.pio import read_into, readv_exact
from h5store.reader_protocol import PerProcessFile, ReaderBase

__all__ = ["DirectReader"]


class DirectReader(PerProcessFile, ReaderBase):
    """Reads unfiltered rows with ``os.preadv`` at byte offsets HDF5 reported once.

    ``pieces`` maps row ranges to file offsets: ``starts`` (the first row of each piece,
    increasing) and ``offsets`` (its byte offset); a piece holds ``piece_rows`` rows
    (contiguous data is a single piece). The offsets stay right while a writer appends:
    an unfiltered chunk never moves, and committed rows are never rewritten with other
    bytes, so these reads need neither HDF5 nor the commit lock (``stable``).
    """

    stable = True
    releases_gil = True
    survives_fork = False  # its descriptor is per process: reopened in a forked child

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype, starts: np.ndarray,
                 offsets: np.ndarray, piece_rows: int, where: str | None = None) -> None:
        self.path = path
        self.where = where or path
        self.shape = shape
        self.dtype = dtype
        self.row_nbytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self.starts = starts
        self.offsets = offsets
        self.piece_rows = piece_rows
        self._fd: int | None = None
        self._pid = -1

    @classmethod
    def for_dataset(cls, ds: h5py.Dataset, path: str, where: str | None = None) -> DirectReader | None:
        """A direct reader when ``ds`` is plain numeric bytes in this file, else None."""
        if ds.dtype.kind not in "biufc" or ds.dtype.hasobject:
            return None
        if ds.id.get_create_plist().get_nfilters():  # any filter: gzip, lzf, a plugin's (zstd, blosc)...
            return None
        if ds.external or ds.is_virtual:
            return None
        n = ds.shape[0] if ds.shape else 0
        if ds.chunks is None:
            off = ds.id.get_offset()
            if off is None:
                return None if n else cls(path, ds.shape, ds.dtype, np.zeros(1, np.int64), np.zeros(1, np.int64), 1, where)
            return cls(path, ds.shape, ds.dtype, np.zeros(1, np.int64), np.array([off], np.int64), max(n, 1), where)
        if tuple(ds.chunks[1:]) != tuple(ds.shape[1:]):
            return None  # chunks split rows: not worth a direct path
        rows = int(ds.chunks[0])
        found: list[tuple[int, int]] = []
        if n:
            ds.id.chunk_iter(lambda info: found.append((info.chunk_offset[0], info.byte_offset)))
        found.sort()
        starts = np.array([c for c, _ in found], dtype=np.int64)
        offsets = np.array([o for _, o in found], dtype=np.int64)
        if len(found) != -(-n // rows):
            return None  # unallocated chunks (fill values) are left to HDF5
        expected = np.arange(0, n, rows, dtype=np.int64)
        if np.any(starts != expected):
            return None  # unallocated chunks (fill values) are left to HDF5
        row_nbytes = int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize
        if starts.size > 1 and np.all(np.diff(offsets) == rows * row_nbytes):
            # Chunks laid end to end (as a single writer allocates them): one piece.
            return cls(path, ds.shape, ds.dtype, starts[:1], offsets[:1], max(n, 1), where)
        return cls(path, ds.shape, ds.dtype, starts, offsets, rows, where)


    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        out = np.empty((plan.total, *self.shape[1:]), dtype=self.dtype)
        fd = self._file()
        rb = self.row_nbytes
        o = 0
        for a, b in plan.runs.tolist():
            if b > self.shape[0]:
                raise CorruptRecordError(f"{self.where}: read of rows [{a}, {b}) past the end ({self.shape[0]})")
            for p, first, end in piece_spans(a, b, self.piece_rows, self.starts):
                want = (end - first) * rb
                got = read_into(fd, out[o : o + end - first], int(self.offsets[p]) + (first - int(self.starts[p])) * rb)
                if got != want:
                    raise CorruptRecordError(
                        f"{self.where}: short read ({got} of {want} bytes): the file is truncated"
                    )
                o += end - first
        return out

    def read_scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """Rows ``[starts[j], +counts[j])`` into ``out[dest[j]]`` with ``os.preadv``: one copy, no HDF5.

        Byte offsets come from the piece table (:func:`~h5store.layout.byte_offsets`,
        vectorised); reads go in file order, and ranges that follow each other on disk share
        one ``preadv`` call (one iovec per batch slot).
        """
        rb = self.row_nbytes
        if not rb or not len(dest):
            return
        if int((starts + counts).max()) > self.shape[0]:
            raise CorruptRecordError(f"{self.where}: read past the end of the data ({self.shape[0]} rows)")
        view = memoryview(out).cast("B")
        slot = (out.strides[0] if out.ndim > 1 else rb)
        byte, inside = byte_offsets(self.starts, self.offsets, self.piece_rows, rb, starts, counts)
        nbytes = counts * rb
        order = np.argsort(byte, kind="stable")
        fd = self._file()
        preadv = os.preadv
        iov: list[memoryview] = []
        at = end = -1
        for j, o, n, ok, s, c in zip(dest[order].tolist(), byte[order].tolist(), nbytes[order].tolist(),
                                     inside[order].tolist(), starts[order].tolist(), counts[order].tolist()):
            if not n:
                continue
            if not ok:  # the range crosses pieces: read it piece by piece
                dst, d = view[j * slot : j * slot + n], 0
                for p, first, stop in piece_spans(s, s + c, self.piece_rows, self.starts):
                    k = (stop - first) * rb
                    self._readv(fd, [dst[d : d + k]], int(self.offsets[p]) + (first - int(self.starts[p])) * rb)
                    d += k
                continue
            if o != end:
                if iov and preadv(fd, iov, at) != end - at:
                    self._readv(fd, iov, at)  # a short read: finished buffer by buffer
                iov, at = [], o
            iov.append(view[j * slot : j * slot + n])
            end = o + n
        if iov and preadv(fd, iov, at) != end - at:
            self._readv(fd, iov, at)

    def _readv(self, fd: int, iov: list[memoryview], offset: int) -> None:
        try:
            readv_exact(fd, iov, offset, self.where)
        except EOFError as e:
            raise CorruptRecordError(f"{e}: the file is truncated") from None
