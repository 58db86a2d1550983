"""Sources of a create: folders, globs, CSV manifests and paths, expanded into sorted
:class:`~h5store.schema.Source` objects with stable ids (the path relative to the common root,
without extension, ``/``-separated).
"""

from __future__ import annotations

import csv
import glob
import os
from collections.abc import Mapping
from typing import Any

from h5store.errors import SourceError
from h5store.schema import Source

__all__ = ["expand_sources", "source_id"]


def source_id(path: str, root: str) -> str:
    """The id of ``path``: relative to ``root``, without extension, ``/``-separated.

    Examples
    --------
    >>> source_id("/data/wavs/LJ001-0001.wav", "/data")
    'wavs/LJ001-0001'
    """
    rel = os.path.relpath(path, root) if root else os.path.basename(path)
    stem, ext = os.path.splitext(rel)
    if os.path.isdir(path) or not ext:
        stem = rel
    return stem.replace(os.sep, "/")


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _read_manifest(path: str) -> list[tuple[str, dict[str, str]]]:
    """Rows of a CSV manifest: a ``path`` column (else the first) plus the other columns."""
    with open(path, newline="", encoding="utf-8") as fh:
        sample = fh.read(65536)
        fh.seek(0)
        try:
            dialect: Any = csv.Sniffer().sniff(sample, delimiters=",|\t;")
        except csv.Error:
            dialect = csv.excel
        reader = csv.reader(fh, dialect)
        rows = [r for r in reader if r]
    if not rows:
        raise SourceError(f"{path}: empty manifest")
    header = [h.strip() for h in rows[0]]
    key = header.index("path") if "path" in header else 0
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for r in rows[1:]:
        p = r[key] if key < len(r) else ""
        full = p if os.path.isabs(p) else os.path.join(base, p)
        out.append((full, {h: v for j, (h, v) in enumerate(zip(header, r)) if j != key}))
    if out and not any(os.path.exists(p) for p, _ in out[:1000]):
        # LJSpeech's metadata.csv given as the sources: its first column holds ids, not paths.
        column = "its 'path' column" if "path" in header else "its first column (no 'path' header)"
        raise SourceError(
            f"{path}: read as a manifest, {column} should list files, but none of them exists "
            f"(first: {out[0][0]}). A table of ids and texts (such as LJSpeech's metadata.csv) is not "
            f"a list of sources: pass the audio folder as sources and read the table with "
            f"h5s.CSVColumn({os.path.basename(path)!r}, column=...)"
        )
    return out


_IN_MEMORY = ("create() reads sources from disk (a folder, a glob, a CSV manifest or a list of paths); to store "
              "values you already hold in memory, open the file for writing and extend it: "
              "`with MyFile(path, mode='w') as f: f.extend({id: {feature: value, ...}, ...})`")


def check_paths(sources: Any) -> list[Any]:
    """``sources`` as a list of paths, or :class:`~h5store.errors.SourceError` saying what to do instead.

    Values held in memory (a dict of id -> values, arrays) are not sources: the message
    points to ``extend``.

    Examples
    --------
    >>> check_paths("wavs/")
    ['wavs/']
    """
    if isinstance(sources, Mapping):
        raise SourceError(f"sources is a {type(sources).__name__} of {len(sources)} entries: {_IN_MEMORY}")
    entries = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    for s in entries:
        if not isinstance(s, (str, os.PathLike)):
            raise SourceError(f"a source is a {type(s).__name__}, not a path: {_IN_MEMORY}")
    return entries


def expand_sources(sources: Any, root: str | None = None) -> tuple[list[Source], str]:
    """Expand ``sources`` into sorted :class:`Source` objects and their common root.

    ``sources`` may be a folder (walked recursively; folders are sources too, for features
    such as video frames), a glob pattern, a CSV manifest (``.csv`` given explicitly: a
    ``path`` column, or the first column, plus other columns kept as ``Source.meta``), or a
    list mixing these and plain paths.
    """
    items: list[tuple[str, dict[str, str]]] = []
    dirs: set[str] = set()
    roots: list[str] = []
    entries = check_paths(sources)
    if root is not None and entries and all(isinstance(s, Source) and s.root == os.path.abspath(root) for s in entries):
        # Expanded already (a shard's share of a sharded create): kept with their ids and meta.
        return sorted(entries, key=lambda s: (s.id, str(s))), os.path.abspath(root)
    for s in entries:
        s = os.fspath(s)
        if not os.path.exists(s) and not _is_glob(s) and (len(entries) == 1 or not os.path.splitext(s)[1]):
            # A missing folder (or the only source named) would otherwise just match nothing.
            raise SourceError(f"no such file or folder: {s}")
        if os.path.isdir(s):
            top = os.path.abspath(s)
            roots.append(top)
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames.sort()
                for name in dirnames:
                    items.append((os.path.join(dirpath, name), {}))
                    dirs.add(items[-1][0])
                for name in sorted(filenames):
                    items.append((os.path.join(dirpath, name), {}))
        elif _is_glob(s):
            found = sorted(glob.glob(s, recursive=True))
            if not found and len(entries) == 1:
                raise SourceError(f"no file or folder matches {s}")
            for p in found:
                items.append((os.path.abspath(p), {}))
        elif s.lower().endswith(".csv") and os.path.isfile(s):
            for p, meta in _read_manifest(s):
                items.append((os.path.abspath(p), meta))
        else:
            items.append((os.path.abspath(s), {}))
    if root is None:
        if len(roots) == 1:
            root = roots[0]
        else:
            parents = [os.path.dirname(p) for p, _ in items] or [os.getcwd()]
            root = os.path.commonpath(parents)
    root = os.path.abspath(root)
    out = [Source(p, id=source_id(p, root), root=root, meta=m, is_dir=p in dirs or os.path.isdir(p)) for p, m in items]
    out.sort(key=lambda s: (s.id, str(s)))
    return out, root

