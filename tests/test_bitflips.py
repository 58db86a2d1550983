"""Single-bit flips: a read returns the stored value exactly, or raises an h5store error.

200 flips (seed 2024) in copies of one small valid file written through the public API
(tests/test_integrity.make_store: ragged float32, fixed int64, Text, blobs, and a second
group). Three in four land in the bytes that hold the rows of a dataset (data, index,
checksum, frames, ids: located through ``chunk_iter``), one in four in HDF5 metadata (any
byte outside every chunk). For every flip, every item of every feature is read by id and by
position through the class, all of them at once through :func:`h5store.open` (the schema
from the file), and the ids are listed:

* each read returns exactly the original value or raises :class:`h5store.H5StoreError`
  (``CorruptRecordError``, ``FormatError``, ``NotFound``...), never another exception and
  never a different value;
* ``verify(deep=True)`` reports every flip in the rows of a dataset.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import pytest

import h5store as h5s
from h5store.errors import H5StoreError
from h5store.integrity import verify
from tests.test_integrity import Clip, Expected, make_store, same, used_ranges

SEED = 2024
FLIPS = 200


def flip(path: Path, offset: int, bit: int) -> None:
    """Flip one bit of a file in place (a second call restores it)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))


def allocated(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of every stored chunk (whole chunks, used or not)."""
    spans: list[tuple[int, int]] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and obj.chunks:
            obj.id.chunk_iter(lambda c: spans.append((c.byte_offset, c.size)))

    with h5py.File(path, "r", locking=False) as f:
        f.visititems(visit)
    return sorted(spans)


def flips(path: Path, raw: bytes) -> Iterator[tuple[int, int, str]]:
    """``(byte offset, bit, what it hits)`` for :data:`FLIPS` flips."""
    rng = random.Random(SEED)
    used = used_ranges(path)
    names = sorted(used)
    chunks = allocated(path)
    for k in range(FLIPS):
        if k % 4 == 3:
            while True:
                off = rng.randrange(len(raw))
                if not any(a <= off < a + n for a, n in chunks):
                    break
            yield off, rng.randrange(8), "metadata"
        else:
            name = rng.choice(names)
            a, n = rng.choice(used[name])
            off = a + rng.randrange(n)
            yield off, rng.randrange(8), name


def read_everything(path: Path, expected: Expected) -> list[str]:
    """Every read of every item, by id and by position, with the class and without it."""
    wrong: list[str] = []
    groups = sorted({g for g, _ in expected})
    ids = {g: list(dict.fromkeys(i for (gg, _), items in expected.items() if gg == g for i in items)) for g in groups}
    order = {g: {i: k for k, i in enumerate(sorted(ids[g], key=_position))} for g in groups}

    for opener in (Clip, h5s.open):
        name = getattr(opener, "__name__", "open")
        try:
            f = opener(path)
        except H5StoreError:
            continue
        except Exception as e:  # noqa: BLE001 - see above
            wrong.append(f"{name}() raised {type(e).__name__}: {str(e)[:120]}")
            continue
        with f:
            # One item at a time (by id and by position) through the class; batches through open().
            findings = _read_file(f, name, groups, ids, order, expected, singles=opener is Clip)
            wrong.extend(findings)
    return wrong


def _read_file(f: h5s.TypedFile, name: str, groups: list[str], ids: dict[str, list[str]],
               order: dict[str, dict[str, int]], expected: Expected, singles: bool) -> list[str]:
    wrong: list[str] = []

    def attempt(what: str, read: Callable[[], Any], check: Callable[[Any], bool]) -> None:
        try:
            value = read()
        except H5StoreError:
            return
        except Exception as e:  # noqa: BLE001 - anything else is what this test looks for
            wrong.append(f"{what} raised {type(e).__name__}: {str(e)[:120]}")
            return
        if not check(value):
            wrong.append(f"{what} returned a wrong value {str(value)[:60]}")

    for g in groups:
        want = sorted(ids[g], key=_position)
        attempt(f"{name}: ids of /{g}", lambda g=g: list(f.group(g).ids), lambda v, w=want: v == w)
    for (g, feat), items in expected.items():
        view = f"{name}: /{g}{'/' if g else ''}{feat}"
        for key, value in items.items() if singles else ():
            pos = order[g][key]
            for k in (key, pos):
                attempt(f"{view}[{k!r}]", lambda g=g, feat=feat, k=k: f.group(g).feature(feat)[k],
                        lambda v, value=value: same(v, value))
        attempt(f"{view}.read_many", lambda g=g, feat=feat, items=items: f.group(g).feature(feat).read_many(
            list(items)), lambda v, items=items: all(same(a, b) for a, b in zip(v, items.values())))
    return wrong


def _position(id: str) -> int:
    # make_store adds c0, c1, ... and run-0, run-1, ... in this order.
    return int(id.rsplit("-", 1)[-1] if "-" in id else id[1:])


@pytest.mark.slow
def test_single_bit_flips_never_read_back_wrong(tmp_path: Path) -> None:
    base = tmp_path / "base.h5"
    expected = make_store(base)
    raw = base.read_bytes()
    assert read_everything(base, expected) == []
    work = tmp_path / "flipped.h5"
    work.write_bytes(raw)
    findings: list[str] = []
    hits = {"metadata": 0, "rows": 0}
    for off, bit, what in flips(base, raw):
        flip(work, off, bit)
        label = f"bit {bit} of byte {off} ({what})"
        findings.extend(f"{label}: {w}" for w in read_everything(work, expected))
        if what == "metadata":
            hits["metadata"] += 1
        else:
            hits["rows"] += 1
            if verify(work, deep=True):
                findings.append(f"{label}: verify(deep=True) found nothing")
        flip(work, off, bit)  # and back: one copy serves every flip
    assert hits == {"metadata": FLIPS // 4, "rows": FLIPS - FLIPS // 4}
    assert not findings, f"{len(findings)} finding(s):\n" + "\n".join(findings)


@pytest.mark.slow
def test_every_bit_of_the_ids_and_the_low_bits_of_blob_frames(tmp_path: Path) -> None:
    """Exhaustively, where a CRC-32 over item bytes alone would not look: the ids' bytes, and
    the blob boundaries inside an item (its CRC-32 covers the bytes, not where they split)."""
    base = tmp_path / "base.h5"
    expected = make_store(base)
    raw = base.read_bytes()
    used = used_ranges(base)
    # Bits 0, 5 and 7 of every id byte: a changed character, a changed case, a broken utf-8.
    targets = [(a + k, bit, name) for name in ("ids/data", "logs/ids/data") for a, n in used[name]
               for k in range(n) for bit in (0, 5, 7)]
    # Each frame row is two little-endian int64: flip the 3 low bits of both.
    targets += [(a + k, bit, "frames/frames") for a, n in used["frames/frames"] for k in range(0, n, 8)
                for bit in range(3)]
    work = tmp_path / "flipped.h5"
    work.write_bytes(raw)
    frames = expected[("", "frames")]
    want = {"": [f"c{i}" for i in range(12)], "logs": [f"run-{i}" for i in range(3)]}
    findings = []
    for off, bit, what in targets:
        flip(work, off, bit)
        label = f"bit {bit} of byte {off} ({what})"
        with Clip(work) as f:
            for g, ids in want.items():
                try:
                    got = list(f.group(g).ids)
                except H5StoreError:
                    continue
                except Exception as e:  # noqa: BLE001 - anything else is what this test looks for
                    findings.append(f"{label}: ids of /{g} raised {type(e).__name__}: {e}")
                    continue
                if got != ids:
                    findings.append(f"{label}: ids of /{g} read back as {got}")
            for key, value in frames.items() if what == "frames/frames" else ():
                for read in (lambda k=key: f.frames[k], lambda k=key: f.frames.blobs(k)):
                    try:
                        got = read()
                    except H5StoreError:
                        continue
                    except Exception as e:  # noqa: BLE001 - see above
                        findings.append(f"{label}: frames[{key!r}] raised {type(e).__name__}: {e}")
                        continue
                    if not same([bytes(b) for b in got], value):
                        findings.append(f"{label}: frames[{key!r}] read back as {[len(b) for b in got]} "
                                        f"blob sizes instead of {[len(b) for b in value]}")
        if verify(work, deep=what == "frames/frames"):  # an id's CRC-32 is checked without deep
            findings.append(f"{label}: verify() found nothing")
        flip(work, off, bit)
    assert len(targets) == 3 * (26 + 15) + 3 * 42
    assert not findings, f"{len(findings)} finding(s):\n" + "\n".join(findings)
