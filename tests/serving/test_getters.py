"""Getters, in one process: every value compared with a read through the public API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.errors import SchemaError
from h5store.layout import count_windows
from h5store.serving import FileDataset
from h5store.serving.getters import mix64
from tests.serving.conftest import reference
from tests.serving.schemas import ReaderKind, Speech, SpeechLZF


def _offsets(batch_mag: np.ndarray, items: np.ndarray) -> np.ndarray:
    # mag[i][t] == i + t: a window of mag tells its own first row.
    return (batch_mag[:, 0, 0] - items).astype(np.int64)


def test_item_pads_and_reports_lengths(speech: Speech) -> None:
    mel = reference(speech, "mel")
    ds = FileDataset(speech, dict(x=h5s.Item("mel"), pos=h5s.Position()))
    idx = np.array([5, 0, 39, 5, 17])
    b = ds.fetch(idx)
    assert set(b) == {"x", "x_lengths", "pos"}
    assert b["x"].dtype == np.float32 and b["x_lengths"].dtype == np.int64
    assert b["x"].shape == (5, max(len(mel[i]) for i in idx), 8)
    assert b["pos"].tolist() == idx.tolist()
    for j, i in enumerate(idx.tolist()):
        n = len(mel[i])
        assert b["x_lengths"][j] == n
        np.testing.assert_array_equal(b["x"][j, :n], mel[i])
        assert not b["x"][j, n:].any()


def test_scalars_labels_and_text(speech: Speech) -> None:
    ds = FileDataset(speech, dict(lab=h5s.Label("label"), raw=h5s.Item("label"), score=h5s.Label("score"),
                                  text=h5s.Item("text")))
    idx = [3, 1, 4, 1, 5]
    b = ds.fetch(idx)
    assert b["lab"].dtype == np.int64 and b["lab"].tolist() == [i % 5 for i in idx]
    assert b["raw"].dtype == np.int32 and b["raw"].tolist() == [i % 5 for i in idx]
    assert b["score"].dtype == np.float32 and b["score"].tolist() == [i / 4 for i in idx]
    assert b["text"] == [f"item {i} é" for i in idx]
    assert "text_lengths" not in b


def test_window_determinism(speech: Speech) -> None:
    batch = dict(m=h5s.Window("mag", 4), pos=h5s.Position())
    a = FileDataset(speech, batch, seed=7)
    idx = np.arange(len(a))
    e0 = a.fetch(idx, epoch=0)
    np.testing.assert_array_equal(e0["m"], FileDataset(speech, batch, seed=7).fetch(idx, epoch=0)["m"])
    np.testing.assert_array_equal(e0["m"], a.fetch(idx[::-1], epoch=0)["m"][::-1])  # order-independent
    e1 = a.fetch(idx, epoch=1)
    other_seed = FileDataset(speech, batch, seed=8).fetch(idx, epoch=0)
    off0, off1 = _offsets(e0["m"], idx), _offsets(e1["m"], idx)
    assert (off0 != off1).any()
    assert (off0 != _offsets(other_seed["m"], idx)).any()
    lengths = speech.mag.lengths
    assert ((off0 >= 0) & (off0 <= np.maximum(lengths - 4, 0))).all()
    # Offsets cover the possible range over epochs, not just one corner.
    many = np.stack([_offsets(a.fetch(idx, epoch=e)["m"], idx) for e in range(20)])
    long_item = int(np.argmax(lengths))
    assert len(set(many[:, long_item].tolist())) > 5


def test_two_windows_stay_aligned(speech: Speech) -> None:
    mel = reference(speech, "mel")
    ds = FileDataset(speech, dict(x=h5s.Window("mel", 5), m=h5s.Window("mag", 5), pos=h5s.Position()))
    idx = np.arange(len(ds))
    for epoch in (0, 3):
        b = ds.fetch(idx, epoch=epoch)
        off = _offsets(b["m"], idx)
        for j, i in enumerate(idx.tolist()):
            want = mel[i][off[j] : off[j] + 5]
            np.testing.assert_array_equal(b["x"][j, : len(want)], want)


def test_window_pad_zero_and_mask(speech: Speech) -> None:
    mel = reference(speech, "mel")
    ds = FileDataset(speech, dict(x=h5s.Window("mel", 20)), mask=True)
    b = ds.fetch(np.arange(len(ds)))
    assert b["x"].shape == (len(ds), 20, 8)
    n = np.minimum(speech.mel.lengths, 20)
    np.testing.assert_array_equal(b["x_lengths"], n)
    np.testing.assert_array_equal(b["x_mask"], np.arange(20)[None, :] < n[:, None])
    for j, length in enumerate(n.tolist()):
        assert not b["x"][j, length:].any()
        if len(mel[j]) <= 20:
            np.testing.assert_array_equal(b["x"][j, :length], mel[j])
    assert set(FileDataset(speech, dict(x=h5s.Window("mel", 20))).fetch([0])) == {"x"}


def test_window_pad_skip_drops_short_items(speech: Speech) -> None:
    lengths = speech.mel.lengths
    ds = FileDataset(speech, dict(x=h5s.Window("mel", 20, pad="skip"), pos=h5s.Position()))
    assert len(ds) == int((lengths >= 20).sum()) > 0
    b = ds.fetch(np.arange(len(ds)))
    assert (lengths[b["pos"]] >= 20).all()
    np.testing.assert_array_equal(b["pos"], np.flatnonzero(lengths >= 20))


def test_window_hop_and_fixed_offsets(speech: Speech) -> None:
    idx = np.arange(len(speech))
    lengths = speech.mag.lengths
    hopped = FileDataset(speech, dict(m=h5s.Window("mag", 4, hop=3)))
    for e in range(4):
        assert (_offsets(hopped.fetch(idx, epoch=e)["m"], idx) % 3 == 0).all()
    first = FileDataset(speech, dict(m=h5s.Window("mag", 4, random=False)))
    assert not _offsets(first.fetch(idx, epoch=5)["m"], idx).any()
    sweep = FileDataset(speech, dict(m=h5s.Window("mag", 4, random=False, hop=2)))
    positions = np.where(lengths > 4, (lengths - 4) // 2 + 1, 1)
    for e in range(3):
        np.testing.assert_array_equal(_offsets(sweep.fetch(idx, epoch=e)["m"], idx), 2 * (e % positions))


def test_window_length_from_shared_param(speech: Speech) -> None:
    ds = FileDataset(speech, dict(x=h5s.Window("mel", "crop")), params=dict(crop=4))
    assert ds.fetch([0, 1])["x"].shape[1] == 4
    ds.params.crop = 7
    assert ds.fetch([0, 1])["x"].shape[1] == 7
    with pytest.raises(SchemaError, match="no shared parameter 'nope'"):
        FileDataset(speech, dict(x=h5s.Window("mel", "nope"))).fetch([0])


def test_frames_enumerates_every_window(speech: Speech) -> None:
    lengths = speech.mag.lengths
    length, hop = 6, 4
    ds = FileDataset(speech, dict(m=h5s.Frames("mag", length, hop), y=h5s.Label("label"), pos=h5s.Position()))
    brute = [(i, s) for i, n in enumerate(lengths.tolist()) for s in range(0, n - length + 1, hop)]
    assert len(ds) == len(brute) == int(count_windows(lengths, length, hop).sum())
    b = ds.fetch(np.arange(len(ds)))
    assert b["m"].shape == (len(ds), length, 3)
    got = list(zip(b["pos"].tolist(), _offsets(b["m"], b["pos"]).tolist()))
    assert got == brute
    assert b["y"].tolist() == [i % 5 for i, _ in brute]
    # A window's rows are consecutive rows of its item.
    np.testing.assert_array_equal(np.diff(b["m"][:, :, 0], axis=1), 1)


def test_frames_and_window_together_and_errors(speech: Speech) -> None:
    ds = FileDataset(speech, dict(a=h5s.Frames("mel", 5), b=h5s.Frames("mag", 5)))
    b = ds.fetch(np.arange(len(ds)))
    assert b["a"].shape[0] == b["b"].shape[0] == len(ds)
    with pytest.raises(SchemaError, match="several examples"):
        FileDataset(speech, dict(a=h5s.Frames("mel", 5), b=h5s.Frames("mag", 6)))
    with pytest.raises(SchemaError, match="fixed-shape"):
        FileDataset(speech, dict(a=h5s.Window("label", 5)))
    with pytest.raises(SchemaError, match="not one number per item"):
        FileDataset(speech, dict(a=h5s.Label("mel")))
    with pytest.raises(ValueError, match="pad must be"):
        h5s.Window("mel", 4, pad="reflect")


def test_compressed_feature_reads_through_hdf5(lzf_path: Path) -> None:
    f = SpeechLZF(lzf_path)
    mel = reference(f, "mel")
    ds = FileDataset(f, dict(x=h5s.Item("mel"), w=h5s.Window("mel", 3, random=False), kind=ReaderKind("mel")))
    idx = np.array([4, 0, 24, 4])
    b = ds.fetch(idx)
    assert (b["kind"] == 3).all()  # ChunkReader: lzf decoded by h5store, bounded
    for j, i in enumerate(idx.tolist()):
        np.testing.assert_array_equal(b["x"][j, : len(mel[i])], mel[i])
        np.testing.assert_array_equal(b["w"][j, : min(3, len(mel[i]))], mel[i][:3])
    f.close()


def test_read_only_file_takes_the_direct_path(speech: Speech) -> None:
    b = FileDataset(speech, dict(kind=ReaderKind("mel"))).fetch([0, 1])
    assert (b["kind"] == 0).all()  # DirectReader


def test_decoded_blob_frames(tmp_path: Path) -> None:
    pytest.importorskip("PIL")

    class Video(h5s.TypedFile):
        frames = h5s.EncodedFrames()

    rng = np.random.default_rng(0)
    videos = [rng.integers(0, 255, (n, 6, 5, 3), dtype=np.uint8) for n in (3, 7, 5)]
    with Video(tmp_path / "v.h5", mode="w") as f:
        f.extend([(f"v{k}", dict(frames=v)) for k, v in enumerate(videos)])
    f = Video(tmp_path / "v.h5")
    decoded = [f.frames[k] for k in range(3)]
    ds = FileDataset(f, dict(v=h5s.Item("frames"), w=h5s.Window("frames", 4, random=False)))
    b = ds.fetch([0, 1, 2])
    assert b["v"].shape == (3, 7, 6, 5, 3)
    for k, d in enumerate(decoded):
        np.testing.assert_array_equal(b["v"][k, : len(d)], d)
        assert not b["v"][k, len(d) :].any()
        np.testing.assert_array_equal(b["w"][k, : min(4, len(d))], d[:4])
    frames = FileDataset(f, dict(c=h5s.Frames("frames", 3)))
    assert len(frames) == 1 + 2 + 1  # windows at 0 | 0, 3 | 0
    c = frames.fetch(np.arange(4))["c"]
    for j, (k, s) in enumerate([(0, 0), (1, 0), (1, 3), (2, 0)]):
        np.testing.assert_array_equal(c[j], decoded[k][s : s + 3])
    f.close()


def test_signatures(speech: Speech) -> None:
    ds = FileDataset(speech, dict(x=h5s.Item("mel"), w=h5s.Window("mel", 5), p=h5s.Window("mel", "crop"),
                                  y=h5s.Label("label"), t=h5s.Item("text"), pos=h5s.Position()),
                     params=dict(crop=3))
    sig = ds.signature()
    assert sig["x"] == (np.dtype("float32"), (None, 8))
    assert sig["w"] == (np.dtype("float32"), (5, 8))
    assert sig["p"] == (np.dtype("float32"), (None, 8))
    assert sig["y"] == (np.dtype("int64"), ())
    assert sig["t"] == (np.dtype(object), ())
    assert sig["pos"] == (np.dtype("int64"), ())


def test_custom_getter_subclass(speech: Speech) -> None:
    class Energy(h5s.Getter):
        def __init__(self, feature: str) -> None:
            self.features = (feature,)

        def fetch(self, files, request):  # type: ignore[no-untyped-def]
            x = h5s.Item(self.features[0]).fetch(files, request)
            return (x.values ** 2).sum(axis=(1, 2))

    mel = reference(speech, "mel")
    b = FileDataset(speech, dict(e=Energy("mel"))).fetch([2, 9])
    np.testing.assert_allclose(b["e"], [(mel[2] ** 2).sum(), (mel[9] ** 2).sum()], rtol=1e-5)
    with pytest.raises(TypeError):
        h5s.Getter()  # type: ignore[abstract]


def test_mix64_is_a_vectorised_hash() -> None:
    a = mix64(1, 2, np.arange(1000))
    assert a.dtype == np.uint64 and len(np.unique(a)) == 1000
    np.testing.assert_array_equal(a, mix64(1, 2, np.arange(1000)))
    assert (a != mix64(1, 3, np.arange(1000))).all()
    assert (a % 2).mean() == pytest.approx(0.5, abs=0.06)
