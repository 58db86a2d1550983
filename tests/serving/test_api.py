"""One way to serve, ids in batches, concat checked when it is made (issue 12, points 6 and 7).

Written the way a user would: ``f.serve`` / ``f.iter_batches`` / ``f.to_tf_dataset`` on a file
and on ``h5s.concat([...])``, with the same signature and defaults (PyTorch's DataLoader's:
``batch_size=1``, ``shuffle=False``, ``drop_last=False``), ``batch_size`` positional or keyword
everywhere, ``h5s.Id()`` in the batch dict; and every wrong call fails with its message.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.errors import H5StoreError, NotFound, SchemaError
from h5store.serving import CorruptRecordWarning
from tests.serving.conftest import N
from tests.serving.schemas import Other, Speech, make_speech

ENTRY_POINTS = ("serve", "iter_batches", "to_tf_dataset")


def _pos(b: dict) -> list[int]:
    v = b["n"]
    return [int(x) for x in (v.numpy() if hasattr(v, "numpy") else v)]


def _ids(b: dict) -> list[str]:
    v = b["id"]
    if hasattr(v, "numpy"):  # tf.string
        return [s.decode("utf-8") for s in v.numpy().tolist()]
    return list(v)


def _batches(source, how: str, batch, **kw):
    if how == "torch":
        return list(source.serve(batch, **kw))
    if how == "numpy":
        return list(source.iter_batches(batch, **kw))
    pytest.importorskip("tensorflow")
    return list(source.to_tf_dataset(batch, **kw))


# --------------------------------------------------------------------------- point 7: one signature
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_same_signature_and_defaults_on_file_and_concat(name, speech, shard_paths):
    both = h5s.concat(shard_paths)
    for method in (getattr(speech, name), getattr(both, name)):
        params = inspect.signature(method).parameters
        assert list(params)[:2] == ["batch", "batch_size"], (name, list(params))
        assert params["batch_size"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        want = dict(batch_size=1, shuffle=False, drop_last=False, seed=0, verify=True)
        got = {k: params[k].default for k in want}
        assert got == want, (name, got)
        for k in ("shuffle", "drop_last", "seed", "verify"):
            assert params[k].kind is inspect.Parameter.KEYWORD_ONLY, (name, k)
        assert method.__doc__ and "Examples" in method.__doc__


@pytest.mark.parametrize("how", ["torch", "numpy", "tf"])
def test_defaults_behave_like_a_dataloader(how, speech):
    # No shuffle, batches of one, in file order: what DataLoader(ds) gives.
    got = [p for b in _batches(speech, how, dict(n=h5s.Position())) for p in _pos(b)]
    assert got == list(range(N))
    lens = {len(_pos(b)) for b in _batches(speech, how, dict(n=h5s.Position()))}
    assert lens == {1}


@pytest.mark.parametrize("how", ["torch", "numpy", "tf"])
def test_batch_size_positional_or_keyword_everywhere(how, speech, shard_paths):
    both = h5s.concat(shard_paths)
    for source in (speech, both):
        call = {"torch": source.serve, "numpy": source.iter_batches, "tf": source.to_tf_dataset}[how]
        if how == "tf":
            pytest.importorskip("tensorflow")
        positional = [_pos(b) for b in call(dict(n=h5s.Position()), 8)]
        keyword = [_pos(b) for b in call(dict(n=h5s.Position()), batch_size=8)]
        assert positional == keyword
        assert [len(p) for p in positional][0] == 8
        shuffled = [p for b in call(dict(n=h5s.Position()), 8, shuffle=True, seed=3) for p in _pos(b)]
        assert sorted(shuffled) == list(range(len(source))) and shuffled != sorted(shuffled)


def test_the_three_paths_give_the_same_batches(speech, shard_paths):
    batch = dict(x=h5s.Window("mel", 4), n=h5s.Position(), id=h5s.Id())
    for source in (speech, h5s.concat(shard_paths)):
        kw = dict(batch_size=6, shuffle=True, seed=5)
        runs = [_batches(source, how, batch, **kw) for how in ("torch", "numpy", "tf")]
        for a, b in zip(runs[0], runs[1]):
            assert _pos(a) == _pos(b) and _ids(a) == _ids(b)
            np.testing.assert_array_equal(a["x"].numpy(), b["x"])
        for a, c in zip(runs[0], runs[2]):
            assert _pos(a) == _pos(c) and _ids(a) == _ids(c)
            np.testing.assert_array_equal(a["x"].numpy(), c["x"].numpy())


def test_interleave_has_the_same_defaults(shard_paths):
    pytest.importorskip("tensorflow")
    params = inspect.signature(h5s.interleave).parameters
    assert list(params)[:3] == ["files", "batch", "batch_size"]
    assert {k: params[k].default for k in ("batch_size", "shuffle", "drop_last", "seed", "verify")} == dict(
        batch_size=1, shuffle=False, drop_last=False, seed=0, verify=True)
    got = [p for b in h5s.interleave(shard_paths, dict(n=h5s.Position()), 4, cycle_length=1) for p in _pos(b)]
    assert got == list(range(7 + 5 + 11))  # file by file, in order: nothing shuffled (positions across the files)
    ids = [i.decode() for b in h5s.interleave(shard_paths, dict(id=h5s.Id()), 4, shuffle=True, cycle_length=2)
           for i in b["id"].numpy().tolist()]
    assert sorted(ids) == sorted(f"{p}::{i}" for p in shard_paths for i in Speech(p).ids)  # names the file


# --------------------------------------------------------------------------- point 7: wrong calls
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_wrong_calls_fail_with_one_clear_message(name, speech, speech_path):
    if name == "to_tf_dataset":
        pytest.importorskip("tensorflow")
    call = getattr(speech, name)
    with pytest.raises(NotFound, match=r"no feature 'nope'.*features: \[.*'mel'") as e:
        call(dict(x=h5s.Item("nope")), batch_size=4)
    assert str(speech_path) in str(e.value)
    with pytest.raises(SchemaError, match=r"batch\['x'\] must be a getter.*h5s.Item\('mel'\)"):
        call(dict(x="mel"), batch_size=4)
    with pytest.raises(SchemaError, match=r"batch must be a non-empty dict of key -> getter.*dict\(x=h5s.Item"):
        call(h5s.Item("mel"), batch_size=4)
    for bad in (0, -3, 2.5, True, "32"):
        with pytest.raises(H5StoreError, match=rf"{name}: batch_size must be an int > 0.*, got {bad!r}") as e:
            call(dict(x=h5s.Item("mel")), bad)
        assert isinstance(e.value, (TypeError, ValueError))
    with pytest.raises(TypeError, match=rf"{name}\(\): unknown keyword 'shufle'; did you mean 'shuffle'"):
        call(dict(x=h5s.Item("mel")), batch_size=4, shufle=True)
    with pytest.raises(TypeError, match=r"takes 2 positional|positional argument"):
        call(dict(x=h5s.Item("mel")), 4, True)


def test_workers_and_threads_are_named_per_framework(speech):
    with pytest.raises(TypeError, match=r"iter_batches\(\) reads with threads: threads=4"):
        speech.iter_batches(dict(x=h5s.Item("mel")), batch_size=4, num_workers=4)
    pytest.importorskip("tensorflow")
    with pytest.raises(TypeError, match=r"to_tf_dataset\(\) reads with tf.data threads: num_parallel_calls=4"):
        speech.to_tf_dataset(dict(x=h5s.Item("mel")), batch_size=4, num_workers=4)
    with pytest.raises(TypeError, match=r"serve\(\) reads with worker processes: num_workers=4"):
        speech.serve(dict(x=h5s.Item("mel")), batch_size=4, threads=4)


def test_one_documented_spelling():
    assert not hasattr(h5s, "iter_batches")  # f.iter_batches(...) is the spelling
    assert "iter_batches" not in h5s.__all__
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = doc.split("## One way to serve", 1)[1].split("\n## ", 1)[0]
    for word in ("f.serve(batch, batch_size=1", "f.iter_batches(batch, batch_size=1",
                 "f.to_tf_dataset(batch, batch_size=1", "h5s.interleave(files, batch, batch_size=1",
                 "| `shuffle` |", "| `drop_last` |", "| `seed` |", "| `verify` |"):
        assert word in table, word


# --------------------------------------------------------------------------- point 6: ids in batches
@pytest.mark.parametrize("how", ["torch", "numpy", "tf"])
def test_id_getter_gives_the_ids_of_the_batch(how, speech):
    batches = _batches(speech, how, dict(n=h5s.Position(), id=h5s.Id()), batch_size=7, shuffle=True, seed=1)
    seen = []
    for b in batches:
        ids = _ids(b)
        assert all(isinstance(i, str) for i in ids) and len(ids) == len(_pos(b))
        assert ids == [speech.ids[p] for p in _pos(b)]
        seen += ids
    assert sorted(seen) == sorted(speech.ids)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_id_in_dataloader_workers(method, speech, shard_paths):
    loader = speech.serve(dict(n=h5s.Position(), id=h5s.Id()), batch_size=8, shuffle=True, num_workers=2,
                          multiprocessing_context=method)
    got = [(p, i) for b in loader for p, i in zip(_pos(b), _ids(b))]
    assert sorted(got) == [(p, speech.ids[p]) for p in range(N)]
    both = h5s.concat(shard_paths)
    want = [f"{p}::{i}" for p in shard_paths for i in Speech(p).ids]
    loader = both.serve(dict(n=h5s.Position(), id=h5s.Id()), 4, shuffle=True, num_workers=2,
                        multiprocessing_context=method)
    got = [(p, i) for b in loader for p, i in zip(_pos(b), _ids(b))]
    assert sorted(got) == list(enumerate(want))


def test_id_over_concat_names_the_file(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    make_speech(a, 6, seed=1)
    make_speech(b, 4, seed=2)  # the same ids id00000..id00003 as in a
    both = h5s.concat([str(a), b])  # paths are accepted
    batch = dict(x=h5s.Item("mel"), id=h5s.Id(), bare=h5s.Id(file=False))
    got = {}
    for bt in both.iter_batches(batch, batch_size=4, shuffle=True):
        for j, (qid, bare) in enumerate(zip(bt["id"], bt["bare"])):
            path, sep, i = qid.rpartition("::")
            assert sep and i == bare
            got[qid] = bt["x"][j, : bt["x_lengths"][j]]
    assert len(got) == 10  # every (file, id) once: nothing ambiguous
    for path in (a, b):
        f = Speech(path)
        for i in f.ids:
            np.testing.assert_array_equal(got[f"{path}::{i}"], f.mel[i])
    one = next(iter(Speech(a).iter_batches(dict(id=h5s.Id(file=True)), batch_size=2)))
    assert one["id"] == [f"{a}::id00000", f"{a}::id00001"]
    with pytest.raises(ValueError, match=r"Id: file must be True, False or None, got 'yes'"):
        h5s.Id(file="yes")


def test_ids_stay_aligned_when_damaged_items_are_skipped(tmp_path):
    from tests.test_serving_crc import flip

    path = tmp_path / "damaged.h5"
    make_speech(path, 20, seed=0)
    clean = Speech(path)
    want = {i: clean.mel[i] for i in clean.ids}
    clean.close()
    flip(path, "mel", 5)
    f = Speech(path)
    with pytest.warns(CorruptRecordWarning, match="id00005"):
        batches = list(f.iter_batches(dict(x=h5s.Item("mel"), id=h5s.Id()), batch_size=4, verify="skip"))
    seen = []
    for b in batches:
        assert len(b["id"]) == len(b["x"])
        for j, i in enumerate(b["id"]):
            np.testing.assert_array_equal(b["x"][j, : b["x_lengths"][j]], want[i])
            seen.append(i)
    assert sorted(seen) == sorted(set(want) - {"id00005"})


# --------------------------------------------------------------------------- point 6: concat checks at build
def test_concat_refuses_incompatible_files_when_made(tmp_path, speech_path):
    class Fewer(h5s.TypedFile):
        mel = h5s.Array(dtype="float32", shape=(None, 8))

    fewer, other = tmp_path / "fewer.h5", tmp_path / "other.h5"
    with Fewer(fewer, mode="w") as w:
        w.add("a", dict(mel=np.zeros((3, 8), "float32")))
    with Other(other, mode="w") as w:
        w.add("a", dict(mel=np.zeros((3, 4), "float32")))
    with pytest.raises(SchemaError) as e:
        h5s.concat([fewer, other])  # at once, not at the first batch
    text = str(e.value)
    assert str(other) in text and "'mel'" in text and "shape" in text and "(None, 8)" in text, text
    with pytest.raises(SchemaError, match=rf"{fewer} lacks the feature 'label' that {speech_path} has"):
        h5s.concat([Speech(speech_path), Fewer(fewer)])

    class TwoKinds(h5s.TypedFile):
        kind = h5s.DirLabel(classes=("cat", "dog"))

    class ThreeKinds(h5s.TypedFile):
        kind = h5s.DirLabel(classes=("cat", "dog", "eel"))

    paths = [tmp_path / "two.h5", tmp_path / "three.h5"]
    for cls, p in zip((TwoKinds, ThreeKinds), paths):
        with cls(p, mode="w") as w:
            w.add("x", dict(kind=0))
    with pytest.raises(SchemaError, match=r"'kind'.*classes.*\('cat', 'dog'\).*\('cat', 'dog', 'eel'\)"):
        h5s.concat(paths)
    with pytest.raises(FileNotFoundError, match=r"missing.h5: no such file"):
        h5s.concat([speech_path, tmp_path / "missing.h5"])
    with pytest.raises(TypeError, match="concat takes paths or h5store files"):
        h5s.concat([speech_path, 3])


def test_concat_allows_storage_differences(tmp_path):
    class Plain(h5s.TypedFile):
        mel = h5s.Array(dtype="float32", shape=(None, 8))

    class Zipped(h5s.TypedFile):
        mel = h5s.Array(dtype="float32", shape=(None, 8), compression="gzip", chunk_rows=16)

    paths = [tmp_path / "plain.h5", tmp_path / "zipped.h5"]
    for cls, p in zip((Plain, Zipped), paths):
        with cls(p, mode="w") as w:
            w.extend([(f"u{i}", dict(mel=np.full((3 + i, 8), i, "float32"))) for i in range(5)])
    both = h5s.concat(paths)  # how bytes are stored may differ
    b = next(iter(both.iter_batches(dict(x=h5s.Item("mel"), id=h5s.Id()), 10)))
    assert [i.rpartition("::")[2] for i in b["id"]] == [f"u{i}" for i in range(5)] * 2
    assert b["x_lengths"].tolist() == [3, 4, 5, 6, 7] * 2


def test_by_shard_is_refused_where_serve_makes_no_batch_sampler(shard_paths):
    torch = pytest.importorskip("torch")
    shards = h5s.concat(shard_paths)
    with pytest.raises(ValueError, match=r"by_shard= make their own batch sampler; do not pass sampler"):
        shards.serve(dict(x=h5s.Item("mel")), batch_size=4, by_shard=True,
                     sampler=torch.utils.data.SequentialSampler(range(len(shards))))
    with pytest.raises(ValueError, match=r"by_shard= make their own batch sampler; do not pass sampler"):
        shards.serve(dict(x=h5s.Item("mel")), batch_size=None, by_shard=True,
                     batch_sampler=torch.utils.data.BatchSampler(range(len(shards)), 4, False))
    with pytest.raises(ValueError, match=r"by_shard= need a batch_size"):
        shards.serve(dict(x=h5s.Item("mel")), batch_size=None, by_shard=True)
    assert len(shards.serve(dict(x=h5s.Item("mel")), batch_size=4, by_shard=True)) == 6  # 23 items, one rank
