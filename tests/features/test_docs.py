"""The code of docs/features.md runs, and its custom feature passes the conformance kit."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import h5store as h5s
from h5store.testing import FeatureTests

from .signals import write_audio

DOC = Path(__file__).resolve().parents[2] / "docs" / "features.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)

# Run every block, in order, in one namespace named after this module (so that the classes
# it defines pickle by reference, as a user's module-level classes do).
_ns: dict[str, Any] = {"__name__": __name__}
for _block in BLOCKS:
    exec(compile(_block, str(DOC), "exec"), _ns)
FrameEnergy = _ns["FrameEnergy"]


def test_doc_blocks_declare_what_they_say():
    assert len(BLOCKS) == 4
    assert _ns["Compressed"].mel.spec().compression == "blosc" and _ns["Compressed"].mag.spec().compression == "zstd"
    assert _ns["Speech"].mel.spec().shape == (None, 80)
    assert h5s.feature_types()["myproject.FrameEnergy"] is FrameEnergy
    with pytest.raises(h5s.SchemaError, match="Bad.energy: frame must be > 0, got 0"):
        type("Bad", (h5s.TypedFile,), {"energy": FrameEnergy(frame=0)})


class TestFrameEnergy(FeatureTests):
    rtol = 1e-6
    name = "energy"

    def make_feature(self):
        return FrameEnergy(frame=320)

    def make_source(self, tmp_path):
        write_audio(tmp_path / "a.wav", seconds=0.5)
        return str(tmp_path / "a.wav")

    def expected(self, source):
        return FrameEnergy(frame=320).energy(source).astype(np.float32)

    def roundtrip(self, obj):
        return pickle.loads(pickle.dumps(obj))

    def test_mean_is_learned_and_kept_when_appending(self, tmp_path):
        cls, feature, src, path = self.write(tmp_path)
        assert feature.mean > 0
        assert FrameEnergy(frame=320).prepare([], existing=feature).mean == feature.mean
        with h5s.open(path) as f:
            assert f.energy.attrs["mean"] == feature.mean
