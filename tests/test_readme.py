"""The README's first code block and every block of docs/faq.md run as written."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FAQ = REPO / "docs" / "faq.md"


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def _write_wavs(root: Path, sr: int, per_class: int = 4) -> None:
    """Wavs of 1-1.5 s in two speaker folders: spk1/utt-001.wav, ..."""
    import soundfile as sf

    rng = np.random.default_rng(0)
    for spk in ("spk1", "spk2"):
        (root / spk).mkdir(parents=True, exist_ok=True)
        for k in range(1, per_class + 1):
            t = np.arange(int(rng.uniform(1.0, 1.5) * sr)) / sr
            x = 0.3 * np.sin(2 * np.pi * rng.uniform(150, 600) * t) + 0.01 * rng.standard_normal(t.size)
            sf.write(root / spk / f"utt-{k:03d}.wav", x.astype(np.float32), sr)


@pytest.mark.slow
def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    code = _python_blocks(README)[0]
    # The sources the snippet names, made here: a folder of wavs in class (speaker) subfolders.
    folders = re.findall(r'sources="([^"]+)/"', code)
    assert folders, "the README example should create a file from a folder of sources"
    sr = int(re.search(r"sr=(\d+)", code).group(1))  # type: ignore[union-attr]
    for folder in folders:
        _write_wavs(tmp_path / folder, sr)
    # Checks of what the snippet's comments promise, run after it (not part of the README).
    checks = textwrap.dedent("""
        assert f.ids[0] == "spk1/utt-001" and f.mel[f.ids[0]].shape[1] == 80
        assert [m.shape for m in f.mel.read_many([5, 0, 5])][0] == f.mel[5].shape
        assert batch["x"].shape[1:] == (64, 80) and str(batch["x"].dtype) == "torch.float32"
        assert str(batch["y"].dtype) == "torch.int64"
        print("README OK")
    """)
    (tmp_path / "readme_example.py").write_text(code + checks, encoding="utf-8")
    proc = subprocess.run([sys.executable, "readme_example.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "8 stored" in proc.stdout and "README OK" in proc.stdout
    assert (tmp_path / "speech.h5").exists()


def test_readme_example_is_short() -> None:
    code = _python_blocks(README)[0]
    assert len(code.strip().splitlines()) <= 25


@pytest.mark.slow
def test_faq_blocks_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the last block draws a plot (the `plot` extra)
    blocks = _python_blocks(FAQ)
    assert len(blocks) >= 10
    # One script, as a reader would paste them: run as __main__, its classes pickle by name.
    script = "\n\n".join(blocks) + "\nf.close()\nprint('FAQ OK')\n"
    (tmp_path / "faq.py").write_text(script, encoding="utf-8")
    proc = subprocess.run([sys.executable, "faq.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "FAQ OK" in proc.stdout
