"""`h5store bench` on a user's file, and `h5store info` staying readable on a file of 100k items."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.cli import main


class Big(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 4))
    label = h5s.Scalar(dtype="int64")


class Small(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 8))
    mag = h5s.Array(dtype="float32", shape=(None, 2))
    label = h5s.Scalar(dtype="int64")
    text = h5s.Text()


@pytest.fixture(scope="module")
def small_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "small.h5"
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 120, 48)
    with Small(path, mode="w") as w:
        w.extend([f"u{i:02d}" for i in range(48)], {
            "mel": [rng.standard_normal((int(n), 8)) for n in lengths],
            "mag": [rng.standard_normal((int(n), 2)) for n in lengths],
            "label": (np.arange(48) % 3).tolist(),
            "text": [f"utterance {i}" for i in range(48)],
        })
    return path


ROW = re.compile(r"^\s+(Item|Window \d+)\s+(\d+)\s+([\d,]+)\s+([\d,.]+)\s+([\d.]+) s$")


def _rows(out: str) -> list[tuple[str, int, float, float]]:
    rows = []
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows.append((m[1], int(m[2]), float(m[3].replace(",", "")), float(m[4].replace(",", ""))))
    return rows


def test_bench_prints_items_and_mb_per_second_per_getter_and_worker_count(
        small_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(small_path), "--seconds", "0.3", "--workers", "0,2", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("feature: mel (the largest; --feature to choose: label, mag, text)")
    assert "Array float32 (T, 8) ragged, 48 items, mean length" in out and "batch 8" in out
    rows = _rows(out)
    assert [(g, w) for g, w, _, _ in rows] == [("Item", 0), ("Item", 2), ("Window 64", 0), ("Window 64", 2)]
    assert all(rate > 0 and mbs > 0 for _, _, rate, mbs in rows)
    assert "fastest mel Item:" in out and "fastest mel Window 64:" in out


def test_bench_features_of_every_kind(small_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", str(small_path), "--feature", "label,text,mag", "--seconds", "0.2", "--workers", "0",
            "--window", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # label: fixed shape, no windows; text: decoded to str, no windows; mag: ragged, windows.
    assert [(g, w) for g, w, _, _ in _rows(out)] == [("Item", 0), ("Item", 0), ("Item", 0), ("Window 16", 0)]
    assert "Scalar int64 () fixed" in out and "Text uint8 (T) ragged" in out


def test_bench_refuses_bad_arguments_in_one_line(small_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(small_path), "--workers", "0,two"]) == 1
    assert capsys.readouterr().err.strip() == ("h5store: error: --workers takes comma-separated integers, "
                                               "e.g. 0,2,4; got '0,two'")
    assert main(["bench", str(small_path), "--feature", "nope"]) == 1
    assert "no feature 'nope'" in capsys.readouterr().err
    assert main(["bench", str(small_path.parent / "missing.h5")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_info_of_100k_items_fits_on_a_screen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.h5"
    n, block = 100_000, 25_000
    rng = np.random.default_rng(0)
    with Big(path, mode="w") as w:
        for a in range(0, n, block):
            lengths = rng.integers(1, 9, block)
            w.extend([f"utt{i:06d}" for i in range(a, a + block)],
                     {"mel": [np.full((int(k), 4), i, np.float32) for i, k in enumerate(lengths)],
                      "label": (np.arange(block) % 10).tolist()})
    t0 = time.perf_counter()
    assert main(["info", str(path)]) == 0
    seconds = time.perf_counter() - t0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 6, out  # a header, a table head and rule, one row per feature: no per-item dump
    assert "100000 ids" in lines[0] or "100,000 ids" in lines[0]
    assert "utt0" not in out  # no id listed
    mel = next(line for line in lines if line.startswith("mel "))
    assert re.search(r"\b100000\b", mel) and "1/" in mel and "/8" in mel  # items and length percentiles
    assert max(len(line) for line in lines) <= 140
    assert seconds < 30  # reads index tables only (a generous bound on a loaded machine)
