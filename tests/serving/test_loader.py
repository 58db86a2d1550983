"""serve() with real DataLoader worker processes: every value compared with a single-process read."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import h5store as h5s
from h5store.serving import FileDataset, pad_collate
from tests.serving.conftest import N, reference
from tests.serving.schemas import ReaderKind, Speech, SpeechDS


def _same(got: Any, want: Any, key: str) -> None:
    if isinstance(got, torch.Tensor):
        np.testing.assert_array_equal(got.numpy(), want, err_msg=key)
        assert got.numpy().dtype == want.dtype, key
    else:
        assert got == want, key


BATCH = dict(x=h5s.Item("mel"), w=h5s.Window("mel", "crop"), m=h5s.Window("mag", "crop"), y=h5s.Label("label"),
             t=h5s.Item("text"), ex=h5s.Position(of="example"), kind=ReaderKind("mel"))


@pytest.mark.parametrize(("ctx", "in_memory"), [("fork", False), ("spawn", True), ("forkserver", False)])
def test_workers_serve_every_value(speech_path: Path, tmp_path: Path, ctx: str, in_memory: bool) -> None:
    path = tmp_path / "speech.h5"
    shutil.copy(speech_path, path)
    writer = Speech(path, mode="a")  # the training process logs into the file it serves
    writer.logs.add("run-0", dict(loss=np.ones(3, "float32")))
    writer.flush()
    f = Speech(path)
    loader = f.serve(BATCH, params=dict(crop=5), seed=3, batch_size=6, shuffle=True, num_workers=2,
                     persistent_workers=True, multiprocessing_context=ctx, in_memory=in_memory)
    ref = FileDataset(Speech(path), BATCH, params=dict(crop=5), seed=3)
    kind = 2 if in_memory else 0  # shared memory, or os.preadv on a read-only handle
    for epoch, crop in ((0, 5), (1, 9)):
        seen: list[int] = []
        for b in loader:
            idx = b["ex"].numpy()
            seen += idx.tolist()
            assert b["w"].shape[1:] == (crop, 8) and b["m"].shape[1:] == (crop, 3)
            want = ref.fetch(idx, epoch=epoch)
            want["kind"][:] = kind
            assert b.keys() == want.keys()
            for key in b:
                _same(b[key], want[key], key)
        assert sorted(seen) == list(range(N))
        # Between epochs: a new crop for every worker, and more logs from the writer.
        loader.dataset.params.crop = 9
        ref.params.crop = 9
        writer.logs.add(f"run-{epoch + 1}", dict(loss=np.ones(2, "float32")))
        writer.flush()
    writer.close()
    assert len(h5s.open(path).logs) == 3


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_typed_file_as_torch_dataset(speech_path: Path, ctx: str) -> None:
    ds = SpeechDS(speech_path)
    mel = reference(ds, "mel")
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, collate_fn=pad_collate,
                        multiprocessing_context=ctx)
    seen = []
    for b in loader:
        for j, i in enumerate(b["pos"].tolist()):
            seen.append(i)
            np.testing.assert_array_equal(b["mel"][j, : len(mel[i])].numpy(), mel[i])
            assert b["mel_lengths"][j] == len(mel[i]) and b["label"][j] == i % 5
    assert sorted(seen) == list(range(N))
    ds.close()


def test_resume_mid_epoch(speech: Speech) -> None:
    def make() -> Any:
        return speech.serve(dict(ex=h5s.Position(of="example"), w=h5s.Window("mel", 4)), batch_size=4, shuffle=True,
                            seed=1, num_workers=2, multiprocessing_context="fork")

    loader = make()
    full = [b for b in loader]  # epoch 0
    loader.sampler.set_epoch(0)
    it = iter(loader)
    got = [next(it) for _ in range(3)]  # the workers have prefetched more than that
    state = loader.sampler.state_dict()
    del it
    assert state["epoch"] == 0 and state["batches"] == 3
    resumed = make()
    resumed.batch_sampler.load_state_dict(state)
    rest = list(resumed)
    assert len(got) + len(rest) == len(full) == len(loader)
    for a, b in zip(got + rest, full):
        assert torch.equal(a["ex"], b["ex"]) and torch.equal(a["w"], b["w"])
    assert loader.state_dict() == state and loader.batch_sampler is loader.sampler


def test_concat_served_by_workers(shard_paths: list[Path]) -> None:
    files = [Speech(p) for p in shard_paths]
    truth = [f.mel[i] for f in files for i in range(len(f))]
    ctx = mp.get_context("fork")
    calls = ctx.Value("i", 0)

    def init(worker_id: int) -> None:  # the user's worker_init_fn still runs
        with calls.get_lock():
            calls.value += 1

    loader = h5s.concat(files).serve(dict(x=h5s.Item("mel"), pos=h5s.Position()), batch_size=5, shuffle=True,
                                     num_workers=2, multiprocessing_context=ctx, worker_init_fn=init)
    seen = []
    for b in loader:
        for j, p in enumerate(b["pos"].tolist()):
            seen.append(p)
            np.testing.assert_array_equal(b["x"][j, : len(truth[p])].numpy(), truth[p])
    assert sorted(seen) == list(range(len(truth)))
    assert calls.value == 2


def test_distributed_ranks_share_each_epoch(speech: Speech) -> None:
    loaders = [speech.serve(dict(ex=h5s.Position(of="example")), batch_size=4, shuffle=True, distributed=True,
                            rank=r, world_size=2) for r in range(2)]
    epochs = []
    for epoch in (0, 1):
        for lo in loaders:
            lo.sampler.set_epoch(epoch)
        per_rank = [[i for b in lo for i in b["ex"].tolist()] for lo in loaders]
        assert len(per_rank[0]) == len(per_rank[1]) == N // 2
        assert sorted(per_rank[0] + per_rank[1]) == list(range(N))
        epochs.append(per_rank)
    assert epochs[0] != epochs[1]
    with pytest.raises(RuntimeError, match="not initialised"):
        speech.serve(dict(ex=h5s.Position()), batch_size=4, distributed=True)


def test_bucketed_batches_pad_less(speech: Speech) -> None:
    def padding(loader: Any) -> float:
        real = total = 0
        for b in loader:
            real += int(b["x_lengths"].sum())
            total += b["x"].shape[0] * b["x"].shape[1]
        return 1 - real / total

    plain = speech.serve(dict(x=h5s.Item("mel")), batch_size=4, shuffle=True)
    bucketed = speech.serve(dict(x=h5s.Item("mel")), batch_size=4, shuffle=True, bucket=True)
    assert sorted(i for b in bucketed.batch_sampler for i in b) == list(range(N))
    assert padding(bucketed) < 0.5 * padding(plain)


def test_loader_options(speech: Speech) -> None:
    raw = speech.serve(dict(x=h5s.Item("mel"), y=h5s.Label("label")), batch_size=3, collate_fn=lambda b: b)
    b = next(iter(raw))
    assert isinstance(b["x"], np.ndarray) and b["y"].dtype == np.int64  # collate_fn gets numpy, collated
    masked = speech.serve(dict(x=h5s.Item("mel")), batch_size=3, mask=True, drop_last=True)
    b = next(iter(masked))
    assert b["x_mask"].dtype == torch.bool and torch.equal(b["x_mask"].sum(1), b["x_lengths"])
    assert len(masked) == N // 3
    single = speech.serve(dict(x=h5s.Item("mel")), batch_size=None)
    assert next(iter(single))["x"].ndim == 2
    with pytest.raises(ValueError, match="bucket"):
        speech.serve(dict(x=h5s.Item("mel")), batch_size=None, bucket=True)
    own = speech.serve(dict(x=h5s.Item("mel")), sampler=range(5), batch_size=2)
    assert [len(b["x"]) for b in own] == [2, 2, 1]
    with pytest.raises(ValueError, match="sampler"):
        speech.serve(dict(x=h5s.Item("mel")), sampler=range(5), distributed=True, rank=0, world_size=1)


def test_file_dataset_in_a_plain_dataloader(speech: Speech) -> None:
    ds = FileDataset(speech, dict(x=h5s.Item("mel"), pos=h5s.Position()))
    mel = reference(speech, "mel")
    loader = DataLoader(ds, batch_size=6, shuffle=True, num_workers=2, collate_fn=ds.collate,
                        multiprocessing_context="fork")
    seen = []
    for b in loader:
        for j, p in enumerate(b["pos"].tolist()):
            seen.append(p)
            np.testing.assert_array_equal(b["x"][j, : b["x_lengths"][j]].numpy(), mel[p])
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("many", [False, True])
def test_a_file_moved_to_the_path_between_epochs_is_refused(speech_path: Path, tmp_path: Path, many: bool) -> None:
    # Non-persistent workers reopen the path every epoch; the tables (and the shared
    # "checked" flags) are the old file's: another file there must raise, not serve its
    # bytes through the old index.
    from tests.serving.schemas import make_speech

    path = tmp_path / "speech.h5"
    shutil.copy(speech_path, path)
    paths = [path]
    if many:  # a concat: the second of two files is replaced
        paths.insert(0, tmp_path / "first.h5")
        make_speech(paths[0], 6, seed=4)
    make_speech(tmp_path / "other.h5", N + 5, seed=7)  # same schema, more items
    src = Speech(path) if not many else h5s.concat(paths)
    loader = src.serve(dict(x=h5s.Item("mel"), y=h5s.Label("label")), batch_size=8, num_workers=2,
                       multiprocessing_context="fork", persistent_workers=False)
    one = [b["x"].numpy().copy() for b in loader]
    two = [b["x"].numpy().copy() for b in loader]  # the same, unchanged file reopened: served as before
    assert len(one) == len(two) and all(np.array_equal(a, b) for a, b in zip(one, two))
    os.replace(tmp_path / "other.h5", path)
    with pytest.raises(h5s.errors.CorruptRecordError, match="another file was moved to the path"):
        list(loader)
    if not many:
        src.close()
