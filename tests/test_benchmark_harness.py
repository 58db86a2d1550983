"""The benchmark harness (h5store.benchmark): what it times, in which order, and what it reports."""

from __future__ import annotations

import math

import numpy as np
import pytest

from h5store import benchmark as B


def _batches(n: int, size: int = 4) -> list[dict[str, np.ndarray]]:
    return [{"x": np.zeros((size, 3), np.float32)} for _ in range(n)]


class Epochs:
    """A loader whose iterators remember being closed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.made = 0
        self.closed = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.made += 1
        try:
            yield from _batches(self.n)
        finally:
            self.closed += 1


def test_time_batches_stops_after_min_batches_and_seconds() -> None:
    loader = Epochs(3)
    run = B.time_batches(lambda: loader, min_seconds=0.0, min_batches=5)
    assert (run.items, run.batches, run.payload) == (20, 5, 5 * 4 * 3 * 4)
    assert loader.made == 2 and loader.closed == 2  # epochs follow each other; the last one closed mid-way
    assert run.seconds > 0 and run.rate > 0 and not math.isnan(run.cpu)


def test_time_batches_whole_epochs_and_a_started_iterator() -> None:
    loader = Epochs(3)
    it = iter(loader)
    next(it)  # read before the clock: not counted
    run = B.time_batches(lambda: loader, min_seconds=0.0, whole_epochs=True, started=it)
    assert run.batches == 2 and loader.made == 1


def test_time_batches_refuses_an_empty_epoch() -> None:
    with pytest.raises(RuntimeError, match="no batches"):
        B.time_batches(list, min_seconds=0.0)


def test_rounds_interleave_and_leave_out_a_failing_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    order: list[str] = []

    def run(name: str) -> B.Run:
        order.append(name)
        return B.Run(10, 0.5 if name == "a" else 0.25)

    def broken() -> B.Run:
        raise OSError("no such loader")

    out = B.rounds({"a": lambda: run("a"), "bad": broken, "b": lambda: run("b")}, 2, "test")
    assert order == ["a", "b", "a", "b", "a", "b"]  # warm-up, then two interleaved rounds
    assert list(out) == ["a", "b"] and len(out["a"].runs) == 2
    assert out["b"].rate == 40 and out["a"].rate == 20
    assert "FAILED: OSError: no such loader" in capsys.readouterr().err
    with pytest.raises(OSError):
        B.rounds({"bad": broken}, 1, "test", keep_going=False)
    order.clear()  # --quick: no warm-up, the first timed run stands in for it; failures left out alike
    out = B.rounds({"a": lambda: run("a"), "bad": broken, "b": lambda: run("b")}, 2, "test", warm_up=False)
    assert order == ["a", "b", "a", "b"] and list(out) == ["a", "b"] and len(out["b"].runs) == 2
    assert "FAILED: OSError: no such loader" in capsys.readouterr().err


def test_timing_figures_come_from_the_best_run() -> None:
    t = B.Timing("x", [B.Run(10, 1.0, 1_000_000, cpu=0.5, faults=4, batches=2), B.Run(10, 2.0, 0, cpu=2.0)])
    assert (t.rate, t.mb_per_s, t.cores, t.cpu_us_per_item, t.faults_per_batch) == (10, 1.0, 0.5, 50_000, 2)
    assert math.isnan(B.Timing("none").rate)


def test_tables_and_load() -> None:
    assert B.md_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
    assert (B.fmt_rate(float("nan")), B.fmt_rate(12345.6), B.fmt_rate(1.25)) == ("-", "12,346", "1.2")
    assert B.fmt_ratio(1.5) == "1.50x"
    with B.LoadAverage() as load:
        pass
    assert load.span[0] >= 0 and load.span[1] >= 0
    assert "Load average (1 min)" in B.load_note(load.span)
