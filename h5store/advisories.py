"""Published vulnerabilities of the HDF5 library that a crafted file can reach.

No check above the library prevents memory corruption while HDF5 parses crafted metadata:
:func:`hdf5_advisories` lists the known CVEs that apply to the HDF5 in use, and the untrusted
checks warn with :class:`H5StoreSecurityWarning` on such a version. The table is a dated data
file, ``h5store/data/hdf5_advisories.json`` (its ``as_of`` date and its sources), read at first
use, not at import. See ``docs/reliability.md``.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any

import h5py

__all__ = ["Advisory", "H5StoreSecurityWarning", "advisories_as_of", "hdf5_advisories", "warn_advisories"]

_DATA = "data/hdf5_advisories.json"


class H5StoreSecurityWarning(UserWarning):
    """The HDF5 library in use has published vulnerabilities reachable from crafted files."""


@dataclass(frozen=True)
class Advisory:
    """Published vulnerabilities of HDF5 releases before ``fixed_in``."""

    ids: str
    summary: str
    fixed_in: tuple[int, int, int] | None
    affected_through: tuple[int, int, int] | None
    mitigation: str
    source: str

    def affects(self, version: tuple[int, int, int]) -> bool:
        if self.fixed_in is not None and version >= self.fixed_in:
            return False
        return self.affected_through is None or version <= self.affected_through



def _version(text: str | None) -> tuple[int, int, int] | None:
    return None if text is None else _parse_version(text)


@functools.cache
def _table() -> tuple[str, tuple[Advisory, ...]]:
    """(as_of, advisories) of the bundled data file, read once."""
    raw = json.loads(resources.files("h5store").joinpath(_DATA).read_text(encoding="utf-8"))
    sources = raw["sources"]
    found = tuple(
        Advisory(a["ids"], a["summary"], _version(a["fixed_in"]), _version(a["affected_through"]),
                 a["mitigation"], sources[a["source"]])
        for a in raw["advisories"]
    )
    return raw["as_of"], found


def advisories_as_of() -> str:
    """The date (ISO 8601) the bundled advisory table was last checked against its sources.

    Examples
    --------
    >>> advisories_as_of()  # doctest: +SKIP
    '2026-11-22'
    """
    return _table()[0]


def __getattr__(name: str) -> Any:
    # HDF5_ADVISORIES: the known CVEs, read from the data file at first use.
    if name == "HDF5_ADVISORIES":
        return _table()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _parse_version(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]] + [0, 0, 0]
    return parts[0], parts[1], parts[2]


def hdf5_advisories(version: str | None = None) -> list[Advisory]:
    """The known advisories (``HDF5_ADVISORIES``, from the data file) that apply to ``version`` (default: the HDF5 h5py uses).

    Examples
    --------
    >>> [a.ids for a in hdf5_advisories("2.2.0")]
    ['CVE-2026-19025']
    """
    v = _parse_version(version if version is not None else h5py.version.hdf5_version)
    return [a for a in _table()[1] if a.affects(v)]


def warn_advisories() -> None:
    """Warn :class:`H5StoreSecurityWarning` when the HDF5 in use has known advisories."""
    found = hdf5_advisories()
    if not found:
        return
    fixed = sorted({".".join(map(str, a.fixed_in)) for a in found if a.fixed_in})
    warnings.warn(
        f"HDF5 {h5py.version.hdf5_version} (used by h5py {h5py.version.version}) has published CVEs "
        f"reachable from crafted files ({len(found)} advisories, fixed in HDF5 {', '.join(fixed) or 'no release yet'}); "
        "h5store's untrusted checks avoid some of them, not all: parse files from strangers with "
        "h5store.integrity.verify_in_subprocess (see docs/reliability.md)",
        H5StoreSecurityWarning,
        stacklevel=3,
    )

