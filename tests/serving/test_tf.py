"""tf.data serving with real TensorFlow: the same batches as the torch path, ragged values, concat,
and ``interleave`` over many files read by several threads, each file opened once per pass."""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import torch

import h5store as h5s
from h5store.errors import SchemaError
from h5store.serving import FileDataset
from h5store.serving.tf import output_signature
from tests.serving.conftest import N, reference
from tests.serving.schemas import Speech, make_speech, mel_of

SPEC = dict(x=h5s.Item("mel"), w=h5s.Window("mel", 5), m=h5s.Window("mag", 5), y=h5s.Label("label"),
            s=h5s.Item("score"), t=h5s.Item("text"), n=h5s.Position())


def as_numpy(batch: dict[str, Any]) -> dict[str, Any]:
    """tf / torch / numpy batch -> numpy arrays, text as lists of str."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, tf.Tensor) and v.dtype == tf.string:
            out[k] = [s.decode("utf-8") for s in v.numpy().tolist()]
        elif isinstance(v, (tf.Tensor, torch.Tensor)):
            out[k] = v.numpy()
        else:
            out[k] = v
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, list):
            assert got[k] == v, k
        else:
            np.testing.assert_array_equal(got[k], v, err_msg=k)
            assert got[k].dtype == v.dtype, k


def test_tf_numpy_and_torch_serve_the_same_batches(speech: Speech) -> None:
    loader = speech.serve(SPEC, batch_size=6, shuffle=True, seed=3, num_workers=0)
    ds = speech.to_tf_dataset(SPEC, 6, shuffle=True, seed=3, num_parallel_calls=2)
    for epoch in (0, 1):  # each iteration is the next epoch, on both sides
        torch_batches = [as_numpy(b) for b in loader]
        tf_batches = [as_numpy(b) for b in ds]
        numpy_batches = [as_numpy(b) for b in speech.iter_batches(SPEC, 6, shuffle=True, seed=3, epoch=epoch)]
        assert len(tf_batches) == len(torch_batches) == len(numpy_batches) == 7
        for a, b, c in zip(tf_batches, torch_batches, numpy_batches):
            assert_same(a, b)
            assert_same(c, b)
        assert sorted(i for b in tf_batches for i in b["n"].tolist()) == list(range(N))
    first = next(iter(speech.to_tf_dataset(SPEC, 6, shuffle=True, seed=3, epoch=1)))
    assert_same(as_numpy(first), tf_batches[0])  # epoch=1 starts at the second epoch


def test_values_match_the_file(speech: Speech) -> None:
    mel, text = reference(speech, "mel"), reference(speech, "text")
    for b in speech.to_tf_dataset(dict(x=h5s.Item("mel"), t=h5s.Item("text"), n=h5s.Position()), 7, seed=1):
        for j, p in enumerate(b["n"].numpy().tolist()):
            n = int(b["x_lengths"][j])
            assert n == len(mel[p])
            np.testing.assert_array_equal(b["x"][j, :n].numpy(), mel[p])
            assert not b["x"][j, n:].numpy().any()
            assert b["t"][j].numpy().decode("utf-8") == text[p] == f"item {p} é"


def test_output_signature_is_static(speech: Speech) -> None:
    ds = speech.to_tf_dataset(dict(SPEC, f=h5s.Frames("mel", 3)), 8, drop_last=True, mask=True)
    spec = ds.element_spec
    assert spec["x"] == tf.TensorSpec((8, None, 8), tf.float32)
    assert spec["x_lengths"] == tf.TensorSpec((8,), tf.int64)
    assert spec["x_mask"] == tf.TensorSpec((8, None), tf.bool)
    assert spec["w"] == tf.TensorSpec((8, 5, 8), tf.float32) and spec["w_mask"] == tf.TensorSpec((8, 5), tf.bool)
    assert spec["m"] == tf.TensorSpec((8, 5, 3), tf.float32)
    assert spec["y"] == tf.TensorSpec((8,), tf.int64) and spec["s"] == tf.TensorSpec((8,), tf.float32)
    assert spec["t"] == tf.TensorSpec((8,), tf.string) and spec["n"] == tf.TensorSpec((8,), tf.int64)
    assert spec["f"] == tf.TensorSpec((8, 3, 8), tf.float32)
    n_batches = len(FileDataset(speech, dict(f=h5s.Frames("mel", 3)))) // 8
    assert int(ds.cardinality()) == n_batches == sum(1 for _ in ds)
    loose = speech.to_tf_dataset(dict(x=h5s.Item("mel")), 8)
    assert loose.element_spec["x"].shape.as_list() == [None, None, 8]
    assert int(loose.cardinality()) == -(-N // 8)
    assert output_signature(FileDataset(speech, dict(y=h5s.Label("label")))) == {"y": tf.TensorSpec((None,), tf.int64)}


def test_ragged_items(speech: Speech) -> None:
    mel = reference(speech, "mel")
    ds = speech.to_tf_dataset(dict(x=h5s.Item("mel"), w=h5s.Window("mel", 4), n=h5s.Position()), 6, ragged=True)
    assert isinstance(ds.element_spec["x"], tf.RaggedTensorSpec)
    assert ds.element_spec["x"].shape.as_list() == [None, None, 8]
    assert ds.element_spec["w"] == tf.TensorSpec((None, 4, 8), tf.float32)  # windows stay dense
    seen = 0
    for b in ds:
        assert "x_lengths" not in b and isinstance(b["x"], tf.RaggedTensor)
        for j, p in enumerate(b["n"].numpy().tolist()):
            np.testing.assert_array_equal(b["x"][j].numpy(), mel[p])
            seen += 1
    assert seen == N


def test_concat_of_files(shard_paths: list[Path]) -> None:
    files = [Speech(p) for p in shard_paths]
    both = h5s.concat(files)
    want = [m for f in files for m in reference(f, "mel")]
    seen = []
    for b in both.to_tf_dataset(dict(x=h5s.Item("mel"), n=h5s.Position()), 5, num_parallel_calls=3):
        for j, p in enumerate(b["n"].numpy().tolist()):
            seen.append(p)
            np.testing.assert_array_equal(b["x"][j, : int(b["x_lengths"][j])].numpy(), want[p])
    assert sorted(seen) == list(range(23))
    torch_first = as_numpy(next(iter(both.serve(dict(x=h5s.Item("mel")), batch_size=5, shuffle=True))))
    assert_same(as_numpy(next(iter(both.to_tf_dataset(dict(x=h5s.Item("mel")), 5, shuffle=True)))), torch_first)
    for f in files:
        f.close()


def test_compressed_feature_read_by_parallel_calls(lzf_path: Path) -> None:
    from tests.serving.schemas import SpeechLZF

    f = SpeechLZF(lzf_path)
    mel = reference(f, "mel")
    ds = f.to_tf_dataset(dict(x=h5s.Item("mel"), n=h5s.Position()), 3, num_parallel_calls=4, deterministic=False)
    seen = []
    for b in ds:
        for j, p in enumerate(b["n"].numpy().tolist()):
            seen.append(p)
            np.testing.assert_array_equal(b["x"][j, : int(b["x_lengths"][j])].numpy(), mel[p])
    assert sorted(seen) == list(range(len(mel)))
    f.close()


def test_buckets_and_ranks(speech: Speech) -> None:
    spec = dict(x=h5s.Item("mel"), n=h5s.Position())
    bucketed = speech.to_tf_dataset(spec, 4, bucket=True, seed=2)
    batches = list(bucketed)
    assert int(bucketed.cardinality()) == len(batches)
    assert sorted(p for b in batches for p in b["n"].numpy().tolist()) == list(range(N))
    padding = sum(int(b["x"].shape[1]) * len(b["n"]) - int(b["x_lengths"].numpy().sum()) for b in batches)
    loose = sum(int(b["x"].shape[1]) * len(b["n"]) - int(b["x_lengths"].numpy().sum())
                for b in speech.to_tf_dataset(spec, 4, seed=2))
    assert padding < loose  # similar lengths share a batch
    shares = [[p for b in speech.to_tf_dataset(spec, 4, rank=r, world_size=2) for p in b["n"].numpy().tolist()]
              for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == N // 2 and sorted(shares[0] + shares[1]) == list(range(N))


def test_shared_params_reach_the_reads(speech: Speech) -> None:
    params = h5s.serving.SharedParams(dict(crop=3))
    ds_tf = speech.to_tf_dataset(dict(x=h5s.Window("mel", "crop")), 4, params=params, prefetch=None,
                                 num_parallel_calls=1)
    assert ds_tf.element_spec["x"].shape.as_list() == [None, None, 8]  # a parameter: not static
    assert {int(b["x"].shape[1]) for b in ds_tf} == {3}
    params.crop = 6  # between epochs: the next iteration's reads see it
    assert {int(b["x"].shape[1]) for b in ds_tf} == {6}


class Untyped(h5s.Getter):
    """A getter that returns floats but says int (a wrong signature)."""

    features = ()

    def fetch(self, files: Any, request: Any) -> np.ndarray:
        return np.zeros(len(request), "float64")

    def signature(self, files: Any) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype("int64"), ()


class Objects(h5s.Getter):
    features = ()

    def fetch(self, files: Any, request: Any) -> list[Any]:
        return [{"a": 1}] * len(request)

    def signature(self, files: Any) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype(object), ()


def test_refuses_what_tf_cannot_carry(speech: Speech) -> None:
    with pytest.raises(SchemaError, match=re.escape("signature() says int64")):
        speech.to_tf_dataset(dict(u=Untyped()), 4)
    with pytest.raises(SchemaError, match="tf.data carries arrays and str"):
        speech.to_tf_dataset(dict(o=Objects()), 4)
    with pytest.raises(ValueError, match="no example"):
        speech.to_tf_dataset(dict(x=h5s.Item("mel")), 4, items=[])
    with pytest.raises(ValueError, match="batch_size"):
        speech.to_tf_dataset(dict(x=h5s.Item("mel")), 0)


# --------------------------------------------------------------------------- interleave
OPENS: Counter[str] = Counter()
CLOSES: Counter[str] = Counter()
LIVE: dict[str, int] = {"now": 0, "max": 0}
_LOCK = threading.Lock()


class Counted(Speech):
    """Speech that counts the times each file is really opened and closed (copies keep the class)."""

    def _ensure_open(self) -> None:
        opening = not (self._pid == os.getpid() and self._handle.is_open)
        super()._ensure_open()
        if opening:
            with _LOCK:
                OPENS[Path(self.path).name] += 1
                LIVE["now"] += 1
                LIVE["max"] = max(LIVE["max"], LIVE["now"])

    def close(self) -> None:
        was_open = self._pid == os.getpid() and self._handle.is_open
        super().close()
        if was_open:
            with _LOCK:
                CLOSES[Path(self.path).name] += 1
                LIVE["now"] -= 1


@pytest.fixture(scope="module")
def eight_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("eight")
    paths = []
    for k in range(8):
        p = d / f"part{k}.h5"
        make_speech(p, 4 + 2 * k, seed=100 + k)  # 4..18 items: files end at different times
        paths.append(p)
    return paths


def fds_on(paths: list[Path]) -> int:
    names = {str(p) for p in paths}
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in names
        except OSError:
            pass
    return n


def test_interleave_every_item_once_each_file_opened_once_per_pass(eight_files: list[Path]) -> None:
    files = [Counted(p) for p in eight_files]
    for f in files:
        f.close()  # what interleave keeps is each file's recipe, not its handle
    sizes = [4 + 2 * k for k in range(8)]
    spec = dict(x=h5s.Item("mel"), n=h5s.Position(), t=h5s.Item("text"))
    ds = h5s.interleave(files, spec, batch_size=3, shuffle=True, cycle_length=3, num_parallel_calls=3, file_key="file",
                        seed=5, mix="batches")
    assert ds.element_spec["file"] == tf.TensorSpec((None,), tf.int64)
    OPENS.clear()
    CLOSES.clear()
    LIVE.update(now=0, max=0)
    orders = []
    for passes in (1, 2):
        seen: list[tuple[int, int]] = []
        for b in ds:
            ks = b["file"].numpy().tolist()
            assert len(set(ks)) == 1  # a batch holds items of one file
            for j, (k, p) in enumerate(zip(ks, b["n"].numpy().tolist())):
                seen.append((k, p))
                n = int(b["x_lengths"][j])
                np.testing.assert_array_equal(b["x"][j, :n].numpy(), mel_of(100 + k, p, n))
                assert b["t"][j].numpy().decode() == f"item {p} é"
        assert sorted(seen) == [(k, p) for k in range(8) for p in range(sizes[k])]  # each item exactly once
        assert OPENS == {p.name: passes for p in eight_files}  # each file opened once per pass
        assert CLOSES == OPENS and LIVE["now"] == 0  # ... and closed at the end of it
        assert fds_on(eight_files) == 0  # no descriptor left behind
        orders.append(seen)
    assert orders[0] != orders[1]  # the second pass is the next epoch: reshuffled
    assert LIVE["max"] >= 2  # files were read concurrently (tf.data also opens a few ahead of the cycle)
    # A loop that stops early leaves its cycle's files open until the next iteration starts.
    one = h5s.interleave(files, spec, batch_size=1, cycle_length=3, num_parallel_calls=3, prefetch=None, mix="batches")
    for _ in one.take(2):
        pass
    assert LIVE["now"] > 0
    assert sum(len(b["n"]) for b in one) == sum(sizes)
    assert LIVE["now"] == 0 and CLOSES == OPENS and fds_on(eight_files) == 0


def test_interleave_paths_deterministic_and_ragged(eight_files: list[Path]) -> None:
    spec = dict(x=h5s.Item("mel"), n=h5s.Position())
    paths = [str(p) for p in eight_files]
    a = h5s.interleave(paths, spec, batch_size=4, cycle_length=3, num_parallel_calls=3, file_key="k", seed=1)
    b = h5s.interleave(paths, spec, batch_size=4, cycle_length=3, num_parallel_calls=1, file_key="k", seed=1)
    got_a = [as_numpy(x) for x in a]
    got_b = [as_numpy(x) for x in b]
    assert len(got_a) == len(got_b)
    for x, y in zip(got_a, got_b):
        assert_same(x, y)
    loose = h5s.interleave(paths, spec, batch_size=4, cycle_length=3, num_parallel_calls=3, deterministic=False,
                           shuffle=False, ragged=True, file_key="k", drop_last=True, mix="batches")
    assert loose.element_spec["x"].shape.as_list() == [4, None, 8]
    seen = Counter()
    for x in loose:
        assert isinstance(x["x"], tf.RaggedTensor)
        seen.update(x["k"].numpy().tolist())
    assert seen == {k: (4 + 2 * k) // 4 * 4 for k in range(8)}
    with pytest.raises(SchemaError, match="already a key"):
        h5s.interleave(paths, spec, batch_size=4, file_key="n")
    with pytest.raises(FileNotFoundError):
        h5s.interleave([*paths, paths[0] + ".missing"], spec, batch_size=4)


# --------------------------------------------------------------------------- docs
def test_doc_blocks_run() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "tf_numpy.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 4
    ns: dict[str, Any] = {"__name__": __name__}
    for block in blocks:
        exec(compile(block, str(doc), "exec"), ns)
    # The iterators' reader threads end with them (the chunk decoding pool lives per process).
    assert not [t for t in threading.enumerate() if t.name.startswith("h5store-batches")]
