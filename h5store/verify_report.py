"""What :func:`h5store.integrity.verify` found: a :class:`VerifyReport` of :class:`Problem` s,
named by group, feature and id; falsy when anything is wrong, and JSON-able (the subprocess
verify hands it back as JSON).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Problem", "VerifyReport"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a file: where, which id (when one), and why.

    ``group`` is "" for the root group; ``feature`` is "" for the group itself and
    ``"ids"`` for its ids table; ``row`` is the id's position.
    """

    group: str
    feature: str
    reason: str
    id: str | None = None
    row: int | None = None

    @property
    def where(self) -> str:
        return "/" + "/".join(p for p in (self.group, self.feature) if p)

    def __str__(self) -> str:
        who = ""
        if self.id is not None:
            who = f" id {self.id!r}" + (f" (row {self.row})" if self.row is not None else "")
        elif self.row is not None:
            who = f" row {self.row}"
        return f"{self.where}{who}: {self.reason}"


@dataclass
class VerifyReport:
    """What :func:`verify` found. Falsy when the file has any problem.

    Attributes
    ----------
    fatal : str or None
        Why the file could not be checked at all (unopenable, refused as untrusted).
    truncated : (int, int) or None
        ``(size, expected)``: the file's size and the end-of-file address in its superblock.
    problems : list of Problem
        The first ``max_errors`` problems; ``n_problems`` counts them all.
    lost : dict
        Feature path -> items lost to a truncation.
    unreadable : dict
        Group, feature or ids path -> the parts of it that could not be read.
    """

    path: str
    deep: bool = False
    untrusted: bool = False
    max_errors: int = 1000
    fatal: str | None = None
    truncated: tuple[int, int] | None = None
    problems: list[Problem] = field(default_factory=list)
    n_problems: int = 0
    groups: int = 0
    features: int = 0
    ids: int = 0
    items: int = 0
    items_verified: int = 0
    bytes_verified: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    unreadable: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __bool__(self) -> bool:
        return self.fatal is None and self.n_problems == 0 and self.truncated is None

    @property
    def ok(self) -> bool:
        return bool(self)

    def add(self, problem: Problem) -> None:
        self.n_problems += 1
        if len(self.problems) < self.max_errors:
            self.problems.append(problem)

    def summary(self) -> str:
        """One line: the verdict and what was checked."""
        counts = (f"{self.groups} group(s), {self.features} feature(s), {self.ids} id(s), {self.items} item(s)"
                  + (f", {self.items_verified} CRC-32 checked ({_human(self.bytes_verified)})" if self.deep else ""))
        if self.truncated is not None:
            size, eof = self.truncated
            lost = sum(self.lost.values())
            parts = [f"{self.path}: TRUNCATED: {size} of {eof} bytes (the end-of-file address in its superblock)"]
            if self.fatal is not None:
                parts.append(self.fatal.removeprefix(f"{self.path}: "))
            else:
                what = ", ".join(f"{k} {v}" for k, v in sorted(self.lost.items()))
                if self.items:
                    parts.append(f"lost {lost} of the {self.items} item(s) whose index survived"
                                 + (f" ({what})" if what else ""))
                if self.unreadable:
                    parts.append("unreadable (lost): " + ", ".join(
                        f"{k} ({', '.join(v)})" for k, v in self.unreadable.items()))
            return "; ".join(parts)
        if self.fatal is not None:
            return self.fatal
        quick = "" if self.deep else ("; structure only: item data was not read (its CRC-32s not checked; "
                                      "check every item with deep=True, `h5store verify` without --quick)")
        if self.n_problems:
            return f"{self.path}: {self.n_problems} problem(s) in {counts}{quick}"
        return f"{self.path}: OK: {counts}{quick}"

    def lines(self) -> list[str]:
        """The summary, then one line per problem (at most ``max_errors``)."""
        out = [self.summary()]
        out.extend(f"  {p}" for p in self.problems)
        if self.n_problems > len(self.problems):
            out.append(f"  ... and {self.n_problems - len(self.problems)} more")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["truncated"] = list(self.truncated) if self.truncated else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifyReport:
        d = dict(d)
        d["problems"] = [Problem(**p) for p in d.get("problems", [])]
        d["truncated"] = tuple(d["truncated"]) if d.get("truncated") else None
        return cls(**d)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"

