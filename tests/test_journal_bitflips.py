"""Rollback is all-or-nothing (issue 11, point 4).

A real writer process commits records, then is SIGKILLed at the commit point of its next
commit: the new pages are written over the committed ones and fsynced, the journal (holding
the originals) is not deleted yet. That hot journal is the only copy of the committed pages.
One flipped byte in it must never be applied in part, nor deleted: the file is refused with an
error naming the file and its journal, and nothing changes on disk. With the byte restored,
the open rolls back to exactly the committed records.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from h5store.errors import JournalError
from h5store.journal import find_journal
from tests.test_journal_links import Log, check_log, kill_while_hot, make_log

N = 120  # records committed before the hot commit


@pytest.fixture
def hot_state(tmp_path):
    """(file bytes, journal bytes, rolled-back file bytes) of a writer killed mid-commit, in
    ``tmp_path/log.h5``: a journal names its file's inode, so the states are rewritten in place."""
    path = tmp_path / "log.h5"
    make_log(path, 100)
    kill_while_hot(path, [20, 60])  # 120 committed; the commit to 180 is hot
    journal = find_journal(path)
    assert journal is not None
    state = path.read_bytes(), Path(journal).read_bytes()
    check_log(path, N)  # rolls back
    return state[0], state[1], path.read_bytes()


def put(d: Path, data: bytes, journal: bytes) -> tuple[Path, Path]:
    """The file (the same inode: rewritten in place) and its journal, holding these bytes."""
    path = d / "log.h5"
    jpath = d / "log.h5-journal"
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
    jpath.write_bytes(journal)
    return path, jpath


def test_a_clean_hot_journal_rolls_back_to_the_committed_records(tmp_path, hot_state):
    data, journal, _ = hot_state
    assert len(journal) > 4096  # pages were journaled (and overwritten: the file differs)
    path, jpath = put(tmp_path, data, journal)
    check_log(path, N)
    assert not jpath.exists()


def test_single_byte_flips_in_a_hot_journal_are_refused_and_nothing_changes(tmp_path, hot_state):
    data, journal, rolled = hot_state
    rng = random.Random(11)
    # Every byte of the journal header, of the first batch header and of its first record
    # header, and of the journal's last 64 bytes; then 120 positions drawn at random.
    positions = list(range(100)) + list(range(len(journal) - 64, len(journal)))
    positions += [rng.randrange(len(journal)) for _ in range(120)]
    refused = 0
    for k, pos in enumerate(positions):
        bad = bytearray(journal)
        bad[pos] ^= rng.randrange(1, 256)
        path, jpath = put(tmp_path, data, bytes(bad))
        mode = "a" if k % 10 == 0 else "r"  # writers and readers alike
        with pytest.raises(JournalError) as err:
            Log(path, mode=mode).close()
        msg = str(err.value)
        assert str(path) in msg and str(jpath) in msg and "h5store recover" in msg, msg
        assert path.read_bytes() == data, f"flip at journal byte {pos}: the file changed"
        assert jpath.read_bytes() == bytes(bad), f"flip at journal byte {pos}: the journal changed or went"
        refused += 1
        if k % 4 == 0:  # the byte restored: the same journal rolls back to the committed records
            jpath.write_bytes(journal)
            check_log(path, N)
            assert path.read_bytes() == rolled and not jpath.exists()
    assert refused == len(positions) >= 200


def test_a_torn_journal_tail_is_ignored(tmp_path, hot_state):
    """A crash while journaling: the last batch is cut short (or its bytes never reached the disk:
    zeros); none of its pages was overwritten yet, so the committed file is intact."""
    from h5store.journal import _BATCH, _HEADER

    _, journal, rolled = hot_state
    # The committed file as it is before any page is overwritten, with the transaction's new
    # bytes past the committed size.
    base = rolled + os.urandom(10000)
    start = _HEADER.size  # the hot commit journaled its pages in one batch
    assert journal[start : start + 4] == _BATCH.pack(b"BTCH", 0, 0, 0, 0)[:4]
    rng = random.Random(5)
    cuts = [0, 1, _HEADER.size - 1, start + 1, start + _BATCH.size - 1, start + _BATCH.size, len(journal) - 1]
    cuts += [rng.randrange(start, len(journal)) for _ in range(20)]
    for cut in cuts:
        path, jpath = put(tmp_path, base, journal[:cut])
        check_log(path, N)
        assert not jpath.exists()
        if cut >= _HEADER.size:  # the committed size is known: the transaction's bytes are cut away
            assert path.read_bytes() == rolled
        else:  # a torn header: nothing to restore, the new bytes past the committed ones stay
            assert path.read_bytes() == base
    # The batch's bytes never reached the disk (a power loss after the size was extended).
    path, jpath = put(tmp_path, base, journal[:start] + bytes(len(journal) - start))
    check_log(path, N)
    assert not jpath.exists()


def test_recover_reports_then_restores_what_checks_out_and_keeps_the_journal(tmp_path, hot_state, capsys):
    from h5store.cli import main

    data, journal, rolled = hot_state
    path, jpath = put(tmp_path, data, journal)
    assert main(["recover", str(path)]) != 0  # a journal waits: it says what it would do
    out = capsys.readouterr().out
    assert "would restore" in out and "nothing was changed" in out
    assert path.read_bytes() == data and jpath.read_bytes() == journal
    assert main(["recover", str(path), "--apply"]) == 0
    out = capsys.readouterr().out
    assert "restored" in out and "OK" in out
    assert path.read_bytes() == rolled and not jpath.exists()

    # A damaged payload: every other page is restored; the damaged range is named; the journal kept.
    bad = bytearray(journal)
    bad[len(journal) - 10] ^= 0xFF
    path, jpath = put(tmp_path, data, bytes(bad))
    assert main(["recover", str(path)]) != 0
    out = capsys.readouterr().out
    assert "cannot restore" in out and path.read_bytes() == data and jpath.read_bytes() == bytes(bad)
    assert main(["recover", str(path), "--apply"]) != 0
    out = capsys.readouterr().out
    assert "cannot restore" in out
    assert not jpath.exists()
    kept = [p for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert len(kept) == 1 and kept[0].read_bytes() == bytes(bad)
    assert path.stat().st_size == len(rolled)
