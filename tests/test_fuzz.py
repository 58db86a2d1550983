"""Mutation fuzzing: 500+ damaged copies of a valid file, each opened, verified and read in a
forked child with a time limit. Allowed outcomes: h5store errors and FileNotFoundError.
Not allowed: any other exception, a crash (a signal), a hang, a wrong value, or a
:func:`~h5store.integrity.verify` that raises.

Mutations (deterministic seeds): random byte rewrites (half of them aimed at the bytes that
hold data, indexes and metadata rather than unused chunk space), truncations, zeroed 4 KiB
pages, and byte ranges duplicated over other ranges.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import resource
import select
import signal
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import h5store as h5s
from h5store.errors import H5StoreError
from h5store.integrity import verify
from h5store.safety import H5StoreSecurityWarning
from tests.test_integrity import Clip, Expected, make_store, same, used_ranges

N_FILES = 520
TIMEOUT = 10.0
WORKERS = 2
CHILD_MEMORY = 3 << 30  # RLIMIT_AS of a child: a runaway allocation fails there, not the machine


@dataclass(frozen=True)
class Mutation:
    seed: int
    kind: str
    detail: str
    edits: tuple[tuple[int, bytes], ...]  # (offset, new bytes)
    size: int  # the mutated file's length

    def apply(self, raw: bytes) -> bytes:
        b = bytearray(raw[: self.size])
        for off, data in self.edits:
            b[off : off + len(data)] = data[: max(0, len(b) - off)]
        return bytes(b)


def mutations(raw: bytes, hot: list[tuple[int, int]], n: int) -> list[Mutation]:
    """``n`` deterministic mutations that each change the file; ``hot``: byte ranges worth aiming at."""
    out = []
    for m in _candidates(raw, hot):
        if m.size < len(raw) or any(raw[o : o + len(d)] != d for o, d in m.edits):
            out.append(m)
            if len(out) == n:
                return out
    return out


def _candidates(raw: bytes, hot: list[tuple[int, int]]) -> Iterator[Mutation]:
    size = len(raw)
    for seed in itertools.count():
        rng = random.Random(seed)
        kind = ("bytes", "bytes", "truncate", "zero-page", "duplicate")[seed % 5]

        def spot(rng: random.Random = rng) -> int:
            if rng.random() < 0.5:
                a, length = rng.choice(hot)
                return a + rng.randrange(length)
            return rng.randrange(size)

        if kind == "bytes":
            edits = tuple((o, bytes([raw[o] ^ rng.randrange(1, 256)]))
                          for o in (spot() for _ in range(rng.choice((1, 1, 2, 4, 16)))))
            yield Mutation(seed, kind, ",".join(f"{o}={d.hex()}" for o, d in edits), edits, size)
        elif kind == "truncate":
            cut = rng.randrange(size)
            yield Mutation(seed, kind, f"to {cut} bytes", (), cut)
        elif kind == "zero-page":
            page = spot() // 4096 * 4096
            yield Mutation(seed, kind, f"page at {page}", ((page, bytes(4096)),), size)
        else:
            length = rng.choice((8, 64, 512, 4096, 65536))
            src, dst = rng.randrange(size - length), spot()
            yield Mutation(seed, kind, f"{length} bytes from {src} over {dst}", ((dst, raw[src : src + length]),),
                           size)


def hot_ranges(path: Path, raw: bytes) -> list[tuple[int, int]]:
    """Used bytes of every dataset, plus the metadata at the start and end of the file."""
    spans = [s for v in used_ranges(path).values() for s in v]
    return spans + [(0, 8192), (max(0, len(raw) - 8192), min(8192, len(raw)))]


# ----------------------------------------------------------------------------- in the child
def check_file(path: Path, expected: Expected, seed: int = 0) -> dict[str, Any]:
    """Open, read everything, verify: what went wrong (documented exceptions are fine).

    Even seeds open with :func:`h5store.open` (the schema from the file), odd ones with the
    class; every third file is also verified with ``untrusted=True``.
    """
    out: dict[str, Any] = {"undocumented": [], "wrong": []}

    def bad(stage: str, e: BaseException) -> None:
        frames = traceback.extract_tb(e.__traceback__)
        ours = [fr for fr in frames if f"{os.sep}h5store{os.sep}" in fr.filename] or frames
        where = ", ".join(f"{Path(fr.filename).name}:{fr.lineno}" for fr in (ours[-1], frames[-1]))
        out["undocumented"].append(f"{stage}: {type(e).__name__}: {str(e)[:160]} (at {where})")

    opener: Any = Clip if seed % 2 else h5s.open
    try:
        f = opener(path)
    except (H5StoreError, FileNotFoundError):
        f = None
    except Exception as e:  # noqa: BLE001 - that is the finding
        bad(f"open with {opener.__name__}", e)
        f = None
    if f is not None:
        with f:
            groups = {g for g, _ in expected}
            for g in sorted(groups):
                want = list(dict.fromkeys(i for (gg, _), items in expected.items() if gg == g for i in items))
                try:
                    got_ids = list(f.group(g).ids)
                except (H5StoreError, FileNotFoundError):
                    continue
                except Exception as e:  # noqa: BLE001 - that is the finding
                    bad(f"ids of /{g}", e)
                    continue
                if sorted(got_ids) != sorted(want):
                    out["wrong"].append(f"/{g} ids")
            for (g, name), items in expected.items():
                try:
                    view = f.group(g).feature(name)
                    ids = list(items)
                    got = view.read_many(ids)
                except (H5StoreError, FileNotFoundError):
                    continue
                except Exception as e:  # noqa: BLE001 - that is the finding
                    bad(f"read /{g}{'/' if g else ''}{name}", e)
                    continue
                for id, value in zip(ids, got):
                    if not same(value, items[id]):
                        out["wrong"].append(f"/{g}{'/' if g else ''}{name}[{id!r}]")
    for kw in [dict(deep=True)] + ([dict(untrusted=True)] if seed % 3 == 0 else []):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", H5StoreSecurityWarning)
                verify(path, **kw)
        except Exception as e:  # noqa: BLE001 - verify reports, it never raises
            bad(f"verify({kw})", e)
    return out


def _child(path: Path, data: bytes, expected: Expected, seed: int, wfd: int) -> None:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.alarm(int(TIMEOUT) + 2)
        path.write_bytes(data)
        result = check_file(path, expected, seed)
    except BaseException as e:  # noqa: BLE001 - report whatever escaped, then leave at once
        result = {"undocumented": [f"child: {type(e).__name__}: {e}"], "wrong": []}
    os.write(wfd, json.dumps(result).encode())
    os._exit(0)


def run_all(base: Path, expected: Expected, muts: list[Mutation], work: Path) -> list[str]:
    """Run every mutation in a forked child, ``WORKERS`` at a time; return the findings."""
    raw = base.read_bytes()
    findings: list[str] = []
    running: dict[int, tuple[int, int, Mutation, float, list[bytes]]] = {}  # pid -> (rfd, slot, m, t0, out)
    todo = list(muts)
    free = list(range(WORKERS))
    while todo or running:
        while todo and free:
            m, slot = todo.pop(0), free.pop()
            rfd, wfd = os.pipe()
            with warnings.catch_warnings():
                # Python >= 3.12 warns when forking a threaded process; the child only reads files.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                os.close(rfd)
                _child(work / f"slot{slot}.h5", m.apply(raw), expected, m.seed, wfd)
            os.close(wfd)
            running[pid] = (rfd, slot, m, time.monotonic(), [])
        fds = {v[0]: pid for pid, v in running.items()}
        poll = select.poll()  # not select(): a long test session may hold descriptors past 1024
        for fd in fds:
            poll.register(fd, select.POLLIN)
        for fd, _ in poll.poll(200):
            chunk = os.read(fd, 1 << 16)
            running[fds[fd]][4].append(chunk)
        for pid in list(running):
            rfd, slot, m, t0, out = running[pid]
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() - t0 > TIMEOUT:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                findings.append(f"HANG (> {TIMEOUT:g} s): seed {m.seed} {m.kind} {m.detail}")
            elif not done:
                continue
            else:
                while True:
                    chunk = os.read(rfd, 1 << 16)
                    if not chunk:
                        break
                    out.append(chunk)
                if os.WIFSIGNALED(status):
                    name = signal.Signals(os.WTERMSIG(status)).name
                    findings.append(f"CRASH ({name}): seed {m.seed} {m.kind} {m.detail}")
                else:
                    result = json.loads(b"".join(out) or b'{"undocumented": ["child wrote nothing"], "wrong": []}')
                    for what in result["undocumented"]:
                        findings.append(f"EXCEPTION {what}: seed {m.seed} {m.kind} {m.detail}")
                    if result["wrong"]:
                        findings.append(f"WRONG VALUE {result['wrong'][:4]}: seed {m.seed} {m.kind} {m.detail}")
            os.close(rfd)
            free.append(slot)
            del running[pid]
    return findings


@pytest.mark.slow
def test_mutated_files_fail_only_in_documented_ways(tmp_path: Path) -> None:
    base = tmp_path / "base.h5"
    expected = make_store(base)
    raw = base.read_bytes()
    muts = mutations(raw, hot_ranges(base, raw), N_FILES)
    assert len(muts) == N_FILES >= 500
    t0 = time.monotonic()
    findings = run_all(base, expected, muts, tmp_path)
    elapsed = time.monotonic() - t0
    # ~35 s of CPU for 520 files: ~20 s on two idle cores (no wall-clock assert: CI machines are shared).
    assert not findings, f"{len(findings)} finding(s) in {len(muts)} files ({elapsed:.0f} s):\n" + "\n".join(findings)
