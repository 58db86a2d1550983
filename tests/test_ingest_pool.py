"""The workers of a create: forked when the call starts, or joblib's; the same file either way.

Real processes throughout: creates with ``n_workers=2`` through the fork pool and through
joblib (loky), a worker killed by its source, a parent killed with SIGKILL whose workers must
not outlive it, and the first progress output before the workers' first result.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from h5store import ingest_workers
from h5store.ingest import stored_failures
from h5store.ingest_workers import ForkPool, start_workers
from tests.ingest_schemas import Nums, PacedNums

from .test_ingest import write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _same_file(a, b) -> None:
    assert list(a.ids) == list(b.ids)
    for i in a.ids:
        np.testing.assert_array_equal(a.nums[i], b.nums[i])


def test_fork_pool_and_joblib_build_the_same_file(tmp_path, monkeypatch):
    write_corpus(tmp_path / "src", n=40, extra={"bad/boom.txt": "boom", "bad/crash.txt": "crash"})
    # The fork pool, in a fresh single-threaded process as a user's script is (this one may
    # keep loky's threads from other tests, and then rightly declines to fork).
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        import h5store.ingest as ingest
        from h5store.ingest_workers import ForkPool, start_workers
        used = []
        ingest.start_workers = lambda n: used.append(start_workers(n)) or used[-1]
        from tests.ingest_schemas import Nums
        Nums.create({str(tmp_path / 'fork.h5')!r}, {str(tmp_path / 'src')!r}, n_workers=2, progress=False).close()
        assert isinstance(used[0], ForkPool), used
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    used = []
    real = ingest_workers.start_workers
    monkeypatch.setattr("h5store.ingest.start_workers", lambda n: used.append(real(n)) or used[-1])
    # joblib's loky workers when another thread runs in the caller (forking it is unsafe)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        with Nums.create(tmp_path / "loky.h5", tmp_path / "src", n_workers=2, progress=False) as lok, \
                Nums(tmp_path / "fork.h5") as forked:
            assert used[-1] is None
            _same_file(forked, lok)
            assert {(f.id, f.error) for f in lok.report.failures} == {("bad/boom", "RuntimeError"), ("bad/crash", "WorkerDied")}
            assert {(f.id, f.error) for f in stored_failures(forked)} == {(f.id, f.error) for f in lok.report.failures}
    finally:
        stop.set()
        t.join()


def test_start_workers_declines_where_forking_is_wrong():
    assert start_workers(1) is None
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert start_workers(2) is None  # another thread could hold a lock across the fork
    finally:
        stop.set()
        t.join()
    import joblib

    with joblib.parallel_config(backend="threading"):
        assert start_workers(2) is None  # the caller chose a joblib backend: joblib runs it
    # In a fresh single-threaded process (this one may keep loky's threads from other tests):
    code = ("from h5store.ingest_workers import ForkPool, start_workers\n"
            "pool = start_workers(2)\nassert isinstance(pool, ForkPool), pool\npool.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    # torch's thread pools (libgomp) do not survive a fork: with torch imported, joblib spawns.
    code = "import torch\nfrom h5store.ingest_workers import start_workers\nassert start_workers(2) is None\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_workers_run_one_blas_thread_and_ignore_sigint():
    pool = ForkPool(2)
    try:
        states = [f.result() for f in [pool._ex.submit(_worker_state) for _ in range(4)]]
    finally:
        pool.close()
    for blas, sigint, ppid in states:
        assert blas in ([], [1]) or set(blas) == {1}
        assert sigint == signal.SIG_IGN
        assert ppid == os.getpid()


def _worker_state() -> tuple[list[int], object, int]:
    try:
        from threadpoolctl import threadpool_info

        blas = [d["num_threads"] for d in threadpool_info() if d.get("user_api") == "blas"]
    except ImportError:
        blas = []
    return blas, signal.getsignal(signal.SIGINT), os.getppid()


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(name))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_workers_do_not_outlive_a_killed_create(tmp_path):
    write_corpus(tmp_path / "src", n=200)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from tests.ingest_schemas import PacedNums
        PacedNums.create({str(tmp_path / 'out.h5')!r}, {str(tmp_path / 'src')!r}, n_workers=2, progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "H5STORE_TEST_LOAD_DELAY": "0.2"})
    deadline = time.monotonic() + 120  # a hang guard, not a timing
    workers: list[int] = []
    while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
        workers = _children(proc.pid)
    assert len(workers) >= 2, "the create's workers never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "workers outlived the create that started them"


def test_first_progress_comes_before_the_first_result(tmp_path):
    """The bar is drawn when the call starts, not when the workers' first result arrives."""
    write_corpus(tmp_path / "src", n=8)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from tests.ingest_schemas import PacedNums
        PacedNums.create({str(tmp_path / 'out.h5')!r}, {str(tmp_path / 'src')!r}, n_workers=2)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          env={**os.environ, "H5STORE_TEST_LOAD_DELAY": "0.2"})
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-2000:]
    # Order in the stream, not a timing: the first line is drawn before any result is counted.
    assert "scanning sources" in err, err
    counted = [err.find(f"{k}/8") for k in range(1, 9) if f"{k}/8" in err]
    assert counted and err.index("scanning sources") < min(counted), err
    with PacedNums(tmp_path / "out.h5") as f:
        assert len(f) == 8


def test_joblib_workers_say_they_are_starting(tmp_path):
    """Where joblib runs the workers (here: another thread runs in the caller), the bar says
    they are starting while their fresh interpreters import, rather than a silent 0%."""
    write_corpus(tmp_path / "src", n=8)
    script = textwrap.dedent(f"""
        import sys, threading; sys.path.insert(0, {str(ROOT)!r})
        from tests.ingest_schemas import Nums
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        Nums.create({str(tmp_path / 'out.h5')!r}, {str(tmp_path / 'src')!r}, n_workers=2)
        stop.set()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "scanning sources" in r.stderr and "starting 2 workers" in r.stderr, r.stderr
    assert r.stderr.index("scanning sources") < r.stderr.index("starting 2 workers")
    assert r.stderr.rstrip().splitlines()[-1].count("8/8")
