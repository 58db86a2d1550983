"""Run every benchmark: each ``benchmarks/bench_*.py`` in turn, each writing its own RESULTS.md section.

``make bench-all`` runs this. Options after the script name are passed to every benchmark
(``--quick``, ``--no-write``, ``--cache-dir DIR``); ``--only serve,cold`` runs a subset.
Exits non-zero when a benchmark fails (the others still run), listing which.

Run from the repository root (a fresh clone needs only ``make test``'s set-up first)::

    .venv/bin/python benchmarks/run_all.py              # every table of RESULTS.md (~1 hour)
    .venv/bin/python benchmarks/run_all.py --quick --no-write   # smoke run of every script
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts(only: str | None = None) -> list[Path]:
    """Every ``bench_*.py`` (sorted), or those named in ``only`` (``serve,cold``)."""
    found = sorted(HERE.glob("bench_*.py"))
    if only:
        names = {n.strip().removeprefix("bench_").removesuffix(".py") for n in only.split(",") if n.strip()}
        unknown = names - {p.stem.removeprefix("bench_") for p in found}
        if unknown:
            raise SystemExit(f"--only: no benchmark {sorted(unknown)}; there are "
                             f"{', '.join(p.stem.removeprefix('bench_') for p in found)}")
        found = [p for p in found if p.stem.removeprefix("bench_") in names]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated subset, e.g. serve,cold")
    args, rest = ap.parse_known_args(argv)
    env = dict(os.environ)
    root = str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    failed = []
    for script in scripts(args.only):
        cmd = [sys.executable, str(script), *rest]
        print(f"=== {script.name} {' '.join(rest)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=root, env=env)
        print(f"=== {script.name}: exit {rc} after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if rc != 0:
            failed.append(script.name)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
