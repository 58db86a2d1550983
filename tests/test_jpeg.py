"""h5store.jpeg.decode_many: a clip's frames into its batch slot, the same pixels as decode()."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from h5store import jpeg


def _jpeg(a: np.ndarray, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a.squeeze(-1) if a.shape[-1] == 1 else a).save(buf, format=fmt, quality=90)
    return buf.getvalue()


def _frames(n: int, h: int, w: int, c: int = 3, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [_jpeg(rng.integers(0, 256, (h, w, c), dtype=np.uint8)) for _ in range(n)]


@pytest.mark.parametrize("c", [3, 1])
@pytest.mark.parametrize("min_size", [None, (10, 14), (4, 4)])
def test_decode_many_equals_decode_frame_by_frame(c: int, min_size: tuple[int, int] | None) -> None:
    blobs = _frames(5, 40, 56, c)
    first = jpeg.decode(blobs[0], min_size=min_size)
    out = np.full((5, *first.shape), 7, np.uint8)
    jpeg.decode_many([np.frombuffer(b, np.uint8) for b in blobs], out, min_size)  # uint8 arrays, as stored
    for k, b in enumerate(blobs):
        np.testing.assert_array_equal(out[k], jpeg.decode(b, min_size=min_size))
        np.testing.assert_array_equal(out[k], np.asarray(_pil(b, min_size)))


def _pil(b: bytes, min_size: tuple[int, int] | None) -> np.ndarray:
    return jpeg._pil_decode(b, min_size)


def test_a_frame_of_another_size_is_refused_not_decoded_into_part_of_the_slot() -> None:
    blobs = _frames(3, 40, 56) + _frames(1, 32, 56, seed=1)  # the last frame is smaller: fits the slot's bytes
    out = np.zeros((4, 40, 56, 3), np.uint8)
    with pytest.raises(ValueError, match=r"decodes to uint8 \(32, 56, 3\)"):
        jpeg.decode_many(blobs, out)
    grey = _frames(1, 40, 56, 1)
    with pytest.raises(ValueError):
        jpeg.decode_many(grey, np.zeros((1, 40, 56, 3), np.uint8))


def test_corrupt_and_non_jpeg_frames() -> None:
    good = _frames(1, 16, 16)[0]
    out = np.zeros((1, 16, 16, 3), np.uint8)
    with pytest.raises(ValueError):
        jpeg.decode_many([good[: len(good) // 3]], out)
    png = _jpeg(np.full((16, 16, 3), 200, np.uint8), "PNG")  # not a JPEG: decoded by PIL, same slot
    jpeg.decode_many([png], out)
    assert (out == 200).all()
