"""The :class:`Reader` protocol every way of reading rows implements, and what readers share.

See :mod:`h5store.readers` for the readers and the one place a reader is chosen.
"""

from __future__ import annotations

import os
import weakref
from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

import h5py
import numpy as np

from h5store.layout import ReadPlan, plan_reads

__all__ = ["PerProcessFile", "Reader", "ReaderBase"]


@runtime_checkable
class Reader(Protocol):
    """Reads ranges of rows of one dataset (axis 0), for any read path.

    Attributes
    ----------
    stable : bool
        Where the rows are never moves while a writer commits: reads need no commit lock.
        Otherwise (addresses from HDF5) read under the file's commit lock, after
        :meth:`rebind` to the dataset of the current open.
    releases_gil : bool
        Its reads release the GIL for the copy or the decoding: threads read in parallel.
    resident : bool
        The rows are in memory already: rereading them costs nothing, and bytes checked
        once stay checked.
    survives_fork : bool
        A forked child can keep using it as it is; otherwise it is chosen again (it holds
        per-process descriptors or HDF5 objects).
    max_gap : int
        Rows worth reading across to join two runs into one read call.
    """

    stable: bool
    releases_gil: bool
    resident: bool
    survives_fork: bool
    max_gap: int

    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        """The rows of ``plan.runs``, concatenated in order: a ``(plan.total, ...)`` array."""

    def read_scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """Rows ``[starts[j], starts[j] + counts[j])`` into ``out[dest[j], :counts[j]]`` (a caller's buffer)."""

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Row ``rows[j]`` at ``[j]``: one row each."""

    def open(self) -> None:
        """Open what reads need in this process now (before threads share the reader)."""

    def close(self) -> None:
        """Close this process's descriptors (they reopen on the next read)."""

    def rebind(self, ds: h5py.Dataset) -> None:
        """The file was reopened after a commit: read ``ds`` (the same dataset) from now on."""


def _scatter(out: np.ndarray, dest: np.ndarray, buf: np.ndarray, offsets: np.ndarray, counts: np.ndarray) -> None:
    """``out[dest[j], :counts[j]] = buf[offsets[j]:+counts[j]]``."""
    for j, o, c in zip(dest.tolist(), offsets.tolist(), counts.tolist()):
        out[j, :c] = buf[o : o + c]


class ReaderBase(ABC):
    """What a reader inherits: :meth:`read_scatter` and :meth:`take` through :meth:`read_runs`,
    nothing to open, close or rebind. A subclass must define :meth:`read_runs` (it cannot be
    instantiated otherwise)."""

    stable = False
    releases_gil = False
    resident = False
    survives_fork = False
    max_gap = 0

    @abstractmethod
    def read_runs(self, plan: ReadPlan) -> np.ndarray:
        """The rows of ``plan.runs``, concatenated in plan order."""

    def read_scatter(self, out: np.ndarray, dest: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        plan = plan_reads(starts, starts + counts, max_gap=self.max_gap)
        _scatter(out, dest, self.read_runs(plan), plan.offsets, counts)

    def take(self, rows: np.ndarray) -> np.ndarray:
        plan = plan_reads(rows, rows + 1, max_gap=self.max_gap)
        return self.read_runs(plan)[plan.offsets]

    def open(self) -> None:  # noqa: B027 - deliberately nothing: most readers hold nothing to open
        """Acquire what reads need (a descriptor); nothing by default."""

    def close(self) -> None:  # noqa: B027 - deliberately nothing to release by default
        """Release what :meth:`open` acquired; nothing by default."""

    def rebind(self, ds: h5py.Dataset) -> None:  # noqa: B027 - only readers holding HDF5 objects rebind
        """Take the dataset of a reopened file (after a commit); nothing by default."""


def _close_fd(fd: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child's copy of the reader must not close anything
        try:
            os.close(fd)
        except OSError:
            pass


class PerProcessFile:
    """A descriptor of ``self.path`` per process: opened on first use, never inherited."""

    path: str
    _fd: int | None
    _pid: int

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
            # Closed with the reader (or when it is garbage): never one descriptor per open leaked.
            self._closer = weakref.finalize(self, _close_fd, self._fd, self._pid)
        return self._fd

    def open(self) -> None:
        self._file()

    def close(self) -> None:
        closer = self.__dict__.get("_closer")
        if closer is not None and self._pid == os.getpid():
            closer()
        self._fd = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fd"], state["_pid"] = None, -1
        state.pop("_closer", None)
        return state
