"""Shared fixtures: small files in pytest's tmp_path, nothing global."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def tmp_h5(tmp_path: Path) -> Path:
    """Path of a not-yet-existing ``.h5`` file in this test's own temporary directory."""
    return tmp_path / "test.h5"


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 2 MiB tmpfs mounted for this test and unmounted after it (a full disk on demand).

    Mounting needs root: skipped, with the reason, where it is impossible; CI runs as root here.
    """
    import os
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or 'mount failed'})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
