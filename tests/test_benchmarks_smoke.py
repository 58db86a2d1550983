"""The benchmark scripts still run: each one's ``--quick --no-write`` smoke run exits 0.

Timings are never asserted (the machine is shared and noisy); these tests only keep the
scripts from rotting as the library changes under them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ["bench_serve.py", "bench_create.py", "bench_tf.py", "bench_crc.py", "bench_open.py", "bench_append.py",
           "bench_scale.py", "bench_cold.py", "bench_codecs.py", "bench_transforms.py", "bench_read_paths.py",
           "bench_video.py", "bench_remote.py", "bench_stream.py", "bench_shards.py"]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run_exits_cleanly(script: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--no-write", "--cache-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard, not a timing: the quick runs take < 30 s on a quiet machine
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "FAILED" not in proc.stderr, f"{script}: a pipeline failed:\n{proc.stderr[-5000:]}"
    assert "| " in proc.stdout  # it printed its tables


def test_run_all_runs_every_script_and_reports_failures(tmp_path: Path) -> None:
    """run_all.py passes its options through and exits non-zero when a script fails."""
    sys.path.insert(0, str(REPO))
    from benchmarks import run_all

    assert {p.name for p in run_all.scripts()} >= set(SCRIPTS)
    assert [p.name for p in run_all.scripts("cold, bench_scale.py")] == ["bench_cold.py", "bench_scale.py"]
    with pytest.raises(SystemExit, match="no benchmark"):
        run_all.scripts("nope")
    # A bad option makes the chosen script fail (argparse exits 2): run_all says so and exits 1.
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--only", "cold", "--bogus"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "FAILED: bench_cold.py" in proc.stderr


@pytest.mark.slow
def test_profile_workers_reports_every_process(tmp_path: Path) -> None:
    """The worker profiler (a diagnostic, not in run_all) prints the stages of the main process and each worker."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "profile_workers.py"), "--items", "100", "--seconds", "1",
         "--repeat", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for where in ('"in-process"', '"main"', '"worker0"', '"worker1"'):
        assert f'"where": {where}' in proc.stdout, proc.stdout
