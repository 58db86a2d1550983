"""How a TypedFile class's declared schema meets the schema a file stores.

* :func:`check_names`: names a class may not give its features and groups (they would hide
  a member of the file or of its group views), checked when the class is defined;
* :func:`merge`: the schema an open file uses, the stored one checked against the declared
  one (dtype, shape and layout must agree; undeclared parts fit any; a writable open adds
  declared features the file lacks);
* :func:`with_learned` / :func:`with_fixed`: the schema after ingest's ``prepare`` learned
  parameters, or after first items fixed an undeclared dtype or shape.

Pure functions of :class:`~h5store.schema.Schema` values: writing the result into the file
is the caller's (``TypedFile``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from h5store.access import GroupView
from h5store.errors import SchemaError
from h5store.schema import Feature, Schema

__all__ = ["check_names", "merge", "with_fixed", "with_learned"]


def check_names(cls: type, file_members: set[str]) -> None:
    """Refuse feature and group names that would hide a member of the file or its views.

    ``path = h5s.Array()`` would make opening recurse, ``close`` would break ``f.close()``,
    ``mode`` would be silently hidden: such a class fails when it is defined.

    Parameters
    ----------
    cls : type
        The TypedFile subclass just defined (its ``schema`` collected).
    file_members : set of str
        The names a root feature or a group may not take (TypedFile's members).

    Raises
    ------
    SchemaError
        Naming every offending feature or group.
    """
    group_members = set(dir(GroupView)) | {"name", "store", "features"}  # set in GroupView.__init__
    problems = []
    for gname, feats in cls.schema.groups.items():  # type: ignore[attr-defined]
        if gname and gname in file_members:
            problems.append(f"{cls.__name__}.{gname}: the group name hides TypedFile.{gname}")
        for name in feats:
            where = f"{cls.__name__}.{gname + '.' if gname else ''}{name}"
            if not gname and name in file_members:
                problems.append(f"{where}: the feature name hides TypedFile.{name}")
            elif gname and name in group_members:
                problems.append(f"{where}: the feature name hides the group view's {name!r}")
    if problems:
        raise SchemaError("; ".join(problems) + " (rename the feature; reserved names are listed in docs/guide.md)")


def merge(stored: Schema, declared: Schema, path: str, writable: bool) -> Schema:
    """The schema an open file uses: the stored one, checked against the class's.

    Parameters
    ----------
    stored : Schema
        The schema the file holds.
    declared : Schema
        The opening class's schema (``TypedFile``'s own is empty: any file fits it).
    path : str
        The file, for messages.
    writable : bool
        Whether the open may add declared features the file lacks (else they are refused).

    Returns
    -------
    Schema
        Every stored feature (what was learned at create kept), the declared ones the file
        lacks (writable opens), named after the class unless the class is ``TypedFile``.

    Raises
    ------
    SchemaError
        When a declared feature is stored another way (naming the parameters behind the
        difference), or is missing from a file opened read-only.
    """
    groups = {g: dict(feats) for g, feats in stored.groups.items()}
    missing = []
    for g, feats in declared.groups.items():
        have = groups.setdefault(g, {})
        for name, feat in feats.items():
            where = f"{path}:/{g + '/' if g else ''}{name}"
            if name in have and not (have[name].is_fixed and feat.is_fixed):
                # An undeclared dtype or shape (h5s.Array()) on either side.
                have[name] = _merge_undeclared(have[name], feat, where, declared.name, writable)
                continue
            if name in have:
                a, b = have[name].spec(), feat.spec()
                if (a.dtype, a.shape, a.layout) != (b.dtype, b.shape, b.layout):
                    # Name the parameters behind the difference (n_mels=80 stored, 40 declared).
                    old, new = have[name].params(), feat.params()
                    diff = [f"{k}={old[k]!r} stored, {new[k]!r} declared" for k in new
                            if k in old and k not in ("shape", "pattern") and old[k] != new[k]]
                    raise SchemaError(
                        f"{where}: stored as {a.dtype} {a.shape} ({a.layout}), "
                        f"but {declared.name} declares {b.dtype} {b.shape} ({b.layout})"
                        + (f" ({'; '.join(diff)})" if diff else "")
                        + f"; open it with the class it was written with, or with h5store.open({path!r}), "
                        "which reads the schema stored in the file"
                    )
            elif not writable:
                missing.append(where)
            if name not in have or type(have[name]) is not type(feat):
                # The stored feature holds what was learned at create (a label
                # vocabulary); the class's own is used for features new to the file.
                have[name] = feat
    if missing:
        raise SchemaError(
            f"{', '.join(missing)}: declared by {declared.name} but not in the file; "
            "open with mode='a' to add the feature"
        )
    return Schema(declared.name if declared.name != "TypedFile" else stored.name, groups)


def _merge_undeclared(stored: Feature, declared: Feature, where: str, cls_name: str, writable: bool) -> Feature:
    """The feature an open file uses when the stored or the declared one leaves dtype or shape
    to the first item: declared parts must agree with the stored ones, undeclared ones fit any."""
    if stored.is_fixed:
        spec = stored.spec()
        if declared.conflict(spec):
            raise SchemaError(
                f"{where}: stored as {spec.dtype} {spec.shape} ({spec.layout}), but {cls_name} declares "
                f"{declared.describe_storage()}; open it with the class it was written with, or with "
                "h5store.open(), which reads the schema stored in the file")
        # What the first item fixed stays; the class's own type decodes (when it differs).
        return (stored if type(stored) is type(declared) else declared).fixed_as(spec, by_first_item=declared)
    for part in ("dtype", "shape"):
        mine, theirs = getattr(declared, part), getattr(stored, part)
        if mine is not None and theirs is not None and mine != theirs:
            raise SchemaError(f"{where}: stored with {part}={theirs!r} (no item yet), but {cls_name} declares "
                              f"{part}={mine!r}; open it with the class it was written with, or with h5store.open()")
    if not writable:
        return stored  # no item, no column: an empty feature until a writer stores the first item
    return dataclasses.replace(declared, dtype=declared.dtype if declared.dtype is not None else stored.dtype,
                               shape=declared.shape if declared.shape is not None else stored.shape)


def with_learned(schema: Schema, features: Mapping[str, Feature], path: str) -> Schema:
    """``schema`` with root features replaced by versions holding learned parameters.

    Storage must not change: a feature the file's first item fixed keeps that dtype and
    shape (``SchemaError`` when ``prepare()`` changed them).
    """
    root = dict(schema.groups[""])
    for name, feat in features.items():
        old = root.get(name)
        if old is not None and old.is_fixed and not feat.is_fixed:
            feat = feat.fixed_as(old.spec())  # the file's first item fixed it already
        if old is not None and old.is_fixed and old.spec() != feat.spec():
            raise SchemaError(f"{path}:/{name}: prepare() changed how the feature is stored")
        root[name] = feat
    return Schema(schema.name, {**schema.groups, "": root})


def with_fixed(schema: Schema, group: str, features: Mapping[str, Feature]) -> Schema:
    """``schema`` with the features of ``group`` that first items fixed."""
    feats = {**schema.groups[group], **features}
    return Schema(schema.name, {**schema.groups, group: feats})
