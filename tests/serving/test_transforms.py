"""Batch transforms (issue 15): statistics and determinism of the augmentations, a reassigned
transform reaching real DataLoader workers, and augmentation identical across worker counts and
front ends."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch

import h5store as h5s
from h5store.serving import transforms as T
from h5store.serving.transforms import batch_rng
from tests.serving.transform_helpers import BATCH, Marker, Noisy, speech_transform


def _ragged_batch(rng: np.random.Generator, b: int = 6, width: int = 50, rest: tuple[int, ...] = ()) -> dict:
    lengths = rng.integers(10, width + 1, b)
    lengths[0] = width
    x = rng.standard_normal((b, width, *rest)).astype(np.float32)
    for j, n in enumerate(lengths):
        x[j, n:] = 0
    return {"x": x, "x_lengths": lengths.astype(np.int64)}


# ----------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("snr", [0.0, 7.5, 20.0])
def test_add_noise_measured_snr_matches_request(snr: float) -> None:
    rng = np.random.default_rng(1)
    batch = _ragged_batch(rng, b=8, width=4000)
    noise = rng.standard_normal(30_000) * 3
    out = T.AddNoise("x", noise, snr_db=snr)(batch, rng=batch_rng(0, 0, 0))
    for j, n in enumerate(batch["x_lengths"]):
        clean, mixed = batch["x"][j, :n].astype(np.float64), out["x"][j, :n].astype(np.float64)
        measured = 10 * np.log10((clean**2).sum() / ((mixed - clean) ** 2).sum())
        assert measured == pytest.approx(snr, abs=1e-3)
        assert not out["x"][j, n:].any()  # padding stays zero


def test_add_noise_from_a_batch_key_and_from_a_file(tmp_path) -> None:
    rng = np.random.default_rng(2)
    batch = _ragged_batch(rng, b=5, width=300)
    batch["n"] = rng.standard_normal((5, 120)).astype(np.float32)  # shorter than items: repeated
    out = T.AddNoise("x", "n", snr_db=(3, 3))(batch, rng=batch_rng(0, 0, 1))
    for j, n in enumerate(batch["x_lengths"]):
        d = (out["x"][j, :n] - batch["x"][j, :n]).astype(np.float64)
        assert 10 * np.log10((batch["x"][j, :n].astype(np.float64) ** 2).sum() / (d**2).sum()) == pytest.approx(3, abs=1e-3)

    class Noise(h5s.TypedFile):
        audio = h5s.Array(dtype="float32")

    path = tmp_path / "noise.h5"
    with Noise(path, mode="w") as f:
        f.extend([(f"n{i}", {"audio": rng.standard_normal(200 + 50 * i).astype("float32")}) for i in range(4)])
    t = T.AddNoise("x", (str(path), "audio"), snr_db=10)
    t = pickle.loads(pickle.dumps(t))  # as a worker receives it
    a = t(batch, rng=batch_rng(5, 1, 2))["x"]
    b = t(batch, rng=batch_rng(5, 1, 2))["x"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, batch["x"])


def test_gain_is_in_the_requested_range() -> None:
    x = np.ones((400, 3), np.float32)
    out = T.Gain("x", -6, 6)({"x": x}, rng=batch_rng(0, 0, 0))["x"]
    db = 20 * np.log10(out[:, 0].astype(np.float64))
    assert db.min() >= -6 - 1e-4 and db.max() <= 6 + 1e-4 and db.std() > 2  # spread over the range
    power = T.Gain("x", 10, 10, power=True)({"x": x}, rng=batch_rng(0, 0, 0))["x"]
    np.testing.assert_allclose(power, 10.0, rtol=1e-6)


@pytest.mark.parametrize("mode", ["roll", "zero"])
def test_time_shift_moves_rows_within_each_item(mode: str) -> None:
    rng = np.random.default_rng(3)
    batch = _ragged_batch(rng, b=7, width=40, rest=(2,))
    out = T.TimeShift("x", 9, mode=mode)(batch, rng=batch_rng(0, 0, 0))["x"]
    moved = 0
    for j, n in enumerate(batch["x_lengths"]):
        src, dst = batch["x"][j, :n], out[j, :n]
        assert not out[j, n:].any()  # padding untouched
        if mode == "roll":
            shifts = [s for s in range(-9, 10) if np.array_equal(np.roll(src, s, axis=0), dst)]
            assert shifts, f"item {j} is not a roll of its rows"
        else:
            s = next(s for s in range(-9, 10) if np.array_equal(
                dst[max(s, 0): n + min(s, 0)], src[max(-s, 0): n - max(s, 0)]))
            assert not dst[: max(s, 0)].any() and not dst[n + min(s, 0):].any()
        moved += not np.array_equal(src, dst)
    assert moved >= 4


@pytest.mark.parametrize("cls", [T.TimeMask, T.FreqMask])
def test_masks_are_bands_of_at_most_max_width_inside_each_item(cls) -> None:
    rng = np.random.default_rng(4)
    batch = _ragged_batch(rng, b=30, width=60, rest=(16,))
    batch["x"] += 10  # no zero in the data: zeros are masks (or padding)
    for j, n in enumerate(batch["x_lengths"]):
        batch["x"][j, n:] = 0
    out = cls("x", 5, n=1)(batch, rng=batch_rng(0, 0, 0))["x"]
    widths = []
    for j, n in enumerate(batch["x_lengths"]):
        z = out[j, :n] == 0
        axis_hits = z.all(axis=1) if cls is T.TimeMask else z.all(axis=0)
        assert z.sum() == axis_hits.sum() * (z.shape[1] if cls is T.TimeMask else z.shape[0])  # whole rows/columns
        idx = np.flatnonzero(axis_hits)
        if idx.size:
            assert idx[-1] - idx[0] + 1 == idx.size  # one band
        widths.append(idx.size)
        assert not out[j, n:].any()
    assert max(widths) <= 5 and len(set(widths)) > 2


def test_mixup_mixes_pairs_and_labels() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    y = np.arange(16)  # one class per item: the soft labels name each item's partner
    out = T.Mixup("x", alpha=0.4, label="y", num_classes=16)({"x": x, "y": y}, rng=batch_rng(1, 2, 3))
    soft = out["y"]
    assert soft.shape == (16, 16) and np.allclose(soft.sum(1), 1)
    own = soft[np.arange(16), y]
    lam = own[own < 1].min() if (own < 1).any() else 1.0
    assert 0.5 <= lam <= 1
    partner = np.where(own < 1, np.argmin(np.where(np.eye(16, dtype=bool), 2, -soft), axis=1), np.arange(16))
    np.testing.assert_allclose(out["x"], lam * x + (1 - lam) * x[partner], rtol=1e-5, atol=1e-6)
    assert sorted(partner.tolist()) == list(range(16))  # a permutation
    plain = T.Mixup("x", label="y")({"x": x, "y": y}, rng=batch_rng(1, 2, 3))
    assert set(plain) == {"x", "y", "y_mix", "mixup_lambda"}
    np.testing.assert_array_equal(plain["y_mix"], partner)


def test_same_generator_same_result_and_torch_agrees_with_numpy() -> None:
    rng = np.random.default_rng(6)
    batch = _ragged_batch(rng, b=5, width=30, rest=(8,))
    batch["y"] = np.arange(5)
    t = T.Compose([T.Gain("x"), T.TimeShift("x", 4), T.SpecAugment("x", 3, 1, 5, 1), T.Mixup("x", label="y",
                                                                                              num_classes=5)])
    a = t(batch, rng=batch_rng(9, 1, 4))
    b = t(batch, rng=batch_rng(9, 1, 4))
    c = t(batch, rng=batch_rng(9, 1, 5))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["x"], c["x"])
    tb = {k: torch.from_numpy(v) for k, v in batch.items()}
    ta = t(tb, rng=batch_rng(9, 1, 4))
    for k in a:
        assert isinstance(ta[k], torch.Tensor)
        np.testing.assert_allclose(ta[k].numpy(), a[k], rtol=1e-5, atol=1e-6)


def test_a_transform_that_is_not_callable_is_refused(speech) -> None:
    with pytest.raises(TypeError, match="transform must be a callable"):
        speech.serve(BATCH, 4, transform="gain")


# ----------------------------------------------------------------------------- workers
@pytest.mark.parametrize(("ctx", "persistent"), [("fork", False), ("spawn", True), ("forkserver", True),
                                                 ("fork", True)])
def test_reassigned_transform_reaches_every_worker(speech, ctx: str, persistent: bool) -> None:
    workers, prefetch = 2, 2
    loader = speech.serve(BATCH, 2, num_workers=workers, prefetch_factor=prefetch, persistent_workers=persistent,
                          multiprocessing_context=ctx, transform=Marker(1))
    for epoch in range(2):
        seen = []
        for k, b in enumerate(loader):
            seen.append(int(b["m"][0]))
            assert (b["m"] == b["m"][0]).all()
            if epoch == 0 and k == 3:
                loader.transform = Marker(2)
        if epoch == 0:
            # Batches 0-3 were built before the change; every batch dispatched after it (from
            # batch 4 + prefetch_factor * num_workers on) was built after it.
            assert seen[:4] == [1] * 4
            assert set(seen[4 + workers * prefetch:]) == {2}
            assert len(seen) > 4 + workers * prefetch
        else:
            assert set(seen) == {2}  # persistent or new workers: the new transform from the start
    assert isinstance(loader.transform, Marker) and loader.transform.value == 2
    loader.transform = None
    assert "m" not in next(iter(loader))


def _epoch(loader) -> list[dict]:
    return [{k: np.asarray(v) for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_seeded_augmentation_is_the_same_for_any_number_of_workers(speech, ctx: str) -> None:
    kw = dict(batch_size=4, shuffle=True, seed=3, transform=speech_transform())
    ref = _epoch(speech.serve(BATCH, **kw))
    for w in (1, 2):
        got = _epoch(speech.serve(BATCH, num_workers=w, multiprocessing_context=ctx, **kw))
        assert len(got) == len(ref)
        for a, b in zip(ref, got):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
    # and it is augmentation: another seed, other draws
    other = _epoch(speech.serve(BATCH, **{**kw, "seed": 4}))
    assert not np.array_equal(np.concatenate([b["r"] for b in ref]), np.concatenate([b["r"] for b in other]))


def test_numpy_and_tf_paths_augment_like_serve(speech) -> None:
    kw = dict(batch_size=4, shuffle=True, seed=3, transform=speech_transform())
    ref = _epoch(speech.serve(BATCH, **kw))
    for threads in (0, 2):
        got = list(speech.iter_batches(BATCH, threads=threads, **kw))
        for a, b in zip(ref, got, strict=True):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
    pytest.importorskip("tensorflow")
    tf_batches = [{k: v.numpy() for k, v in b.items()} for b in speech.to_tf_dataset(BATCH, **kw)]
    for a, b in zip(ref, tf_batches, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_later_epochs_draw_other_randomness(speech) -> None:
    loader = speech.serve(BATCH, 8, transform=Noisy())
    e0 = np.concatenate([b["r"].numpy() for b in loader])
    e1 = np.concatenate([b["r"].numpy() for b in loader])
    assert not np.array_equal(e0, e1)


# ----------------------------------------------------------------------------- duration batches
@pytest.mark.parametrize("padded", [False, True])
def test_max_frames_through_every_front_end(speech, padded: bool) -> None:
    lengths = speech.mel.lengths
    budget = 2 * int(lengths.max())
    loader = speech.serve(BATCH, shuffle=True, max_frames=budget, padded=padded)
    first = []
    for b in loader:
        n = b["x_lengths"].numpy()
        cost = len(n) * int(n.max()) if padded else int(n.sum())
        assert cost <= budget
        first.append(b["pos"].tolist())
    assert sorted(i for b in first for i in b) == list(range(len(speech)))
    assert len(first) < len(speech) / 1.5  # batches of several items
    nb = [b["pos"].tolist() for b in speech.iter_batches(BATCH, shuffle=True, max_frames=budget, padded=padded)]
    assert nb == first  # the same batches in the numpy path (epoch 0)
    pytest.importorskip("tensorflow")
    tb = [b["pos"].numpy().tolist() for b in speech.to_tf_dataset(BATCH, shuffle=True, max_frames=budget,
                                                                   padded=padded)]
    assert tb == first


def _sampler(lengths, **kw) -> h5s.serving.DurationBatchSampler:
    return h5s.serving.DurationBatchSampler(lengths, **kw)


@pytest.mark.parametrize(("padded", "buckets"), [(False, 10), (True, 10), (True, 1), (False, 3)])
def test_duration_sampler_budget_coverage_and_epochs(padded: bool, buckets: int) -> None:
    lengths = np.random.default_rng(0).integers(100, 1001, 3000)  # LJSpeech-like: 1-10 s at 100 frames/s
    s = _sampler(lengths, max_frames=8000, padded=padded, num_buckets=buckets, seed=1)
    epochs = []
    for _ in range(3):
        batches = [list(b) for b in s]
        for b in batches:
            cost = len(b) * lengths[b].max() if padded else lengths[b].sum()
            assert cost <= 8000
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(3000))  # every item exactly once
        epochs.append(batches)
    assert epochs[0] != epochs[1] != epochs[2]
    # bucketing keeps padding low: padded frames / real frames
    b0 = epochs[0]
    waste = sum(len(b) * lengths[b].max() for b in b0) / lengths.sum() - 1
    if buckets >= 10:
        assert waste < 0.15


def test_duration_sampler_refuses_items_over_budget() -> None:
    with pytest.raises(ValueError, match="longer than max_frames=50.*raise max_frames"):
        _sampler(np.array([10, 60, 20]), max_frames=50)


def test_duration_sampler_ranks_have_equal_steps_and_cover_everything() -> None:
    lengths = np.random.default_rng(1).integers(50, 500, 1001)
    for ws in (2, 3, 4):
        ranks = [_sampler(lengths, max_frames=3000, seed=5, rank=r, world_size=ws) for r in range(ws)]
        per = [[list(b) for b in r.batches(2)] for r in ranks]
        assert len({len(p) for p in per}) == 1
        assert set(itertools.chain.from_iterable(itertools.chain.from_iterable(per))) == set(range(1001))
        dropped = [_sampler(lengths, max_frames=3000, seed=5, rank=r, world_size=ws, drop_last=True) for r in range(ws)]
        assert len({len(d.batches(2)) for d in dropped}) == 1


def test_duration_sampler_resumes_exactly_where_it_stopped() -> None:
    lengths = np.random.default_rng(2).integers(50, 500, 500)
    s = _sampler(lengths, max_frames=2500, seed=7)
    list(s)  # epoch 0
    it = iter(s)  # epoch 1
    head = [list(next(it)) for _ in range(5)]
    state = s.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 5
    fresh = _sampler(lengths, max_frames=2500, seed=7)
    fresh.load_state_dict(state)
    rest = [list(b) for b in fresh]
    full = [list(b) for b in _sampler(lengths, max_frames=2500, seed=7).batches(1)]
    assert head + rest == full
    with pytest.raises(ValueError, match="max_frames"):
        _sampler(lengths, max_frames=3000, seed=7).load_state_dict(state)


def test_duration_sampler_resume_through_serve(speech) -> None:
    budget = 2 * int(speech.mel.lengths.max())
    loader = speech.serve(BATCH, shuffle=True, max_frames=budget, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    head = [next(it)["pos"].tolist() for _ in range(3)]
    state = loader.state_dict()
    del it
    again = speech.serve(BATCH, shuffle=True, max_frames=budget)
    again.load_state_dict(state)
    rest = [b["pos"].tolist() for b in again]
    assert sorted(i for b in head + rest for i in b) == list(range(len(speech)))


def test_transformed_batches_larger_than_the_slot_layout_survive_workers(tmp_path) -> None:
    """A transform's new arrays on top of the carved ones overflow the worker's slot: the batch
    moves to another slot whole, and arrives equal to the in-process result."""
    from tests.serving.schemas import Speech, mel_of

    path = tmp_path / "big.h5"
    sizes = [10_000] * 4 + [15_000] * 8
    with Speech(path, mode="w") as w:
        w.extend([(f"id{i:03d}", {"mel": mel_of(3, i, n), "label": i}) for i, n in enumerate(sizes)])
    with Speech(path) as f:
        kw = dict(batch_size=4, transform=T.Compose([T.Gain("x", -3, 3), Noisy()]))
        ref = _epoch(f.serve(BATCH, **kw))
        got = _epoch(f.serve(BATCH, num_workers=1, multiprocessing_context="fork", **kw))
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_max_frames_with_windows(speech) -> None:
    """Windows have one length: max_frames then sets how many fit (items shorter than the window count less)."""
    batch = dict(x=h5s.Window("mel", 8), pos=h5s.Position())
    loader = speech.serve(batch, shuffle=True, max_frames=40, mask=True)
    seen = []
    for b in loader:
        assert int(b["x_lengths"].sum()) <= 40
        seen.extend(b["pos"].tolist())
    assert sorted(seen) == list(range(len(speech)))
    assert max(len(b["pos"]) for b in loader) >= 5


@pytest.mark.parametrize("mix", ["examples", "batches"])
def test_interleave_applies_the_transform_reproducibly(shard_paths, mix: str) -> None:
    pytest.importorskip("tensorflow")
    batch = dict(x=h5s.Item("mel"), pos=h5s.Position())
    kw = dict(batch_size=3, shuffle=True, seed=2, mix=mix, transform=speech_transform(), cycle_length=2,
              num_parallel_calls=2)
    a = [{k: v.numpy() for k, v in b.items()} for b in h5s.interleave([str(p) for p in shard_paths], batch, **kw)]
    b = [{k: v.numpy() for k, v in b.items()} for b in h5s.interleave([str(p) for p in shard_paths], batch, **kw)]
    assert len(a) == len(b) > 3 and all("r" in x for x in a)
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert len({float(x["r"][0]) for x in a}) == len(a)  # each batch its own draws


def test_a_transform_naming_a_missing_key_says_which_keys_there_are(speech) -> None:
    loader = speech.serve(dict(x=h5s.Item("mel")), 4, transform=T.Compose([T.Gain("mel")]))
    with pytest.raises(KeyError, match=r"Gain\(key='mel'.*no key 'mel' \(its keys: x, x_lengths\)"):
        next(iter(loader))


def test_in_place_only_on_the_batch_own_buffers(speech) -> None:
    """Served batches are changed in place (no copy); arrays of anyone else never are."""
    class Keep(h5s.Getter):  # a user's getter that returns an array it keeps
        features = ("mel",)

        def __init__(self) -> None:
            self.const = np.ones((64, 2), np.float32)

        def fetch(self, files, request):
            return self.const[: len(request)]

        def signature(self, files):
            return np.dtype("float32"), (2,)

    keep = Keep()
    ds = h5s.serving.FileDataset(speech, dict(x=h5s.Item("mel"), k=keep),
                                 transform=T.Compose([T.Gain("x", 6, 6), T.Gain("k", 6, 6), T.FreqMask("x", 3)]))
    plain = h5s.serving.FileDataset(speech, dict(x=h5s.Item("mel")))
    b = ds.fetch(np.arange(4))
    ref = plain.fetch(np.arange(4))
    assert "x" in b.owned  # (and "k" since Gain made it a new array of the batch)
    np.testing.assert_allclose(b["k"], 10 ** (6 / 20), rtol=1e-6)
    assert (keep.const == 1).all()  # the getter's own array was copied, not changed
    gain = 10 ** (6 / 20)
    kept = b["x"] != 0
    np.testing.assert_allclose(b["x"][kept], (ref["x"] * gain)[kept], rtol=1e-5)
    batch = {"x": np.ones((2, 3, 4), np.float32)}  # a batch of the user's: never changed
    T.Compose([T.Gain("x", 6, 6), T.TimeMask("x", 2)])(batch, rng=batch_rng(0, 0, 0))
    assert (batch["x"] == 1).all()
