"""Random clips of K consecutive video frames: `Window` over an `EncodedFrames` feature.

No getter of its own is needed: on a "blobs" feature `Window` reads only the K frames'
bytes at an offset drawn from (seed, epoch, index), decodes them, and returns
``(B, K, H, W, C)`` uint8. These tests hold it to that.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.serving import FileDataset
from h5store.storage import Column

pytest.importorskip("PIL")

K = 4
FRAMES = (9, 12, 6, 4, 15)


class Video(h5s.TypedFile):
    video = h5s.EncodedFrames(quality=95)
    label = h5s.Scalar(dtype="int64")


def frame_value(v: int, t: int) -> int:
    """The flat grey level of frame t of video v (JPEG keeps flat frames within a few levels)."""
    return 8 * t + 3 * v


@pytest.fixture(scope="module")
def video_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("clip") / "video.h5"
    with Video(path, mode="w") as w:
        for v, n in enumerate(FRAMES):
            frames = np.stack([np.full((6, 10, 3), frame_value(v, t), np.uint8) for t in range(n)])
            w.add(f"v{v}", dict(video=frames, label=v % 2))
    return path


def first_frames(clips: np.ndarray, items: np.ndarray) -> list[int]:
    """The index of each clip's first frame, recovered from its grey level (and checked consecutive)."""
    out = []
    for clip, v in zip(clips, items.tolist()):
        level = clip.reshape(len(clip), -1).mean(axis=1)
        t0 = int(round((level[0] - 3 * v) / 8))
        np.testing.assert_allclose(level, [frame_value(v, t0 + j) for j in range(len(clip))], atol=3)
        out.append(t0)
    return out


def test_clips_are_k_consecutive_frames_reproducible_per_epoch(video_path: Path) -> None:
    f = Video(video_path)
    ds = FileDataset(f, dict(clip=h5s.Window("video", K), n=h5s.Position()), seed=7)
    idx = np.array([0, 1, 4, 2, 1])
    a = ds.fetch(idx, epoch=0)
    assert a["clip"].shape == (5, K, 6, 10, 3) and a["clip"].dtype == np.uint8
    starts = first_frames(a["clip"], a["n"])
    assert all(0 <= s <= FRAMES[v] - K for s, v in zip(starts, a["n"].tolist()))
    np.testing.assert_array_equal(ds.fetch(idx, epoch=0)["clip"], a["clip"])  # same (seed, epoch): same clips
    later = [first_frames(ds.fetch(idx, epoch=e)["clip"], a["n"]) for e in range(1, 6)]
    assert any(s != starts for s in later)  # other epochs: other offsets
    other_seed = FileDataset(f, dict(clip=h5s.Window("video", K), n=h5s.Position()), seed=8)
    assert any(first_frames(other_seed.fetch(idx, epoch=e)["clip"], a["n"]) != starts for e in range(3))
    # Exactly what f.video.blobs() decodes for the same frames.
    v, s = int(a["n"][2]), starts[2]
    np.testing.assert_array_equal(a["clip"][2], np.stack(f.video.blobs(f"v{v}", s, s + K)))
    f.close()


def test_a_clip_reads_only_its_frames(video_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spans: list[tuple[int, int]] = []
    real = Column.read_blob_spans

    def spy(self: Column, rows: np.ndarray, first: np.ndarray, stop: np.ndarray,
            verify: bool = True) -> list[list[np.ndarray]]:
        spans.extend(zip(np.asarray(first).tolist(), np.asarray(stop).tolist()))
        return real(self, rows, first, stop, verify)

    def no_whole_items(self: Column, *args: object, **kwargs: object) -> None:
        raise AssertionError("a clip must not read whole videos")

    f = Video(video_path)
    unchecked = FileDataset(f, dict(clip=h5s.Window("video", K)), verify=False)
    checked = FileDataset(f, dict(clip=h5s.Window("video", K)))
    checked.fetch([0, 1, 2, 4])  # verify=True: each video is read whole (its CRC-32) once per process
    monkeypatch.setattr(Column, "read_blob_spans", spy)
    monkeypatch.setattr(Column, "read_items", no_whole_items)
    unchecked.fetch([0, 1, 2, 4])
    checked.fetch([0, 1, 2, 4])  # ... and only its clip's frames afterwards
    assert len(spans) == 8 and all(stop - first == K for first, stop in spans)
    f.close()


def test_short_videos_are_padded_or_skipped(video_path: Path) -> None:
    f = Video(video_path)
    long = 8
    padded = FileDataset(f, dict(clip=h5s.Window("video", long), n=h5s.Position()), mask=True).fetch([3, 0])
    assert padded["clip"].shape == (2, long, 6, 10, 3)
    assert padded["clip_lengths"].tolist() == [4, long]  # video 3 has 4 frames: zero-padded after them
    assert not padded["clip"][0, 4:].any() and padded["clip_mask"][0].tolist() == [True] * 4 + [False] * 4
    skipped = FileDataset(f, dict(clip=h5s.Window("video", long, pad="skip")))
    assert len(skipped) == sum(n >= long for n in FRAMES)
    f.close()


def test_clips_served_by_two_workers(video_path: Path) -> None:
    f = Video(video_path)
    loader = f.serve(dict(clip=h5s.Window("video", K), y=h5s.Label("label"), n=h5s.Position()), batch_size=5,
                     num_workers=2, seed=3)
    batches = list(loader)
    b = batches[0]
    assert tuple(b["clip"].shape) == (5, K, 6, 10, 3) and str(b["clip"].dtype) == "torch.uint8"
    first_frames(b["clip"].numpy(), b["n"].numpy())
    assert sorted(int(p) for b in batches for p in b["n"]) == list(range(len(FRAMES)))
    # The workers drew the same clips as a dataset fetch of the same indices in epoch 0.
    again = FileDataset(f, dict(clip=h5s.Window("video", K), y=h5s.Label("label"), n=h5s.Position()),
                        seed=3).fetch(np.arange(5), epoch=0)
    np.testing.assert_array_equal(b["clip"].numpy(), again["clip"])
    del loader
    f.close()


def test_batched_span_reads_equal_plain_h5py(video_path: Path) -> None:
    """Column.read_blob_spans (the batched read behind every clip getter) against plain h5py:
    random spans, empty ones, a span at an item's end, whole items, rows in any order."""
    import h5py

    with h5py.File(video_path, "r") as h:
        data, frames, index = h["video/data"][()], h["video/frames"][()], h["video/index"][()]
    f = Video(video_path)
    col = f.video.column
    rng = np.random.default_rng(5)
    for _ in range(60):
        rows = rng.integers(0, len(FRAMES), int(rng.integers(1, 9)))
        n = np.array([FRAMES[r] for r in rows])
        first = rng.integers(0, n + 1)
        stop = np.minimum(n, first + rng.integers(0, 6, len(rows)))
        whole = rng.random(len(rows)) < 0.2
        first[whole], stop[whole] = 0, n[whole]
        got = col.read_blob_spans(rows, first, stop)
        for r, a, b, blobs in zip(rows.tolist(), first.tolist(), stop.tolist(), got):
            want = [data[s:e].tobytes() for s, e in frames[index[r, 0] + a : index[r, 0] + b]]
            assert [bytes(x) for x in blobs] == want
            assert [bytes(x) for x in col.read_blobs(r, a, b)] == want
    with pytest.raises(IndexError, match="out of range"):
        col.read_blob_spans(np.array([0]), np.array([2]), np.array([FRAMES[0] + 1]))
    f.close()


def test_serving_checks_whole_clips_by_its_own_verify_policy(video_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole videos served as clips are checked once per loader (verify=True) or not at all
    (verify=False), never again at every read by the column."""
    from h5store.serving.files import FileSet

    by_column: list[int] = []
    by_loader: list[int] = []
    real_column, real_loader = Column.verify, FileSet._check

    def column_spy(self: Column, rows: np.ndarray, parts: list[np.ndarray]) -> None:
        by_column.extend(np.asarray(rows).tolist())
        real_column(self, rows, parts)

    def loader_spy(self: FileSet, name: str, position: int, value: object) -> bool:
        by_loader.append(position)
        return real_loader(self, name, position, value)

    monkeypatch.setattr(Column, "verify", column_spy)
    monkeypatch.setattr(FileSet, "_check", loader_spy)
    f = Video(video_path)
    whole = dict(clip=h5s.Window("video", 4))  # video 3 has 4 frames: its clip is the whole item
    FileDataset(f, whole, verify=False).fetch([3, 3, 3])
    assert by_column == [] and by_loader == []
    ds = FileDataset(f, whole)
    for _ in range(3):
        ds.fetch([3])
    assert by_loader == [3] and by_column == []  # once, by the loader's check, not at each read
    assert [bytes(b) for b in f.video.column.read_blobs(3, 0, 4)]  # a direct whole read: the column checks it
    assert by_column == [3]
    f.close()


def test_a_subclass_decode_into_decodes_its_clips(video_path: Path) -> None:
    """A feature that overrides decode_into (its own conversion) has its clips decoded by it."""

    class Inverted(h5s.EncodedFrames):
        def decode_into(self, blob, out, min_size=None):  # type: ignore[no-untyped-def]
            super().decode_into(blob, out, min_size)
            np.subtract(255, out, out=out)
            return out

    class InvertedVideo(h5s.TypedFile):
        video = Inverted(quality=95)
        label = h5s.Scalar(dtype="int64")

    f = InvertedVideo(video_path)
    g = Video(video_path)
    a = FileDataset(f, dict(clip=h5s.Clips("video", 4, random=False))).fetch([0, 1])["clip"]
    b = FileDataset(g, dict(clip=h5s.Clips("video", 4, random=False))).fetch([0, 1])["clip"]
    np.testing.assert_array_equal(a, 255 - b)
    f.close()
    g.close()
