"""h5store.refs: id normalisation and the hash-sorted id <-> row table."""

from __future__ import annotations

import unicodedata
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5store.errors import CorruptRecordError, DuplicateIdError, NotFound
from h5store.refs import Refs, crc32_many, normalize_id

# Two different ids with the same CRC-32 (a well-known collision): lookups must compare bytes.
COLLIDE = ("plumless", "buckeroo")


def flushed(ids: list[str]) -> Refs:
    """A Refs as a reader builds it from disk: every id merged into the numpy arrays."""
    r = Refs.empty("t.h5:/")
    r.add(ids)
    lengths, data, crc = r.take_pending()
    stops = np.cumsum(lengths)
    return Refs(np.stack([stops - lengths, stops], axis=1), data, crc, "t.h5:/")


def test_normalize_id() -> None:
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert composed != decomposed
    assert normalize_id(decomposed) == composed == unicodedata.normalize("NFC", decomposed)
    assert normalize_id("spk/utt 1.wav") == "spk/utt 1.wav"
    for bad, why in [("", "empty"), ("a\x00b", "control"), ("a\nb", "control"), ("x\x85", "control"), (3, "str")]:
        with pytest.raises(ValueError, match=why):
            normalize_id(bad)


def test_collision_pair_really_collides() -> None:
    assert zlib.crc32(COLLIDE[0].encode()) == zlib.crc32(COLLIDE[1].encode())


@pytest.mark.parametrize("merge", [False, True], ids=["pending", "flushed"])
def test_lookup_row_id_contains(merge: bool) -> None:
    ids = ["a", "b", *COLLIDE, "caf\u00e9", "\u65e5\u672c"]
    r = flushed(ids) if merge else Refs.empty("t.h5:/")
    if not merge:
        assert r.add(ids).tolist() == list(range(len(ids)))
    assert len(r) == len(ids)
    assert list(r) == ids
    for k, i in enumerate(ids):
        assert r.row(i) == k and r.find(i) == k and r.id(k) == i and i in r
    assert r.row("cafe\u0301") == 4  # looked up after NFC normalisation
    assert r.id(-1) == "\u65e5\u672c"
    assert r.find("zzz") == -1 and "zzz" not in r and 5 not in r and r.find("") == -1
    assert r.rows(["b", "buckeroo", "a", "b", "plumless"]).tolist() == [1, 3, 0, 1, 2]
    assert r.rows([]).tolist() == []
    with pytest.raises(NotFound, match="no id 'zzz'") as e:
        r.rows(["a", "zzz", "yyy"])
    assert str(e.value) == "t.h5:/: no id 'zzz'"  # a sentence, not a KeyError repr
    with pytest.raises(NotFound, match="position 6 out of range for 6 ids"):
        r.id(6)
    with pytest.raises(NotFound):
        r.row("bad\x00id")
    np.testing.assert_array_equal(r.to_numpy(), np.array(ids))


def test_rows_across_flushed_and_pending() -> None:
    r = flushed(["a", "plumless"])
    r.add(["buckeroo", "c"])  # pending: not yet in the arrays
    assert r.rows(["c", "plumless", "buckeroo", "a"]).tolist() == [3, 1, 2, 0]
    assert r.row("buckeroo") == 2 and r.id(3) == "c"
    lengths, data, crc = r.take_pending()
    assert lengths.tolist() == [8, 1] and bytes(data) == b"buckerooc"
    assert crc.tolist() == [zlib.crc32(b"buckeroo"), zlib.crc32(b"c")]
    assert r.rows(["c", "plumless", "buckeroo", "a"]).tolist() == [3, 1, 2, 0]
    assert r.take_pending()[0].size == 0


def test_duplicates_refused_and_nothing_added() -> None:
    r = flushed(["a", "b"])
    with pytest.raises(DuplicateIdError, match="'b' is already stored"):
        r.add(["c", "b"])
    with pytest.raises(DuplicateIdError, match="'d' given twice"):
        r.add(["d", "e", "d"])
    with pytest.raises(DuplicateIdError, match="given twice"):
        r.add(["caf\u00e9", "cafe\u0301"])  # the same id once NFC-normalised
    assert len(r) == 2 and "c" not in r and "d" not in r
    with pytest.raises(ValueError, match="t.h5:/: an id must not be empty"):
        r.add(["ok", ""])
    assert len(r) == 2


def test_ids_stored_out_of_order_or_with_gaps() -> None:
    # h5store writes ids back to back; any valid [start, stop) index must read the same.
    data = np.frombuffer(b"..ccc.a..bb.", dtype=np.uint8)
    index = np.array([[6, 7], [9, 11], [2, 5]])
    crc = crc32_many([b"a", b"bb", b"ccc"])
    r = Refs(index, data, crc, "t.h5:/")
    assert list(r) == ["a", "bb", "ccc"] and r.merged == 3
    assert r.rows(["ccc", "a", "bb"]).tolist() == [2, 0, 1] and r.row("bb") == 1
    r.add(["dddd"])
    r.take_pending()
    assert r.rows(["dddd", "a"]).tolist() == [3, 0] and r.id(3) == "dddd"


def test_a_damaged_id_is_refused_not_returned() -> None:
    r = flushed(["alpha", "beta"])
    r._data = r._data.copy()
    r._data[5] ^= 0x20  # "beta" -> "Beta" in memory, as a flipped bit on disk would read
    with pytest.raises(CorruptRecordError, match="t.h5:/: the id at position 1 fails its checksum"):
        r.id(1)
    assert r.id(0) == "alpha"
    assert r.find("beta") == -1 and r.find("Beta") == -1  # lookups compare bytes and hash together


def test_mismatched_tables_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        Refs(np.zeros((2, 2), np.int64), np.zeros(0, np.uint8), np.zeros(1, np.uint32), "t.h5:/")


def test_crc32_many() -> None:
    blobs = [b"", b"a", b"hello"]
    out = crc32_many(blobs)
    assert out.dtype == np.uint32 and out.tolist() == [zlib.crc32(b) for b in blobs]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=6),
                min_size=1, max_size=40, unique_by=lambda s: unicodedata.normalize("NFC", s)),
       st.data())
def test_lookup_matches_a_dict(ids: list[str], data: st.DataObject) -> None:
    r = flushed(ids)
    expect = {unicodedata.normalize("NFC", i): k for k, i in enumerate(ids)}
    queries = data.draw(st.lists(st.sampled_from(ids), max_size=20))
    assert r.rows(queries).tolist() == [expect[unicodedata.normalize("NFC", q)] for q in queries]
    assert [r.row(q) for q in queries] == [expect[unicodedata.normalize("NFC", q)] for q in queries]
    absent = data.draw(st.text(min_size=1, max_size=6))
    assert (r.find(absent) >= 0) == (normalize_id_or_none(absent) in expect)


def normalize_id_or_none(s: str) -> str | None:
    try:
        return normalize_id(s)
    except ValueError:
        return None
