"""h5store.storage: column specs, the writer, the three readers, integrity checks."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5store.errors import CorruptRecordError, FormatError, ReadOnlyError, SchemaError
from h5store.layout import plan_reads
from h5store.storage import (
    FORMAT_VERSION,
    ChunkReader,
    Column,
    ColumnSpec,
    DirectReader,
    GroupStore,
    H5Reader,
    MemoryReader,
    check_root,
    init_root,
)

MEL = ColumnSpec(dtype="float32", shape=(None, 4), layout="ragged")


def items(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((int(rng.integers(0, 9)), 4)).astype(np.float32) for _ in range(n)]


def write_store(path: Path, specs: dict[str, ColumnSpec], ids: list[str], values: dict[str, list]) -> None:
    with h5py.File(path, "w") as f:
        init_root(f, {"class": "T", "groups": {"": {}}}, "test")
        store = GroupStore(f, specs, f"{path}:/", writable=True, path=str(path))
        store.add(ids, values)
        store.flush()


# ----------------------------------------------------------------------------- ColumnSpec
def test_column_spec_validation_lists_every_problem() -> None:
    with pytest.raises(SchemaError) as e:
        ColumnSpec(dtype="nope", shape=(None, None), layout="ragged", compression="brotli", chunk_rows=0)
    msg = str(e.value)
    for part in ("unknown dtype 'nope'", "only the first axis may be variable", "compression must be one of",
                 "chunk_rows must be > 0"):
        assert part in msg
    with pytest.raises(SchemaError, match="fixed layout needs a fixed shape"):
        ColumnSpec(dtype="int8", shape=(None,), layout="fixed")
    with pytest.raises(SchemaError, match="ragged layout needs shape"):
        ColumnSpec(dtype="int8", shape=(3,), layout="ragged")
    with pytest.raises(SchemaError, match="blobs layout stores bytes"):
        ColumnSpec(dtype="float32", shape=(None,), layout="blobs")
    with pytest.raises(SchemaError, match="numeric or bool"):
        ColumnSpec(dtype="U5", shape=(), layout="fixed")


def test_column_spec_round_trips_and_shapes() -> None:
    spec = ColumnSpec(dtype="uint8", shape=(None, 4, 5, 3), layout="ragged", compression="gzip", compression_opts=4)
    assert ColumnSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.inner == (4, 5, 3) and spec.row_nbytes == 60 and spec.filtered
    assert ColumnSpec(dtype="float64", shape=(3,), layout="fixed").inner == (3,)
    assert ColumnSpec(dtype="int16", shape=(), layout="fixed").row_nbytes == 2
    assert ColumnSpec(dtype="uint8", shape=(None,), layout="blobs").inner == ()


# ----------------------------------------------------------------------------- root
def test_check_root(tmp_h5: Path) -> None:
    with h5py.File(tmp_h5, "w") as f:
        with pytest.raises(FormatError, match="not an h5store file"):
            check_root(f, str(tmp_h5))
        init_root(f, {"class": "T", "groups": {"": {}}}, "9.9")
        assert check_root(f, str(tmp_h5)) == {"class": "T", "groups": {"": {}}}
        assert int(f.attrs["h5store_format"]) == FORMAT_VERSION == 1
        assert f.attrs["h5store_version"] == "9.9"
        for bad, why in [(2, "newer than this library"), (0, "invalid h5store format"), ("x", "malformed")]:
            f.attrs["h5store_format"] = bad
            with pytest.raises(FormatError, match=why) as e:
                check_root(f, str(tmp_h5))
            assert str(tmp_h5) in str(e.value)
        f.attrs["h5store_format"] = 1
        f.attrs["h5store_schema"] = "{not json"
        with pytest.raises(FormatError, match="malformed schema"):
            check_root(f, str(tmp_h5))
        f.attrs["h5store_schema"] = json.dumps({"class": "T"})
        with pytest.raises(FormatError, match="no 'groups'"):
            check_root(f, str(tmp_h5))


# ----------------------------------------------------------------------------- writer + reader
SPECS = {
    "mel": MEL,
    "vec": ColumnSpec(dtype="float64", shape=(3,), layout="fixed"),
    "n": ColumnSpec(dtype="int16", shape=(), layout="fixed"),
    "z": ColumnSpec(dtype="int32", shape=(None, 2), layout="ragged", compression="gzip", shuffle=True),
    "vid": ColumnSpec(dtype="uint8", shape=(None,), layout="blobs"),
}


@pytest.fixture
def store_file(tmp_h5: Path) -> tuple[Path, dict]:
    mel = items(30)
    values = {
        "mel": mel,
        "vec": [np.arange(3.0) + i for i in range(30)],
        "n": [np.int16(i - 15) for i in range(30)],
        "z": [np.full((i % 4, 2), i, np.int32) for i in range(30)],
        "vid": [[bytes([i] * (j + 1)) for j in range(i % 3)] for i in range(30)],
    }
    write_store(tmp_h5, SPECS, [f"id{i}" for i in range(30)], values)
    return tmp_h5, values


def open_store(path: Path, writable: bool = False) -> tuple[h5py.File, GroupStore]:
    f = h5py.File(path, "r+" if writable else "r")
    return f, GroupStore(f, SPECS, f"{path}:/", writable=writable, path=str(path))


def test_store_round_trip_and_layout_on_disk(store_file: tuple[Path, dict]) -> None:
    path, values = store_file
    f, store = open_store(path)
    with f:
        assert len(store) == 30 and store.refs.id(7) == "id7"
        rows = np.array([5, 0, 29, 5, 12])
        for name in ("mel", "vec", "n", "z"):
            got = store.columns[name].read_items(rows, verify=True)
            for r, g in zip(rows.tolist(), got):
                np.testing.assert_array_equal(g, values[name][r])
        blobs = store.columns["vid"].read_items(rows, verify=True)
        assert [[b.tobytes() for b in item] for item in blobs] == [values["vid"][r] for r in rows.tolist()]
        # The on-disk shapes of docs/format.md.
        assert f["mel/data"].shape == (sum(len(x) for x in values["mel"]), 4)
        assert f["vec/data"].shape == (30, 3) and f["n/data"].shape == (30,)
        assert f["vec/index"][...].tolist() == [[i, i + 1] for i in range(30)]
        assert f["mel/index"].dtype == np.int64 and f["mel/checksum"].dtype == np.uint32
        assert f["vid/frames"].shape == (sum(len(x) for x in values["vid"]), 2)
        assert f["z/data"].compression == "gzip"
        assert json.loads(f["mel"].attrs["h5store_column"]) == MEL.to_dict()
        crc = [zlib.crc32(np.ascontiguousarray(x).tobytes()) for x in values["mel"]]
        assert f["mel/checksum"][...].tolist() == crc
        assert f["ids/checksum"][...].tolist() == [zlib.crc32(f"id{i}".encode()) for i in range(30)]


def test_readers_agree(store_file: tuple[Path, dict]) -> None:
    path, _ = store_file
    f, store = open_store(path)
    with f:
        col = store.columns["mel"]
        assert isinstance(col.reader(), DirectReader)  # uncompressed, read-only: the fast path
        assert isinstance(store.columns["z"].reader(), ChunkReader)  # gzip: decoded by h5store, bounded
        idx = col.index
        rows = np.array([3, 3, 28, 0, 17, 9, 1])
        plan = plan_reads(idx[rows, 0], idx[rows, 1])
        direct = col.reader().read_runs(plan)
        through_h5 = H5Reader(col.data).read_runs(plan)
        in_memory = MemoryReader(col.data[...]).read_runs(plan)
        np.testing.assert_array_equal(direct, through_h5)
        np.testing.assert_array_equal(direct, in_memory)
        col.use_memory(col.data[...])
        assert isinstance(col.reader(), MemoryReader)
        for got, r in zip(col.read_items(rows), rows.tolist()):  # now served from memory
            np.testing.assert_array_equal(got, col.data[idx[r, 0] : idx[r, 1]])
        with pytest.raises(ValueError, match="in-memory copy"):
            col.use_memory(np.zeros((1, 4), np.float32))


def test_direct_reader_follows_scattered_chunks(tmp_h5: Path) -> None:
    # Two datasets appended in turn: their chunks interleave in the file, so the chunk
    # table (not one contiguous offset) must drive the reads.
    with h5py.File(tmp_h5, "w") as f:
        a = f.create_dataset("a", shape=(0, 3), maxshape=(None, 3), chunks=(4, 3), dtype="int32")
        b = f.create_dataset("b", shape=(0,), maxshape=(None,), chunks=(4,), dtype="float64")
        for k in range(10):
            a.resize(4 * (k + 1), axis=0)
            a[4 * k :] = np.arange(12).reshape(4, 3) + 100 * k
            b.resize(4 * (k + 1), axis=0)
            b[4 * k :] = np.arange(4) + 0.5 * k
            f.flush()  # allocate the chunks now, in turn (the chunk cache would keep them together)
        f.create_dataset("c", data=np.arange(50, dtype=np.int16))  # contiguous
        f.create_dataset("g", data=np.arange(50, dtype=np.int16), compression="gzip")
    with h5py.File(tmp_h5, "r") as f:
        for name in ("a", "b", "c"):
            ds = f[name]
            reader = DirectReader.for_dataset(ds, str(tmp_h5))
            assert reader is not None
            plan = plan_reads(np.array([37, 0, 5, 13, 2]), np.array([40, 3, 11, 13, 9]))
            np.testing.assert_array_equal(reader.read_runs(plan), H5Reader(ds).read_runs(plan))
            np.testing.assert_array_equal(reader.read_runs(plan_reads(np.array([0]), np.array([len(ds)]))), ds[...])
        assert len(DirectReader.for_dataset(f["a"], str(tmp_h5)).starts) > 1
        assert DirectReader.for_dataset(f["g"], str(tmp_h5)) is None


def test_read_past_the_end_is_corrupt_record(store_file: tuple[Path, dict]) -> None:
    path, _ = store_file
    f, store = open_store(path)
    with f:
        col = store.columns["mel"]
        n = col.data.shape[0]
        for reader in (col.reader(), H5Reader(col.data)):
            with pytest.raises(CorruptRecordError, match="past the end"):
                reader.read_runs(plan_reads(np.array([n - 1]), np.array([n + 1])))


def test_index_pointing_outside_data_is_refused(store_file: tuple[Path, dict]) -> None:
    path, _ = store_file
    with h5py.File(path, "r+") as f:
        f["mel/index"][3] = [0, 10**6]
        f["vec/index"][2] = [0, 2]  # a fixed item spans exactly one row
        f["vid/frames"][0] = [0, 10**6]
    f, store = open_store(path)
    with f:
        with pytest.raises(CorruptRecordError, match=r"mel: index row 3 = \[0, 1000000\] points outside"):
            _ = store.columns["mel"].index
        with pytest.raises(CorruptRecordError, match="vec: index row 2"):
            _ = store.columns["vec"].index
        with pytest.raises(CorruptRecordError, match="vid: frames row 0"):
            _ = store.columns["vid"].frames


def test_checksums_catch_a_flipped_byte(store_file: tuple[Path, dict]) -> None:
    path, values = store_file
    with h5py.File(path, "r+") as f:
        a, b = f["mel/index"][4]
        assert b > a
        row = f["mel/data"][a]
        row[0] += 1.0
        f["mel/data"][a] = row
    f, store = open_store(path)
    with f:
        col = store.columns["mel"]
        assert col.read_items(np.array([4]))[0][0, 0] == values["mel"][4][0, 0] + 1  # unverified: wrong value
        with pytest.raises(CorruptRecordError, match="item at row 4 fails its checksum"):
            col.read_items(np.array([1, 4]), verify=True)
        col.read_items(np.array([1, 5]), verify=True)  # the others still verify


def test_index_length_mismatch_is_refused(store_file: tuple[Path, dict]) -> None:
    path, _ = store_file
    with h5py.File(path, "r+") as f:
        f["vec/index"].resize(29, axis=0)
    with h5py.File(path, "r") as f, pytest.raises(CorruptRecordError, match="vec: index has 29 rows for 30 ids"):
        GroupStore(f, SPECS, f"{path}:/", writable=False, path=str(path))


def test_missing_column_and_wrong_dtype_are_format_errors(store_file: tuple[Path, dict]) -> None:
    path, _ = store_file
    with h5py.File(path, "r") as f:
        with pytest.raises(FormatError, match="no column 'other'"):
            GroupStore(f, {"other": MEL}, f"{path}:/", writable=False, path=str(path))
        with pytest.raises(FormatError, match="data is float32"):
            Column(f["mel"], ColumnSpec(dtype="float64", shape=(None, 4), layout="ragged"), "x", False, str(path))


def test_read_only_column_refuses_writes(store_file: tuple[Path, dict]) -> None:
    path, _ = store_file
    f, store = open_store(path)
    with f:
        with pytest.raises(ReadOnlyError):
            store.add(["new"], {})
        with pytest.raises(ReadOnlyError):
            store.columns["mel"].overwrite(0, np.zeros((0, 4), np.float32))
        with pytest.raises(PermissionError):
            store.columns["mel"].append(np.array([0]), [np.zeros((1, 4), np.float32)])


def test_append_overwrite_and_flush_keep_disk_consistent(store_file: tuple[Path, dict]) -> None:
    path, values = store_file
    f, store = open_store(path, writable=True)
    with f:
        rows = store.add(["x1", "x2"], {"mel": [np.ones((2, 4), np.float32), np.zeros((0, 4), np.float32)]})
        assert rows.tolist() == [30, 31]
        store.put("vec", 30, np.array([7.0, 8.0, 9.0]))  # absent -> append
        store.put("vec", 0, np.array([1.0, 1.0, 1.0]))  # present -> overwrite
        with pytest.raises(SchemaError, match="overwrite needs shape"):
            store.columns["mel"].overwrite(1, np.zeros((99, 4), np.float32))
        with pytest.raises(SchemaError, match="cannot be overwritten"):
            store.columns["vid"].overwrite(1, np.zeros(1, np.uint8))
        with pytest.raises(ValueError, match="already stored"):
            store.columns["mel"].append(np.array([30]), [np.ones((1, 4), np.float32)])
        with pytest.raises(SchemaError, match="no feature 'nope'"):
            store.add(["x3"], {"nope": [1]})
        store.flush()
    with h5py.File(path, "r") as f:
        n = 32
        assert f["ids/index"].shape == (n, 2)
        for name in SPECS:
            assert f[f"{name}/index"].shape == (n, 2) and f[f"{name}/checksum"].shape == (n,)
        assert f["mel/index"][31].tolist()[0] == f["mel/index"][31].tolist()[1]  # empty, not absent
        assert f["n/index"][30].tolist() == [-1, -1] and f["n/checksum"][30] == 0
        assert f["mel/data"].shape[0] == f["mel/index"][...].max()  # trimmed to the logical size
        vi = f["vec/index"][...]
        np.testing.assert_array_equal(f["vec/data"][vi[30, 0]], [7.0, 8.0, 9.0])
        np.testing.assert_array_equal(f["vec/data"][vi[0, 0]], [1.0, 1.0, 1.0])
        assert f["vec/checksum"][0] == zlib.crc32(np.array([1.0, 1.0, 1.0]).tobytes())
    f, store = open_store(path)
    with f:
        present = np.flatnonzero(store.columns["vec"].present)
        assert present.tolist() == [*range(30), 30]
        store.columns["vec"].read_items(present, verify=True)
        with pytest.raises(KeyError):
            store.columns["vec"].read_items(np.array([31]))


def test_adopting_tables_of_another_store(store_file: tuple[Path, dict]) -> None:
    path, values = store_file
    with h5py.File(path, "r") as f:
        first = GroupStore(f, SPECS, f"{path}:/", writable=False, path=str(path))
        first.refs.row("id3")
        _ = first.columns["mel"].index, first.columns["vid"].frames  # load them
        tables = first.tables()
        assert tables is not None and tables.refs is first.refs
        again = GroupStore(f, SPECS, f"{path}:/", writable=False, path=str(path))
        again.adopt(tables)  # the file is unchanged: the very same arrays
        assert again.refs is first.refs
        assert again.columns["mel"].index is first.columns["mel"].index
        assert again.columns["vid"].frames is first.columns["vid"].frames
        assert again.columns["vec"]._index is None  # never loaded: nothing to adopt, read on demand
        np.testing.assert_array_equal(again.columns["mel"].read_items(np.array([7]))[0], values["mel"][7])
    write_more = GroupStore(h5py.File(path, "r+"), SPECS, f"{path}:/", writable=True, path=str(path))
    assert write_more.tables() is None  # a writer hands nothing over
    write_more.add(["late"], {"mel": [np.ones((2, 4), np.float32)]})
    write_more.flush()
    write_more.g.file.close()
    with h5py.File(path, "r") as f:
        grown = GroupStore(f, SPECS, f"{path}:/", writable=False, path=str(path))
        grown.adopt(tables)  # stale tables (30 ids, fewer mel rows) are not taken
        assert grown.refs is not tables.refs and len(grown.refs) == 31 and grown.refs.row("late") == 30
        assert len(grown.columns["mel"].index) == 31
        assert grown.columns["vid"].frames is tables.columns["vid"][4]  # vid did not change
