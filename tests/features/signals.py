"""Small real inputs for the feature tests: wav/flac/ogg files written by soundfile, images by pillow."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SR = 16000


def tone(seconds: float = 1.0, sr: int = SR, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A deterministic float32 test signal in [-0.6, 0.6]: a chord plus a little noise."""
    t = np.arange(int(seconds * sr)) / sr
    rng = np.random.default_rng(seed)
    cols = [
        0.3 * np.sin(2 * np.pi * (220 * (c + 1)) * t) + 0.2 * np.sin(2 * np.pi * 3100 * t + c) + 0.05 * rng.standard_normal(len(t))
        for c in range(channels)
    ]
    x = np.stack(cols, axis=1).astype(np.float32)
    return x[:, 0] if channels == 1 else x


def write_audio(path: Path, seconds: float = 1.0, sr: int = SR, channels: int = 1, subtype: str | None = None,
                format: str | None = None) -> np.ndarray:
    """Write :func:`tone` to ``path`` with soundfile; returns the signal written."""
    import soundfile as sf

    x = tone(seconds, sr, channels)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), x, sr, subtype=subtype, format=format)
    return x


def picture(h: int = 24, w: int = 32, seed: int = 0) -> np.ndarray:
    """A smooth deterministic RGB uint8 image (JPEG-friendly gradients plus a block)."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y + seed * 17) % 256], axis=2)
    img[h // 4 : h // 2, w // 4 : w // 2] = (200, 30, 90)
    return img.astype(np.uint8)


def write_image(path: Path, img: np.ndarray | None = None, format: str | None = None, **save: object) -> np.ndarray:
    """Save ``img`` (default :func:`picture`) with pillow; returns the pixels given."""
    from PIL import Image

    img = picture() if img is None else img
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(img).save(str(path), format=format, **save)
    return img
