"""Ingest of real audio corpora: broken files, flac/ogg, Dask, the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s

sf = pytest.importorskip("soundfile")  # a core dependency: present whenever h5store is installed

ROOT = Path(__file__).resolve().parents[1]
SR = 16000


class Speech(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=40)
    mag = h5s.MagSpectrogram(sr=SR, n_fft=512, hop_length=128)
    label = h5s.DirLabel(pattern=r"(?i)\.(wav|flac|ogg)$")


def write_wavs(root: Path, n: int = 10, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    ids = []
    for i in range(n):
        kind = ("tone", "noise")[i % 2]
        t = np.arange(int(rng.uniform(0.2, 0.6) * SR)) / SR
        x = np.sin(2 * np.pi * rng.uniform(200, 800) * t) if kind == "tone" else rng.uniform(-1, 1, t.size)
        fmt = ("wav", "flac", "ogg")[i % 3]
        (root / kind).mkdir(parents=True, exist_ok=True)
        name = f"clip {i:02d}é"
        sf.write(root / kind / f"{name}.{fmt}", (0.5 * x).astype(np.float32), SR)
        ids.append(f"{kind}/{name}")
    return ids


def write_broken(root: Path) -> dict[str, str]:
    """Broken sources -> the word their failure message must contain."""
    bad = root / "bad"
    bad.mkdir(parents=True)
    (bad / "empty.wav").write_bytes(b"")
    (bad / "text.wav").write_text("this is not audio\n")
    sf.write(bad / "header_only.wav", np.zeros(0, np.float32), SR, subtype="PCM_16")
    sf.write(bad / "truncated.wav", np.zeros(SR, np.float32), SR, subtype="PCM_16")
    data = (bad / "truncated.wav").read_bytes()
    (bad / "truncated.wav").write_bytes(data[: len(data) // 2])
    return {"bad/empty": "empty", "bad/text": "", "bad/header_only": "0", "bad/truncated": "truncated"}


def test_create_audio_corpus_reports_every_broken_file(tmp_path):
    ids = write_wavs(tmp_path / "src")
    broken = write_broken(tmp_path / "src")
    with Speech.create(tmp_path / "s.h5", tmp_path / "src", n_workers=2, progress=False) as f:
        assert sorted(f.ids) == sorted(ids)
        failed = {x.id for x in f.report.failures}
        assert failed == set(broken)
        for failure in f.report.failures:
            assert failure.error == "SourceError"
            assert broken[failure.id] in failure.message
        # Every stored item equals the feature applied directly to its source.
        src = tmp_path / "src"
        for i in ids:
            path = next(src.glob(f"{i}.*"))
            np.testing.assert_allclose(f.mel[i], Speech.mel.load(str(path)), rtol=1e-6)
            assert f.mag[i].shape == (f.mel[i].shape[0], 257)
        labels = {i: int(f.label[i]) for i in ids}
        classes = list(f.features["label"].classes)
        assert all(classes[labels[i]] == i.split("/")[0] for i in ids)


def test_create_on_a_dask_local_cluster_equals_the_local_run(tmp_path):
    distributed = pytest.importorskip("distributed")  # the `dask` extra, installed by `make test`
    import joblib

    write_wavs(tmp_path / "src", n=8)
    local = Speech.create(tmp_path / "local.h5", tmp_path / "src", n_workers=1, progress=False)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            distributed.Client(cluster), joblib.parallel_config(backend="dask"):
        remote = Speech.create(tmp_path / "dask.h5", tmp_path / "src", n_workers=2, progress=False)
    with local, remote:
        assert list(local.ids) == list(remote.ids)
        for name in ("mel", "mag", "label"):
            for a, b in zip(local.feature(name), remote.feature(name)):
                np.testing.assert_array_equal(a, b)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "h5store.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_cli_create_with_a_preset_then_info(tmp_path):
    write_wavs(tmp_path / "src", n=6)
    write_broken(tmp_path / "src")
    out = tmp_path / "p.h5"
    r = run_cli("create", "audio-mel", str(out), str(tmp_path / "src"), "--workers", "2", "--sr", "16000", "-q")
    assert r.returncode == 0, r.stderr
    assert "6 stored" in r.stdout and "4 of 10 sources failed" in r.stdout
    # Per source file, with each failing feature's error underneath.
    assert r.stdout.count("  failed: ") == 4 and "    mel: " in r.stdout
    r = run_cli("info", str(out))
    assert r.returncode == 0, r.stderr
    assert "mel" in r.stdout and "label" in r.stdout and "(T, 80)" in r.stdout
    assert "bad/truncated" in r.stdout  # recorded failures are printed
    with h5s.open(out) as f:
        assert len(f) == 6 and f.mel[0].shape[1] == 80


def test_cli_module_class_schema_and_resume(tmp_path):
    write_wavs(tmp_path / "src", n=4)
    (tmp_path / "myschema.py").write_text(
        "import h5store as h5s\n"
        "class S(h5s.TypedFile):\n"
        "    mel = h5s.MelSpectrogram(sr=16000, n_fft=512, hop_length=128, n_mels=20)\n"
    )
    r = run_cli("create", "myschema:S", "out.h5", "src", "-q", "-j", "1", "--resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("args, words", [
    (("info", "missing.h5"), "no such file"),
    (("create", "nope:X", "o.h5", "."), "cannot import"),
    (("create", "no-such-preset", "o.h5", "."), "unknown preset"),
    (("info", "notes.txt"), "not a readable HDF5 file"),
])
def test_cli_errors_are_one_line_and_nonzero(tmp_path, args, words):
    (tmp_path / "notes.txt").write_text("hello")
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h5store: error:") and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


class Labelled(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=20)
    label = h5s.DirLabel()  # default pattern: any file
    text = h5s.CSVColumn("metadata.csv", column=1)


def test_annotations_only_add_to_ids_that_content_features_create(tmp_path):
    ids = write_wavs(tmp_path / "src", n=4)
    rows = [f"{i.split('/')[-1]}|text of {i}|norm" for i in ids]
    (tmp_path / "src" / "metadata.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    (tmp_path / "src" / "tone" / "notes.txt").write_text("a stray file the label pattern matches")
    with Labelled.create(tmp_path / "l.h5", tmp_path / "src", n_workers=1, progress=False) as f:
        assert sorted(f.ids) == sorted(ids)  # no "metadata", no "tone/notes", no folder ids
        assert f.report.ok
        for i in ids:
            assert f.text[i] == f"text of {i}"
        classes = f.features["label"].classes
        assert sorted(classes) == ["noise", "tone"]
