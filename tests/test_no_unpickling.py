"""h5store never unpickles: not a file, not a shared-memory block, not a worker's message.

Unpickling runs code chosen by whoever wrote the bytes. What crosses processes through
h5store's own channels is plain bytes (arrays, JSON); objects travel only through
DataLoader's own queues, as the dataset itself does.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "h5store"


def test_no_module_unpickles() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\b(c?pickle|dill|cloudpickle)\.(loads?|Unpickler)\b|\bmarshal\.loads?\b", code):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not found, "h5store must not unpickle:\n" + "\n".join(found)
