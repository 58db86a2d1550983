"""iter_batches: the torch path's batches as numpy arrays, read ahead by real threads, which end
when the loop stops early."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import h5store as h5s
from h5store.serving import BatchIterator, FileDataset, iter_batches
from h5store.serving.numpy_iter import BufferPool, aligned_empty, prepare_for_threads
from tests.serving.conftest import N, reference
from tests.serving.schemas import Speech, SpeechLZF

SPEC = dict(x=h5s.Item("mel"), w=h5s.Window("mel", 5), m=h5s.Window("mag", 5), y=h5s.Label("label"),
            t=h5s.Item("text"), n=h5s.Position())


def ours() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("h5store-batches")]


def as_numpy(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in batch.items()}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, list):
            assert got[k] == v, k
        else:
            assert isinstance(got[k], np.ndarray), k
            np.testing.assert_array_equal(got[k], v, err_msg=k)
            assert got[k].dtype == v.dtype, k


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_same_batches_as_serve(speech: Speech, threads: int) -> None:
    loader = speech.serve(SPEC, batch_size=6, shuffle=True, seed=7, num_workers=0)
    for epoch in (0, 1):
        want = [as_numpy(b) for b in loader]  # the loader's first iteration is epoch 0, then 1
        got = list(speech.iter_batches(SPEC, 6, shuffle=True, seed=7, epoch=epoch, threads=threads, prefetch=2))
        assert len(got) == len(want) == 7
        for g, w in zip(got, want):
            assert_same(g, w)
    assert not ours()


def test_concat_and_options(shard_paths: list[Path]) -> None:
    files = [Speech(p) for p in shard_paths]
    both = h5s.concat(files)
    mel = [m for f in files for m in reference(f, "mel")]
    it = both.iter_batches(dict(x=h5s.Item("mel"), n=h5s.Position()), 4, drop_last=True)
    assert isinstance(it, BatchIterator) and len(it) == 23 // 4
    seen = []
    for b in it:
        assert b["x"].shape[0] == 4
        for j, p in enumerate(b["n"].tolist()):
            seen.append(p)
            np.testing.assert_array_equal(b["x"][j, : b["x_lengths"][j]], mel[p])
    assert seen == list(range(20))  # in order, the last incomplete batch dropped
    bucketed = list(both.iter_batches(dict(x=h5s.Item("mel"), n=h5s.Position()), 4, bucket=True, seed=1))
    assert sorted(p for b in bucketed for p in b["n"].tolist()) == list(range(23))
    for f in files:
        f.close()


def test_a_dataset_served_epoch_after_epoch(speech: Speech) -> None:
    ds = FileDataset(speech, dict(w=h5s.Window("mel", "crop"), n=h5s.Position()), params=dict(crop=4))
    first = [b["w"].shape[1] for b in iter_batches(ds, None, 8, epoch=0)]
    ds.params.crop = 6  # reaches the threads' next reads
    second = list(iter_batches(ds, None, 8, epoch=1))
    assert first == [4] * 5 and [b["w"].shape[1] for b in second] == [6] * 5
    assert sorted(p for b in second for p in b["n"].tolist()) == list(range(N))
    with pytest.raises(TypeError, match="batch=None"):
        iter_batches(ds, dict(x=h5s.Item("mel")), 8)


def test_compressed_feature_through_threads(lzf_path: Path) -> None:
    f = SpeechLZF(lzf_path)
    mel = reference(f, "mel")
    seen = 0
    for b in f.iter_batches(dict(x=h5s.Item("mel"), n=h5s.Position()), 3, threads=4, prefetch=8):
        for j, p in enumerate(b["n"].tolist()):
            np.testing.assert_array_equal(b["x"][j, : b["x_lengths"][j]], mel[p])
            seen += 1
    assert seen == len(mel)
    f.close()


class Recorder(h5s.Getter):
    """Records which batches were read, by which thread; can be told to fail or to be slow."""

    features = ()

    def __init__(self, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.fail_at = fail_at
        self.delay = delay
        self.reads: list[int] = []
        self.names: set[str] = set()
        self.lock = threading.Lock()

    def fetch(self, files: Any, request: Any) -> np.ndarray:
        first = int(request.indices[0])
        with self.lock:
            self.reads.append(first)
            self.names.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        if first == self.fail_at:
            raise RuntimeError(f"bad batch at {first}")
        return request.indices.copy()

    def signature(self, files: Any) -> tuple[np.dtype, tuple[int | None, ...]]:
        return np.dtype("int64"), ()


def test_reads_ahead_within_the_window(speech: Speech) -> None:
    rec = Recorder()
    it = speech.iter_batches(dict(i=rec), 2, shuffle=False, threads=2, prefetch=3)
    assert len(it.threads) == 2
    first = next(it)
    assert first["i"].tolist() == [0, 1]
    deadline = time.monotonic() + 30
    while len(rec.reads) < 1 + 3 and time.monotonic() < deadline:  # the threads fill the window...
        time.sleep(0.01)
    time.sleep(0.2)  # ...then wait for the loop
    assert len(rec.reads) == 1 + 3  # the batch taken, plus 3 ahead: never more
    rest = list(it)
    assert [b["i"][0] for b in rest] == list(range(2, N, 2))  # in order
    assert rec.names <= {"h5store-batches-0", "h5store-batches-1"}
    assert not it.threads and not ours()  # the end of the epoch ends the threads


def test_stopping_early_leaks_no_thread(speech: Speech) -> None:
    # break out of a for loop over an iterator nobody else holds: dropping it ends the threads
    for b in speech.iter_batches(dict(i=Recorder(delay=0.01)), 2, threads=3):
        assert b["i"].shape == (2,)
        break
    gc.collect()
    assert not ours()
    # close() and the with block end them too, waiting for the batch being read
    it = speech.iter_batches(dict(i=Recorder(delay=0.05)), 2, threads=3, prefetch=6)
    next(it)
    assert it.threads
    it.close()
    assert not it.threads and not ours()
    with pytest.raises(StopIteration):
        next(it)
    with speech.iter_batches(dict(i=Recorder(delay=0.01)), 2, threads=2) as it2:
        next(it2)
    assert not ours()


def test_an_error_reaches_the_loop_and_stops_the_threads(speech: Speech) -> None:
    it = speech.iter_batches(dict(i=Recorder(fail_at=6)), 2, shuffle=False, threads=2)
    got = []
    with pytest.raises(RuntimeError, match="bad batch at 6"):
        for b in it:
            got.append(int(b["i"][0]))
    assert got == [0, 2, 4]  # every batch before the failing one, in order
    assert not ours()
    with pytest.raises(ValueError, match="threads"):
        speech.iter_batches(dict(x=h5s.Item("mel")), 2, threads=-1)


def test_buffer_pool_reuses_only_free_buffers() -> None:
    pool = BufferPool(size=2, min_bytes=1 << 10)
    a = pool((64, 100), "float32")
    addr = a.ctypes.data
    assert addr % 64 == 0  # tensorflow adopts such buffers without a copy
    b = pool((64, 100), "float32")
    assert b.ctypes.data != addr  # a is still held: never handed out twice
    view = a[:3]
    del a
    assert pool((64, 100), "float32").ctypes.data != addr  # a view still holds it
    del view
    c = pool((60, 100), "float32")
    assert c.ctypes.data == addr  # free again: reused
    d = pool((64, 100), "float32")  # both pooled buffers in use, the pool full: a plain array
    assert d.ctypes.data % 64 == 0 and d.ctypes.data not in (addr, b.ctypes.data)
    assert pool((2, 2), "int64").shape == (2, 2) and aligned_empty((0, 3), "float32").shape == (0, 3)


def test_threads_share_one_prepared_dataset(speech: Speech) -> None:
    ds = prepare_for_threads(FileDataset(speech, dict(x=h5s.Item("mel"), t=h5s.Item("text"))))
    assert isinstance(ds.files.alloc, BufferPool)
    b = ds.fetch(np.arange(5))
    assert b["x"].ctypes.data % 64 == 0
    want = [ds.fetch([i]) for i in range(N)]
    errors: list[BaseException] = []

    def hammer(k: int) -> None:
        try:
            for i in list(range(N))[k::4]:
                got = ds.fetch([i])
                np.testing.assert_array_equal(got["x"], want[i]["x"])
                assert got["t"] == want[i]["t"]
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


class SpeechGz(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, 8), compression="gzip", shuffle=True, chunk_rows=7)
    mag = h5s.Array(dtype="float32", shape=(None, 3), compression="gzip", compression_opts=1, chunk_rows=5)


def test_gzip_features_are_inflated_by_the_threads(tmp_path: Path, speech: Speech) -> None:
    from h5store.serving.numpy_iter import GzipChunkReader
    from h5store.storage import H5Reader

    path = tmp_path / "gz.h5"
    with SpeechGz(path, mode="w") as w:
        w.extend([(f"id{i:05d}", dict(mel=speech.mel[i], mag=speech.mag[i])) for i in range(N)])
    f = SpeechGz(path)
    spec = dict(x=h5s.Item("mel"), w=h5s.Window("mag", 4), n=h5s.Position())
    ds = FileDataset(f, spec)
    plain = FileDataset(speech, spec)
    it = iter_batches(ds, None, 6, threads=3, seed=2)
    assert all(type(ds.files.column(0, name).reader()) is GzipChunkReader for name in ("mel", "mag"))
    seen = 0
    for b, want in zip(it, iter_batches(plain, None, 6, threads=0, seed=2)):
        for key in b:
            np.testing.assert_array_equal(b[key], want[key], err_msg=key)
        seen += len(b["n"])
    assert seen == N

    class ViaHDF5(H5Reader):
        """A reader chosen by the caller: prepare_for_threads leaves it alone."""

    col = ds.files.column(0, "mel")
    col._reader = ViaHDF5(col.data)
    prepare_for_threads(ds)
    assert type(col.reader()) is ViaHDF5
    np.testing.assert_array_equal(ds.fetch([3])["x"], plain.fetch([3])["x"])
    f.close()
