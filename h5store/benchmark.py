"""The benchmark harness: timed runs, interleaved rounds, load averages and tables.

One harness for every measurement h5store reports: the ``benchmarks/bench_*.py`` scripts
(through ``benchmarks/_common.py``) and ``h5store bench``. It imports no framework (no
torch, no tensorflow): loaders and datasets are handed to it already made.

Measurement rules (the machine is shared and noisy):

* every figure is reported next to a baseline measured in the same run, as a ratio;
* each measurement is repeated and the best run is kept (noise only ever slows a run);
* pipelines are timed in interleaved rounds (A, B, C, then A, B, C again), so that a burst
  of load from other users hits all of them alike rather than all the repeats of one;
* the load average at the start and the end of a run is reported with its figures.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LoadAverage", "Run", "Timing", "batch_size_of", "fmt_rate", "fmt_ratio", "load_note", "md_table", "repeat",
    "rounds", "step", "time_batches", "timed", "today",
]

NAN = float("nan")


# --------------------------------------------------------------------------- runs
@dataclass
class Run:
    """One timed run: how many items (and payload bytes) in how many seconds.

    ``cpu`` (process CPU seconds), ``faults`` (minor page faults) and ``batches`` are
    recorded by :func:`time_batches`; other runs leave them unmeasured.
    """

    items: int
    seconds: float
    payload: int = 0
    cpu: float = NAN
    faults: int = 0
    batches: int = 0

    @property
    def rate(self) -> float:
        """Items per second."""
        return self.items / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class Timing:
    """Repeated runs of one pipeline; the best (fastest) run stands for it."""

    name: str
    runs: list[Run] = field(default_factory=list)

    @property
    def best(self) -> Run:
        return max(self.runs, key=lambda r: r.rate)

    @property
    def rate(self) -> float:
        """Items per second of the best run (NaN before any run)."""
        return self.best.rate if self.runs else NAN

    @property
    def mb_per_s(self) -> float:
        """Payload MB per second of the best run."""
        b = self.best
        return b.payload / b.seconds / 1e6 if b.seconds > 0 else float("inf")

    @property
    def cores(self) -> float:
        """CPU cores the best run kept busy (process CPU time / wall time)."""
        b = self.best
        return b.cpu / b.seconds if self.runs and b.seconds > 0 else NAN

    @property
    def cpu_us_per_item(self) -> float:
        """Process CPU microseconds per item of the best run."""
        b = self.best
        return 1e6 * b.cpu / b.items if self.runs and b.items else NAN

    @property
    def faults_per_batch(self) -> float:
        """Minor page faults per batch of the best run."""
        b = self.best
        return b.faults / b.batches if self.runs and b.batches else NAN


def timed(fn: Callable[[], tuple[int, int]]) -> Run:
    """Call ``fn`` (returning ``(items, payload bytes)``) once and time it."""
    t0 = time.perf_counter()
    items, payload = fn()
    return Run(items, time.perf_counter() - t0, payload)


def repeat(name: str, fn: Callable[[], tuple[int, int]], times: int) -> Timing:
    """Call ``fn`` (returning ``(items, payload bytes)``) ``times`` times, timing each call."""
    return Timing(name, [timed(fn) for _ in range(times)])


def batch_size_of(batch: Mapping[str, Any]) -> tuple[int, int]:
    """``(items, bytes)`` of a batch dict: the length of ``x`` and the bytes of all its arrays."""
    return len(batch["x"]), sum(int(v.nbytes) for v in batch.values() if hasattr(v, "nbytes"))


def time_batches(epochs: Callable[[], Iterable[Any]], *, min_seconds: float, max_seconds: float | None = None,
                 min_batches: int = 1, whole_epochs: bool = False, started: Iterator[Any] | None = None,
                 size: Callable[[Any], tuple[int, int]] = batch_size_of) -> Run:
    """Time the batches of a loader, epoch after epoch, until enough were timed.

    Parameters
    ----------
    epochs : callable
        Gives the next epoch's batches (``lambda: loader``). Epoch starts (workers woken,
        iterators made, the first batch's latency) are part of the cost, as in training.
    min_seconds : float
        A run lasts at least this long...
    max_seconds : float, optional
        ...but stops, mid-epoch, once this has passed (the slow baselines).
    min_batches : int
        ...and times at least this many batches (short runs are at the mercy of a
        scheduler hiccup).
    whole_epochs : bool
        Stop only at the end of an epoch (or at ``max_seconds``).
    started : iterator, optional
        The first epoch's iterator, made (and perhaps read from) before the clock starts:
        with persistent workers, ``iter()`` first drains the batches still in flight from a
        run that stopped mid-epoch, which is not this run's cost.
    size : callable
        ``(items, payload bytes)`` of one batch.

    Returns
    -------
    Run
        Items, seconds and payload, with the process's CPU seconds, minor page faults and
        batches during the run.
    """
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    c0 = time.process_time()
    t0 = time.perf_counter()
    it = iter(epochs()) if started is None else started
    items = payload = batches = 0
    fresh = True
    try:
        while True:
            try:
                batch = next(it)
            except StopIteration:
                if fresh:
                    raise RuntimeError(f"{it!r}: an epoch with no batches") from None
                _close(it)
                if whole_epochs and batches >= min_batches and time.perf_counter() - t0 >= min_seconds:
                    break
                it, fresh = iter(epochs()), True
                continue
            fresh = False
            n, nbytes = size(batch)
            items += n
            payload += nbytes
            batches += 1
            elapsed = time.perf_counter() - t0
            if max_seconds is not None and elapsed >= max_seconds:
                break
            if not whole_epochs and batches >= min_batches and elapsed >= min_seconds:
                break
    finally:
        _close(it)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return Run(items, dt, payload, time.process_time() - c0, r1.ru_minflt - r0.ru_minflt, batches)


def _close(it: Any) -> None:
    """Stop an iterator's threads now (numpy batch iterators, generators); loaders' have no close."""
    close = getattr(it, "close", None)
    if close is not None:
        close()


def rounds(runs: Mapping[str, Callable[[], Run]], repeat: int, label: str, *, pause: float = 0.0,
           keep_going: bool = True, warm_up: bool = True) -> dict[str, Timing]:
    """One untimed warm-up run of each pipeline, then ``repeat`` interleaved rounds of timed runs.

    Parameters
    ----------
    runs : mapping
        Name -> a callable making one timed run of that pipeline.
    repeat : int
        Timed rounds; each pipeline's best run stands for it.
    label : str
        What is measured, for the progress lines on stderr.
    pause : float
        Seconds of sleep before each timed run (thread pools that spin after their work
        would otherwise take a core from the next run).
    keep_going : bool
        A pipeline whose warm-up fails is reported (``FAILED`` on stderr) and left out;
        with False the error propagates.
    warm_up : bool
        False: no warm-up run, the first timed run stands in for it (a failure there is
        reported and the pipeline left out the same way). For smoke runs whose figures
        nobody reads (the benchmarks' ``--quick``): every pipeline still runs.

    Returns
    -------
    dict
        Name -> :class:`Timing`, for the pipelines that ran.

    Examples
    --------
    >>> def run():
    ...     return Run(items=100, seconds=0.5, batches=4)
    >>> {k: len(t.runs) for k, t in rounds(dict(a=run), 2, "demo", warm_up=False).items()}
    {'a': 2}
    """
    live: dict[str, Callable[[], Run]] = {}
    out: dict[str, Timing] = {}
    for name, run in runs.items():
        with step(f"{label} {name}: {'warm-up' if warm_up else 'first timed run'}"):
            try:
                first = run()
            except Exception as e:
                if not keep_going:
                    raise
                print(f"    FAILED: {type(e).__name__}: {e}", file=sys.stderr)  # under the step's line
                continue
        live[name] = run
        out[name] = Timing(name)
        if not warm_up:
            out[name].runs.append(first)
    with step(f"{label}: {repeat - (not warm_up)} more timed rounds of {len(live)} pipelines"
              if not warm_up else f"{label}: {repeat} timed rounds of {len(live)} pipelines"):
        for _ in range(repeat - (not warm_up)):
            for name, run in live.items():
                if pause:
                    time.sleep(pause)
                out[name].runs.append(run())
    return out


# --------------------------------------------------------------------------- load
class LoadAverage:
    """The 1-minute load average at the start and the end of a measurement.

    >>> with LoadAverage() as load:  # doctest: +SKIP
    ...     measure()
    >>> load_note(load.span)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.start = os.getloadavg()[0]
        self.end = NAN

    def __enter__(self) -> LoadAverage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> tuple[float, float]:
        """Record the end; returns ``(start, end)``."""
        self.end = os.getloadavg()[0]
        return self.span

    @property
    def span(self) -> tuple[float, float]:
        return self.start, self.end


def load_note(load: tuple[float, float]) -> str:
    """A sentence on how busy the machine was (other users share it), for the reader to judge noise."""
    a, b = load
    return (f"Load average (1 min) {a:.1f} at the start of the run and {b:.1f} at the end, on {os.cpu_count()} "
            "cores shared with other users: absolute figures move with it, ratios measured in the same run much less.")


# --------------------------------------------------------------------------- tables
def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_rate(x: float) -> str:
    """Items/s with sensible precision ("-" when not measured)."""
    if x != x:  # NaN: not measured
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_ratio(x: float) -> str:
    """A ratio as ``1.23x`` ("-" when not measured)."""
    return "-" if x != x else f"{x:.2f}x"


def today() -> str:
    return datetime.date.today().isoformat()


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    """Print what is being measured and how long it took (to stderr, to keep stdout tables clean)."""
    print(f"... {what}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    print(f"    {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
