"""Following a file that a writer appends to: the loop behind :meth:`TypedFile.tail`.

A read-only open is a snapshot of one commit. Following polls the writer's commit counter
(:meth:`~h5store.typed_file.TypedFile.changed`, a few system calls), moves the snapshot
when it moved (:meth:`~h5store.typed_file.TypedFile.refresh`), and yields the ids added
since, in the order they were added: only committed records are ever seen.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from h5store.errors import ReadOnlyError

__all__ = ["follow"]


def follow(f: Any, start: int | None = None, timeout: float | None = None, poll: float = 0.1,
           group: str = "") -> Iterator[str]:
    """Yield each id of ``group`` once it is committed (see :meth:`TypedFile.tail` for the parameters).

    Raises
    ------
    ReadOnlyError
        At the first ``next()``, when ``f`` is open for writing (it sees its own records).
    """
    if f.writable:
        raise ReadOnlyError(f"{f.path}: tail() follows a writer from a read-only open (mode 'r')")
    seen = len(f.group(group)) if start is None else start
    quiet_since = time.monotonic()
    while True:
        if f.changed():
            f.refresh()
        ids = f.group(group).ids
        n = len(ids)
        if n > seen:
            for i in range(seen, n):
                yield ids[i]
            seen = n
            quiet_since = time.monotonic()
        elif timeout is not None and time.monotonic() - quiet_since > timeout:
            return
        else:
            time.sleep(poll)
