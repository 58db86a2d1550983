"""Ingest mechanics: sources and ids, failures, atomic publish, resume, append, crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.ingest import expand_sources, source_id, stored_failures
from tests.ingest_schemas import Nums, SlowNums, WithSpeaker

ROOT = Path(__file__).resolve().parents[1]


def write_corpus(root: Path, n: int = 12, extra: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """n good .txt sources in two folders (one name with a space and unicode); returns id -> values."""
    expected = {}
    for i in range(n):
        folder = "spk a" if i % 2 else "spk_b"
        name = f"utt {i:02d}" if i % 3 == 0 else f"ütt-{i:02d}"
        p = root / folder / f"{name}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        values = np.arange(i % 5 + 1, dtype=np.float32) + i
        p.write_text(" ".join(str(v) for v in values), encoding="utf-8")
        expected[f"{folder}/{name}"] = values
    for rel, text in (extra or {}).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return expected


def contents(f: h5s.TypedFile) -> dict[str, np.ndarray]:
    return {i: f.nums[i] for i in f.ids}


def test_ids_are_relative_paths_without_extension_sorted(tmp_path):
    expected = write_corpus(tmp_path / "src")
    sources, root = expand_sources(tmp_path / "src")
    files = [s for s in sources if s.endswith(".txt")]
    assert root == str(tmp_path / "src")
    assert [s.id for s in files] == sorted(expected)
    assert source_id(str(tmp_path / "src" / "a" / "b.c.wav"), str(tmp_path / "src")) == "a/b.c"


def test_create_from_folder_stores_every_source(tmp_path):
    expected = write_corpus(tmp_path / "src")
    with Nums.create(tmp_path / "out.h5", tmp_path / "src", n_workers=2, progress=False) as f:
        assert list(f.ids) == sorted(expected)
        for i, v in expected.items():
            np.testing.assert_array_equal(f.nums[i], v)
        assert f.report.n_stored == len(expected) and f.report.ok
        assert f.mode == "r"
    assert not (tmp_path / ".out.h5.partial").exists()


def test_glob_list_and_manifest_sources(tmp_path):
    expected = write_corpus(tmp_path / "src")
    with Nums.create(tmp_path / "g.h5", str(tmp_path / "src" / "**" / "*.txt"), n_workers=1, progress=False) as f:
        assert sorted(f.ids) == sorted(expected)
    paths = sorted((tmp_path / "src").rglob("*.txt"))[:3]
    with Nums.create(tmp_path / "l.h5", paths, n_workers=1, progress=False) as f:
        assert len(f) == 3
    manifest = tmp_path / "src" / "manifest.csv"
    rows = ["path,speaker"] + [f"{p.relative_to(tmp_path / 'src')},spk{j}" for j, p in enumerate(paths)]
    manifest.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with WithSpeaker.create(tmp_path / "m.h5", manifest, n_workers=1, progress=False) as f:
        assert len(f) == 3
        got = {i: f.speaker[i].tobytes().decode() for i in f.ids}
        assert sorted(got.values()) == ["spk0", "spk1", "spk2"]


def test_bad_sources_are_reported_and_the_rest_stored(tmp_path, capsys):
    expected = write_corpus(tmp_path / "src", extra={
        "bad/nan.txt": "1 nan 3",
        "bad/boom.txt": "boom",
        "bad/words.txt": "not numbers",
        "bad/crash.txt": "crash",
        "spk_b/twin.txt": "1", "spk_b/twin.TXT": "2",
    })
    with Nums.create(tmp_path / "out.h5", tmp_path / "src", n_workers=2, progress=False) as f:
        failures = {x.id: x for x in f.report.failures}
        assert set(failures) == {"bad/nan", "bad/boom", "bad/words", "bad/crash", "spk_b/twin"}
        assert failures["bad/nan"].error == "SchemaError" and "NaN" in failures["bad/nan"].message
        assert failures["bad/boom"].error == "RuntimeError" and "boom" in failures["bad/boom"].message
        assert failures["bad/words"].error == "ValueError"
        assert failures["bad/crash"].error == "WorkerDied"
        assert failures["spk_b/twin"].error == "DuplicateIdError"
        assert failures["bad/boom"].source.endswith("boom.txt")
        # Both sources of the duplicate id are reported, and neither is stored.
        assert sorted(x.source[-8:] for x in f.report.failures if x.id == "spk_b/twin") == ["twin.TXT", "twin.txt"]
        assert set(f.ids) == set(expected)
        for i, v in expected.items():
            np.testing.assert_array_equal(f.nums[i], v)
        assert {x.id for x in stored_failures(f)} == set(failures)
    assert capsys.readouterr().err == ""  # progress=False is silent


def test_on_error_raise_lists_every_bad_source_and_publishes_nothing(tmp_path):
    bad = {"bad/boom.txt": "boom", "bad/nan.txt": "1 nan", "bad/crash.txt": "crash",
           "spk_b/twin.txt": "1", "spk_b/twin.TXT": "2"}
    expected = write_corpus(tmp_path / "src", extra=bad)
    target = tmp_path / "out.h5"
    target.write_bytes(b"previous file")
    with pytest.raises(h5s.SourceError) as info:
        Nums.create(target, tmp_path / "src", n_workers=2, mode="w", on_error="raise", progress=False)
    err = info.value
    # Every bad source, not only the first: a worker crash and a duplicate id included.
    assert {f.id for f in err.failures} == {"bad/boom", "bad/nan", "bad/crash", "spk_b/twin"}
    for name in ("boom.txt", "nan.txt", "crash.txt", "twin.txt", "twin.TXT"):
        assert name in str(err)
    assert str(err).startswith(f"5 of {len(expected) + 5} sources failed; {target} was not written")
    assert target.read_bytes() == b"previous file"
    # The good sources were kept in the partial file: after the fix, resume loads only the others.
    for rel in ("bad/boom.txt", "bad/nan.txt", "bad/crash.txt", "spk_b/twin.TXT"):
        (tmp_path / "src" / rel).unlink()
    with Nums.create(target, tmp_path / "src", n_workers=1, on_error="raise", resume=True, progress=False) as f:
        assert f.report.n_skipped == len(expected) and f.report.n_stored == 1
        assert sorted(f.ids) == sorted([*expected, "spk_b/twin"])
        np.testing.assert_array_equal(f.nums["spk_b/twin"], [1])  # twin.txt, the one left
        for i, v in expected.items():
            np.testing.assert_array_equal(f.nums[i], v)


def test_on_error_raise_from_the_cli_is_a_clear_error(tmp_path):
    write_corpus(tmp_path / "src", extra={"bad/boom.txt": "boom", "bad/nan.txt": "1 nan"})
    out = subprocess.run(
        [sys.executable, "-m", "h5store.cli", "create", "tests.ingest_schemas:Nums", str(tmp_path / "o.h5"),
         str(tmp_path / "src"), "--workers", "1", "--on-error", "raise", "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("h5store: error: 2 of 14 sources failed")
    assert "boom.txt" in out.stderr and "nan.txt" in out.stderr
    assert not (tmp_path / "o.h5").exists()


def test_interrupted_create_leaves_previous_file_and_resumes(tmp_path):
    expected = write_corpus(tmp_path / "src", n=30)
    target = tmp_path / "out.h5"
    Nums.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    before = target.read_bytes()
    # Interrupt a second create half-way (KeyboardInterrupt from inside a load).
    (tmp_path / "src" / "zz").mkdir()
    (tmp_path / "src" / "zz" / "new.txt").write_text("7 8")

    class Interrupting(Nums.schema.groups[""]["nums"].__class__):
        type_name = "tests.Interrupting"
        armed = True  # a class attribute, no parameter: the resume below uses the same feature

        def load(self, source):
            if self.armed and source.id.startswith("spk_b/ütt-08"):
                raise KeyboardInterrupt
            return super().load(source)

    class Flaky(h5s.TypedFile):
        nums = Interrupting()

    with pytest.raises(KeyboardInterrupt):
        Flaky.create(target, tmp_path / "src", n_workers=1, mode="w", progress=False)
    assert target.read_bytes() == before
    assert (tmp_path / ".out.h5.partial").exists()
    # The partial file holds items of Interrupting: another feature class may not resume it.
    with pytest.raises(h5s.SchemaError, match="cannot resume: feature 'nums' was stored as tests.Interrupting"):
        Nums.create(target, tmp_path / "src", n_workers=1, resume=True, progress=False)
    Interrupting.armed = False
    with Flaky.create(target, tmp_path / "src", n_workers=1, resume=True, progress=False) as f:
        assert f.report.n_skipped > 0
        assert contents(f).keys() == set(expected) | {"zz/new"}
        for i, v in expected.items():
            np.testing.assert_array_equal(f.nums[i], v)


def test_append_adds_only_new_ids(tmp_path):
    expected = write_corpus(tmp_path / "src", n=6)
    target = tmp_path / "out.h5"
    Nums.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    (tmp_path / "src" / "new").mkdir()
    (tmp_path / "src" / "new" / "one.txt").write_text("1 2 3")
    with Nums.create(target, tmp_path / "src", n_workers=1, mode="a", progress=False) as f:
        assert f.report.n_stored == 1 and f.report.n_skipped == len(expected)
        assert len(f) == len(expected) + 1
        np.testing.assert_array_equal(f.nums["new/one"], [1, 2, 3])


def test_no_matching_source_is_a_clear_error(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.wav").write_bytes(b"")
    with pytest.raises(h5s.SourceError, match="no source"):
        Nums.create(tmp_path / "out.h5", tmp_path / "src", progress=False)


@pytest.mark.slow
def test_sigkill_during_create_keeps_previous_file_and_resume_completes(tmp_path):
    expected = write_corpus(tmp_path / "src", n=80)
    target = tmp_path / "out.h5"
    Nums.create(target, tmp_path / "src", n_workers=1, progress=False).close()
    before = target.read_bytes()
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from tests.ingest_schemas import SlowNums
        SlowNums.create({str(target)!r}, {str(tmp_path / 'src')!r}, n_workers=1, mode="w", progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    time.sleep(2.0)
    assert proc.poll() is None, "create finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert target.read_bytes() == before
    # The same call with resume=True: mode="w" decides when the kill came before the first commit.
    with SlowNums.create(target, tmp_path / "src", n_workers=2, mode="w", resume=True, progress=False) as f:
        assert set(f.ids) == set(expected)
        for i, v in expected.items():
            np.testing.assert_array_equal(f.nums[i], v)


def test_merge_shards_equals_one_create(tmp_path):
    expected = write_corpus(tmp_path / "src", n=20)
    files = sorted((tmp_path / "src").rglob("*.txt"))
    Nums.create(tmp_path / "s0.h5", files[:7], root=tmp_path / "src", n_workers=1, progress=False).close()
    Nums.create(tmp_path / "s1.h5", files[7:], root=tmp_path / "src", n_workers=1, progress=False).close()
    with Nums.merge([tmp_path / "s0.h5", tmp_path / "s1.h5"], tmp_path / "all.h5", progress=False) as f:
        assert sorted(f.ids) == sorted(expected)
        for i, v in expected.items():
            np.testing.assert_array_equal(f.nums[i], v)
    with pytest.raises(h5s.DuplicateIdError):
        Nums.merge([tmp_path / "s0.h5", tmp_path / "s0.h5"], tmp_path / "dup.h5", progress=False)
    assert not (tmp_path / "dup.h5").exists()
    # An existing target is replaced only on request, like create().
    before = (tmp_path / "all.h5").read_bytes()
    with pytest.raises(h5s.TargetExistsError, match=r"all\.h5 already exists: pass overwrite=True"):
        Nums.merge([tmp_path / "s0.h5"], tmp_path / "all.h5", progress=False)
    assert (tmp_path / "all.h5").read_bytes() == before
    with Nums.merge([tmp_path / "s0.h5"], tmp_path / "all.h5", overwrite=True, progress=False) as f:
        assert len(f) == 7


def test_a_lost_worker_result_file_fails_its_sources_only(tmp_path, monkeypatch):
    """Workers hand arrays over through /dev/shm files; one that vanished (or was cut) before
    the writer read it fails its sources, named, before any of their ids is added."""
    from h5store import ingest_workers

    expected = write_corpus(tmp_path / "src", n=40)
    real = ingest_workers.Spooled.check
    calls = []

    def first_is_lost(self):
        calls.append(self.path)
        if len(calls) == 1:
            os.truncate(self.path, 0)  # as if something cut the file
        return real(self)

    monkeypatch.setattr(ingest_workers.Spooled, "check", first_is_lost)
    with Nums.create(tmp_path / "out.h5", tmp_path / "src", n_workers=2, progress=False) as f:
        lost = {x.id for x in f.report.failures}
        assert calls, "the spool path was not used"
        assert lost and all(x.error == "SpoolError" and "holds 0 of" in x.message for x in f.report.failures)
        assert set(f.ids) == set(expected) - lost
        for i in f.ids:
            np.testing.assert_array_equal(f.nums[i], expected[i])
    assert not list(Path("/dev/shm").glob(f"h5store-ingest-{os.getpid()}-*"))
