"""Several files with the same schema served as one: :func:`concat` and :class:`MultiFile`.

:func:`concat` checks that every file has the features of the first (type, dtype, shape,
parameters; storage parameters may differ) and joins them: global position ``p`` is row
``p - starts[k]`` of file ``k`` (:class:`~h5store.serving.files.FileSet`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from h5store.errors import SchemaError
from h5store.schema import Feature
from h5store.serving import api as _api

__all__ = ["MultiFile", "check_compatible", "concat", "feature_identity", "reader_copy", "schema_hash"]

_I64 = np.int64

# Feature parameters that say how bytes are stored, not what they mean: files may differ.
_STORAGE_PARAMS = frozenset({"compression", "compression_opts", "shuffle", "chunk_rows", "attrs", "pattern", "finite"})


def reader_copy(f: Any) -> Any:
    """A read-only, not yet opened copy of a TypedFile: its pickled recipe, rebuilt here."""
    clone = type(f).__new__(type(f))
    clone.__setstate__(f.__getstate__())
    return clone


class MultiFile:
    """Several files with the same schema, served as one (positions run across files).

    Made by :func:`concat`. Served with the same methods as a TypedFile: ``.serve(...)``,
    ``.iter_batches(...)``, ``.to_tf_dataset(...)``; also by
    :class:`~h5store.serving.FileDataset` and the getters' reads.

    Examples
    --------
    >>> shards = h5s.concat(["a.h5", "b.h5"])  # doctest: +SKIP
    >>> loader = shards.serve(dict(x=h5s.Item("mel"), id=h5s.Id()), batch_size=16)  # doctest: +SKIP
    """

    def __init__(self, files: Sequence[Any]) -> None:
        if isinstance(files, (str, os.PathLike)) or callable(getattr(files, "group", None)):
            raise TypeError(f"concat takes a list of files or paths, got {files!r}: h5s.concat([a, b])")
        flat: list[Any] = []
        for f in files:
            if isinstance(f, MultiFile):
                flat.extend(f.files)
            elif isinstance(f, (str, os.PathLike)):
                opened = _open_path(f)  # a sharded dataset's folder or manifest opens as a MultiFile
                flat.extend(opened.files if isinstance(opened, MultiFile) else [opened])
            elif not callable(getattr(f, "group", None)):
                raise TypeError(f"concat takes paths or h5store files (TypedFile), got {type(f).__name__}: {f!r}")
            else:
                flat.append(f)
        if not flat:
            raise ValueError("concat needs at least one file")
        if len(flat) > 1:
            check_compatible(flat)
        self.files = flat

    #: Whether an id names one item across all the files (a sharded dataset's shards), so
    #: ``h5s.Id()`` serves bare ids, not ``"path::id"``.
    unique_ids = False

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def sizes(self, group: str = "") -> np.ndarray:
        """Ids per file in ``group``."""
        return np.array([len(f.group(group)) for f in self.files], dtype=_I64)

    def __len__(self) -> int:
        return int(self.sizes().sum())

    # One spelling per framework, the same as TypedFile's (h5store.serving.api).
    serve = _api.serve
    iter_batches = _api.iter_batches
    to_tf_dataset = _api.to_tf_dataset

    def __repr__(self) -> str:
        return f"<MultiFile of {len(self.files)} files: {self.paths[:3]}{' ...' if len(self.files) > 3 else ''}>"


def _open_path(path: str | os.PathLike[str]) -> Any:
    """``h5store.open(path)``: read-only, its schema from the file (checked by concat now)."""
    # The façade sits above serving in the layers; importing any h5store module has
    # imported it by the time this runs, so it is looked up rather than imported here.
    return importlib.import_module("h5store.typed_file").open(path)


def _shown(value: Any) -> Any:
    return tuple(_shown(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_compatible(files: Sequence[Any]) -> None:
    """Raise :class:`~h5store.errors.SchemaError` unless every file has the features of the first,
    with the same type and parameters (dtype, shape, layout, learned ones such as a label's
    classes); how they are stored (compression, chunks) may differ.

    Examples
    --------
    >>> check_compatible([Speech("a.h5"), Speech("b.h5")])  # doctest: +SKIP
    """
    first = files[0]
    ref = first.file_schema.groups
    for f in files[1:]:
        groups = f.file_schema.groups
        for g in sorted(set(ref) | set(groups)):
            mine, theirs = ref.get(g, {}), groups.get(g, {})
            for name in sorted(set(mine) | set(theirs)):
                if name not in theirs or name not in mine:
                    lacks, has = (f, first) if name not in theirs else (first, f)
                    raise SchemaError(
                        f"concat: {lacks.path} lacks the feature {_ref(g, name)!r} that {has.path} has; "
                        "concat files of one schema (or serve each file on its own)"
                    )
                a, b = mine[name], theirs[name]
                diff = _difference(a, b)
                if diff is not None:
                    param, va, vb = diff
                    raise SchemaError(
                        f"concat: feature {_ref(g, name)!r}: {param} is {va!r} in {first.path} but {vb!r} in "
                        f"{f.path}; concat files whose features agree (type, dtype, shape, parameters such as "
                        "a label's classes; compression may differ)"
                    )


def _ref(group: str, name: str) -> str:
    return f"{group}/{name}" if group else name


def _difference(a: Feature, b: Feature) -> tuple[str, Any, Any] | None:
    """The first parameter that differs between two features (storage parameters aside)."""
    if a.type_name != b.type_name:
        return "the type", a.type_name, b.type_name
    pa, pb = a.params(), b.params()
    for key in sorted((set(pa) | set(pb)) - _STORAGE_PARAMS):
        if _shown(pa.get(key)) != _shown(pb.get(key)):
            return key, _shown(pa.get(key)), _shown(pb.get(key))
    return None


def concat(files: Sequence[Any]) -> MultiFile:
    """Serve several files (paths or open files) as one: positions run through the files in order.

    The files are checked now: every file must have the features of the first with the same
    type, dtype, shape and parameters (learned ones too, such as a label's classes;
    compression may differ), or a :class:`~h5store.errors.SchemaError` names the file, the
    feature and the difference. Paths are opened read-only (``h5store.open``). Each file is
    then opened once per worker process, lazily. ``h5s.Id()`` over a concat gives
    ``"path::id"``: ids alone may repeat across files.

    Examples
    --------
    >>> import h5store as h5s
    >>> shards = h5s.concat(sorted(glob("shards/*.h5")))  # doctest: +SKIP
    >>> loader = shards.serve(dict(x=h5s.Window("mel", 64)), batch_size=32, shuffle=True)  # doctest: +SKIP
    """
    return MultiFile(files)


def feature_identity(feat: Feature) -> tuple[str, str]:
    """What must agree between the files of a concat: the type and every parameter but storage ones."""
    params = {k: v for k, v in feat.params().items() if k not in _STORAGE_PARAMS}
    return feat.type_name, repr(sorted(params.items()))


def schema_hash(schema: Any) -> str:
    """SHA-256 (hex) of what must agree between files served as one: every group's features,
    their types and parameters (learned ones such as a label's classes), storage parameters
    (compression, chunks) left out, as :func:`check_compatible` compares them.

    ``schema`` is a file's stored schema (``f.file_schema``). A sharded dataset's manifest
    records it; every shard must match (:mod:`h5store.shards`).

    Examples
    --------
    >>> schema_hash(h5s.open("a.h5").file_schema)[:12]  # doctest: +SKIP
    '3f1c0a9b7d2e'
    """
    spec = []
    for g, feats in sorted(schema.groups.items()):
        for name, feat in sorted(feats.items()):
            # A feature of a class not imported here reads as a plain Feature: its stored type
            # and parameters are what the class wrote, so the hash is the same with or without it.
            type_name, params = getattr(feat, "stored_as", None) or (feat.type_name, feat.params())
            spec.append([g, name, type_name, {k: v for k, v in params.items() if k not in _STORAGE_PARAMS}])
    text = json.dumps(spec, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
