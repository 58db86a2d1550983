"""Sharded datasets: built on a real Dask LocalCluster and locally, equal item for item to an
unsharded create; resumed after a SIGKILL; refused when the manifest and the files disagree;
served as one dataset (DataLoader workers under fork and spawn), and by shard across ranks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.ingest import stored_failures
from h5store.shards import file_crc32, read_manifest, verify_sharded
from tests.ingest_schemas import LabeledNums, Nums
from tests.test_ingest import write_corpus

ROOT = Path(__file__).resolve().parents[1]


def corpus(root: Path, n: int = 30) -> dict[str, np.ndarray]:
    """n good sources in two label folders (sorted ids put each folder in its own shards),
    one bad source, and one id given by two files (a duplicate, reported by its shard)."""
    return write_corpus(root, n=n, extra={"spk_c/bad.txt": "boom", "spk_c/twice.txt": "1 2", "spk_c/twice.TXT": "3"})


def failures(report: h5s.IngestReport) -> list[tuple[str, str, str]]:
    return sorted((f.id, f.feature, f.error) for f in report.failures)


def assert_same(ds, one) -> None:
    """Every id, in order, and every feature's item equal between a sharded dataset and a file."""
    assert list(ds.ids) == list(one.ids)
    assert len(ds) == len(one)
    for i in one.ids:
        np.testing.assert_array_equal(ds.nums[i], one.nums[i])
        assert ds.label[i] == one.label[i]
        assert ds[i].keys() == one[i].keys()
    np.testing.assert_array_equal(ds.nums.lengths, one.nums.lengths)
    assert ds.features["label"].classes == one.features["label"].classes


def check_manifest(folder: Path, n_items: int) -> dict:
    m = read_manifest(folder)
    assert m["items"] == n_items == sum(e["items"] for e in m["shards"])
    for e in m["shards"]:
        p = folder / e["file"]
        assert p.stat().st_size == e["bytes"]
        assert f"{file_crc32(str(p)):08x}" == e["crc32"]
        with h5s.open(p) as f:  # an ordinary h5store file
            ends = (f.ids[0], f.ids[len(f) - 1]) if len(f) else (None, None)  # a shard of failures only
            assert ends == (e["first"], e["last"])
            assert len(f) == e["items"]
    assert not (folder / ".index.draft.json").exists()
    return m


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=40) as c, distributed.Client(c) as client:
        yield client


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    expected = corpus(tmp / "src")
    f = LabeledNums.create(tmp / "one.h5", tmp / "src", n_workers=1, progress=False)
    return tmp / "src", f, expected


# ----------------------------------------------------------------------------- build
@pytest.mark.parametrize("how", ["client", "joblib"])
def test_dask_cluster_builds_shards_equal_to_an_unsharded_create(cluster, unsharded, tmp_path, how):
    import joblib
    from distributed import get_task_stream

    src, one, expected = unsharded
    out = tmp_path / "ds"
    with get_task_stream(cluster) as tasks:
        if how == "client":  # the active Client is found by itself
            ds = LabeledNums.create(out, src, shard_size=7, progress=False)
        else:
            with joblib.parallel_config(backend="dask"):
                ds = LabeledNums.create(out, src, shards=3, progress=False)
    n_shards = 5 if how == "client" else 3
    built = [t for t in tasks.data if "build_shard" in str(t["key"])]
    assert len(built) == n_shards, "each shard is built by a Dask task"
    assert {t["worker"] for t in built} <= set(cluster.scheduler_info()["workers"])
    with ds:
        assert_same(ds, one)
        assert len(ds) == len(expected)
        # The bad source and the duplicate id are reported with their ids, the others stored.
        assert failures(ds.report) == failures(one.report)
        assert ("spk_c/bad", "nums", "RuntimeError") in failures(ds.report)
        assert {f.id for f in ds.report.failures} == {"spk_c/bad", "spk_c/twice"}
        assert ds.report.n_stored == len(expected)
        assert ds.report.n_sources == one.report.n_sources
    m = check_manifest(out, len(expected))
    assert len(m["shards"]) == n_shards
    # The vocabulary was learned once over every source: each shard holds all three classes,
    # although the first shard's sources all lie in one folder.
    stored = []
    for e in m["shards"]:
        with h5s.open(out / e["file"]) as f:
            assert f.features["label"].classes == one.features["label"].classes == ("spk a", "spk_b", "spk_c")
            stored.extend(stored_failures(f))  # each shard keeps its own sources' failures
    assert sorted((f.id, f.feature, f.error) for f in stored) == failures(one.report)


def test_a_dask_worker_killed_midway_has_its_shard_rebuilt(cluster, unsharded, tmp_path):
    import threading

    from tests.ingest_schemas import PacedLabeledNums, set_load_delay

    src, one, _ = unsharded
    cluster.run(set_load_delay, 0.1)  # 0.5 s per shard of 5
    pids = cluster.run(os.getpid)
    victim = sorted(pids.values())[0]
    killed = threading.Event()

    def kill_when_a_shard_is_under_way() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.name.endswith(".partial") for p in (tmp_path / "ds").glob(".*")):
                time.sleep(0.2)
                os.kill(victim, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.01)

    t = threading.Thread(target=kill_when_a_shard_is_under_way)
    t.start()
    try:
        ds = PacedLabeledNums.create(tmp_path / "ds", src, shard_size=5, progress=False)
    finally:
        t.join()
        cluster.run(set_load_delay, None)
    assert killed.is_set(), "no worker was killed"
    assert victim not in cluster.run(os.getpid).values()
    with ds:
        assert list(ds.ids) == list(one.ids)
        for i in one.ids:
            np.testing.assert_array_equal(ds.nums[i], one.nums[i])
            assert ds.label[i] == one.label[i]
    check_manifest(tmp_path / "ds", len(one))
    assert not list((tmp_path / "ds").glob(".*partial*"))


def test_local_build_without_dask_equals_unsharded(unsharded, tmp_path):
    src, one, _ = unsharded
    with LabeledNums.create(tmp_path / "ds", src, shard_size=8, n_workers=2, progress=False) as ds:
        assert_same(ds, one)
        assert failures(ds.report) == failures(one.report)
    with LabeledNums.create(tmp_path / "dsp", src, shard_size=8, n_workers=2, shard_processes=True,
                            progress=False) as ds:
        assert_same(ds, one)
        assert failures(ds.report) == failures(one.report)
    with LabeledNums.create(tmp_path / "ds1", src, shards=1, n_workers=1, progress=False) as ds:
        assert_same(ds, one)
        assert len(ds.files) == 1


def test_sharded_create_refuses_what_it_cannot_do(unsharded, tmp_path):
    src, _, _ = unsharded
    out = tmp_path / "ds"
    LabeledNums.create(out, src, shard_size=10, n_workers=1, progress=False).close()
    before = (out / "index.json").read_bytes()
    with pytest.raises(h5s.TargetExistsError, match=r'holds a sharded dataset: pass mode="w"'):
        LabeledNums.create(out, src, shard_size=10, n_workers=1, progress=False)
    with pytest.raises(ValueError, match=r"not appended to"):
        LabeledNums.create(out, src, shard_size=10, mode="a", progress=False)
    with pytest.raises(ValueError, match=r"one of shard_size="):
        LabeledNums.create(tmp_path / "x", src, shard_size=10, shards=2, progress=False)
    with pytest.raises(ValueError, match=r">= 1"):
        LabeledNums.create(tmp_path / "x", src, shards=0, progress=False)
    assert (out / "index.json").read_bytes() == before
    # mode="w" replaces it, and removes the old shards the new manifest does not name.
    with LabeledNums.create(out, src, shard_size=20, mode="w", n_workers=1, progress=False) as ds:
        assert len(ds.files) == 2
        names = [e["file"] for e in ds.manifest["shards"]]
    # The new shards' names carry the build's tag: none takes an old shard's name.
    assert all(re.fullmatch(rf"shard-0000{k}-of-00002\.[0-9a-f]{{12}}\.h5", n) for k, n in enumerate(names)), names
    assert sorted(p.name for p in out.iterdir()) == ["index.json", *names]
    with pytest.raises(ValueError, match="read-only"):
        h5s.open(out, mode="a")


def test_a_replacement_that_failed_midway_is_resumed_and_cleans_up(unsharded, tmp_path):
    src, one, _ = unsharded
    out = tmp_path / "ds"
    LabeledNums.create(out, src, shard_size=10, n_workers=1, progress=False).close()
    old = sorted(p.name for p in out.glob("shard-*"))
    manifest = (out / "index.json").read_bytes()
    with pytest.raises(h5s.SourceError, match="spk_c/bad"):  # the second shard holds the bad source
        LabeledNums.create(out, src, shard_size=20, mode="w", on_error="raise", n_workers=1, progress=False)
    # The old dataset is untouched by the failed replacement: its manifest and shards open as before.
    assert (out / "index.json").read_bytes() == manifest
    with h5s.open(out) as ds:
        assert_same(ds, one)
        assert len(ds.files) == 4
    done = json.loads((out / ".index.draft.json").read_text())["done"]
    assert len(done) == 1 and next(iter(done)).startswith("shard-00000-of-00002.")
    first = next(iter(done))
    kept = (out / first).stat()
    with LabeledNums.create(out, src, shard_size=20, mode="w", resume=True, n_workers=1, progress=False) as ds:
        assert_same(ds, one)
        names = [e["file"] for e in ds.manifest["shards"]]
    assert names[0] == first and (out / first).stat().st_ino == kept.st_ino
    # The replaced dataset's shards are gone, and the hidden files of the failed build.
    assert sorted(p.name for p in out.iterdir()) == ["index.json", *names]
    assert old == [f"shard-0000{k}-of-00004.h5" for k in range(4)]


def test_a_replacement_killed_midway_leaves_the_old_dataset_opening(unsharded, tmp_path):
    # SIGKILL at a random point of a replacement: the old dataset still opens, with its data;
    # a resume finishes the new one and removes the old shards.
    src, one, _ = unsharded
    out = tmp_path / "ds"
    LabeledNums.create(out, src, shard_size=10, n_workers=1, progress=False).close()
    old_files = {p.name: p.read_bytes() for p in out.iterdir()}
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from tests.ingest_schemas import PacedLabeledNums
        PacedLabeledNums.create({str(out)!r}, {str(src)!r}, shard_size=8, mode="w", n_workers=1, progress=False)
    """)
    env = dict(os.environ, H5STORE_TEST_LOAD_DELAY="0.05")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    draft = out / ".index.draft.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(draft.read_text())["done"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the replacement finished (or failed) before a shard was complete"
    time.sleep(float(np.random.default_rng().uniform(0, 0.3)))  # somewhere in the next shards
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for name, data in old_files.items():
        assert (out / name).read_bytes() == data, f"{name} of the old dataset changed"
    with h5s.open(out) as ds:
        assert_same(ds, one)
    assert verify_sharded(out)
    from tests.ingest_schemas import PacedLabeledNums

    with PacedLabeledNums.create(out, src, shard_size=8, mode="w", resume=True, n_workers=1, progress=False) as ds:
        assert_same(ds, one)
        names = [e["file"] for e in ds.manifest["shards"]]
    assert len(names) == 4 and not set(names) & set(old_files)
    assert sorted(p.name for p in out.iterdir()) == sorted(["index.json", *names])
    check_manifest(out, len(one))


# ----------------------------------------------------------------------------- resume after a kill
def test_killed_shard_is_redone_on_resume_and_finished_shards_are_kept(unsharded, tmp_path):
    src, one, _ = unsharded
    out = tmp_path / "ds"
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from tests.ingest_schemas import PacedLabeledNums
        PacedLabeledNums.create({str(out)!r}, {str(src)!r}, shard_size=8, n_workers=1, progress=False)
    """)
    env = dict(os.environ, H5STORE_TEST_LOAD_DELAY="0.1")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    draft = out / ".index.draft.json"
    deadline = time.monotonic() + 120
    done: dict = {}
    while time.monotonic() < deadline and proc.poll() is None:
        if draft.exists():
            try:
                done = json.loads(draft.read_text())["done"]
            except (ValueError, KeyError):
                done = {}
            if done:
                break
        time.sleep(0.02)
    assert proc.poll() is None and done, "the create finished (or failed) before a shard was complete"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "index.json").exists()  # no manifest: a reader never sees a half-built dataset
    with pytest.raises(FileNotFoundError):
        h5s.open(out / "index.json")
    kept = {name: (out / name).stat() for name in done}
    # A finished shard damaged afterwards is not kept: its CRC-32 no longer matches.
    first = sorted(done)[0]
    damaged = len(done) > 1
    if damaged:
        with open(out / sorted(done)[1], "r+b") as fh:
            fh.seek(4096)
            b = fh.read(1)
            fh.seek(4096)
            fh.write(bytes([b[0] ^ 0xFF]))
    from tests.ingest_schemas import PacedLabeledNums

    with PacedLabeledNums.create(out, src, shard_size=8, n_workers=1, resume=True, progress=False) as ds:
        assert list(ds.ids) == list(one.ids)
        for i in one.ids:
            np.testing.assert_array_equal(ds.nums[i], one.nums[i])
            assert ds.label[i] == one.label[i]
        # Only the shards built by this run are in its report.
        assert ds.report.n_stored == len(one) - sum(done[n]["items"] for n in done if not (damaged and n != first))
    st = (out / first).stat()
    assert (st.st_ino, st.st_mtime_ns) == (kept[first].st_ino, kept[first].st_mtime_ns), "a finished shard was rebuilt"
    check_manifest(out, len(one))


# ----------------------------------------------------------------------------- refusals at open
@pytest.fixture
def built(unsharded, tmp_path):
    src, one, _ = unsharded
    out = tmp_path / "ds"
    LabeledNums.create(out, src, shard_size=10, n_workers=1, progress=False).close()
    return out, src, one


def _edit(folder: Path, fn) -> None:
    m = json.loads((folder / "index.json").read_text())
    fn(m)
    (folder / "index.json").write_text(json.dumps(m))


def test_open_refuses_a_missing_or_resized_shard_naming_it(built):
    out, _, _ = built
    shard = out / "shard-00001-of-00004.h5"
    shutil.move(shard, out / "elsewhere.h5")
    with pytest.raises(FileNotFoundError, match=r"shard-00001-of-00004\.h5: shard missing"):
        h5s.open(out)
    shutil.move(out / "elsewhere.h5", shard)
    with open(shard, "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(h5s.FormatError, match=r"shard-00001-of-00004\.h5: \d+ bytes, the manifest records \d+"):
        h5s.open(out / "index.json")
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 1)
    with h5s.open(out) as ds:  # intact again
        assert len(ds.files) == 4


def test_open_refuses_a_shard_of_another_schema_naming_it(built, tmp_path):
    out, src, _ = built
    target = out / "shard-00002-of-00004.h5"
    with h5s.open(target) as f:
        ids = list(f.ids)
    files = [p for p in src.rglob("*.txt") if str(p.relative_to(src).with_suffix("")) in ids]
    Nums.create(tmp_path / "other.h5", files, root=src, n_workers=1, progress=False).close()
    shutil.copy(tmp_path / "other.h5", target)
    _edit(out, lambda m: m["shards"][2].update(bytes=target.stat().st_size))
    with pytest.raises(h5s.SchemaError, match=r"shard-00002-of-00004\.h5: its schema .* is not the dataset's"):
        h5s.open(out)
    with pytest.raises(h5s.SchemaError, match=r"shard-00002-of-00004\.h5"):
        h5s.concat([out])


def test_open_refuses_a_shard_of_another_build_of_the_same_size(built, tmp_path):
    """A shard of the same schema, size and count but other items (a second publisher's upload
    under the same name, a shard copied from another folder) is refused, not served as this one."""
    out, src, _ = built
    target = out / "shard-00002-of-00004.h5"
    with h5s.open(target) as f:
        ids = list(f.ids)
    with h5s.open(out / "shard-00001-of-00004.h5") as f:
        others = list(f.ids)
    files = [p for p in src.rglob("*.txt") if str(p.relative_to(src).with_suffix("")) in others]
    LabeledNums.create(tmp_path / "other.h5", files, root=src, n_workers=1, progress=False).close()
    shutil.copy(tmp_path / "other.h5", target)
    _edit(out, lambda m: m["shards"][2].update(bytes=target.stat().st_size))
    with h5s.open(target) as f:
        assert len(f) == len(ids) and list(f.ids) != ids  # same count, other items
    with pytest.raises(h5s.FormatError, match=r"shard-00002-of-00004\.h5: its ids run .* the manifest records"):
        h5s.open(out)
    problems = verify_sharded(out, deep=False).problems  # --quick reads no bytes: the ids tell
    assert any("shard-00002-of-00004.h5: its ids run" in p for p in problems), problems


def test_a_process_without_the_schema_class_opens_and_describes_shards(built):
    """The manifest's schema hash was computed from the class's schema: a process that has not
    imported the class (the CLI, a notebook) read a custom feature as a plain Feature, got another
    hash and refused every shard ("its schema ... is not the dataset's"): `h5store info` failed on
    any sharded dataset with a feature type of the user's own."""
    out, _, one = built
    code = ("import sys, h5store as h5s; ds = h5s.open(sys.argv[1]); "
            "assert 'tests.ingest_schemas' not in sys.modules; print(len(ds)); print(ds.ids[0])")
    got = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=ROOT)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [str(len(one)), one.ids[0]]
    info = subprocess.run([sys.executable, "-m", "h5store.cli", "info", str(out)], capture_output=True, text=True,
                          cwd=ROOT)
    assert info.returncode == 0 and "sharded: 4 shards" in info.stdout, info.stderr


def test_open_refuses_a_bad_manifest(built):
    out, _, _ = built
    good = (out / "index.json").read_text()
    cases = [
        (lambda m: m.update(version=99), r"manifest version 99"),
        (lambda m: m.update(format="other"), r"not an h5store sharded-dataset manifest"),
        (lambda m: m.update(shards=[]), r"lists no shards"),
        (lambda m: m["shards"][0].update(file="../x.h5"), r"not a file name in the manifest's folder"),
        (lambda m: m["shards"][0].pop("bytes"), r"lacks file, bytes or items"),
        (lambda m: m["shards"][0].update(items=m["shards"][0]["items"] + 1), r"shard-00000-of-00004\.h5: holds 10 items"),
    ]
    for edit, message in cases:
        (out / "index.json").write_text(good)
        _edit(out, edit)
        with pytest.raises(h5s.FormatError, match=message):
            h5s.open(out)
    (out / "index.json").write_text("{not json")
    with pytest.raises(h5s.FormatError, match=r"index\.json: not a readable"):
        h5s.open(out)


# ----------------------------------------------------------------------------- serving
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_serve_with_two_workers_equals_the_unsharded_file(built, context):
    pytest.importorskip("torch")
    out, _, one = built
    batch = dict(x=h5s.Item("nums"), y=h5s.Item("label"), id=h5s.Id())
    kw = dict(batch_size=4, shuffle=True, seed=3, num_workers=2, multiprocessing_context=context)
    with h5s.open(out) as ds:
        got = list(ds.serve(batch, **kw))
        want = list(one.serve(batch, **kw))
    assert len(got) == len(want) == -(-len(one) // 4)
    for a, b in zip(got, want):
        assert a["id"] == b["id"]  # bare ids: unique across shards
        np.testing.assert_array_equal(a["x"].numpy(), b["x"].numpy())
        np.testing.assert_array_equal(a["y"].numpy(), b["y"].numpy())


def test_iter_batches_windows_and_tf_equal_the_unsharded_file(built):
    out, _, one = built
    batch = dict(x=h5s.Window("nums", 2), n=h5s.Item("nums"), id=h5s.Id())
    with h5s.open(out) as ds:
        for epoch in (0, 1):
            a = list(ds.iter_batches(batch, batch_size=5, shuffle=True, seed=1, epoch=epoch))
            b = list(one.iter_batches(batch, batch_size=5, shuffle=True, seed=1, epoch=epoch))
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert list(x["id"]) == list(y["id"])
                np.testing.assert_array_equal(x["x"], y["x"])
                np.testing.assert_array_equal(x["n"], y["n"])
        assert ds.nums.read_many([5, 0, "spk_b/ütt-04", 5])[2].tolist() == one.nums["spk_b/ütt-04"].tolist()
    # concat takes the folder too: its shards join the other files.
    mf = h5s.concat([out, one.path])
    assert len(mf.files) == 4 + 1 and len(mf) == 2 * len(one)


def test_tf_dataset_over_shards_equals_the_unsharded_file(built):
    pytest.importorskip("tensorflow")
    out, _, one = built
    batch = dict(x=h5s.Item("nums"), y=h5s.Item("label"))
    with h5s.open(out) as ds:
        a = [{k: v.numpy() for k, v in b.items()} for b in ds.to_tf_dataset(batch, batch_size=6, shuffle=True, seed=2)]
    b = [{k: v.numpy() for k, v in b.items()} for b in one.to_tf_dataset(batch, batch_size=6, shuffle=True, seed=2)]
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["x"], y["x"])
        np.testing.assert_array_equal(x["y"], y["y"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_by_shard_gives_each_rank_whole_shards_with_equal_steps(unsharded, tmp_path, world_size, drop_last):
    src, one, _ = unsharded
    with LabeledNums.create(tmp_path / "ds", src, shard_size=7, n_workers=1, progress=False) as ds:
        sizes = ds.sizes().tolist()
        assert sizes == [7, 7, 7, 7, 2]  # unequal: the last shard is short
        shard_of = {i: k for k, f in enumerate(ds.files) for i in f.ids}
        per_rank, steps = [], []
        for rank in range(world_size):
            batches = list(ds.iter_batches(dict(id=h5s.Id()), batch_size=3, shuffle=True, seed=5, epoch=1,
                                           rank=rank, world_size=world_size, by_shard=True, drop_last=drop_last))
            ids = [i for b in batches for i in b["id"]]
            per_rank.append(ids)
            steps.append(len(batches))
            assert len({shard_of[i] for i in ids}) >= 1
        assert len(set(steps)) == 1, f"unequal steps per rank: {steps}"
        owners = [{shard_of[i] for i in ids} for ids in per_rank]
        for a in range(world_size):
            for b in range(a + 1, world_size):
                assert not owners[a] & owners[b], "a shard is read by two ranks"
        if not drop_last:
            assert set().union(*map(set, per_rank)) == set(one.ids)  # every item served
            assert set().union(*owners) == set(range(5))
        else:
            assert len({len(ids) for ids in per_rank}) == 1
        # The same shards each epoch (locality), a new order.
        again = list(ds.iter_batches(dict(id=h5s.Id()), batch_size=3, shuffle=True, seed=5, epoch=2,
                                     rank=0, world_size=world_size, by_shard=True, drop_last=drop_last))
        assert {shard_of[i] for b in again for i in b["id"]} == owners[0]
        # torch's loader: the same split.
        pytest.importorskip("torch")
        loader = ds.serve(dict(id=h5s.Id()), batch_size=3, shuffle=True, seed=5, rank=0, world_size=world_size,
                          by_shard=True, drop_last=drop_last)
        loader.batch_sampler.set_epoch(1)
        assert [i for b in loader for i in b["id"]] == per_rank[0]
    with pytest.raises(ValueError, match=r"5 non-empty shards \(of 5\) for 6 ranks"):
        with h5s.open(tmp_path / "ds") as ds:
            ds.iter_batches(dict(id=h5s.Id()), batch_size=3, rank=0, world_size=6, by_shard=True)


# ----------------------------------------------------------------------------- s3:// manifests
def test_an_s3_manifest_opens_its_shards_beside_it(built, tmp_path, monkeypatch):
    pytest.importorskip("moto")
    from tests.s3_server import S3Server

    out, _, one = built
    server = S3Server().start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        for p in sorted(out.iterdir()):
            server.put("h5store-shards", f"ds/{p.name}", str(p))
        for url in ("s3://h5store-shards/ds/index.json", "s3://h5store-shards/ds/"):
            with h5s.open(url, cache_dir=str(tmp_path / "cache")) as ds:
                assert ds.files[1].path == "s3://h5store-shards/ds/shard-00001-of-00004.h5"
                assert list(ds.ids) == list(one.ids)
                for i in one.ids:
                    np.testing.assert_array_equal(ds.nums[i], one.nums[i])
                    assert ds.label[i] == one.label[i]
                b = next(iter(ds.iter_batches(dict(x=h5s.Item("nums"), id=h5s.Id()), batch_size=len(one))))
                assert list(b["id"]) == list(one.ids)
        # A shard of another size, and a missing shard, are refused naming their URLs.
        server.put("h5store-shards", "cut/index.json", str(out / "index.json"))
        for p in sorted(out.glob("shard-*.h5")):
            if p.name != "shard-00003-of-00004.h5":
                server.put("h5store-shards", f"cut/{p.name}", str(p))
        with pytest.raises(FileNotFoundError, match=r"s3://h5store-shards/cut/shard-00003-of-00004\.h5: shard missing"):
            h5s.open("s3://h5store-shards/cut/index.json")
        server.put("h5store-shards", "cut/shard-00003-of-00004.h5", str(out / "shard-00000-of-00004.h5"))
        with pytest.raises(h5s.FormatError, match=r"cut/shard-00003-of-00004\.h5: \d+ bytes, the manifest records"):
            h5s.open("s3://h5store-shards/cut/")
    finally:
        server.stop()


# ----------------------------------------------------------------------------- the command line
def test_cli_creates_describes_and_verifies_shards(unsharded, tmp_path, capsys):
    from h5store.cli import main

    src, one, _ = unsharded
    out = tmp_path / "ds"
    assert main(["create", "tests.ingest_schemas:LabeledNums", str(out), str(src), "--shards", "3", "-j", "1",
                 "-q"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"{out}: ") and "failed" in said  # the bad source and the duplicate, reported
    with h5s.open(out) as ds:
        assert_same(ds, one)
    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "sharded: 3 shards" in info and "shard-00002-of-00003.h5" in info, info
    assert main(["verify", str(out / "index.json")]) == 0
    assert "3 shard(s) checked: OK" in capsys.readouterr().out
    # One flipped byte in a shard's items: the manifest's CRC-32 and the shard's own check name it.
    m = read_manifest(out)
    victim = out / m["shards"][1]["file"]
    import h5py

    with h5py.File(victim, "r") as h:  # the first byte of the nums rows
        d = h["nums/data"]
        offset = d.id.get_offset() if d.chunks is None else d.id.get_chunk_info(0).byte_offset
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x40
    victim.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    report = capsys.readouterr().out
    assert f"{victim}: its bytes' CRC-32 is not the manifest's" in report, report
    # A shard gone: named.
    victim.unlink()
    assert main(["verify", str(out)]) == 1
    assert f"{victim}: missing" in capsys.readouterr().out
