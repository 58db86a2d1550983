"""The code of docs/serving.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_doc_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 11
    ns: dict[str, Any] = {"__name__": __name__}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), ns)
    ns["f"].close()
