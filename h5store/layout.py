"""Pure numpy index math: read planning, row-to-byte offsets, window tables, geometric growth.

Nothing here touches a file. HDF5 (and the page cache) want few, large, increasing reads,
while a training batch asks for many small ranges in random order. :func:`plan_reads`
turns the second into the first: sort, drop duplicates, coalesce overlapping or nearby
ranges into runs, and remember where every requested range lands in the concatenated
buffer of runs, so the caller's order can be restored with plain slicing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "ReadPlan",
    "byte_offsets",
    "count_windows",
    "gather",
    "grow_capacity",
    "locate_windows",
    "merge_extents",
    "piece_spans",
    "plan_reads",
]

_I64 = np.int64


@dataclass(frozen=True)
class ReadPlan:
    """Where to read, and where each requested range sits in what was read.

    Attributes
    ----------
    runs : (R, 2) int64
        Disjoint, increasing ``[start, stop)`` ranges to read, in order.
    offsets : (n,) int64
        For each requested range, its first row in the buffer made by concatenating the
        runs in order.
    lengths : (n,) int64
        The requested ranges' lengths (``stop - start``).
    total : int
        Rows in the concatenated buffer (``sum`` of run lengths).
    """

    runs: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    total: int


def plan_reads(starts: np.ndarray, stops: np.ndarray, max_gap: int = 0) -> ReadPlan:
    """Plan one read per run for a batch of ``[start, stop)`` ranges.

    Ranges may repeat, overlap, be empty, and come in any order. Two ranges join one run
    when the second begins at most ``max_gap`` rows after the first's end (reading a few
    unneeded rows is cheaper than one more read call).

    Examples
    --------
    >>> p = plan_reads(np.array([10, 0, 10, 3]), np.array([12, 3, 12, 4]))
    >>> p.runs.tolist(), p.offsets.tolist()
    ([[0, 4], [10, 12]], [4, 0, 4, 3])
    """
    starts = np.asarray(starts, dtype=_I64).reshape(-1)
    stops = np.asarray(stops, dtype=_I64).reshape(-1)
    if starts.shape != stops.shape:
        raise ValueError(f"starts and stops differ in length: {starts.size} != {stops.size}")
    lengths = stops - starts
    if np.any(lengths < 0):
        raise ValueError("a range has stop < start")
    n = starts.size
    offsets = np.zeros(n, dtype=_I64)
    nonempty = np.flatnonzero(lengths > 0)
    if nonempty.size == 0:
        return ReadPlan(np.zeros((0, 2), dtype=_I64), offsets, lengths, 0)
    order = nonempty[np.argsort(starts[nonempty], kind="stable")]
    s, e = starts[order], stops[order]
    reach = np.maximum.accumulate(e)
    new_run = np.empty(s.size, dtype=bool)
    new_run[0] = True
    new_run[1:] = s[1:] > reach[:-1] + max_gap
    heads = np.flatnonzero(new_run)
    run_starts = s[heads]
    run_stops = np.maximum.reduceat(e, heads)
    run_lengths = run_stops - run_starts
    run_buffer = np.zeros(heads.size, dtype=_I64)
    np.cumsum(run_lengths[:-1], out=run_buffer[1:])
    run_of = np.cumsum(new_run) - 1
    offsets[order] = run_buffer[run_of] + (s - run_starts[run_of])
    runs = np.stack([run_starts, run_stops], axis=1)
    return ReadPlan(runs, offsets, lengths, int(run_lengths.sum()))


def gather(plan: ReadPlan, buffer: np.ndarray) -> list[np.ndarray]:
    """Cut the concatenated buffer of a plan's runs back into the requested ranges.

    Each result is a view into ``buffer``, in the caller's original order.
    """
    return [buffer[o : o + n] for o, n in zip(plan.offsets.tolist(), plan.lengths.tolist())]


def piece_spans(a: int, b: int, piece_rows: int | np.ndarray,
                piece_starts: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """``(piece, first, stop)`` for each piece that rows ``[a, b)`` cross, in order.

    Data stored as pieces (HDF5 chunks, runs of chunks laid end to end, or one piece for
    contiguous data): piece ``p`` holds ``piece_rows`` rows (an int, or one count per
    piece) from ``piece_starts[p]`` (increasing), or from ``p * piece_rows`` when
    ``piece_starts`` is None (a regular grid). The spans join into ``[a, b)``; each lies
    inside its piece.

    Examples
    --------
    >>> piece_spans(3, 12, 5)
    [(0, 3, 5), (1, 5, 10), (2, 10, 12)]
    >>> piece_spans(3, 12, 5, np.array([0, 5, 10]))
    [(0, 3, 5), (1, 5, 10), (2, 10, 12)]
    """
    out = []
    while a < b:
        if piece_starts is None:
            p = a // piece_rows
            base = p * piece_rows
        else:
            p = int(piece_starts.searchsorted(a, side="right")) - 1
            base = int(piece_starts[p])
        end = min(b, base + (piece_rows if isinstance(piece_rows, int) else int(piece_rows[p])))
        out.append((p, a, end))
        a = end
    return out


def byte_offsets(piece_starts: np.ndarray, piece_offsets: np.ndarray, piece_rows: int | np.ndarray, row_nbytes: int,
                 starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """File byte offset of row ``starts[j]``, and whether rows ``[starts[j], +counts[j])`` stay in its piece.

    Pieces as in :func:`piece_spans` (``piece_offsets[p]``: the byte offset of piece
    ``p``'s first row); vectorised over the ranges. A range that leaves its piece is read
    piece by piece (:func:`piece_spans`).

    Examples
    --------
    >>> byte, inside = byte_offsets(np.array([0, 4]), np.array([100, 900]), 4, 8, np.array([1, 3, 5]), np.array([2, 2, 3]))
    >>> byte.tolist(), inside.tolist()
    ([108, 124, 908], [True, False, True])
    """
    piece = np.searchsorted(piece_starts, starts, side="right") - 1
    base = piece_starts[piece]
    rows = piece_rows if isinstance(piece_rows, int) else piece_rows[piece]
    inside = starts + counts <= base + rows
    return piece_offsets[piece] + (starts - base) * row_nbytes, inside


def merge_extents(piece_starts: np.ndarray, piece_offsets: np.ndarray, piece_rows: int,
                  row_nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Join pieces laid end to end on disk into extents: ``(starts, offsets, rows)`` per extent.

    Piece ``p + 1`` continues piece ``p``'s extent when its first row follows the piece's
    last and its bytes follow the piece's bytes in the file (HDF5 allocates a single
    writer's chunks this way, with a rare chunk of another dataset in between). A range of
    rows inside one extent is then one read, whatever the chunks it crosses.

    Examples
    --------
    >>> s, o, r = merge_extents(np.array([0, 4, 8, 12]), np.array([100, 132, 500, 532]), 4, 8)
    >>> s.tolist(), o.tolist(), r.tolist()
    ([0, 8], [100, 500], [8, 8])
    """
    piece_starts = np.asarray(piece_starts, dtype=_I64)
    piece_offsets = np.asarray(piece_offsets, dtype=_I64)
    if piece_starts.size == 0:
        return piece_starts, piece_offsets, np.zeros(0, _I64)
    follows = np.empty(piece_starts.size, dtype=bool)
    follows[0] = False
    follows[1:] = ((np.diff(piece_starts) == piece_rows)
                   & (np.diff(piece_offsets) == piece_rows * row_nbytes))
    heads = np.flatnonzero(~follows)
    counts = np.diff(np.append(heads, piece_starts.size))
    return piece_starts[heads], piece_offsets[heads], (counts * piece_rows).astype(_I64)


def count_windows(lengths: np.ndarray, length: int, hop: int, partial: bool = False) -> np.ndarray:
    """Number of windows of ``length`` rows at every ``hop`` rows in items of ``lengths``.

    With ``partial=True`` an item shorter than ``length`` still yields one (padded)
    window, and so does a non-empty tail; otherwise only full windows count.

    Examples
    --------
    >>> count_windows(np.array([10, 3, 0, 4]), length=4, hop=2).tolist()
    [4, 0, 0, 1]
    """
    if length <= 0 or hop <= 0:
        raise ValueError(f"window length and hop must be > 0, got {length} and {hop}")
    lengths = np.asarray(lengths, dtype=_I64)
    if partial:
        # Windows until one reaches the end, but never one starting past the end (hop > length).
        reach = (np.maximum(lengths - length, 0) + hop - 1) // hop + 1
        return np.where(lengths > 0, np.minimum(reach, (lengths + hop - 1) // hop), 0)
    return np.where(lengths >= length, (lengths - length) // hop + 1, 0)


def locate_windows(flat: np.ndarray, counts: np.ndarray, hop: int) -> tuple[np.ndarray, np.ndarray]:
    """Map flat window numbers to ``(item, first row in item)`` without Python objects.

    ``counts`` comes from :func:`count_windows`; window ``k`` of the whole file is window
    ``k - sum(counts[:item])`` of its item.
    """
    ends = np.cumsum(np.asarray(counts, dtype=_I64))
    flat = np.asarray(flat, dtype=_I64)
    total = int(ends[-1]) if ends.size else 0
    if flat.size and (flat.min() < 0 or flat.max() >= total):
        raise IndexError(f"window number out of range [0, {total})")
    item = np.searchsorted(ends, flat, side="right")
    first = ends[item] - np.asarray(counts, dtype=_I64)[item]
    return item, (flat - first) * hop


def grow_capacity(capacity: int, needed: int, minimum: int = 1024) -> int:
    """Next capacity for a resizable dataset: at least ``needed``, grown geometrically.

    Doubling keeps the number of resizes logarithmic in the final size.
    """
    if needed <= capacity:
        return capacity
    return max(needed, 2 * capacity, minimum)
