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
           "bench_video.py"]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run_exits_cleanly(script: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--no-write", "--cache-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard, not a timing: the quick runs take < 60 s on a quiet machine
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "FAILED" not in proc.stderr, f"{script}: a pipeline failed:\n{proc.stderr[-5000:]}"
    assert "| " in proc.stdout  # it printed its tables
