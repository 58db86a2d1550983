"""Issue 11, ingest: appending never destroys what is there, an existing target is replaced
only on request, and a bad source name is that source's failure.

Real files throughout: wav files written by soundfile, .txt sources, the CLI in a subprocess.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.errors import H5StoreError
from h5store.ingest import stored_failures
from tests.features.signals import write_audio
from tests.ingest_schemas import Numbers, Nums

ROOT = Path(__file__).resolve().parents[1]
SR = 16000


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(folder: Path) -> list[str]:
    """Partial, copy and journal files a create may have left beside its target."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.name.endswith("-journal"))


def write_numbers(root: Path, n: int, start: int = 0) -> dict[str, list[float]]:
    out = {}
    for i in range(start, start + n):
        p = root / f"spk{i % 2}" / f"utt{i:03d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"{i} {i + 0.5}", encoding="utf-8")
        out[f"spk{i % 2}/utt{i:03d}"] = [i, i + 0.5]
    return out


def write_clips(root: Path, n: int, start: int = 0) -> list[str]:
    ids = []
    for i in range(start, start + n):
        kind = ("tone", "hum")[i % 2]
        write_audio(root / kind / f"clip{i:03d}.wav", seconds=0.2 + 0.01 * i, sr=SR)
        ids.append(f"{kind}/clip{i:03d}")
    return ids


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "h5store.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h5store: error: "), r.stderr
    return lines[0]


class Mel80(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=80)
    label = h5s.DirLabel()


class Mel40(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=40)
    label = h5s.DirLabel()


class Mel80Hop64(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=64, n_mels=80)
    label = h5s.DirLabel()


class Scaled(Numbers):
    """Numbers times ``scale``: a parameter that changes the values, not the stored shape."""

    type_name = "tests.Scaled"
    scale: float = 1.0

    def load(self, source):
        return super().load(source) * self.scale


class Once(h5s.TypedFile):
    nums = Scaled()


class Twice(h5s.TypedFile):
    nums = Scaled(scale=2.0)


# ------------------------------------------------------------------ 1. appending never destroys
def test_append_with_another_n_mels_refuses_and_leaves_the_file_byte_identical(tmp_path):
    ids = write_clips(tmp_path / "src", 12)
    target = tmp_path / "speech.h5"
    Mel80.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    before = sha(target)
    write_clips(tmp_path / "src", 6, start=12)
    with pytest.raises(h5s.SchemaError) as info:
        Mel40.create(target, tmp_path / "src", n_workers=1, mode="a", progress=False)
    msg = str(info.value)
    assert str(target) in msg and "cannot append" in msg and "'mel'" in msg, msg
    assert "stored with n_mels=80, Mel40 declares n_mels=40;" in msg and 'mode="w"' in msg, msg
    assert sha(target) == before
    assert leftovers(tmp_path) == []
    with h5s.open(target) as f:
        assert sorted(f.ids) == sorted(ids) and f.mel[0].shape[1] == 80


def test_append_with_another_hop_length_refuses_although_the_shape_is_the_same(tmp_path):
    write_clips(tmp_path / "src", 4)
    target = tmp_path / "speech.h5"
    Mel80.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    before = sha(target)
    write_clips(tmp_path / "src", 2, start=4)
    with pytest.raises(h5s.SchemaError, match=r"feature 'mel' was stored with hop_length=128, "
                                              r"Mel80Hop64 declares hop_length=64"):
        Mel80Hop64.create(target, tmp_path / "src", n_workers=1, mode="a", progress=False)
    assert sha(target) == before and leftovers(tmp_path) == []


def test_append_with_another_custom_parameter_refuses(tmp_path):
    """Any feature, not only the built-in ones: items computed two ways never share a feature."""
    write_numbers(tmp_path / "src", 6)
    target = tmp_path / "n.h5"
    Once.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    before = sha(target)
    write_numbers(tmp_path / "src", 3, start=6)
    with pytest.raises(h5s.SchemaError) as info:
        Twice.create(target, tmp_path / "src", n_workers=1, mode="a", progress=False)
    assert "feature 'nums' was stored with scale=1.0, Twice declares scale=2.0" in str(info.value)
    assert sha(target) == before and leftovers(tmp_path) == []


def test_append_from_the_cli_with_another_n_mels_is_one_line_and_keeps_the_file(tmp_path):
    write_clips(tmp_path / "src", 6)
    target = tmp_path / "p.h5"
    r = run_cli("create", "audio-mel", str(target), "src", "-j", "1", "--sr", str(SR), "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    before = sha(target)
    write_clips(tmp_path / "src", 2, start=6)
    r = run_cli("create", "audio-mel", str(target), "src", "-j", "1", "--sr", str(SR), "--n-mels", "40",
                "--append", "-q", cwd=tmp_path)
    line = one_error_line(r)
    assert "n_mels=80" in line and "n_mels=40" in line and "--overwrite" in line and "mode=" not in line, line
    assert "stored" not in r.stdout
    assert sha(target) == before and leftovers(tmp_path) == []


def test_append_learns_a_larger_label_vocabulary(tmp_path):
    """Learned parameters may grow on append; the stored classes keep their numbers."""
    ids = write_clips(tmp_path / "src", 4)
    target = tmp_path / "speech.h5"
    Mel80.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    write_audio(tmp_path / "src" / "aaa" / "new.wav", seconds=0.2, sr=SR)
    with Mel80.create(target, tmp_path / "src", n_workers=1, mode="a", progress=False) as f:
        assert f.report.n_stored == 1 and sorted(f.ids) == sorted([*ids, "aaa/new"])
        assert list(f.features["label"].classes) == ["hum", "tone", "aaa"]
        assert f.label["aaa/new"] == 2 and f.label["tone/clip000"] == 1


def test_append_to_a_file_that_is_not_an_h5store_file_refuses_and_keeps_it(tmp_path):
    write_numbers(tmp_path / "src", 4)
    target = tmp_path / "n.h5"
    target.write_bytes(b"precious bytes that are not HDF5" * 100)
    before = sha(target)
    with pytest.raises(H5StoreError) as info:
        Nums.create(target, tmp_path / "src", n_workers=1, mode="a", progress=False)
    assert str(target) in str(info.value) and "cannot append" in str(info.value)
    assert sha(target) == before and leftovers(tmp_path) == []


def leave_partial(tmp_path: Path, cls: type[h5s.TypedFile]) -> Path:
    """A partial file of ``cls`` holding the good sources: on_error="raise" keeps it."""
    write_numbers(tmp_path / "src", 6)
    (tmp_path / "src" / "bad.txt").write_text("boom")
    with pytest.raises(h5s.SourceError):
        cls.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, on_error="raise", progress=False)
    partial = tmp_path / ".n.h5.partial"
    assert partial.exists()
    (tmp_path / "src" / "bad.txt").unlink()
    return partial


def test_resume_from_a_partial_file_built_with_other_parameters_refuses_and_keeps_it(tmp_path):
    partial = leave_partial(tmp_path, Once)
    before = sha(partial)
    with pytest.raises(h5s.SchemaError) as info:
        Twice.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, resume=True, progress=False)
    msg = str(info.value)
    assert str(partial) in msg and "cannot resume" in msg and "scale=1.0" in msg and "scale=2.0" in msg, msg
    assert sha(partial) == before and not (tmp_path / "n.h5").exists()
    # With the parameters it was built with, it resumes and loads nothing again.
    with Once.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, resume=True, progress=False) as f:
        assert f.report.n_skipped == 6 and f.report.n_stored == 0


def test_resume_rebuilds_a_partial_file_that_is_damaged(tmp_path):
    expected = write_numbers(tmp_path / "src", 5)
    (tmp_path / ".n.h5.partial").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)  # cut by a kill
    with Nums.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, resume=True, progress=False) as f:
        assert sorted(f.ids) == sorted(expected) and f.report.n_stored == 5


def test_a_damaged_partial_file_of_an_append_is_rebuilt_from_the_target(tmp_path):
    """resume=True, mode="a": a partial file cut by a kill starts over from a copy of the target,
    never from nothing (which would publish a file without the target's ids)."""
    old = write_numbers(tmp_path / "old", 6)
    target = tmp_path / "n.h5"
    Nums.create(target, tmp_path / "old", n_workers=1, progress=False).close()
    new = {f"new/{k}": v for k, v in write_numbers(tmp_path / "more" / "new", 3, start=6).items()}
    (tmp_path / ".n.h5.partial").write_bytes(b"")  # what a kill before the first commit leaves
    with Nums.create(target, tmp_path / "more", n_workers=1, mode="a", resume=True, progress=False) as f:
        assert sorted(f.ids) == sorted([*old, *new])
        for i, v in new.items():
            np.testing.assert_array_equal(f.nums[i], v)


def test_a_damaged_partial_file_and_an_existing_target_need_a_mode(tmp_path):
    write_numbers(tmp_path / "src", 4)
    target = tmp_path / "n.h5"
    Nums.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    before = sha(target)
    (tmp_path / ".n.h5.partial").write_bytes(b"")
    with pytest.raises(FileExistsError, match=r"partial file cannot be resumed .*empty file.*: pass mode=\"w\""):
        Nums.create(target, tmp_path / "src", n_workers=1, resume=True, progress=False)
    assert sha(target) == before


# ------------------------------------------------------------------ 2. an existing target is explicit
def test_create_onto_an_existing_file_refuses_without_a_mode(tmp_path):
    write_numbers(tmp_path / "src", 6)
    target = tmp_path / "n.h5"
    Nums.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    before = sha(target)
    few = sorted((tmp_path / "src").rglob("*.txt"))[:2]
    src = tmp_path / "src"
    with pytest.raises(FileExistsError) as info:
        Nums.create(target, few, root=src, n_workers=1, progress=False)
    err = info.value
    assert isinstance(err, H5StoreError)
    assert str(target) in str(err) and 'mode="w"' in str(err) and 'mode="a"' in str(err), str(err)
    assert sha(target) == before and leftovers(tmp_path) == []
    # Either choice, said explicitly, works.
    with Nums.create(target, few, root=src, n_workers=1, mode="w", progress=False) as f:
        assert len(f) == 2
    with Nums.create(target, tmp_path / "src", n_workers=1, mode="a", progress=False) as f:
        assert len(f) == 6 and f.report.n_skipped == 2
    with Nums.create(target, few, root=src, n_workers=1, overwrite=True, progress=False) as f:
        assert len(f) == 2
    with pytest.raises(ValueError, match="overwrite=True"):
        Nums.create(target, few, n_workers=1, mode="a", overwrite=True, progress=False)


def test_cli_create_onto_an_existing_file_needs_overwrite_or_append(tmp_path):
    write_numbers(tmp_path / "src", 4)
    target = tmp_path / "n.h5"
    schema = "tests.ingest_schemas:Nums"
    assert run_cli("create", schema, str(target), "src", "-j", "1", "-q", cwd=tmp_path).returncode == 0
    before = sha(target)
    two = ("src/spk0/utt000.txt", "src/spk1/utt001.txt")
    line = one_error_line(run_cli("create", schema, str(target), *two, "-j", "1", "-q", cwd=tmp_path))
    assert str(target) in line and "--overwrite" in line and "--append" in line and "mode=" not in line, line
    assert sha(target) == before and leftovers(tmp_path) == []
    r = run_cli("create", schema, str(target), *two, "-j", "1", "-q", "--overwrite", cwd=tmp_path)
    assert r.returncode == 0 and "2 stored, 0 already present" in r.stdout, r.stderr
    r = run_cli("create", schema, str(target), "src", "-j", "1", "-q", "--append", cwd=tmp_path)
    assert r.returncode == 0 and "2 stored, 2 already present" in r.stdout, r.stderr
    with h5s.open(target) as f:
        assert len(f) == 4
    r = run_cli("create", schema, str(target), "src", "-q", "--append", "--overwrite", cwd=tmp_path)
    assert r.returncode != 0 and "not allowed with" in r.stderr


def test_resume_of_an_interrupted_create_needs_no_mode(tmp_path):
    write_numbers(tmp_path / "src", 6)
    target = tmp_path / "n.h5"
    Nums.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    (tmp_path / "src" / "more.txt").write_text("1 2")
    (tmp_path / "src" / "bad.txt").write_text("boom")
    with pytest.raises(h5s.SourceError):
        Nums.create(target, tmp_path / "src", n_workers=1, mode="w", on_error="raise", progress=False)
    (tmp_path / "src" / "bad.txt").unlink()
    with Nums.create(target, tmp_path / "src", n_workers=1, resume=True, progress=False) as f:
        assert len(f) == 7 and f.report.n_skipped == 7


# ------------------------------------------------------------------ 9. a bad source name
def test_a_newline_in_a_file_name_fails_that_source_only(tmp_path):
    expected = write_numbers(tmp_path / "src", 4)
    (tmp_path / "src" / "two\nlines.txt").write_text("7 8")
    with Nums.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, progress=False) as f:
        assert sorted(f.ids) == sorted(expected)
        (failure,) = f.report.failures
        assert failure.id == "two\nlines" and failure.error == "InvalidIdError"
        assert "control character" in failure.message and failure.source.endswith("lines.txt")
        assert "\n" not in str(failure)
        assert [x.id for x in stored_failures(f)] == ["two\nlines"]
        assert f.report.n_sources == 5 and f.report.n_stored == 4


def test_a_newline_in_a_file_name_from_the_cli(tmp_path):
    write_numbers(tmp_path / "src", 2)
    (tmp_path / "src" / "two\nlines.txt").write_text("7 8")
    r = run_cli("create", "tests.ingest_schemas:Nums", "n.h5", "src", "-j", "1", "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "2 stored" in out[0] and "1 of 3 sources failed" in out[0]
    assert out[1].startswith("  failed: '") and out[1].endswith("(id 'two\\nlines')"), r.stdout
    assert out[2].startswith("    *: InvalidIdError") and len(out) == 3, r.stdout


def test_sources_with_one_id_are_all_reported_and_none_is_stored(tmp_path):
    expected = write_numbers(tmp_path / "src", 4)
    (tmp_path / "src" / "twin.txt").write_text("1")
    (tmp_path / "src" / "twin.TXT").write_text("2")
    # Unicode: the NFC and NFD spellings of one name are one id.
    (tmp_path / "src" / "caf\u00e9.txt").write_text("3")
    (tmp_path / "src" / "cafe\u0301.txt").write_text("4")
    with Nums.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, progress=False) as f:
        assert sorted(f.ids) == sorted(expected)
        failed = sorted((x.id, x.error, os.path.basename(x.source)) for x in f.report.failures)
        assert failed == sorted([("twin", "DuplicateIdError", "twin.txt"), ("twin", "DuplicateIdError", "twin.TXT"),
                                 ("caf\u00e9", "DuplicateIdError", "caf\u00e9.txt"),
                                 ("caf\u00e9", "DuplicateIdError", "cafe\u0301.txt")])
        assert all("twin.txt" in x.message and "twin.TXT" in x.message for x in f.report.failures if x.id == "twin")
    # Once the user removed one of each pair, an append loads the one left, with its content.
    (tmp_path / "src" / "twin.TXT").unlink()
    (tmp_path / "src" / "cafe\u0301.txt").unlink()
    with Nums.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, mode="a", progress=False) as f:
        assert f.report.ok and f.report.n_stored == 2
        np.testing.assert_array_equal(f.nums["twin"], [1])
        np.testing.assert_array_equal(f.nums["caf\u00e9"], [3])
        assert stored_failures(f) == []


def test_duplicates_in_a_resumed_create_are_not_stored(tmp_path):
    partial = leave_partial(tmp_path, Nums)
    (tmp_path / "src" / "twin.txt").write_text("1")
    (tmp_path / "src" / "twin.TXT").write_text("2")
    with Nums.create(tmp_path / "n.h5", tmp_path / "src", n_workers=1, resume=True, progress=False) as f:
        assert "twin" not in f and {x.id for x in f.report.failures} == {"twin"}
        assert len(f.report.failures) == 2 and f.report.n_skipped == 6
    assert not partial.exists()


def test_a_file_given_twice_is_one_source(tmp_path):
    """A folder and a glob over it list every file twice: that is no duplicate id."""
    expected = write_numbers(tmp_path / "src", 4)
    with Nums.create(tmp_path / "n.h5", [tmp_path / "src", str(tmp_path / "src" / "*" / "*.txt")],
                     root=tmp_path / "src", n_workers=1, progress=False) as f:
        assert f.report.ok and f.report.n_sources == 4 and sorted(f.ids) == sorted(expected)


def test_append_on_a_full_disk_leaves_the_file_and_no_half_copy(tmp_path, small_disk):
    """The copy an append works on does not fit: one error naming the file, nothing left behind."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):  # ~1.2 MB of float32 items: the file fits the 2 MiB disk once, not twice
        (src / f"big{i}.txt").write_text(" ".join(["1.5"] * 100_000))
    target = small_disk / "n.h5"
    Nums.create(target, src, n_workers=1, progress=False).close()
    before = sha(target)
    (src / "new.txt").write_text("1 2")
    with pytest.raises(OSError) as info:
        Nums.create(target, src, n_workers=1, mode="a", progress=False)
    assert isinstance(info.value, H5StoreError) and info.value.errno == 28 and str(target) in str(info.value)
    assert sha(target) == before and leftovers(small_disk) == []


def test_append_through_a_symlink_extends_the_file_it_points_to(tmp_path):
    """speech.h5 -> /big/disk/speech.h5: the real file gets the new ids, the link stays a link."""
    expected = write_numbers(tmp_path / "src", 4)
    (tmp_path / "big").mkdir()
    real = tmp_path / "big" / "n.h5"
    Nums.create(real, tmp_path / "src", n_workers=1, progress=False).close()
    link = tmp_path / "n.h5"
    link.symlink_to(real)
    (tmp_path / "src" / "more.txt").write_text("5 6")
    with Nums.create(link, tmp_path / "src", n_workers=1, mode="a", progress=False) as f:
        assert f.report.n_stored == 1
    assert link.is_symlink() and os.readlink(link) == str(real)
    with h5s.open(real) as f:
        assert sorted(f.ids) == sorted([*expected, "more"])
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "big") == []


def test_opening_with_a_class_of_another_shape_names_the_parameter_and_what_to_do(tmp_path):
    write_clips(tmp_path / "src", 2)
    target = tmp_path / "speech.h5"
    Mel80.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    with pytest.raises(h5s.SchemaError) as info:
        Mel40(target)
    msg = str(info.value)
    assert msg.startswith(f"{target}:/mel: stored as float32 (None, 80) (ragged), but Mel40 declares"), msg
    assert "(n_mels=80 stored, 40 declared)" in msg and "h5store.open(" in msg, msg
