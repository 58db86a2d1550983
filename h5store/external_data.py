"""Data from outside the file: the links and dataset storage that would make HDF5 read another
file, and :func:`check_local`, the check every trusted open runs on the objects h5store reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import h5py

from h5store.errors import FormatError
from h5store.format import IDS

__all__ = ["check_local", "link_problem", "storage_problem"]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def link_problem(gid: Any, name: bytes, detail: bool = False) -> str | None:
    """Why following link ``name`` of group ``gid`` could leave the file's own objects, or None.

    Hard links are plain; soft links (h5store never writes one: they may lead through an
    external link), external links and user-defined links are not. ``detail`` adds where
    an external link points (the untrusted checks leave it out of their messages).

    Examples
    --------
    >>> link_problem(f.id, b"mel")  # doctest: +SKIP
    """
    info = gid.links.get_info(name)
    if info.type == h5py.h5l.TYPE_HARD:
        return None
    if info.type == h5py.h5l.TYPE_SOFT:
        return "soft link (may point anywhere in the file)"
    if info.type == h5py.h5l.TYPE_EXTERNAL:
        if detail:
            target, obj = gid.links.get_val(name)
            return f"external link to {_text(obj)!r} in {_text(target)!r} (would open another file)"
        return "external link (would open another file)"
    return f"user-defined link of type {info.type}"


def storage_problem(dcpl: Any, detail: bool = False) -> str | None:
    """Why a dataset's bytes would come from outside the file (external raw storage, a
    virtual dataset), or None. ``detail`` names the first other file.

    Examples
    --------
    >>> storage_problem(ds.id.get_create_plist(), detail=True)  # doctest: +SKIP
    "external raw storage (its bytes live in another file: '/etc/passwd')"
    """
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        if detail and dcpl.get_virtual_count():
            return (f"virtual dataset (maps data of other datasets or files: "
                    f"{_text(dcpl.get_virtual_filename(0))!r})")
        return "virtual dataset (maps data of other datasets or files)"
    if dcpl.get_external_count():
        if detail:
            return f"external raw storage (its bytes live in another file: {_text(dcpl.get_external(0)[0])!r})"
        return "external raw storage (its bytes live in another file)"
    return None


_COLUMN_PARTS = (b"data", b"index", b"checksum", b"frames")
_OPT_IN = ("refused: h5store reads only data stored inside the file. Open it with allow_external=True only if "
           "you trust the file and what it points to")
_NEVER = ("refused: h5store opens files through a file object, and HDF5 cannot follow that through one (an "
          "external link fails to open, a virtual dataset crashes the process); copy the data into the file")


def check_local(h5file: h5py.File, path: str, groups: Mapping[str, Any], allow_external: bool = False) -> None:
    """Refuse an h5store file whose own datasets would read bytes from outside it.

    What every trusted open runs (``h5store.open``, ``TypedFile(path)``): on the path to
    the objects h5store reads (each group of the schema, its ids table and features, their
    ``data``, ``index``, ``checksum`` and ``frames``), not on every object of the file, so
    it costs microseconds per dataset. HDF5 would otherwise read another file (say
    ``/etc/passwd``) as if it were the feature's data. External raw storage and soft links
    are refused unless ``allow_external``; external links, user-defined links and virtual
    datasets always (HDF5 cannot follow them through the file object h5store opens files
    with: measured, a virtual dataset crashed the process). Objects that are missing or
    unreadable are left to the reads that use them, which report them.

    Parameters
    ----------
    h5file : h5py.File
        The open file.
    path : str
        Names the file in messages.
    groups : Mapping
        Group name ("" for the root) -> its feature names (the schema's ``groups``).
    allow_external : bool
        The caller's opt-in (``h5store.open(path, allow_external=True)``).

    Raises
    ------
    FormatError
        Naming the file, the object, where it points and, where one exists, the opt-in.

    Examples
    --------
    >>> check_local(f.h5, f.path, f.file_schema.groups)  # doctest: +SKIP
    """
    for gname, feats in groups.items():
        g = h5file.id
        if gname:
            g = _local_child(g, gname.encode("utf-8"), path, f"/{gname}", allow_external)
            if g is None:
                continue
        base = f"/{gname}" if gname else ""
        for name in (IDS, *feats):
            col = _local_child(g, name.encode("utf-8"), path, f"{base}/{name}", allow_external)
            if col is None:
                continue
            for part in _COLUMN_PARTS:
                _local_child(col, part, path, f"{base}/{name}/{part.decode()}", allow_external, dataset=True)


def _local_child(g: Any, name: bytes, path: str, where: str, allow_external: bool, dataset: bool = False) -> Any:
    """The group behind link ``name`` (with ``dataset``: True), after checking it; None
    when absent or unreadable (the read that needs it reports that)."""
    try:
        try:
            why = link_problem(g, name, detail=True)
        except KeyError:
            return None  # absent
        # Only a soft link (inside the file) and external raw storage can be opted into.
        opt_in = why is not None and g.links.get_info(name).type == h5py.h5l.TYPE_SOFT
        if why is None or (opt_in and allow_external):
            if not dataset:
                return h5py.h5g.open(g, name)
            dcpl = h5py.h5d.open(g, name).get_create_plist()
            why = storage_problem(dcpl, detail=True)
            opt_in = why is not None and dcpl.get_layout() != h5py.h5d.VIRTUAL
            if why is None or (opt_in and allow_external):
                return True
    except (OSError, KeyError, RuntimeError, ValueError, TypeError):
        return None  # not a group (dataset), or damaged metadata: the read of this object reports it
    raise FormatError(f"{path}:{where}: {why}; {_OPT_IN if opt_in else _NEVER}")

