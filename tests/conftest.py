"""Shared fixtures: small files in pytest's tmp_path, nothing global."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def tmp_h5(tmp_path: Path) -> Path:
    """Path of a not-yet-existing ``.h5`` file in this test's own temporary directory."""
    return tmp_path / "test.h5"
