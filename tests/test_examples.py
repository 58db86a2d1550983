"""Every script in examples/ runs to the end (exit status 0) at a small size.

Each example takes command-line flags that shrink it; the scripts check their own results
with asserts (served == stored, crop lengths per epoch, clips reproducible...), so a zero
exit status means the story they tell still holds. The selected scripts start together,
two at a time, when the first of these tests runs: most of their time is spent importing
torch, tensorflow and librosa, which overlaps well.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

# script -> its flags at CI size ("{out}" is a fresh folder per script).
SMALL: dict[str, list[str]] = {
    "demo.py": ["--n-wavs", "30", "--steps", "20", "--out", "{out}"],
    # One ingest worker and one DataLoader worker: the demo runs the two-worker paths already.
    "audio_mel_training.py": ["--n-wavs", "18", "--steps", "10", "--workers", "1", "--out", "{out}"],
    "images_jpeg.py": ["--n-images", "64", "--steps", "3", "--workers", "2", "--out", "{out}"],
    "video_frames.py": ["--n-videos", "8", "--frames", "20", "--clip", "8", "--steps", "2", "--workers", "2",
                        "--out", "{out}"],
    "multi_file.py": ["--items", "30", "--workers", "2", "--out", "{out}"],
    "shared_params.py": ["--epochs", "4", "--double-at", "2", "--workers", "2", "--out", "{out}"],
    "tf_pipeline.py": ["--files", "3", "--items", "64", "--epochs", "1", "--out", "{out}"],
    "custom_feature.py": ["--n", "12", "--out", "{out}"],
    "distributed_ingest.py": ["--n", "8", "--workers", "2", "--out", "{out}"],  # 1 would skip joblib
}
# What each script prints when it got to its end (beyond exit status 0).
LAST_WORDS = {
    "demo.py": "demo: done",
    "audio_mel_training.py": "losses stored beside",
    "images_jpeg.py": "steps of 32 images",
    "video_frames.py": "batches of 8 clips",
    "multi_file.py": "merged into",
    "shared_params.py": "worker processes served all 4 epochs",
    "tf_pipeline.py": "interleave: 192 examples from 3 files",
    "custom_feature.py": "reopened without the class",
    "distributed_ingest.py": "identical to a local run: True",
}
TIMEOUT = 600  # a hang guard, not a timing


def _run(script: str, out: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    args = [a.replace("{out}", str(out)) for a in SMALL[script]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=out, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    return proc, time.perf_counter() - t0


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """Start every selected example at once (two at a time); each test waits for its own."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_example_runs" and item.module is request.module]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {s: pool.submit(_run, s, tmp_path_factory.mktemp(s.removesuffix(".py"))) for s in selected}


def test_every_example_is_run() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - {"speech_schema.py"}  # a module the demo imports
    assert scripts == set(SMALL) == set(LAST_WORDS)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALL))
def test_example_runs(script: str, runs: dict[str, Future]) -> None:
    proc, seconds = runs[script].result()
    report = f"{script} ({seconds:.0f} s):\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, report
    assert LAST_WORDS[script] in proc.stdout, report
