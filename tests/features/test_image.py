"""EncodedImage and EncodedFrames on real files written by pillow, stored in real files."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import h5store as h5s
from h5store import SchemaError, Source, SourceError

from .signals import picture, write_image


def pil_decode(data: bytes) -> np.ndarray:
    a = np.asarray(Image.open(io.BytesIO(data)))
    return a[..., None] if a.ndim == 2 else a


# --------------------------------------------------------------------------- EncodedImage
@pytest.mark.parametrize("name,fmt", [("a.jpg", "JPEG"), ("a.png", "PNG")])
def test_jpeg_and_png_are_stored_byte_for_byte(tmp_path, name, fmt):
    write_image(tmp_path / name, quality=90) if fmt == "JPEG" else write_image(tmp_path / name)
    data = (tmp_path / name).read_bytes()
    img = h5s.EncodedImage()
    raw = img.encode(img.load(Source(str(tmp_path / name))))
    assert raw.dtype == np.uint8 and raw.tobytes() == data
    np.testing.assert_array_equal(img.decode(raw), pil_decode(data))
    if fmt == "PNG":
        np.testing.assert_array_equal(img.decode(raw), picture())


def test_other_formats_are_reencoded_losslessly_as_png(tmp_path):
    write_image(tmp_path / "a.bmp")
    img = h5s.EncodedImage()
    raw = img.encode(img.load(str(tmp_path / "a.bmp")))
    assert raw[:8].tobytes() == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(img.decode(raw), picture())


def test_format_jpeg_converts_png_with_alpha(tmp_path):
    rgba = np.dstack([picture(), np.full(picture().shape[:2], 128, np.uint8)])
    write_image(tmp_path / "a.png", rgba)
    img = h5s.EncodedImage(format="jpg", quality=80)
    assert img.format == "JPEG"
    raw = img.encode(img.load(str(tmp_path / "a.png")))
    assert raw[:2].tobytes() == b"\xff\xd8"
    out = img.decode(raw)
    assert out.shape == (24, 32, 3)
    assert np.abs(out.astype(int) - picture().astype(int)).mean() < 8


def test_arrays_pil_images_and_grey(tmp_path):
    img = h5s.EncodedImage()
    np.testing.assert_array_equal(img.decode(img.encode(picture())), picture())
    np.testing.assert_array_equal(img.decode(img.encode(Image.fromarray(picture()))), picture())
    grey = picture()[:, :, 0]
    out = img.decode(img.encode(grey))
    assert out.shape == (24, 32, 1)
    np.testing.assert_array_equal(out[:, :, 0], grey)
    with pytest.raises(SchemaError, match="pixels must be uint8"):
        img.encode(picture().astype(np.float32))


@pytest.mark.parametrize(
    "content,reason",
    [
        (lambda d: d[: len(d) // 2], "not a decodable image"),
        (lambda d: b"just some text, not a JPEG", "not a decodable image"),
        (lambda d: b"", r"empty file \(0 bytes\)"),
    ],
    ids=["truncated", "text", "empty"],
)
def test_corrupt_images_are_refused(tmp_path, content, reason):
    write_image(tmp_path / "ok.jpg")
    (tmp_path / "bad.jpg").write_bytes(content((tmp_path / "ok.jpg").read_bytes()))
    with pytest.raises(SourceError, match=reason):
        h5s.EncodedImage().load(Source(str(tmp_path / "bad.jpg")))
    with pytest.raises(SchemaError, match="not a decodable image"):
        h5s.EncodedImage().encode(content((tmp_path / "ok.jpg").read_bytes()) or b"x")


def test_image_in_a_file(tmp_path):
    class Photos(h5s.TypedFile):
        image = h5s.EncodedImage()

    paths = [tmp_path / f"{i}.jpg" for i in range(3)]
    for i, p in enumerate(paths):
        write_image(p, picture(seed=i))
    with Photos(tmp_path / "p.h5", mode="w") as f:
        for p in paths:
            f.add(p.stem, {"image": Photos.image.encode(Photos.image.load(str(p)))})
    with h5s.open(tmp_path / "p.h5") as f:
        got = f.image[["2", "0"]]
        np.testing.assert_array_equal(got[0], pil_decode(paths[2].read_bytes()))
        np.testing.assert_array_equal(got[1], pil_decode(paths[0].read_bytes()))
        assert f.image.data.shape[0] == sum(p.stat().st_size for p in paths)


# --------------------------------------------------------------------------- EncodedFrames
def write_video(folder, n=5, h=16, w=24, ext="jpg"):
    frames = [picture(h, w, seed=k) for k in range(n)]
    folder.mkdir(parents=True)
    for k, fr in enumerate(frames):
        write_image(folder / f"frame_{k}.{ext}", fr, quality=95) if ext == "jpg" else write_image(folder / f"frame_{k}.{ext}", fr)
    return frames


def test_frames_folder_natural_order_and_accepts(tmp_path):
    write_video(tmp_path / "v", n=12)
    (tmp_path / "v" / "notes.txt").write_text("not a frame")
    (tmp_path / "empty").mkdir()
    video = h5s.EncodedFrames()
    files = video.frame_files(str(tmp_path / "v"))
    assert [f.rsplit("/", 1)[1] for f in files[:3]] == ["frame_0.jpg", "frame_1.jpg", "frame_2.jpg"]
    assert files[-1].endswith("frame_11.jpg") and len(files) == 12
    assert video.accepts(str(tmp_path / "v"))
    assert not video.accepts(str(tmp_path / "empty")) and not video.accepts(files[0])
    with pytest.raises(SourceError, match="no frame files matching"):
        video.load(str(tmp_path / "empty"))
    with pytest.raises(SourceError, match="not a folder of frames"):
        video.load(files[0])


def test_jpeg_frames_kept_png_frames_encoded(tmp_path):
    write_video(tmp_path / "j", n=3)
    write_video(tmp_path / "p", n=3, ext="png")
    video = h5s.EncodedFrames(quality=90)
    kept = video.encode(video.load(str(tmp_path / "j")))
    assert kept == [(tmp_path / "j" / f"frame_{k}.jpg").read_bytes() for k in range(3)]
    encoded = video.encode(video.load(str(tmp_path / "p")))
    assert all(b[:2] == b"\xff\xd8" for b in encoded)
    assert video.decode([np.frombuffer(b, np.uint8) for b in encoded]).shape == (3, 16, 24, 3)


def test_frames_must_agree(tmp_path):
    write_video(tmp_path / "v", n=2)
    write_image(tmp_path / "v" / "frame_2.jpg", picture(8, 8))
    video = h5s.EncodedFrames()
    with pytest.raises(SchemaError, match="frame 2 is 8x8x3, frame 0 is 16x24x3"):
        video.encode(video.load(str(tmp_path / "v")))
    (tmp_path / "v" / "frame_2.jpg").write_bytes(b"garbage")
    with pytest.raises(SourceError, match="frame_2.jpg: not a decodable image"):
        video.load(str(tmp_path / "v"))
    with pytest.raises(SchemaError, match="at least one frame"):
        video.encode([])
    with pytest.raises(SchemaError, match="no alpha channel"):
        video.encode([np.zeros((4, 4, 4), np.uint8)])


def test_partial_blob_reads_decode_only_those_frames(tmp_path):
    class Clips(h5s.TypedFile):
        video = h5s.EncodedFrames()

    write_video(tmp_path / "a", n=7)
    arrays = [picture(16, 24, seed=10 + k) for k in range(4)]
    with Clips(tmp_path / "c.h5", mode="w") as f:
        f.add("a", {"video": Clips.video.encode(Clips.video.load(str(tmp_path / "a")))})
        f.add("b", {"video": arrays})  # a list of arrays is JPEG-encoded
    with h5s.open(tmp_path / "c.h5") as f:
        whole = f.video["a"]
        assert whole.shape == (7, 16, 24, 3) and whole.dtype == np.uint8
        for k, stop in [(0, 7), (2, 5), (6, 7), (3, 3)]:
            part = f.video.blobs("a", k, stop)
            assert len(part) == stop - k
            np.testing.assert_array_equal(np.stack(part) if part else whole[:0], whole[k:stop])
        # only the requested frames' bytes are read: the column's frame table says where they are
        frames_of_a = f.video.column.frames[f.video.index[0, 0] : f.video.index[0, 1]]
        assert (frames_of_a[2:5, 1] - frames_of_a[2:5, 0]).sum() == sum(
            len((tmp_path / "a" / f"frame_{k}.jpg").read_bytes()) for k in range(2, 5)
        )
        b = f.video["b"]
        assert b.shape == (4, 16, 24, 3)
        assert np.abs(b.astype(int) - np.stack(arrays).astype(int)).mean() < 6
        # bounds behave like a slice's: clamped past the end, negative from the end
        np.testing.assert_array_equal(np.stack(f.video.blobs("a", 5, 9)), whole[5:9])
        np.testing.assert_array_equal(np.stack(f.video.blobs("a", -3)), whole[-3:])
        assert f.video.blobs("a", 9, 12) == []


def test_image_features_need_pillow_message():
    # A process where pillow cannot be imported (None in sys.modules makes the import fail).
    code = (
        "import sys; sys.modules['PIL'] = None\n"
        "import numpy as np, h5store as h5s\n"
        "try:\n"
        "    h5s.EncodedImage().encode(np.zeros((2, 2, 3), np.uint8))\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install h5store[image]" in out
