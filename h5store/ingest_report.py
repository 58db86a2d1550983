"""What a create or append did: an :class:`IngestReport` of the sources stored, skipped and
failed (each :class:`Failure` named by id, feature and error), and the failures stored in the
file itself (``/_h5store/failures``, JSON) by the creates and appends that built it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from h5store.typed_file import TypedFile

__all__ = ["FAILURES_PATH", "Failure", "IngestReport", "shown", "store_failures", "stored_failures"]

FAILURES_PATH = "_h5store/failures"
_NUMBERS = re.compile(r"\d+(\.\d+)?")


def shown(text: str) -> str:
    """``text`` as is, or its repr when it holds a newline or another unprintable character."""
    return text if text.isprintable() else repr(text)


@dataclass(frozen=True)
class Failure:
    """One source that was not stored, and why.

    ``error`` is the exception type a feature raised, or one of ``DuplicateIdError`` (more
    than one source has this id: none of them is stored), ``InvalidIdError`` (the source's
    name makes no valid id, e.g. it holds a newline), ``WorkerDied`` and ``SpoolError``.
    """

    id: str
    feature: str
    error: str
    message: str
    source: str

    def __str__(self) -> str:
        return f"{shown(self.id)} [{self.feature}] {self.error}: {self.message}"


@dataclass
class IngestReport:
    """What a create or append did.

    Attributes
    ----------
    n_sources : int
        Sources that at least one feature accepts.
    n_stored : int
        Ids stored by this run.
    n_skipped : int
        Sources already in the file (append or resume), not loaded again.
    failures : list of Failure
        Sources not stored: one entry per source and feature that failed, with the
        exception type and message (a source fails whole when any of its features fails).
    warnings : list of [category, message, count, example id]
        Each distinct warning the features raised while loading (e.g. librosa's "n_fft is
        too large"), once, with how many sources raised it and one of them.
    wall_seconds, writer_seconds, load_seconds : float
        Wall time of the run; time the parent spent writing; summed worker time.
    writer_cpu_seconds : float
        CPU time the parent's thread spent writing: ``writer_seconds`` without the waits for
        a core (on a busy machine the two differ a lot).

    Examples
    --------
    >>> r = IngestReport(n_sources=11, n_stored=7)
    >>> r.failures.append(Failure("a", "mel", "ValueError", "too short", "/d/a.wav"))
    >>> r.summary()
    '7 stored, 0 already present, 1 of 11 sources failed in 0.0 s (writer 0.0 s)'
    """

    n_sources: int = 0
    n_stored: int = 0
    n_skipped: int = 0
    failures: list[Failure] = field(default_factory=list)
    warnings: list[list[Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    writer_seconds: float = 0.0
    load_seconds: float = 0.0
    writer_cpu_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def n_failed(self) -> int:
        """Sources that failed (a source with two failing features counts once)."""
        return len({f.source for f in self.failures})

    def summary(self) -> str:
        warned = f", {len(self.warnings)} distinct warning(s)" if self.warnings else ""
        return (
            f"{self.n_stored} stored, {self.n_skipped} already present, {self.n_failed} of "
            f"{self.n_sources} sources failed in {self.wall_seconds:.1f} s "
            f"(writer {self.writer_seconds:.1f} s){warned}"
        )

    def lines(self) -> list[str]:
        """The summary, then each failed source with its features' errors, then the warnings."""
        out = [self.summary()]
        by_source: dict[str, list[Failure]] = {}
        for f in self.failures:
            by_source.setdefault(f.source, []).append(f)
        for source, fails in by_source.items():
            out.append(f"  failed: {shown(source)} (id {shown(fails[0].id)})")
            out.extend(f"    {f.feature}: {f.error}: {f.message}" for f in fails)
        for category, message, count, example in self.warnings:
            out.append(f"  warning ({count} source{'s' if count != 1 else ''}, e.g. {shown(example)}): "
                       f"{category}: {message}")
        return out

    def _warn(self, warning: tuple[str, str], id: str) -> None:
        # "n_fft=1024 is too large for input signal of length=500" differs by its numbers
        # from source to source: those count as one warning, shown by its first message.
        key = (warning[0], _NUMBERS.sub("#", warning[1]))
        for entry in self.warnings:
            if (entry[0], _NUMBERS.sub("#", entry[1])) == key:
                entry[2] += 1
                return
        self.warnings.append([warning[0], warning[1], 1, id])



def store_failures(tf: TypedFile, failures: Sequence[Failure]) -> None:
    """Record ``failures`` in the file, replacing older entries of the same id and feature and
    dropping those of ids the file now holds."""
    h5 = tf.h5
    old: list[dict[str, str]] = []
    if FAILURES_PATH in h5:
        old = json.loads(h5[FAILURES_PATH][()].tobytes().decode("utf-8"))
        del h5[FAILURES_PATH]
    fresh = [asdict(f) for f in failures]
    keep = {(f["id"], f["feature"]) for f in fresh}
    merged = [f for f in old if (f["id"], f["feature"]) not in keep and f["id"] not in tf] + fresh
    h5.create_dataset(FAILURES_PATH, data=np.frombuffer(json.dumps(merged).encode("utf-8"), np.uint8))


def stored_failures(tf: TypedFile) -> list[Failure]:
    """The failures recorded in a file by the creates and appends that built it."""
    h5 = tf.h5
    if FAILURES_PATH not in h5:
        return []
    return [Failure(**d) for d in json.loads(h5[FAILURES_PATH][()].tobytes().decode("utf-8"))]
