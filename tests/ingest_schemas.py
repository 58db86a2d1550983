"""Schemas for the ingest tests; importable by joblib and Dask worker processes."""

from __future__ import annotations

import os
import time

import numpy as np

import h5store as h5s


class Numbers(h5s.Feature):
    """Whitespace-separated numbers in a .txt file; 'crash' kills the worker, 'sleep' is slow."""

    type_name = "tests.Numbers"
    dtype: str = "float32"
    shape: tuple = (None,)
    pattern: str = r"(?i)\.txt$"
    finite: bool = True
    delay: float = 0.0

    def load(self, source):
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
        if text.startswith("crash"):
            os._exit(3)
        if text.startswith("boom"):
            raise RuntimeError("boom: this source is bad")
        if self.delay:
            time.sleep(self.delay)
        return np.array([float(x) for x in text.split()], dtype="float64")


class Speaker(h5s.Feature):
    """The manifest's `speaker` column (Source.meta) as utf-8 text."""

    type_name = "tests.Speaker"
    dtype: str = "uint8"
    shape: tuple = (None,)
    pattern: str = r"(?i)\.txt$"

    def load(self, source):
        return np.frombuffer(source.meta["speaker"].encode("utf-8"), np.uint8)


class Nums(h5s.TypedFile):
    nums = Numbers()


class SlowNums(h5s.TypedFile):
    nums = Numbers(delay=0.05)


class WithSpeaker(h5s.TypedFile):
    nums = Numbers()
    speaker = Speaker()


class PacedNumbers(Numbers):
    """Numbers that sleep ``$H5STORE_TEST_LOAD_DELAY`` seconds per source (unset: no delay).

    The delay comes from the environment, not from a parameter stored in the file, so a slow
    create in a child process (and its joblib workers, which inherit the environment) and a
    fast resume of the same partial file in the test process share one schema.
    """

    type_name = "tests.PacedNumbers"

    def load(self, source):
        delay = float(os.environ.get("H5STORE_TEST_LOAD_DELAY") or 0)
        if delay:
            time.sleep(delay)
        return super().load(source)


class PacedNums(h5s.TypedFile):
    nums = PacedNumbers()


class WarningNumbers(Numbers):
    """Numbers that warn, as librosa does on short inputs, when the file starts with 'warn'."""

    type_name = "tests.WarningNumbers"

    def load(self, source):
        import warnings

        with open(source, encoding="utf-8") as fh:
            text = fh.read()
        if text.startswith("warn"):
            values = text.split()[1:]
            warnings.warn(f"n_fft=1024 is too large for input signal of length={len(values)}", UserWarning, stacklevel=2)
            return np.array([float(x) for x in values])
        return super().load(source)


class WarnNums(h5s.TypedFile):
    nums = WarningNumbers()


class LabeledNums(h5s.TypedFile):
    """Numbers plus a label vocabulary learned in ``prepare`` (the sharded-create tests)."""

    nums = Numbers()
    label = h5s.DirLabel()


class PacedLabeledNums(h5s.TypedFile):
    nums = PacedNumbers()
    label = h5s.DirLabel()


def set_load_delay(seconds: float | None) -> None:
    """Set (None: unset) PacedNumbers' delay in this process (run on Dask workers by client.run)."""
    if seconds is None:
        os.environ.pop("H5STORE_TEST_LOAD_DELAY", None)
    else:
        os.environ["H5STORE_TEST_LOAD_DELAY"] = str(seconds)
