"""h5store.integrity: verify (shallow and deep), truncation diagnosis, the CLI, the subprocess."""

from __future__ import annotations

import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.cli import main
from h5store.errors import FormatError
from h5store.integrity import VerifyReport, _child_report, verify, verify_in_subprocess
from h5store.safety import H5StoreSecurityWarning, hdf5_advisories, read_superblock


class Clip(h5s.TypedFile):
    """Every layout: ragged float32, fixed int64, Text, blobs, and a second group."""

    mel = h5s.Array(dtype="float32", shape=(None, 4), chunk_rows=64)
    label = h5s.Scalar(dtype="int64", chunk_rows=64)
    text = h5s.Text(chunk_rows=256)
    frames = h5s.Feature(dtype="uint8", shape=(None,), layout="blobs", chunk_rows=256)
    logs = h5s.Group(loss=h5s.Array(dtype="float32", chunk_rows=64))


Expected = dict[tuple[str, str], dict[str, Any]]


def make_store(path: Path, n: int = 12, seed: int = 0) -> Expected:
    """A small valid file of :class:`Clip`; returns every stored item by (group, feature) and id.

    Every item differs from every other, so an index pointing at the wrong item cannot
    return the right value by chance. Ids ``c3`` and ``c7`` have no text and no frames.
    """
    rng = np.random.default_rng(seed)
    out: Expected = {("", f): {} for f in ("mel", "label", "text", "frames")}
    out[("logs", "loss")] = {}
    with Clip(path, mode="w") as f:
        for i in range(n):
            values: dict[str, Any] = {
                "mel": rng.standard_normal((i + 1, 4)).astype(np.float32),
                "label": np.int64(1000 + i),
            }
            if i not in (3, 7):
                values["text"] = f"clip {i}: " + "".join(rng.choice(list("abcdefgh"), size=i + 3))
                values["frames"] = [rng.bytes(int(rng.integers(1, 40))) for _ in range(1 + i % 3)]
            f.add(f"c{i}", values)
            for k, v in values.items():
                out[("", k)][f"c{i}"] = v
        for r in range(3):
            loss = rng.random(5 + r).astype(np.float32)
            f.logs.add(f"run-{r}", dict(loss=loss))
            out[("logs", "loss")][f"run-{r}"] = loss
    return out


def same(a: Any, b: Any) -> bool:
    """Exactly the stored value: same type, dtype, shape and bytes."""
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(bytes(x) == y for x, y in zip(a, b))
    if isinstance(b, str):
        return isinstance(a, str) and a == b
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def used_ranges(path: Path) -> dict[str, list[tuple[int, int]]]:
    """File byte ranges holding the rows of every dataset (chunks trimmed to the shape)."""
    out: dict[str, list[tuple[int, int]]] = {}

    def visit(name: str, obj: Any) -> None:
        if not isinstance(obj, h5py.Dataset) or not obj.shape or not obj.shape[0]:
            return
        row = int(np.prod(obj.shape[1:], dtype=np.int64)) * obj.dtype.itemsize
        rows, n = obj.chunks[0], obj.shape[0]
        spans: list[tuple[int, int]] = []
        obj.id.chunk_iter(lambda c: spans.append((c.byte_offset, min(rows, n - c.chunk_offset[0]) * row)))
        out[name] = sorted(spans)

    with h5py.File(path, "r", locking=False) as f:
        f.visititems(visit)
    return out


def poke(path: Path, offset: int, value: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(value)


def edit(path: Path, dataset: str, row: Any, value: Any) -> None:
    with h5py.File(path, "r+", locking=False) as f:
        f[dataset][row] = value


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, Expected]:
    path = tmp_path / "clip.h5"
    return path, make_store(path)


# ----------------------------------------------------------------------------- clean files
def test_clean_file_verifies_shallow_and_deep(store: tuple[Path, Expected]) -> None:
    path, expected = store
    n_items = sum(len(v) for v in expected.values())
    for deep in (False, True):
        r = verify(path, deep=deep)
        assert r, r.lines()
        assert (r.groups, r.features, r.ids, r.items) == (2, 5, 15, n_items)
        assert r.items_verified == (n_items if deep else 0)
        assert r.lines() == [r.summary()] and ": OK: " in r.summary()


def test_deep_verify_reads_in_bounded_blocks(store: tuple[Path, Expected]) -> None:
    path, expected = store
    # 40-byte blocks: every mel item from row 3 on (>= 64 bytes) is read in several pieces.
    r = verify(path, deep=True, block_bytes=40)
    assert r and r.items_verified == sum(len(v) for v in expected.values())
    edit(path, "mel/data", 60, np.float32(123.0))  # row 60 lies in c10 (rows 55..66)
    bad = verify(path, deep=True, block_bytes=40)
    assert [(p.feature, p.id) for p in bad.problems] == [("mel", "c10")]


def test_report_round_trips_through_json(store: tuple[Path, Expected]) -> None:
    path, _ = store
    edit(path, "label/index", 2, [5, 9])
    r = verify(path)
    again = VerifyReport.from_dict(r.to_dict())
    assert again.lines() == r.lines() and bool(again) is False


# ----------------------------------------------------------------------------- damage, by kind
def test_flipped_data_bit_is_found_by_deep_verify_only(store: tuple[Path, Expected]) -> None:
    path, _ = store
    offset, _ = used_ranges(path)["mel/data"][0]
    row_of_c5 = sum(range(1, 6))  # items c0..c4 hold 1..5 rows
    poke(path, offset + row_of_c5 * 16 + 2, b"\xff")
    assert verify(path, deep=False)  # quick: structure only
    r = verify(path)  # the default reads every item
    assert not r and r.n_problems == 1
    p = r.problems[0]
    assert (p.group, p.feature, p.id, p.row) == ("", "mel", "c5", 5) and "CRC-32" in p.reason
    assert str(p).startswith("/mel id 'c5' (row 5): fails its CRC-32")
    with h5s.open(path) as f, pytest.raises(h5s.CorruptRecordError, match="row 5 fails its checksum"):
        f.mel["c5"]


def test_index_outside_data_and_wide_fixed_rows(store: tuple[Path, Expected]) -> None:
    path, _ = store
    edit(path, "mel/index", 4, [70, 99999])
    edit(path, "label/index", 2, [2, 4])
    edit(path, "text/index", 6, [-5, 3])
    r = verify(path)
    found = {(p.feature, p.id): p.reason for p in r.problems}
    assert found.keys() == {("mel", "c4"), ("label", "c2"), ("text", "c6")}
    assert "outside the 78 stored rows" in found[("mel", "c4")]
    assert "spans 2 rows for a fixed-shape item" in found[("label", "c2")]


def test_absent_item_with_a_checksum_is_reported(store: tuple[Path, Expected]) -> None:
    path, _ = store
    edit(path, "text/checksum", 3, 77)
    r = verify(path)
    assert [(p.feature, p.id) for p in r.problems] == [("text", "c3")]
    assert "absent item has checksum 77" in r.problems[0].reason


def test_ids_table_damage(store: tuple[Path, Expected]) -> None:
    path, _ = store
    edit(path, "ids/checksum", 1, 1)
    r = verify(path)
    assert [(p.feature, p.row) for p in r.problems] == [("ids", 1)]
    assert "fail their CRC-32" in r.problems[0].reason
    # A duplicate: id c2's bytes rewritten as "c1", with a matching CRC-32.
    with h5py.File(path, "r+", locking=False) as f:
        a, b = f["ids/index"][2]
        f["ids/data"][a:b] = np.frombuffer(b"c1", np.uint8)
        f["ids/checksum"][1] = zlib.crc32(b"c1")
        f["ids/checksum"][2] = zlib.crc32(b"c1")
    r = verify(path)
    assert [(p.feature, p.row, p.reason) for p in r.problems] == [("ids", 2, "duplicate of the id at row 1")]


def test_row_counts_that_disagree(store: tuple[Path, Expected]) -> None:
    path, _ = store
    with h5py.File(path, "r+", locking=False) as f:
        f["label/index"].resize(10, axis=0)
        f["mel/checksum"].resize(11, axis=0)
    msgs = [str(p) for p in verify(path).problems]
    assert "/label: index has 10 rows for 12 ids" in msgs
    assert "/mel: checksum has shape (11,) for 12 index rows" in msgs


def test_blob_frames_outside_data_or_split(store: tuple[Path, Expected]) -> None:
    path, _ = store
    with h5py.File(path, "r+", locking=False) as f:
        idx = f["frames/index"][...]
        fr = f["frames/frames"][...]
        a1, _ = idx[1]
        fr[a1, 1] += 1  # c1's first blob now overlaps its second: not contiguous
        a2, _ = idx[2]
        fr[a2, 0] = 10**9
        f["frames/frames"][...] = fr
    found = {p.id: p.reason for p in verify(path).problems}
    assert found == {
        "c1": "the blobs of this item are not contiguous in data",
        "c2": f"a blob frame of this item lies outside the {int(f_size(path))} bytes of data",
    }


def test_blob_item_emptied_by_damage_is_refused_on_every_read(store: tuple[Path, Expected]) -> None:
    """Damage that empties a blobs item's index row (seen in the fuzz run: a duplicated 4 KiB
    range zeroed four rows) leaves nothing to read: the empty item must still fail its CRC-32."""
    path, expected = store
    with h5py.File(path, "r+", locking=False) as f:
        f["frames/index"][4] = (0, 0)
    with Clip(path) as f:
        with pytest.raises(h5s.CorruptRecordError, match="row 4 fails its checksum"):
            f.frames.read_many(["c4"])
        with pytest.raises(h5s.CorruptRecordError, match="row 4 fails its checksum"):
            f.frames.read_many(["c5", "c4"])
        with pytest.raises(h5s.CorruptRecordError, match="row 4 fails its checksum"):
            f.frames.blobs("c4")  # all of its (now no) blobs: a whole item, checked
        with pytest.raises(h5s.CorruptRecordError, match="row 4 fails its checksum"):
            f.frames.frames("c4", encoded=True)[:]
        assert f.frames.frames("c5", encoded=True)[:] == expected[("", "frames")]["c5"]
        assert [bytes(b) for b in f.frames.read_many(["c5"])[0]] == expected[("", "frames")]["c5"]
        with pytest.raises(h5s.CorruptRecordError, match="'c4'"):
            list(f.iter_batches(dict(x=h5s.Item("frames")), batch_size=2, items=[0, 4]))
    assert {p.id for p in verify(path, deep=True).problems} == {"c4"}


def test_a_part_of_a_damaged_blob_item_is_refused(store: tuple[Path, Expected]) -> None:
    """A byte flipped in c5's second blob: reading just that blob (``frames(id)[k]``,
    ``blobs(id, a, b)``) must not return it unchecked. The first part read of an item reads and
    checks the whole item (once per process); an intact item's parts still read as stored."""
    path, expected = store
    with h5py.File(path, "r", locking=False) as f:
        a, _ = f["frames/index"][5]
        start = int(f["frames/frames"][a + 1][0])
    offset, _ = used_ranges(path)["frames/data"][0]
    with open(path, "r+b") as fh:
        fh.seek(offset + start)
        byte = fh.read(1)[0]
        fh.seek(offset + start)
        fh.write(bytes([byte ^ 0x40]))
    with Clip(path) as f:
        for read in (lambda: f.frames.frames("c5", encoded=True)[1], lambda: f.frames.blobs("c5", 1, 2),
                     lambda: f.frames.frames("c5", encoded=True)[0:1]):
            with pytest.raises(h5s.CorruptRecordError, match="row 5 fails its checksum"):
                read()
        want = expected[("", "frames")]["c8"]
        for _ in range(2):  # checked the first time, read from its own bytes after
            assert f.frames.frames("c8", encoded=True)[1] == want[1]
            assert [bytes(b) for b in f.frames.blobs("c8", 1)] == want[1:]


def test_item_marked_absent_by_damage_is_refused_not_skipped(store: tuple[Path, Expected]) -> None:
    """Damage that turns a present item's index row into ``[-1, -1]`` (an erased flash page
    reads as 0xff) while its checksum row still holds its CRC-32: reads must not treat the
    item as absent (iteration, ``get``, ``present`` and serving would leave it out silently)."""
    path, expected = store
    edit(path, "mel/index", 5, [-1, -1])
    for opener in (Clip, h5s.open):
        with opener(path) as f:
            for read in (lambda: f.mel["c5"], lambda: f.mel.present, lambda: list(f.mel), lambda: f.get("c6"),
                         lambda: list(f.iter_batches(dict(x=h5s.Item("mel")), batch_size=4))):
                with pytest.raises(h5s.CorruptRecordError, match=r"clip\.h5:/mel: index row 5 marks the item absent"):
                    read()
            assert same(f.text["c5"], expected[("", "text")]["c5"])  # other features read as before
            with pytest.raises(h5s.NotFound):
                f.text["c3"]  # truly absent: checksum 0
    assert [(p.feature, p.id) for p in verify(path).problems] == [("mel", "c5")]


def f_size(path: Path) -> int:
    with h5py.File(path, "r", locking=False) as f:
        return int(f["frames/data"].shape[0])


def test_missing_dataset_spoils_one_feature_only(store: tuple[Path, Expected]) -> None:
    path, expected = store
    with h5py.File(path, "r+", locking=False) as f:
        del f["mel/checksum"]
    r = verify(path, deep=True)
    assert not r
    assert [p.where for p in r.problems] == ["/mel"] and "missing dataset" in r.problems[0].reason
    assert r.unreadable == {"/mel": ["feature"]}
    assert r.items_verified == sum(len(v) for k, v in expected.items() if k != ("", "mel"))


def test_max_errors_keeps_counting(store: tuple[Path, Expected]) -> None:
    path, _ = store
    with h5py.File(path, "r+", locking=False) as f:
        f["mel/checksum"][...] = 1
    r = verify(path, deep=True, max_errors=3)
    assert r.n_problems == 12 and len(r.problems) == 3
    assert r.lines()[-1] == "  ... and 9 more"


def test_files_that_are_not_h5store(tmp_path: Path) -> None:
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = np.arange(3)
    assert verify(plain).fatal == f"{plain}: not an h5store file (no 'h5store_format' attribute)"
    text = tmp_path / "notes.txt"
    text.write_text("hello, not HDF5\n" * 100)
    assert "no HDF5 signature" in verify(text).summary()
    empty = tmp_path / "empty.h5"
    empty.write_bytes(b"")
    assert verify(empty).summary() == f"{empty}: empty file (0 bytes), not an HDF5 file"
    with pytest.raises(FileNotFoundError):
        verify(tmp_path / "absent.h5")


def test_damaged_superblock_is_not_called_truncated(store: tuple[Path, Expected]) -> None:
    path, _ = store
    poke(path, 20, b"\x00\x00\x00\x7f")  # inside the end-of-file address: the checksum no longer matches
    sb = read_superblock(path)
    assert not isinstance(sb, str) and sb.checksum_ok is False
    r = verify(path)
    assert r.truncated is None and r.fatal == f"{path}: the superblock fails its checksum: the file is damaged"


# ----------------------------------------------------------------------------- truncation
def test_truncation_anywhere_is_refused_and_diagnosed(tmp_path: Path) -> None:
    full = tmp_path / "full.h5"
    expected = make_store(full)
    raw = full.read_bytes()
    size = len(raw)
    n_items = sum(len(v) for v in expected.values())
    cuts = sorted({size * k // 64 for k in range(1, 64)} | {size - 1})
    cut_path = tmp_path / "cut.h5"
    for cut in cuts:
        cut_path.write_bytes(raw[:cut])
        with pytest.raises(FormatError, match=str(cut_path)):
            h5s.open(cut_path)
        with pytest.raises(FormatError, match="truncated"):
            Clip(cut_path)
        r = verify(cut_path)
        assert not r and r.truncated == (cut, size), cut
        first = r.summary()
        assert first.startswith(f"{cut_path}: TRUNCATED: {cut} of {size} bytes"), first
        if r.fatal is None:
            # What remains was parsed: the report says what was lost.
            assert "lost" in first
            assert sum(r.lost.values()) <= r.items <= n_items
    # One byte short: the metadata at the very end is lost, and the report says which.
    cut_path.write_bytes(raw[:-1])
    r = verify(cut_path, deep=True)
    assert r.truncated == (size - 1, size)
    assert "lost" in r.summary() or "cannot be opened" in r.summary()


def test_truncated_file_cli_says_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full.h5"
    make_store(full)
    raw = full.read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(raw[: len(raw) // 2])
    assert main(["verify", str(cut)]) == 1
    out = capsys.readouterr()
    first = out.out.splitlines()[0]
    assert first.startswith(f"{cut}: TRUNCATED: {len(raw) // 2} of {len(raw)} bytes") and "lost" in first
    assert "Traceback" not in out.err
    tiny = tmp_path / "tiny.h5"
    tiny.write_bytes(raw[:5])
    assert main(["verify", str(tiny)]) == 1
    out = capsys.readouterr()
    assert out.out.strip() == f"{tiny}: 5 bytes: too short to hold an HDF5 superblock (truncated, or not HDF5)"


# ----------------------------------------------------------------------------- CLI
def test_cli_exit_codes_and_lines(store: tuple[Path, Expected], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = store
    assert main(["verify", str(path), "--deep"]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: OK: 2 group(s)")
    edit(path, "label/checksum", 4, 0)
    assert main(["verify", str(path), "--quick"]) == 0  # structure only: the index and ids are fine
    capsys.readouterr()
    assert main(["verify", str(path), "--deep"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: 1 problem(s) in 2 group(s), 5 feature(s), 15 id(s), 47 item(s), "
                               "47 CRC-32 checked (")
    assert lines[1].startswith("  /label id 'c4' (row 4): fails its CRC-32 (stored 0x00000000")
    assert main(["verify", str(path.parent / "nope.h5")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"h5store: error: {path.parent / 'nope.h5'}: no such file"


def test_cli_untrusted_runs_in_a_child(store: tuple[Path, Expected], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = store
    assert main(["verify", str(path), "--untrusted", "--deep"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"{path}: OK")
    # The advisory note, once, as a line of its own (never a Python warning dump).
    assert out.err.count("h5store: note: HDF5 ") == (1 if hdf5_advisories() else 0)
    assert "H5StoreSecurityWarning" not in out.err


# ----------------------------------------------------------------------------- subprocess
def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the HDF5 advisory warning silenced (test_untrusted.py checks it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", H5StoreSecurityWarning)
        return fn(*args, **kwargs)


def test_verify_in_subprocess_matches_in_process(store: tuple[Path, Expected]) -> None:
    path, _ = store
    edit(path, "mel/index", 1, [1, 1000])
    inside = verify(path, deep=True)
    child = verify_in_subprocess(path, deep=True, untrusted=False)
    assert child.lines() == inside.lines() and not child
    refused = quiet(verify_in_subprocess, path)
    assert refused.fatal == (f"{path}:/mel: index row 1 = [1, 1000] points outside the 78 stored rows; "
                             "refused (untrusted file)")


def test_verify_in_subprocess_limits_time_and_memory(tmp_path: Path) -> None:
    path = tmp_path / "big.h5"
    with Clip(path, mode="w") as f:
        f.add("big", dict(mel=np.ones((1 << 22, 4), np.float32)))  # one 64 MiB item
    slow = verify_in_subprocess(path, deep=True, untrusted=False, timeout=0.05)
    assert not slow and "did not finish within 0.05 s and was killed" in (slow.fatal or "")
    tight = verify_in_subprocess(path, deep=True, untrusted=False, max_memory=32 << 20, block_bytes=1 << 30)
    assert not tight and tight.fatal == f"{path}: verification needs more than the 33554432 bytes of memory it may " \
                                        "use: refused"
    roomy = verify_in_subprocess(path, deep=True, untrusted=False, max_memory=32 << 20, block_bytes=4 << 20)
    assert roomy and roomy.bytes_verified == 64 << 20


def test_a_crashing_child_becomes_a_fatal_report() -> None:
    # A real segfault (a NULL read), standing in for HDF5 dying on a crafted file.
    proc = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"], capture_output=True)
    r = _child_report("evil.h5", proc.returncode, proc.stdout, proc.stderr)
    assert not r and r.fatal is not None
    assert r.fatal.startswith("evil.h5: the verifying process was killed by SIGSEGV (HDF5 cannot parse")
    r = _child_report("evil.h5", proc.returncode, proc.stdout, proc.stderr, max_memory=1 << 20)
    assert "(HDF5 cannot parse this file safely, or when denied more than 1048576 bytes of memory;" in str(r.fatal)
    r = _child_report("evil.h5", 3, b"garbage\n", b"Traceback...\nSystemError: boom\n")
    assert r.fatal == ("evil.h5: the verifying process exited with status 3 (HDF5 cannot parse this file safely; "
                       "never open it in-process): SystemError: boom")


def test_verify_never_modifies_the_file(store: tuple[Path, Expected]) -> None:
    path, _ = store
    before = path.read_bytes()
    verify(path, deep=True)
    assert path.read_bytes() == before
