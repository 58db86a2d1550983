"""Shared helpers of the benchmark scripts: schema classes, data, memory, reporting.

Everything a worker process may have to unpickle lives here, in an importable module
(``benchmarks._common``), so the benchmarks run under fork, spawn and forkserver alike:
the TypedFile schema classes and the synthetic data generators. torch is *not* imported
here: the ingest benchmark's joblib workers import this module, and a torch import
would add seconds to every worker start.

The timing harness itself (runs, interleaved rounds, load averages, tables) is
:mod:`h5store.benchmark`, which states the measurement rules; here, in addition, files are
read once before timing, so every pipeline reads from the page cache.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import glob
import io
import os
import platform
import pstats
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
RESULTS_TITLE = "# Benchmark results"
N_MELS = 80


def setup_paths() -> None:
    """Make ``benchmarks`` and ``h5store`` importable here and in every child process.

    ``sys.path`` covers this process and multiprocessing's spawn children; ``PYTHONPATH``
    covers the rest (joblib/loky workers, ``subprocess`` children).
    """
    root = str(REPO)
    if root not in sys.path:
        sys.path.insert(0, root)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


setup_paths()

import h5store as h5s  # noqa: E402 - needs the repo root on sys.path when run as a script

# The harness (runs, interleaved rounds, load averages, tables) is h5store's own, shared with
# ``h5store bench``; re-exported here so that the scripts reach everything through ``C``.
from h5store.benchmark import (  # noqa: E402,F401
    LoadAverage,
    Run,
    Timing,
    fmt_rate,
    fmt_ratio,
    load_note,
    md_table,
    repeat,
    rounds,
    step,
    time_batches,
    timed,
    today,
)


# --------------------------------------------------------------------------- schemas
class Mels(h5s.TypedFile):
    """The serving benchmark's file: the same mel items stored three ways."""

    mel = h5s.Array(dtype="float32", shape=(None, N_MELS))
    mel_lzf = h5s.Array(dtype="float32", shape=(None, N_MELS), compression="lzf")
    mel_gz = h5s.Array(dtype="float32", shape=(None, N_MELS), compression="gzip", compression_opts=4, shuffle=True)


class Small(h5s.TypedFile):
    """Many small items: the first-batch benchmark's file (100,000 items)."""

    mel = h5s.Array(dtype="float32", shape=(None, N_MELS))


def _audio_features() -> tuple[Any, Any] | None:
    """h5store's MelSpectrogram and MagSpectrogram, when that part of h5store exists."""
    if hasattr(h5s, "MelSpectrogram") and hasattr(h5s, "MagSpectrogram"):
        return h5s.MelSpectrogram, h5s.MagSpectrogram
    try:
        from h5store.features.audio import MagSpectrogram, MelSpectrogram
    except ImportError:
        return None
    return MelSpectrogram, MagSpectrogram


_AUDIO = _audio_features()
Speech: type[h5s.TypedFile] | None = None
if _AUDIO is not None:

    class Speech(h5s.TypedFile):  # type: ignore[no-redef]
        """Mel and magnitude spectrograms of a folder of wavs (the ingest benchmark's schema)."""

        mel = _AUDIO[0](sr=16000, n_fft=1024, hop_length=256, n_mels=N_MELS)
        mag = _AUDIO[1](sr=16000, n_fft=1024, hop_length=256)


# --------------------------------------------------------------------------- data
def item_ids(n: int) -> list[str]:
    """Ids ``i000000``, ``i000001``... (also the dataset names of the per-item h5py files)."""
    return [f"i{i:06d}" for i in range(n)]


def make_mels(n: int, seed: int = 0, lo: int = 100, hi: int = 600) -> tuple[np.ndarray, np.ndarray]:
    """``n`` mel-like float32 items of ``lo..hi`` frames x 80, as one concatenation + offsets.

    Values are a per-item spectral envelope plus noise: full-entropy float mantissas, as in
    real log-mels, so lzf and gzip compress them about as poorly as they do real data.
    Returns ``(data (T, 80), offsets (n + 1,))``; item ``i`` is ``data[offsets[i]:offsets[i+1]]``.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = rng.standard_normal((int(offsets[-1]), N_MELS), dtype=np.float32)
    envelope = np.linspace(-2.0, -8.0, N_MELS, dtype=np.float32)
    data += envelope
    return data, offsets


def split(data: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The items of a concatenation, as views."""
    return [data[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def warm_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Read every file once so that timed runs read from the page cache; returns bytes read."""
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                total += len(chunk)
    return total


# --------------------------------------------------------------------------- timing
def memcpy_gbps(nbytes: int = 256 << 20, times: int = 5) -> float:
    """This machine's single-core memcpy bandwidth: best numpy copy of an ``nbytes`` array (GB/s)."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def profile_top(fn: Callable[[], Any], n: int = 12) -> str:
    """Run ``fn`` under cProfile; the ``n`` functions with the most own time, as text."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(n)
    text = out.getvalue()
    # Keep the table only, with paths shortened to package/module.
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    short = [re.sub(r"\S*/(site-packages|lib/python3\.\d+|main)/", "", line) for line in lines[start:]]
    return "\n".join(line for line in short if line.strip())


def round_ratios(a: Timing | None, b: Timing | None) -> list[float]:
    """``a``'s rate over ``b``'s in each interleaved round (runs are kept in round order)."""
    if a is None or b is None:
        return []
    return [x.rate / y.rate for x, y in zip(a.runs, b.runs) if y.rate > 0]


def fmt_round_ratios(ratios: Sequence[float]) -> str:
    """Median per-round ratio and its range, e.g. ``1.05x (0.98-1.12)``; "-" when none."""
    if not ratios:
        return "-"
    return f"{float(np.median(ratios)):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def table_load(load: tuple[float, float]) -> str:
    """The load average (1 min) over one table's measurement, for its heading line."""
    a, b = load
    return f"load average {a:.1f} -> {b:.1f} on {os.cpu_count()} cores"


# --------------------------------------------------------------------------- memory
def tree_rss(root: int | None = None) -> int:
    """Summed RSS (bytes) of a process and all its descendants."""
    import psutil

    try:
        p = psutil.Process(root or os.getpid())
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += q.memory_info().rss
    return total


class PeakRss:
    """A thread sampling the process tree's summed RSS every ``interval`` s; keeps the peak.

    >>> with PeakRss() as peak:  # doctest: +SKIP
    ...     work()
    >>> peak.peak  # doctest: +SKIP
    """

    def __init__(self, interval: float = 0.02, shm_glob: str | None = None) -> None:
        self.interval = interval
        self.shm_glob = shm_glob  # files in RAM (tmpfs) the tree holds: counted with the tree
        self.peak = 0  # whole tree (+ those files)
        self.peak_shm = 0
        self.peak_self = 0  # this process alone
        self.start_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        import psutil

        shm = shm_bytes(self.shm_glob) if self.shm_glob else 0
        self.peak_shm = max(self.peak_shm, shm)
        self.peak = max(self.peak, tree_rss() + shm)
        self.peak_self = max(self.peak_self, psutil.Process().memory_info().rss)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self.start_rss = tree_rss()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def shm_bytes(pattern: str) -> int:
    """Bytes of memory held by the files under the folders (or files) matching ``pattern``."""
    total = 0
    for top in glob.glob(pattern):
        for dirpath, _dirs, files in os.walk(top) if os.path.isdir(top) else [("", [], [top])]:
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def uss_pss(pids: Sequence[int]) -> tuple[int, int]:
    """Summed USS and PSS (bytes) of ``pids`` (``/proc/<pid>/smaps``, through psutil)."""
    import psutil

    uss = pss = 0
    for pid in pids:
        info = psutil.Process(pid).memory_full_info()
        uss += info.uss
        pss += getattr(info, "pss", 0)
    return uss, pss


# --------------------------------------------------------------------------- reporting
def machine_info() -> str:
    """One line naming this machine and the versions that matter for the figures."""
    import h5py

    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        m = re.search(r"model name\s*:\s*(.+)", fh.read())
        if m:
            cpu = m.group(1).strip()
    try:
        import psutil

        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:  # pragma: no cover - psutil is a dev dependency
        mem = "?"
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem} RAM, Python {platform.python_version()}, "
        f"numpy {np.__version__}, h5py {h5py.__version__} / HDF5 {h5py.version.hdf5_version}, "
        f"h5store {h5s.__version__}"
    )


def parser(doc: str, cache_help: str) -> argparse.ArgumentParser:
    """The arguments every script takes: ``--quick``, ``--no-write``, ``--cache-dir``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a < 60 s smoke run")
    ap.add_argument("--no-write", action="store_true", help="do not update benchmarks/RESULTS.md")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "h5store-bench-cache"), help=cache_help)
    return ap


def publish(heading: str, text: str, write: bool, started: float | None = None) -> None:
    """Print a script's report (and its total time, from ``started``); unless ``--no-write``,
    make it the ``## heading`` section of RESULTS.md."""
    print(text)
    if started is not None:
        print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if write:
        write_section(heading, text)
        print(f"wrote {RESULTS}", file=sys.stderr)


def write_section(heading: str, body: str, path: Path = RESULTS) -> None:
    """Replace the ``## heading`` section of ``path`` (create the file or section if absent).

    Other sections, owned by other scripts, are kept byte for byte.
    """
    title = f"## {heading}"
    text = path.read_text() if path.exists() else f"{RESULTS_TITLE}\n"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == title), None)
    block = [title, "", *body.strip("\n").splitlines(), ""]
    if start is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["", *block]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = block
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
