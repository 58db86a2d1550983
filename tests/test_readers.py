"""Every reader passes the Reader conformance kit (h5store.testing.ReaderTests)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from h5store.readers import ChunkReader, DirectReader, H5Reader, MemoryReader, Reader, choose_reader
from h5store.testing import ReaderTests


def _store(tmp_path: Path, data: np.ndarray, **kw: Any) -> str:
    """``data`` as the dataset "x" of a new file (kept open by no one)."""
    path = str(tmp_path / "r.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, **kw)
    return path


class PickledReaderTests(ReaderTests):
    """The kit with a byte-level pickle round trip (what DataLoader's spawn workers receive)."""

    def roundtrip(self, obj: Any) -> Any:
        return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class _FromFile(PickledReaderTests):
    """Readers of a dataset in a file: the file stays open (read-only) while the test runs."""

    kw: dict[str, Any] = {}
    kind: type = DirectReader

    def make_reader(self, tmp_path: Path, data: np.ndarray) -> Reader:
        path = _store(tmp_path, data, **self.kw)
        f = h5py.File(path, "r")
        self._files = getattr(self, "_files", []) + [f]
        reader = self.build(f["x"], path)
        assert type(reader) is self.kind, f"chose {type(reader).__name__}, expected {self.kind.__name__}"
        return reader

    def build(self, ds: h5py.Dataset, path: str) -> Reader:
        return choose_reader(ds, path, f"{path}:/x", writable=False)

    @pytest.fixture(autouse=True)
    def _close_files(self) -> Any:
        yield
        for f in getattr(self, "_files", []):
            f.close()
        self._files = []


class TestDirectContiguous(_FromFile):
    kw: dict[str, Any] = {}
    reads_after_fork = True  # its descriptor is reopened in the child


class TestDirectChunked(_FromFile):
    kw = dict(chunks=(16, 3), maxshape=(None, 3))
    reads_after_fork = True


class TestDirectChunkedMoved(_FromFile):
    """Chunks not laid end to end (written last to first): one piece per chunk."""

    reads_after_fork = True

    def make_reader(self, tmp_path: Path, data: np.ndarray) -> Reader:
        path = str(tmp_path / "r.h5")
        with h5py.File(path, "w") as f:
            ds = f.create_dataset("x", shape=data.shape, maxshape=(None, 3), chunks=(10, 3), dtype=data.dtype)
            for a in reversed(range(0, len(data), 10)):  # the last chunk allocated first
                ds[a : a + 10] = data[a : a + 10]
                f.flush()
        f = h5py.File(path, "r")
        self._files = getattr(self, "_files", []) + [f]
        reader = DirectReader.for_dataset(f["x"], path)
        assert reader is not None and len(reader.starts) > 1, "expected one piece per chunk"
        return reader


class TestChunkGzip(_FromFile):
    kw = dict(chunks=(16, 3), compression="gzip")
    kind = ChunkReader
    reads_after_fork = True


class TestChunkLzfShuffle(_FromFile):
    kw = dict(chunks=(16, 3), compression="lzf", shuffle=True)
    kind = ChunkReader
    reads_after_fork = True


class TestChunkShuffleFletcher(_FromFile):
    kw = dict(chunks=(16, 3), shuffle=True, fletcher32=True)
    kind = ChunkReader
    reads_after_fork = True


class TestChunkSplitRows(_FromFile):
    """Chunks that split rows (not what h5store writes): a grid of cells per row."""

    kw = dict(chunks=(16, 2), compression="gzip")
    kind = ChunkReader
    reads_after_fork = True


class TestH5Reader(_FromFile):
    kw = dict(chunks=(16, 3), scaleoffset=True)  # a filter h5store leaves to HDF5
    kind = H5Reader
    picklable = False  # holds an h5py dataset

    def make_data(self) -> np.ndarray:
        return np.arange(257 * 3, dtype=np.int32).reshape(257, 3) - 100


class TestH5ReaderOfAnyDataset(_FromFile):
    kw = dict(chunks=(16, 3))
    kind = H5Reader
    picklable = False

    def build(self, ds: h5py.Dataset, path: str) -> Reader:
        return H5Reader(ds)


class TestMemoryReader(PickledReaderTests):
    def make_reader(self, tmp_path: Path, data: np.ndarray) -> Reader:
        return MemoryReader(data.copy())


class TestMemoryReaderRagged(PickledReaderTests):
    """Rows of a different shape: uint8 scalars (the ids table, blobs)."""

    def make_data(self) -> np.ndarray:
        return (np.arange(1000) % 251).astype(np.uint8)

    def make_reader(self, tmp_path: Path, data: np.ndarray) -> Reader:
        return MemoryReader(data.copy())


class TestDirectBytes(_FromFile):
    kw = dict(chunks=(64,))
    reads_after_fork = True

    def make_data(self) -> np.ndarray:
        return (np.arange(1000) % 251).astype(np.uint8)


def test_the_writer_reads_compressed_chunks_through_hdf5(tmp_path: Path) -> None:
    data = ReaderTests().make_data()
    path = _store(tmp_path, data, chunks=(16, 3), compression="gzip")
    with h5py.File(path, "a") as f:
        reader = choose_reader(f["x"], path, f"{path}:/x", writable=True)
        assert type(reader) is ChunkReader and reader.ds is not None
        ReaderTests().check_runs(reader, data)
        assert type(choose_reader(f["x"], path, f"{path}:/x", writable=False)) is ChunkReader
    path2 = str(tmp_path / "plain.h5")
    _store(tmp_path / "..", data)  # (another file: the writer of unfiltered data reads through HDF5)
    with h5py.File(path2, "w") as f:
        f.create_dataset("x", data=data, chunks=(16, 3))
        assert type(choose_reader(f["x"], path2, f"{path2}:/x", writable=True)) is H5Reader
