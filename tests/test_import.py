"""``import h5store`` stays light: no heavy framework, no warning filter, no open file."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "librosa", "tensorflow", "joblib", "dask"]

PROBE = f"""
import json, sys, warnings
import numpy, h5py  # their own import-time filters are not h5store's
filters = list(warnings.filters)
import h5store
print(json.dumps(dict(
    heavy=sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}),
    filters_changed=warnings.filters != filters,
    version=h5store.__version__,
)))
"""


def test_import_h5store_leaves_heavy_frameworks_unimported() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"import h5store imported {result['heavy']}"
    assert not result["filters_changed"], "import h5store changed the warning filters"
    assert result["version"]


def test_the_probe_can_see_a_heavy_import() -> None:
    # The same probe reports a framework that is imported: the test above can fail.
    probe = PROBE.replace("import h5store\n", "import h5store, joblib\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "joblib" in json.loads(out.stdout.strip().splitlines()[-1])["heavy"]


def test_public_names_are_sorted_and_importable() -> None:
    import h5store

    assert list(h5store.__all__) == sorted(h5store.__all__)
    for name in h5store.__all__:
        assert hasattr(h5store, name), name
