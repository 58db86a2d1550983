"""Transforms for the transform tests, importable by spawned DataLoader workers."""

from __future__ import annotations

from typing import Any

import numpy as np

import h5store as h5s
from h5store.serving.transforms import Transform


class Marker:
    """A plain function-like transform: adds key ``m`` holding ``value`` for every example."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        out = dict(batch)
        out["m"] = np.full(len(batch["pos"]), self.value, np.int64)
        return out


class Noisy(Transform):
    """Draws one random number per example from the batch's generator (key ``r``)."""

    def apply(self, batch: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        return {**batch, "r": rng.random(len(batch["pos"]))}


def speech_transform() -> Any:
    """The augmentation chain the determinism tests serve."""
    from h5store.serving import transforms as T

    return T.Compose([T.Gain("x", -6, 6), T.TimeMask("x", 4, n=1), T.FreqMask("x", 2, n=1), Noisy()])


BATCH = dict(x=h5s.Item("mel"), pos=h5s.Position())
