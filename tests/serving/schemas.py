"""Schemas and getters for the serving tests, importable by spawned DataLoader workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

import h5store as h5s
from h5store.storage import ChunkReader, DirectReader, H5Reader, MemoryReader

MEL = 8


class Speech(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, MEL))
    mag = h5s.Array(dtype="float32", shape=(None, 3))  # as many rows as mel, per item
    label = h5s.Scalar(dtype="int32")
    score = h5s.Scalar(dtype="float32")
    text = h5s.Text()
    logs = h5s.Group(loss=h5s.Array(dtype="float32"))


class SpeechLZF(h5s.TypedFile):
    """The same mel, compressed: read through HDF5, not the direct path."""

    mel = h5s.Array(dtype="float32", shape=(None, MEL), compression="lzf")
    label = h5s.Scalar(dtype="int32")


class Other(h5s.TypedFile):
    """A file whose mel disagrees with Speech's (another row width)."""

    mel = h5s.Array(dtype="float32", shape=(None, 4))


class SpeechDS(Speech, torch.utils.data.Dataset):
    """The pattern users write: a TypedFile that is also a torch Dataset."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"mel": self.mel[i], "label": int(self.label[i]), "pos": i}


def mel_of(seed: int, i: int, n: int) -> np.ndarray:
    return (np.random.default_rng([seed, i]).standard_normal((n, MEL)) + 100 * i).astype("float32")


def make_speech(path: Path | str, n: int, seed: int = 0, lengths: tuple[int, int] = (3, 30),
                cls: type[h5s.TypedFile] = Speech) -> np.ndarray:
    """Write ``n`` items (``id00000``...) and return their lengths."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, n)
    records = []
    for i, t in enumerate(sizes.tolist()):
        values: dict[str, Any] = {"mel": mel_of(seed, i, t), "label": i % 5}
        if cls is Speech:
            values.update(mag=np.full((t, 3), i, "float32") + np.arange(t, dtype="float32")[:, None],
                          score=i / 4, text=f"item {i} é")
        records.append((f"id{i:05d}", values))
    with cls(path, mode="w") as f:
        f.extend(records)
    return sizes


class ReaderKind(h5s.Getter):
    """Which reader served ``feature`` in the process that read the batch (0 direct, 1 HDF5, 2 memory,
    3 compressed chunks decoded by h5store)."""

    def __init__(self, feature: str) -> None:
        self.features = (feature,)

    def fetch(self, files: Any, request: h5s.serving.Request) -> np.ndarray:
        reader = files.column(0, self.features[0]).reader()
        kind = {DirectReader: 0, H5Reader: 1, MemoryReader: 2, ChunkReader: 3}[type(reader)]
        return np.full(len(request), kind, dtype=np.int64)

    def signature(self, files: Any) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype("int64"), ()
