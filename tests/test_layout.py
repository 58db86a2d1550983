"""h5store.layout: the read planner and window tables, property-tested against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5store.layout import (
    ReadPlan,
    byte_offsets,
    count_windows,
    gather,
    grow_capacity,
    locate_windows,
    piece_spans,
    plan_reads,
)

SIZE = 60  # rows in the test "dataset": small, so ranges repeat and overlap often


@st.composite
def ranges(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Random [start, stop) ranges inside SIZE rows: repeats, overlaps, empties, any order."""
    n = draw(st.integers(0, 25))
    pairs = draw(st.lists(st.tuples(st.integers(0, SIZE), st.integers(0, SIZE)), min_size=n, max_size=n))
    pairs = [(min(a, b), max(a, b)) for a, b in pairs]
    if pairs and draw(st.booleans()):
        pairs += draw(st.lists(st.sampled_from(pairs), max_size=5))  # exact repeats
        pairs = draw(st.permutations(pairs))
    starts = np.array([a for a, _ in pairs], dtype=np.int64)
    stops = np.array([b for _, b in pairs], dtype=np.int64)
    return starts, stops


def read_like_storage(data: np.ndarray, plan: ReadPlan) -> np.ndarray:
    """What a reader does with a plan: read each run, concatenate in run order."""
    parts = [data[a:b] for a, b in plan.runs.tolist()]
    return np.concatenate(parts) if parts else data[:0]


@settings(max_examples=200, deadline=None)
@given(ranges(), st.integers(0, 10), st.sampled_from([(), (3,), (2, 2)]))
def test_plan_and_gather_equal_numpy_slicing(r: tuple[np.ndarray, np.ndarray], max_gap: int, inner: tuple) -> None:
    starts, stops = r
    data = np.arange(SIZE * int(np.prod(inner)), dtype=np.float64).reshape(SIZE, *inner)
    plan = plan_reads(starts, stops, max_gap=max_gap)
    got = gather(plan, read_like_storage(data, plan))
    expect = [data[a:b] for a, b in zip(starts.tolist(), stops.tolist())]
    assert len(got) == len(expect)
    for g, e in zip(got, expect):
        np.testing.assert_array_equal(g, e)
        assert g.shape == e.shape
    # The concatenation of the results is what numpy fancy indexing gives.
    rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)]) if len(starts) else np.zeros(0, int)
    joined = np.concatenate(got) if got else data[:0]
    np.testing.assert_array_equal(joined, data[rows])


@settings(max_examples=200, deadline=None)
@given(ranges(), st.integers(0, 10))
def test_runs_are_disjoint_increasing_and_cover_exactly_what_is_needed(r: tuple[np.ndarray, np.ndarray], max_gap: int) -> None:
    starts, stops = r
    plan = plan_reads(starts, stops, max_gap=max_gap)
    runs = plan.runs
    assert runs.dtype == np.int64 and runs.shape[1] == 2
    assert np.all(runs[:, 1] > runs[:, 0]), "no empty run"
    # Disjoint and separated by more than max_gap rows: otherwise they should have merged.
    assert np.all(runs[1:, 0] > runs[:-1, 1] + max_gap)
    assert plan.total == int((runs[:, 1] - runs[:, 0]).sum())
    needed = np.zeros(SIZE, bool)
    for a, b in zip(starts, stops):
        needed[a:b] = True
    covered = np.zeros(SIZE, bool)
    for a, b in runs:
        covered[a:b] = True
    assert np.all(covered[needed]), "every requested row is read"
    if max_gap == 0:
        np.testing.assert_array_equal(covered, needed)  # and nothing else
    # Every run starts and ends on a requested row.
    for a, b in runs:
        assert needed[a] and needed[b - 1]
    np.testing.assert_array_equal(plan.lengths, stops - starts)


def test_plan_doc_example_and_edge_cases() -> None:
    p = plan_reads(np.array([10, 0, 10, 3]), np.array([12, 3, 12, 4]))
    assert p.runs.tolist() == [[0, 4], [10, 12]]
    assert p.offsets.tolist() == [4, 0, 4, 3]
    empty = plan_reads(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert empty.runs.shape == (0, 2) and empty.total == 0
    only_empty = plan_reads(np.array([5, 7]), np.array([5, 7]))
    assert only_empty.total == 0 and only_empty.lengths.tolist() == [0, 0]
    assert [len(x) for x in gather(only_empty, np.zeros((0, 3)))] == [0, 0]
    # max_gap joins ranges 3 rows apart into one run, and not 4 rows apart.
    assert plan_reads(np.array([0, 5]), np.array([2, 7]), max_gap=3).runs.tolist() == [[0, 7]]
    assert plan_reads(np.array([0, 6]), np.array([2, 8]), max_gap=3).runs.tolist() == [[0, 2], [6, 8]]


def test_plan_refuses_bad_ranges() -> None:
    with pytest.raises(ValueError, match="stop < start"):
        plan_reads(np.array([5]), np.array([4]))
    with pytest.raises(ValueError, match="differ in length"):
        plan_reads(np.array([1, 2]), np.array([3]))


def brute_count(lengths: list[int], length: int, hop: int, partial: bool) -> list[int]:
    """Windows start at 0, hop, 2*hop... A full window fits in the item. With ``partial``, a
    start inside the item also counts when the previous window had not reached the end."""
    out = []
    for n in lengths:
        k = 0
        for s in range(0, n, hop):
            if s + length <= n:
                k += 1
            elif partial and (s == 0 or s - hop + length < n):
                k += 1
        out.append(k)
    return out


def brute_windows(lengths: list[int], counts: list[int], hop: int) -> list[tuple[int, int]]:
    return [(item, w * hop) for item, c in enumerate(counts) for w in range(c)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=20), st.integers(1, 12), st.integers(1, 12), st.booleans())
def test_count_windows_matches_brute_force(lengths: list[int], length: int, hop: int, partial: bool) -> None:
    got = count_windows(np.array(lengths, dtype=np.int64), length, hop, partial=partial)
    assert got.tolist() == brute_count(lengths, length, hop, partial)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=20), st.integers(1, 12), st.integers(1, 12), st.booleans(), st.data())
def test_locate_windows_matches_brute_force(lengths: list[int], length: int, hop: int, partial: bool, data: st.DataObject) -> None:
    counts = count_windows(np.array(lengths, dtype=np.int64), length, hop, partial=partial)
    table = brute_windows(lengths, counts.tolist(), hop)
    if not table:
        with pytest.raises(IndexError):
            locate_windows(np.array([0]), counts, hop)
        return
    flat = data.draw(st.lists(st.integers(0, len(table) - 1), max_size=30))
    item, first = locate_windows(np.array(flat, dtype=np.int64), counts, hop)
    assert list(zip(item.tolist(), first.tolist())) == [table[k] for k in flat]
    # Every located window lies inside its item (a partial one may run past its end, padded).
    for i, s in zip(item.tolist(), first.tolist()):
        assert 0 <= s < lengths[i]
        if not partial:
            assert s + length <= lengths[i]


def test_locate_windows_refuses_out_of_range() -> None:
    counts = count_windows(np.array([10, 3]), length=4, hop=2)
    assert counts.tolist() == [4, 0]
    with pytest.raises(IndexError):
        locate_windows(np.array([4]), counts, 2)
    with pytest.raises(IndexError):
        locate_windows(np.array([-1]), counts, 2)
    with pytest.raises(ValueError):
        count_windows(np.array([3]), length=0, hop=1)


@given(st.integers(0, 10**9), st.integers(0, 10**9), st.integers(1, 10**6))
def test_grow_capacity_is_geometric(capacity: int, needed: int, minimum: int) -> None:
    new = grow_capacity(capacity, needed, minimum)
    if needed <= capacity:
        assert new == capacity
    else:
        assert new >= needed and new >= 2 * capacity and new >= minimum


def test_grow_capacity_resizes_logarithmically() -> None:
    cap, resizes = 0, 0
    for size in range(1, 100_001):
        new = grow_capacity(cap, size, minimum=16)
        resizes += new != cap
        cap = new
    assert resizes <= 14  # 16 * 2**13 > 100_000


# ----------------------------------------------------------------------------- rows to bytes
@st.composite
def pieces(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """A dataset stored as pieces (chunks at arbitrary, non-overlapping byte offsets, or one piece):
    (piece starts, piece byte offsets, rows per piece, bytes per row, rows)."""
    rows = draw(st.integers(1, 80))
    row_nbytes = draw(st.integers(1, 16))
    if draw(st.booleans()):  # contiguous: one piece of every row
        return np.zeros(1, np.int64), np.array([draw(st.integers(0, 4096))], np.int64), rows, row_nbytes, rows
    per = draw(st.integers(1, 20))
    n = -(-rows // per)
    order = draw(st.permutations(range(n)))  # chunks anywhere in the file, in any order
    gaps = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    offsets = np.zeros(n, np.int64)
    at = draw(st.integers(0, 1000))
    for slot, p in enumerate(order):
        at += gaps[slot]
        offsets[p] = at
        at += per * row_nbytes
    return np.arange(0, rows, per, dtype=np.int64), offsets, per, row_nbytes, rows


def byte_of_row(starts: np.ndarray, offsets: np.ndarray, per: int, rb: int, row: int) -> int:
    """Brute force: the piece holding ``row`` by a linear scan."""
    p = max(k for k in range(len(starts)) if starts[k] <= row)
    assert row < starts[p] + per
    return int(offsets[p]) + (row - int(starts[p])) * rb


@given(pieces(), st.data())
@settings(max_examples=200, deadline=None)
def test_piece_spans_tile_the_range_inside_pieces(layout: tuple, data: st.DataObject) -> None:
    starts, _, per, _, rows = layout
    a = data.draw(st.integers(0, rows))
    b = data.draw(st.integers(a, rows))
    by_table = piece_spans(a, b, per, starts)
    assert by_table == piece_spans(a, b, per) or len(starts) == 1  # a table of a regular grid: the grid's spans
    got = [r for _, first, stop in by_table for r in range(first, stop)]
    assert got == list(range(a, b))  # the spans join into [a, b), in order
    for p, first, stop in by_table:
        assert first < stop
        assert int(starts[p]) <= first and stop <= int(starts[p]) + per  # inside its piece


@given(pieces(), st.data())
@settings(max_examples=200, deadline=None)
def test_byte_offsets_match_a_linear_scan(layout: tuple, data: st.DataObject) -> None:
    starts, offsets, per, rb, rows = layout
    k = data.draw(st.integers(0, 12))
    s = np.array(data.draw(st.lists(st.integers(0, rows - 1), min_size=k, max_size=k)), np.int64)
    c = np.array([data.draw(st.integers(0, rows - int(x))) for x in s], np.int64)
    byte, inside = byte_offsets(starts, offsets, per, rb, s, c)
    for j in range(k):
        row = int(s[j])
        assert int(byte[j]) == byte_of_row(starts, offsets, per, rb, row)
        p = max(q for q in range(len(starts)) if starts[q] <= row)
        assert bool(inside[j]) == (row + int(c[j]) <= int(starts[p]) + per)
        # Rows of a range inside its piece are consecutive bytes from there.
        if inside[j] and c[j]:
            last = row + int(c[j]) - 1
            assert byte_of_row(starts, offsets, per, rb, last) == int(byte[j]) + (last - row) * rb


@given(pieces(), st.data())
@settings(max_examples=200, deadline=None)
def test_piece_spans_and_byte_offsets_agree(layout: tuple, data: st.DataObject) -> None:
    starts, offsets, per, rb, rows = layout
    a = data.draw(st.integers(0, rows))
    b = data.draw(st.integers(a, rows))
    for p, first, stop in piece_spans(a, b, per, starts):
        byte, inside = byte_offsets(starts, offsets, per, rb, np.array([first]), np.array([stop - first]))
        assert bool(inside[0])
        assert int(byte[0]) == int(offsets[p]) + (first - int(starts[p])) * rb


def test_piece_spans_examples() -> None:
    assert piece_spans(0, 0, 4) == []
    assert piece_spans(4, 8, 4) == [(1, 4, 8)]
    assert piece_spans(2, 9, 100, np.array([0])) == [(0, 2, 9)]
    assert piece_spans(5, 14, 4, np.array([0, 4, 8, 12])) == [(1, 5, 8), (2, 8, 12), (3, 12, 14)]
