"""ImageFolder-style images served as random resized crops (``h5s.ImageCrop``) and as bytes
(``h5s.Encoded``), checked against PIL's decoding of the source files."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store import jpeg
from h5store.serving import FileDataset, Request
from h5store.serving.getters import crop_boxes

Image = pytest.importorskip("PIL.Image")


class Photos(h5s.TypedFile):
    image = h5s.EncodedImage()
    label = h5s.DirLabel()


SIZES = [(60, 80), (96, 64), (41, 57), (120, 160), (33, 33), (80, 100), (64, 48), (100, 70)]


def picture(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(x * 5) % 256, (y * 7) % 256, ((x + y) * 3) % 256], -1) + rng.integers(0, 30, (h, w, 3))
    return np.clip(a, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("folder")
    for k, (h, w) in enumerate(SIZES):
        d = root / f"class{k % 3}"
        d.mkdir(exist_ok=True)
        a = picture(h, w, k)
        if k == 2:
            Image.fromarray(a[..., 0]).save(d / f"img{k}.jpg", quality=90)  # grey JPEG
        elif k == 5:
            Image.fromarray(a).save(d / f"img{k}.png")  # PNG: decoded by PIL
        else:
            Image.fromarray(a).save(d / f"img{k}.jpg", quality=90)
    path = root.parent / "photos.h5"
    Photos.create(path, sources=str(root), n_workers=1, progress=False).close()
    return root, path


def source(root: Path, ident: str) -> Path:
    return next(root.glob(f"{ident}.*"))


def reference_crop(src: Path, box: tuple[int, int, int, int], size: tuple[int, int], flip: bool) -> np.ndarray:
    """The crop done by hand with PIL on the source file (draft = the same IDCT scaling)."""
    top, left, ch, cw = box
    oh, ow = size
    im = Image.open(src)
    h, w = im.height, im.width
    s = next(s for s in (8, 4, 2, 1) if s == 1 or (ch >= s * oh and cw >= s * ow))
    if s > 1 and im.format == "JPEG":
        im.draft(im.mode, (w // s, h // s))  # PIL's draft: the largest scale whose size is >= these
    im = im.convert("RGB")
    fy, fx = im.height / h, im.width / w
    out = im.resize((ow, oh), Image.BILINEAR, box=(left * fx, top * fy, (left + cw) * fx, (top + ch) * fy))
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(out)


@pytest.fixture(params=["simplejpeg", "pil"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pil":  # the fallback without simplejpeg
        monkeypatch.setattr(jpeg, "_sj", None)
        monkeypatch.setattr(jpeg, "_tried", True)
    assert jpeg.decoder() == request.param
    return request.param


@pytest.mark.parametrize("size", [(16, 16), (24, 32)])
@pytest.mark.parametrize("random", [True, False])
def test_crops_equal_pil_on_the_source_files(corpus: tuple[Path, Path], size: tuple[int, int], random: bool,
                                             decoder: str) -> None:
    root, path = corpus
    f = Photos(path)
    g = h5s.ImageCrop("image", size, random=random)
    ds = FileDataset(f, dict(x=g, p=h5s.Position()), seed=4)
    for epoch in (0, 1):
        idx = np.arange(len(f))
        b = ds.fetch(idx, epoch=epoch)
        assert b["x"].shape == (len(f), *size, 3) and b["x"].dtype == np.uint8
        shapes = np.array([f.image.feature.image_size(f.image.column.read_items([p])[0]) for p in range(len(f))])
        req = Request(idx, np.zeros_like(idx), idx, epoch, 4, {})
        boxes = g.boxes(shapes, req)
        from h5store.serving.getters import mix64

        flips = (mix64(4, epoch, idx, 99) & np.uint64(1)).astype(bool)
        assert 0 < flips.sum() < len(f)  # some flipped, some not
        for j, p in enumerate(b["p"].tolist()):
            src = source(root, f.ids[p])
            np.testing.assert_array_equal(b["x"][j], reference_crop(src, tuple(boxes[j]), size, bool(flips[j])))
    f.close()


def test_crop_boxes_follow_torchvision_rules() -> None:
    n = 2000
    h = np.full(n, 300)
    w = np.full(n, 400)
    b = crop_boxes(h, w, (0.08, 1.0), (3 / 4, 4 / 3), seed=1, epoch=0, indices=np.arange(n))
    top, left, ch, cw = b.T
    assert (top >= 0).all() and (left >= 0).all() and (top + ch <= 300).all() and (left + cw <= 400).all()
    area = ch * cw / (300 * 400)
    assert area.min() >= 0.07 and area.max() <= 1.0 and 0.4 < area.mean() < 0.65
    r = cw / ch
    assert r.min() > 0.7 and r.max() < 1.4
    again = crop_boxes(h, w, (0.08, 1.0), (3 / 4, 4 / 3), seed=1, epoch=0, indices=np.arange(n))
    np.testing.assert_array_equal(b, again)
    other = crop_boxes(h, w, (0.08, 1.0), (3 / 4, 4 / 3), seed=1, epoch=1, indices=np.arange(n))
    assert (other != b).any()
    # A very thin image: no draw fits, the centre crop with the ratio clamped is taken.
    thin = crop_boxes(np.array([10]), np.array([1000]), (0.9, 1.0), (3 / 4, 4 / 3), 0, 0, np.array([0]))
    assert thin.tolist() == [[0, 493, 10, 13]]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_crops_in_dataloader_workers_and_tf(corpus: tuple[Path, Path], context: str) -> None:
    _, path = corpus
    f = Photos(path)
    batch = dict(x=h5s.ImageCrop("image", 16), y=h5s.Label("label"), p=h5s.Position())
    ref = FileDataset(f, batch, seed=2)
    for b in f.serve(batch, batch_size=3, num_workers=2, multiprocessing_context=context, seed=2):
        idx = b["p"].numpy()  # no shuffle: the dataset index is the position
        np.testing.assert_array_equal(b["x"].numpy(), ref.fetch(idx, epoch=0)["x"])
    f.close()


def test_crops_tf(corpus: tuple[Path, Path]) -> None:
    pytest.importorskip("tensorflow")
    _, path = corpus
    f = Photos(path)
    batch = dict(x=h5s.ImageCrop("image", (8, 12)), p=h5s.Position())
    ref = FileDataset(f, batch, seed=0)
    ds = f.to_tf_dataset(batch, batch_size=4)
    assert ds.element_spec["x"].shape.as_list() == [None, 8, 12, 3]
    for b in ds:
        np.testing.assert_array_equal(b["x"].numpy(), ref.fetch(b["p"].numpy(), epoch=0)["x"])
    f.close()


def test_encoded_images_round_trip_exactly(corpus: tuple[Path, Path]) -> None:
    root, path = corpus
    f = Photos(path)
    files = {p.stem: p.read_bytes() for p in root.glob("*/*")}
    for b in f.iter_batches(dict(x=h5s.Encoded("image"), p=h5s.Position()), batch_size=3):
        for raw, p in zip(b["x"], b["p"].tolist()):
            assert raw == files[Path(f.ids[p]).stem]
            np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(raw))).reshape(-1),
                                          f.image[p].reshape(-1))
    tf = pytest.importorskip("tensorflow")
    ds = f.to_tf_dataset(dict(x=h5s.Encoded("image"), p=h5s.Position()), batch_size=4)
    assert ds.element_spec["x"] == tf.TensorSpec((None,), tf.string)
    for b in ds:
        for raw, p in zip(b["x"].numpy().tolist(), b["p"].numpy().tolist()):
            assert raw == files[Path(f.ids[p]).stem]
    with pytest.raises(h5s.SchemaError, match="is not an encoded image"):
        FileDataset(f, dict(x=h5s.ImageCrop("label", 8)))
    f.close()


def test_image_decode_equals_pil(corpus: tuple[Path, Path]) -> None:
    root, path = corpus
    with Photos(path) as f:
        for p in range(len(f)):
            src = source(root, f.ids[p])
            ref = np.asarray(Image.open(src))
            np.testing.assert_array_equal(f.image[p], ref if ref.ndim == 3 else ref[..., None])
