"""Every video decode path against PIL's decoding of the source JPEG files; encoded bytes
round-trip exactly; clip views slice like Python; clip sampling in proportion to length.

The max abs difference to PIL is 0 for simplejpeg (both run libjpeg-turbo's islow IDCT
with fancy upsampling), for the PIL fallback, and for ``tf.io.decode_jpeg(...,
dct_method="INTEGER_ACCURATE")`` of the served bytes; tf's default (fast IDCT) is within 8
levels (measured 4-5). The tests assert exactly that, so a decoder that drifts fails here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store import jpeg
from h5store.serving import FileDataset, Request
from tests.serving.videos import Clips, H, W, make_files, pil_frames

pytest.importorskip("PIL")

LENGTHS = [[9, 4, 13, 6, 2, 7]]
K = 4


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_files(tmp_path_factory.mktemp("decode"), LENGTHS)[0]


@pytest.fixture(params=["simplejpeg", "pil"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pil":
        monkeypatch.setattr(jpeg, "_sj", None)
        monkeypatch.setattr(jpeg, "_tried", True)
    elif jpeg.decoder() != "simplejpeg":
        pytest.skip("simplejpeg is not installed")
    assert jpeg.decoder() == request.param
    return request.param


def source(path: Path, ident: str) -> Path:
    return path.parent / "src0" / ident


def test_whole_videos_slices_and_blobs_equal_pil(path: Path, decoder: str) -> None:
    with Clips(path) as f:
        for ident in f.ids:
            ref = pil_frames(source(path, ident))
            np.testing.assert_array_equal(f.video[ident], ref)
            v = f.video.frames(ident)
            np.testing.assert_array_equal(v[1:4], ref[1:4])
            np.testing.assert_array_equal(v[-1], ref[-1])
            np.testing.assert_array_equal(np.stack(f.video.blobs(ident, -3)), ref[-3:])


SLICES = [slice(None), slice(2, 5), slice(-3, None), slice(-100, 2), slice(5, 100), slice(100, 108),
          slice(4, 2), slice(-1, -5), slice(0, 0), slice(None, None, 2), slice(None, None, -1), slice(7, 1, -3),
          slice(-2, -9, -2), slice(1, -1, 3)]


@pytest.mark.parametrize("sl", SLICES, ids=str)
def test_clip_views_slice_like_python(path: Path, sl: slice) -> None:
    with Clips(path) as f:
        for ident in (f.ids[0], f.ids[int(np.argmin(f.video.lengths))]):  # 9 frames, 2 frames
            ref = pil_frames(source(path, ident))
            v = f.video.frames(ident)
            got = v[sl]
            assert got.shape == ref[sl].shape and got.dtype == np.uint8
            np.testing.assert_array_equal(got, ref[sl])
            files = sorted(source(path, ident).glob("*.jpg"), key=lambda p: int(p.stem))
            assert f.video.frames(ident, encoded=True)[sl] == [p.read_bytes() for p in files][sl]
            if sl.step is None:
                assert len(f.video.blobs(ident, sl.start, sl.stop)) == len(ref[sl])


def test_clip_view_indices_like_a_list(path: Path) -> None:
    with Clips(path) as f:
        v = f.video.frames(f.ids[int(np.argmin(f.video.lengths))])  # 2 frames
        assert len(v) == 2 and len(list(v)) == 2
        for k in (2, -3, 100):
            with pytest.raises(IndexError, match="out of range for a video of 2 frames"):
                v[k]
        with pytest.raises(TypeError):
            v[1.0]
        with pytest.raises(h5s.SchemaError, match="needs a feature stored as blobs"):
            f.label.frames(f.ids[0])


def clip_reference(path: Path, f: Clips, items: np.ndarray, clips: np.ndarray, lengths: np.ndarray) -> None:
    """Each clip is K consecutive source frames (PIL), zero past a short video's end."""
    for clip, p, n in zip(clips, items.tolist(), lengths.tolist()):
        ref = pil_frames(source(path, f.ids[p]))
        starts = [t for t in range(len(ref) - n + 1) if np.array_equal(ref[t : t + n], clip[:n])]
        assert starts, "a clip is not consecutive source frames"
        assert not clip[n:].any()


@pytest.mark.parametrize("getter", [h5s.Window("video", K), h5s.Clips("video", K, every=4), h5s.Frames("video", K, 2)],
                         ids=["Window", "Clips", "Frames"])
def test_clip_getters_equal_pil_in_every_front_end(path: Path, decoder: str, getter: h5s.Getter) -> None:
    f = Clips(path)
    batch = dict(x=getter, p=h5s.Position())
    for b in f.iter_batches(batch, batch_size=4, threads=2, mask=True):
        assert b["x"].shape[1:] == (K, H, W, 3)
        clip_reference(path, f, b["p"], b["x"], b.get("x_lengths", np.full(len(b["p"]), K)))  # Frames: whole clips
    for b in f.serve(batch, batch_size=5, mask=True):
        n = b["x_lengths"].numpy() if "x_lengths" in b else np.full(len(b["p"]), K)
        clip_reference(path, f, b["p"].numpy(), b["x"].numpy(), n)
    f.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_clips_in_dataloader_workers(path: Path, context: str) -> None:
    f = Clips(path)
    loader = f.serve(dict(x=h5s.Clips("video", K, per_item=2), p=h5s.Position()), batch_size=3, num_workers=2,
                     multiprocessing_context=context, mask=True, shuffle=True, seed=1)
    seen = []
    for b in loader:
        clip_reference(path, f, b["p"].numpy(), b["x"].numpy(), b["x_lengths"].numpy())
        seen += b["p"].tolist()
    assert sorted(seen) == sorted(list(range(len(f))) * 2)  # two clips per video per epoch
    f.close()


def test_clips_tf_decoded_and_encoded(path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    f = Clips(path)
    ds = f.to_tf_dataset(dict(x=h5s.Clips("video", K, every=5), p=h5s.Position()), batch_size=4, mask=True)
    for b in ds:
        clip_reference(path, f, b["p"].numpy(), b["x"].numpy(), b["x_lengths"].numpy())
    enc = f.to_tf_dataset(dict(x=h5s.Clips("video", K, encoded=True), p=h5s.Position()), batch_size=4, seed=3)
    assert enc.element_spec["x"] == tf.TensorSpec((None, K), tf.string)
    worst = 0
    for b in enc:
        for row, p, n in zip(b["x"].numpy(), b["p"].numpy(), b["x_lengths"].numpy()):
            files = sorted(source(path, f.ids[int(p)]).glob("*.jpg"), key=lambda q: int(q.stem))
            raw = [q.read_bytes() for q in files]
            got = list(row[:n])
            assert any(got == raw[t : t + n] for t in range(len(raw) - n + 1))  # bytes exactly as ingested
            assert all(x == b"" for x in row[n:])
            ref = pil_frames(source(path, f.ids[int(p)]))
            t0 = raw.index(got[0])
            exact = np.stack([tf.io.decode_jpeg(x, dct_method="INTEGER_ACCURATE").numpy() for x in got])
            np.testing.assert_array_equal(exact, ref[t0 : t0 + n])
            fast = np.stack([tf.io.decode_jpeg(x).numpy() for x in got])
            worst = max(worst, int(np.abs(fast.astype(int) - ref[t0 : t0 + n]).max()))
    # tf's default dct_method is libjpeg's fast integer IDCT: a few levels off (measured 4-5);
    # INTEGER_ACCURATE (islow) equals PIL exactly, as checked above.
    assert worst <= 8
    f.close()


def test_encoded_clips_torch_and_numpy_round_trip(path: Path) -> None:
    f = Clips(path)
    batch = dict(x=h5s.Clips("video", K, encoded=True, random=False), p=h5s.Position())
    for b in [*f.serve(batch, batch_size=4), *f.iter_batches(batch, batch_size=4)]:
        for row, p, n in zip(b["x"], np.asarray(b["p"]), np.asarray(b["x_lengths"])):
            full = f.video.frames(int(p), encoded=True)
            t0 = next(t for t in range(len(full)) if full[t] == row[0])
            assert list(row[:n]) == full[t0 : t0 + n] and n == min(K, len(full))
    f.close()


def test_clip_counts_and_segments(path: Path) -> None:
    f = Clips(path)
    lengths = f.video.lengths
    every = FileDataset(f, dict(x=h5s.Clips("video", K, every=4)))
    assert len(every) == int(np.maximum(1, -(-lengths // 4)).sum())
    per = FileDataset(f, dict(x=h5s.Clips("video", K, per_item=3)))
    assert len(per) == 3 * len(f)
    skip = FileDataset(f, dict(x=h5s.Clips("video", K, per_item=2, pad="skip")))
    assert len(skip) == 2 * int((lengths >= K).sum())
    # The three clips of a 13-frame video start in the three thirds of its 10 offsets.
    g = h5s.Clips("video", K, per_item=3)
    seen = set()
    for epoch in range(6):
        req = Request(np.full(3, 2), np.arange(3), np.arange(6, 9), epoch, 0, {})
        first = g.offsets(np.full(3, 13), req)
        assert 0 <= first[0] <= 2 and 3 <= first[1] <= 5 and 6 <= first[2] <= 9
        seen.add(tuple(first.tolist()))
    assert len(seen) > 1  # new offsets in another epoch
    mid = h5s.Clips("video", K, per_item=3, random=False).offsets(np.full(3, 13), req)
    assert mid.tolist() == [1, 4, 7]
    f.close()


def test_min_size_decodes_smaller_in_the_idct(path: Path, decoder: str) -> None:
    f = Clips(path)
    b = next(iter(f.iter_batches(dict(x=h5s.Clips("video", K, min_size=(H // 2, W // 2))), batch_size=2)))
    assert b["x"].shape == (2, K, H // 2, W // 2, 3)
    from PIL import Image

    first = sorted(source(path, f.ids[0]).glob("*.jpg"), key=lambda q: int(q.stem))
    im = Image.open(first[0])
    im.draft("RGB", (W // 2, H // 2))
    assert im.size == (W // 2, H // 2)
    np.testing.assert_array_equal(f.video.feature.decode_blob(first[0].read_bytes()).shape, (H, W, 3))
    np.testing.assert_array_equal(jpeg.decode(first[0].read_bytes(), min_size=(H // 2, W // 2)), np.asarray(im))
    f.close()


def test_bad_arguments() -> None:
    for kw in (dict(length=0), dict(length=4, per_item=0), dict(length=4, every=-1), dict(length=4, pad="wrap"),
               dict(length=4, min_size=(0, 3))):
        with pytest.raises(ValueError, match="Clips"):
            h5s.Clips("video", **kw)


@pytest.mark.parametrize("getter", [h5s.Clips("video", K), h5s.Clips("video", K, encoded=True),
                                    h5s.Frames("video", K, 2)], ids=["Clips", "encoded", "Frames"])
def test_a_damaged_frame_raises_naming_the_file(path: Path, tmp_path: Path, getter: h5s.Getter) -> None:
    import shutil

    bad = tmp_path / "damaged.h5"
    shutil.copy(path, bad)
    with Clips(path) as f:
        first = f.video.frames(0, encoded=True)[0]
    data = bad.read_bytes()
    at = data.find(first) + len(first) // 2  # inside the first frame's entropy-coded data
    assert data.count(first) == 1 and at > 0
    with open(bad, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([data[at] ^ 0xFF]))
    f = Clips(bad)
    with pytest.raises(h5s.CorruptRecordError, match="damaged.h5"):
        for _ in f.iter_batches(dict(x=getter), batch_size=len(f), threads=0):
            pass
    f.close()
