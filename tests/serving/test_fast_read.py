"""The fast read paths of issue 13, against plain h5py reads of the same file.

* :class:`DirectReader` joins chunks laid end to end into extents: a range crossing chunk
  boundaries inside an extent is one read, one crossing extents is read extent by extent.
* In-process ``serve`` reuses batch buffers (:class:`BatchPool`): a batch the loop holds is
  never overwritten, padding is zero in reused buffers.
* Workers send their shared-memory ring once; later batches name it.

Files here have small chunks (16 rows) and three features written in turn, so items cross
chunk boundaries and the chunks of one feature form several extents.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import torch.multiprocessing  # registers torch's shared-memory pickling

import h5store as h5s
from h5store import direct_reader
from h5store.errors import CorruptRecordError
from h5store.readers import DirectReader, Reader
from h5store.serving import FileDataset
from h5store.serving import loader as loader_mod
from h5store.serving.buffers import BatchPool
from h5store.serving.getters import mix64
from tests.test_readers import PickledReaderTests

ROWS = 16  # rows per chunk of mel
N = 60
CHUNKS_PER_RUN = 3


class Chunky(h5s.TypedFile):
    """mel and mag interleave their chunks on disk; emb is fixed-shape."""

    mel = h5s.Array(dtype="float32", shape=(None, 8), chunk_rows=ROWS)
    mag = h5s.Array(dtype="float32", shape=(None, 3), chunk_rows=ROWS)
    emb = h5s.Array(dtype="float64", shape=(5,), chunk_rows=8)
    label = h5s.Scalar(dtype="int64")


def record(i: int, t: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"mel": (rng.standard_normal((t, 8)) + 100 * i).astype("float32"),
            "mag": np.full((t, 3), i, "float32") + np.arange(t, dtype="float32")[:, None],
            "emb": rng.standard_normal(5) + i, "label": i % 7}


def make_chunky(path: Path, n: int, first: int = 0, mode: str = "w") -> None:
    """Items of 3..70 rows, committed in small batches: the features' chunks interleave."""
    lengths = np.random.default_rng(first).integers(3, 71, n)
    with Chunky(path, mode=mode) as f:
        for a in range(0, n, 7):
            f.extend([(f"id{i:05d}", record(i, int(lengths[i - first]))) for i in range(first + a, first + min(n, a + 7))])
            f.commit()


def plain(path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(data, index) of a feature, read with plain h5py."""
    with h5py.File(path, "r", locking=False) as f:
        return f[f"{name}/data"][...], f[f"{name}/index"][...]


@pytest.fixture(scope="module")
def chunky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fast") / "chunky.h5"
    make_chunky(path, N)
    return path


def check_batch(path: Path, batch: dict[str, Any], items: np.ndarray, window: int | None = None) -> None:
    """Every value of ``batch`` equals plain h5py's bytes for ``items``."""
    mel, mel_idx = plain(path, "mel")
    emb, emb_idx = plain(path, "emb")
    x = np.asarray(batch["x"])
    for j, i in enumerate(items.tolist()):
        a, b = mel_idx[i]
        item = mel[a:b]
        if window is None:
            n = int(np.asarray(batch["x_lengths"])[j])
            assert n == b - a
            np.testing.assert_array_equal(x[j, :n], item)
            assert not x[j, n:].any()  # padding is zero (also in a reused buffer)
        else:
            w = x[j]
            first = np.flatnonzero((item == w[0]).all(axis=1))
            assert first.size == 1, "the window's first row is a row of its item"
            o = int(first[0])
            got = min(window, len(item) - o)
            np.testing.assert_array_equal(w[:got], item[o : o + got])
            assert not w[got:].any()
        np.testing.assert_array_equal(np.asarray(batch["e"])[j], emb[emb_idx[i, 0]])


# --------------------------------------------------------------------------- extents
def test_the_file_has_extents_and_items_crossing_chunks(chunky: Path) -> None:
    with h5py.File(chunky, "r", locking=False) as f:
        ds = f["mel/data"]
        reader = DirectReader.for_dataset(ds, str(chunky))
        assert reader is not None
        chunks = -(-ds.shape[0] // ROWS)
        assert 1 < len(reader.starts) < chunks  # several chunks per extent, several extents
        assert int(reader.piece_rows.sum()) >= ds.shape[0]
        idx = f["mel/index"][...]
    crossing = (idx[:, 0] // ROWS) != ((idx[:, 1] - 1) // ROWS)
    assert crossing.sum() > N // 3
    ext_of = np.searchsorted(reader.starts, idx[:, 0], side="right") != np.searchsorted(
        reader.starts, idx[:, 1] - 1, side="right")
    assert ext_of.any(), "some item crosses two extents (read extent by extent)"


class TestDirectExtents(PickledReaderTests):
    """Chunks written in runs of three with another dataset's chunk between runs."""

    reads_after_fork = True

    def make_reader(self, tmp_path: Path, data: np.ndarray) -> Reader:
        path = str(tmp_path / "r.h5")
        with h5py.File(path, "w") as f:
            ds = f.create_dataset("x", shape=(0, 3), maxshape=(None, 3), chunks=(10, 3), dtype=data.dtype)
            other = f.create_dataset("y", shape=(0,), maxshape=(None,), chunks=(64,), dtype="float64")
            step = 10 * CHUNKS_PER_RUN
            for a in range(0, len(data), step):
                ds.resize(min(len(data), a + step), axis=0)
                ds[a : a + step] = data[a : a + step]
                f.flush()
                other.resize(other.shape[0] + 64, axis=0)
                other[-64:] = a
                f.flush()
        f = h5py.File(path, "r")
        self._files = [*getattr(self, "_files", []), f]
        reader = DirectReader.for_dataset(f["x"], path)
        assert reader is not None and 1 < len(reader.starts) < -(-len(data) // 10)
        return reader

    @pytest.fixture(autouse=True)
    def _close_files(self) -> Any:
        yield
        for f in getattr(self, "_files", []):
            f.close()
        self._files = []


# --------------------------------------------------------------------------- serving == h5py
@pytest.fixture(params=["mapped", "preadv"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both direct read paths: small ranges from the file's mapping, or every range by preadv."""
    if request.param == "preadv":
        monkeypatch.setattr(direct_reader, "MAP_MAX_BYTES", -1)
    return str(request.param)


def test_in_process_items_and_windows_equal_h5py(chunky: Path, path_kind: str) -> None:
    f = Chunky(chunky)
    for window in (None, 20, 64):
        x = h5s.Item("mel") if window is None else h5s.Window("mel", window)
        loader = f.serve(dict(x=x, e=h5s.Item("emb"), p=h5s.Position()), batch_size=7, shuffle=True, seed=3)
        assert isinstance(loader.dataset.files.alloc, BatchPool)
        seen = []
        for epoch in range(2):  # the second epoch reads into reused buffers
            loader.sampler.set_epoch(epoch)
            for batch in loader:
                items = batch["p"].numpy()
                check_batch(chunky, batch, items, window)
                seen.append(items)
        assert sorted(np.concatenate(seen).tolist()) == sorted(list(range(N)) * 2)
    f.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_serve_what_h5py_reads(chunky: Path, context: str) -> None:
    f = Chunky(chunky)
    for window in (None, 24):
        x = h5s.Item("mel") if window is None else h5s.Window("mel", window)
        loader = f.serve(dict(x=x, e=h5s.Item("emb"), p=h5s.Position()), batch_size=5, num_workers=2,
                         multiprocessing_context=context, persistent_workers=True)
        for _ in range(2):  # the second epoch: rings already mapped, batches name them
            got = []
            for batch in loader:
                items = batch["p"].numpy()
                check_batch(chunky, batch, items, window)
                got.append(items)
            assert np.concatenate(got).tolist() == list(range(N))
        del batch
        loader._iterator._shutdown_workers()  # type: ignore[union-attr]
    f.close()


def test_served_while_a_writer_appends(tmp_path: Path, path_kind: str) -> None:
    path = tmp_path / "live.h5"
    make_chunky(path, 30)
    reader = Chunky(path)
    loader = reader.serve(dict(x=h5s.Item("mel"), e=h5s.Item("emb")), batch_size=4)
    it = iter(loader)
    first = next(it)
    check_batch(path, first, np.arange(4))
    make_chunky(path, 30, first=30, mode="a")  # new chunks after the served snapshot's
    rest = list(it)
    assert sum(len(b["x"]) for b in rest) == 26  # the snapshot: 30 items
    for k, b in enumerate(rest):
        check_batch(path, b, np.arange(4 + 4 * k, 4 + 4 * k + len(b["x"])))
    reader.refresh()
    assert len(reader) == 60
    batches = list(reader.serve(dict(x=h5s.Window("mel", 40), e=h5s.Item("emb")), batch_size=8))
    for k, b in enumerate(batches):
        check_batch(path, b, np.arange(8 * k, 8 * k + len(b["x"])), 40)
    reader.close()


def test_a_truncated_file_raises_naming_it(tmp_path: Path, path_kind: str) -> None:
    path = tmp_path / "cut.h5"
    make_chunky(path, 40)
    f = Chunky(path)
    ds = FileDataset(f, dict(x=h5s.Item("mel")))
    ds.fetch(np.arange(3))  # readers open, offsets known
    with h5py.File(path, "r", locking=False) as h:
        reader = DirectReader.for_dataset(h["mel/data"], str(path))
        assert reader is not None
        last = int(reader.offsets[-1])
    os.truncate(path, last + 8)  # the last extent's bytes are gone
    with pytest.raises(CorruptRecordError, match=str(path)) as e:
        ds.fetch(np.arange(40))
    assert "truncated" in str(e.value)
    f.close()


def test_the_mapping_follows_a_growing_file_and_refuses_a_short_one(tmp_path: Path) -> None:
    """Rows past the mapped (and past the file's) end: an error, then read once the file grew."""
    path = tmp_path / "raw.bin"
    data = np.arange(200 * 4, dtype=np.float32).reshape(200, 4)
    data[:100].tofile(path)  # half of the rows the reader knows of are written yet
    reader = DirectReader(str(path), data.shape, data.dtype, np.zeros(1, np.int64), np.zeros(1, np.int64), 200)
    out = np.zeros((3, 10, 4), np.float32)
    reader.read_scatter(out, np.array([0, 2]), np.array([5, 90]), np.array([10, 10]))
    np.testing.assert_array_equal(out[0], data[5:15])
    np.testing.assert_array_equal(out[2], data[90:100])
    with pytest.raises(CorruptRecordError, match=f"{path}.*truncated"):
        reader.read_scatter(out, np.array([1]), np.array([150]), np.array([10]))
    with open(path, "ab") as fh:
        fh.write(data[100:].tobytes())  # the writer appends
    reader.read_scatter(out, np.array([1]), np.array([150]), np.array([10]))  # mapped again, larger
    np.testing.assert_array_equal(out[1], data[150:160])
    mapping = reader._map
    assert mapping is not None and len(mapping) == data.nbytes
    reader.close()
    assert reader._map is None


def test_readers_of_one_file_share_one_mapping(chunky: Path) -> None:
    """Every feature's reader maps the file once per process, not once per dataset."""
    with h5s.open(chunky) as f:
        ds = FileDataset(f, dict(x=h5s.Item("mel"), m=h5s.Item("mag"), e=h5s.Item("emb")))
        ds.fetch(np.arange(8))
        maps = {id(r._map) for r in (ds.files.column(0, n).reader() for n in ("mel", "mag", "emb"))
                if isinstance(r, DirectReader) and r._map is not None}
        assert len(maps) == 1


def test_reads_work_under_an_address_space_limit(chunky: Path, tmp_path: Path) -> None:
    """``ulimit -v`` (RLIMIT_AS) below what mapping the file needs: reads fall back to preadv."""
    big = tmp_path / "big.h5"
    with Chunky(big, mode="w") as f:  # 96 MiB of mel: more than the limit leaves free
        f.extend([(f"b{i}", {"mel": np.full((300_000, 8), i, "float32"), "mag": np.zeros((1, 3), "float32"),
                             "emb": np.zeros(5), "label": i}) for i in range(10)])
    code = f"""
import resource, numpy as np, h5store as h5s
from h5store.serving import FileDataset
f = h5s.open({str(big)!r})
ds = FileDataset(f, dict(x=h5s.Item("mel")))
reader = ds.files.column(0, "mel").reader()  # chosen (HDF5 gave the chunk table): nothing mapped yet
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), vm + (48 << 20)))
for i in range(10):
    b = ds.fetch([i])
    assert b["x"].shape == (1, 300_000, 8) and (b["x"] == i).all(), i
assert reader._map is None  # the mapping was refused: every read went through preadv
print("ok")
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# --------------------------------------------------------------------------- the pieces
def test_batch_pool_reuses_a_buffer_only_once_it_is_garbage() -> None:
    pool = BatchPool(keep=2)
    a = pool((1000, 600), np.float32)
    addr = a.ctypes.data
    assert addr % 64 == 0
    t = torch.from_numpy(a[:10])  # the loop holds a tensor of a view
    del a
    gc.collect()
    b = pool((1000, 600), np.float32)
    assert b.ctypes.data != addr  # still held: not handed out again
    del t
    c = pool((900, 600), np.float32)  # a smaller batch of the same size class
    assert c.ctypes.data == addr
    assert pool((3, 4), np.float32).shape == (3, 4)  # small: plain np.empty
    del b, c
    assert pool.pooled_bytes == 2 * (1 << (1000 * 600 * 4 - 1).bit_length())


def test_batch_pool_from_threads() -> None:
    pool = BatchPool()
    errors: list[BaseException] = []

    def hammer(k: int) -> None:
        try:
            for r in range(200):
                a = pool((700 + r % 7, 400), np.float32)
                a[...] = k
                assert (a == k).all()  # nobody else was handed the same buffer
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _splitmix(parts: list[int]) -> int:
    m = (1 << 64) - 1
    h = 0
    for x in parts:
        z = ((h ^ (x & m)) + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        h = z ^ (z >> 31)
    return h


def test_mix64_is_splitmix64() -> None:
    idx = np.array([0, 1, 7, 2**40, 2**62 + 3], dtype=np.int64)
    for seed, epoch in ((0, 0), (3, 1), (2**63 + 5, 2**32), (-1, 7)):
        got = mix64(seed, epoch, idx)
        assert got.dtype == np.uint64
        assert got.tolist() == [_splitmix([seed, epoch, int(i)]) for i in idx.tolist()]
    assert mix64(5).tolist() == [_splitmix([5])]
    assert mix64(idx, 2).tolist() == [_splitmix([int(i), 2]) for i in idx.tolist()]


def test_a_ring_travels_once() -> None:
    shared = loader_mod.SharedBatches(slots=4)
    batch = {"x": np.arange(3000, dtype=np.float32).reshape(30, 100)}
    shared.reset()
    first = ForkingPickler.dumps(shared.pack(batch))  # as a DataLoader worker sends it
    got = pickle.loads(first)  # the main process adopts the ring
    np.testing.assert_array_equal(got.unpack()["x"].numpy(), batch["x"])
    shared.reset()
    rb = shared.pack(batch)
    rebuild, args = rb.__reduce__()
    assert args[0] is None  # named, not sent
    again = pickle.loads(ForkingPickler.dumps(rb))
    np.testing.assert_array_equal(again.unpack()["x"].numpy(), batch["x"])
    key = rb.key
    with pytest.raises(RuntimeError, match="never received"):
        rebuild(None, (key[0], key[1] + 1000), *args[2:])
    loader_mod._RINGS.pop(key, None)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_ring_keys_never_repeat_across_forked_workers() -> None:
    # Workers forked from one parent inherit its state: a ring numbered from an inherited
    # counter would get the same key part in each; a later worker given a dead worker's
    # pid would then name (and be served) the dead worker's ring.
    def child_key() -> tuple[int, int]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.write(w, pickle.dumps(loader_mod._Ring(1, 4096).key))
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            key = pickle.loads(f.read())
        os.waitpid(pid, 0)
        return key

    a, b = child_key(), child_key()
    assert a[1] != b[1], (a, b)
    # A new ring under a pid drops that pid's other rings (a replaced ring, or a dead worker's).
    ring = torch.zeros(4096, dtype=torch.uint8).share_memory_()
    pid = os.getpid()
    try:
        loader_mod._adopt((pid, a[1]), ring)
        loader_mod._adopt((pid, b[1]), ring)
        assert (pid, a[1]) not in loader_mod._RINGS and (pid, b[1]) in loader_mod._RINGS
    finally:
        loader_mod._RINGS.pop((pid, a[1]), None)
        loader_mod._RINGS.pop((pid, b[1]), None)
