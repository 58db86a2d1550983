"""Small files shared by the serving tests (built once per session: workers only read them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.serving.schemas import Speech, SpeechLZF, make_speech

N = 40


@pytest.fixture(scope="session")
def speech_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 items of 3-30 frames: mel (8 wide), mag (3 wide, same lengths), label, score, text."""
    path = tmp_path_factory.mktemp("serving") / "speech.h5"
    make_speech(path, N, seed=0)
    return path


@pytest.fixture
def speech(speech_path: Path) -> Speech:
    f = Speech(speech_path)
    yield f
    f.close()


@pytest.fixture(scope="session")
def lzf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serving") / "speech_lzf.h5"
    make_speech(path, 25, seed=0, cls=SpeechLZF)
    return path


@pytest.fixture(scope="session")
def shard_paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three files of 7, 5 and 11 items (different seeds, so values differ)."""
    d = tmp_path_factory.mktemp("shards")
    paths = []
    for k, n in enumerate((7, 5, 11)):
        p = d / f"shard{k}.h5"
        make_speech(p, n, seed=10 + k)
        paths.append(p)
    return paths


def reference(f: Speech, name: str) -> list[np.ndarray]:
    """Every item of a feature, read one by one through the public API (the ground truth)."""
    return [np.asarray(getattr(f, name)[i]) for i in range(len(f))]
