"""zstd and blosc features (issue 13, point 5): stored as hdf5plugin's filters, decoded by h5store.

Every read path is compared byte for byte with plain h5py + hdf5plugin reads of the same
file; hostile chunks (a header declaring more than the chunk, a flipped byte) are refused
naming the file; DataLoader workers (fork and spawn) read the compressed features.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.advisories import H5StoreSecurityWarning
from h5store.chunk_reader import ChunkReader, decode_threads, set_decode_threads
from h5store.codecs import _blosc, _TooLarge, _zstd
from h5store.errors import CorruptRecordError, SchemaError
from h5store.format import ColumnSpec
from h5store.layout import plan_reads
from h5store.readers import choose_reader
from tests.test_limits import measure, plant
from tests.test_readers import _FromFile

hdf5plugin = pytest.importorskip("hdf5plugin")  # a base dependency: present wherever h5store installs

CODECS = ["zstd", "blosc", "blosc:zstd", "blosc:lz4hc", "blosc:blosclz", "blosc:zlib", "gzip", "lzf"]


def _mel_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """Smooth log-mel-like rows at float16 precision: compressible, not trivially."""
    t = np.arange(n)[:, None]
    f = np.arange(80)[None, :]
    x = np.sin(t / 7.0 + f / 11.0) * 3 + rng.standard_normal((n, 80)) * 0.3 - 4
    return x.astype(np.float16).astype(np.float32)


def _schema(codec: str, chunk_rows: int | None = None) -> type[h5s.TypedFile]:
    shuffle = codec in ("gzip", "lzf")
    attrs = dict(
        mel=h5s.Array(dtype="float32", shape=(None, 80), compression=codec, shuffle=shuffle, chunk_rows=chunk_rows),
        vec=h5s.Array(dtype="int16", shape=(3,), compression=codec, chunk_rows=chunk_rows),  # fixed items
        raw=h5s.Array(dtype="uint8", shape=(None,), compression=codec),  # one byte wide: no shuffle
    )
    return type(f"C_{codec.replace(':', '_')}", (h5s.TypedFile,), attrs)


def _make(path: Path, codec: str, n: int = 40, seed: int = 0, chunk_rows: int | None = 50) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    items: dict[str, Any] = {}
    cls = _schema(codec, chunk_rows)
    with cls(path, mode="w") as f:
        for i in range(n):
            item = dict(mel=_mel_like(rng, int(rng.integers(20, 130))),
                        vec=rng.integers(-300, 300, 3).astype(np.int16),
                        raw=rng.integers(0, 4, int(rng.integers(1, 300))).astype(np.uint8))
            f.add(f"u{i:03d}", item)
            items[f"u{i:03d}"] = item
        f.commit()
    return items


@pytest.fixture(scope="module", params=CODECS)
def stored(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    codec = request.param
    path = tmp_path_factory.mktemp("codec") / f"{codec.replace(':', '_')}.h5"
    return path, codec, _make(path, codec)


def _h5py_items(path: Path, feature: str) -> dict[str, np.ndarray]:
    """Every item of ``feature`` read by plain h5py (+ hdf5plugin, imported by this module)."""
    with h5py.File(path, "r") as f:
        ids_data, ids_index = f["ids/data"][...], f["ids/index"][...]
        ids = [bytes(ids_data[a:b]).decode("utf-8") for a, b in ids_index.tolist()]
        data, index = f[f"{feature}/data"], f[f"{feature}/index"][...]
        return {i: data[a:b] for i, (a, b) in zip(ids, index.tolist())}


def test_the_codec_is_the_registered_filter_that_hdf5plugin_reads(stored: tuple[Path, str, dict]) -> None:
    path, codec, items = stored
    want_filter = {"zstd": 32015, "gzip": 1, "lzf": 32000}.get(codec, 32001)
    with h5py.File(path, "r") as f:
        for name in ("mel", "vec", "raw"):
            plist = f[f"{name}/data"].id.get_create_plist()
            filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
            assert filters[-1] == want_filter, (name, filters)
            if codec == "zstd":  # byte-shuffled before zstd, except single bytes
                assert filters == ([2, 32015] if name != "raw" else [32015]), (name, filters)
            if codec.startswith("blosc"):
                shuffle = plist.get_filter(0)[2][5]
                assert shuffle == (0 if name == "raw" else 1), (name, shuffle)
    stored_items = _h5py_items(path, "mel")
    for i, item in items.items():
        assert stored_items[i].tobytes() == item["mel"].tobytes()


def test_items_equal_plain_h5py_reads_byte_for_byte(stored: tuple[Path, str, dict]) -> None:
    path, codec, items = stored
    plain = {name: _h5py_items(path, name) for name in ("mel", "vec", "raw")}
    with h5s.open(path) as f:
        ids = list(f.ids)
        for name in ("mel", "vec", "raw"):
            view = getattr(f, name)
            for i in ids:
                got = view[i]
                want = plain[name][i]
                if name == "vec":
                    want = want[0]
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (codec, name, i)
            many = view.read_many(ids[::-1] + ids[:5])
            for got, i in zip(many, ids[::-1] + ids[:5]):
                want = plain[name][i][0] if name == "vec" else plain[name][i]
                assert got.tobytes() == want.tobytes(), (codec, name, i)


def test_runs_crossing_chunk_boundaries_equal_h5py(stored: tuple[Path, str, dict]) -> None:
    path, codec, _ = stored
    rng = np.random.default_rng(3)
    with h5py.File(path, "r") as f:
        for name in ("mel", "vec", "raw"):
            ds = f[f"{name}/data"]
            n = ds.shape[0]
            reader = choose_reader(ds, str(path), f"{path}:{ds.name}", writable=False)
            assert isinstance(reader, ChunkReader), (codec, name, type(reader))
            starts = rng.integers(0, n, 60)
            stops = np.minimum(n, starts + rng.integers(1, 3 * ds.chunks[0], 60))  # most cross a boundary
            for threads in (1, 3):
                set_decode_threads(threads)
                try:
                    reader._cache.clear()
                    plan = plan_reads(starts, stops)
                    got = reader.read_runs(plan)
                finally:
                    set_decode_threads(None)
                want = np.concatenate([ds[a:b] for a, b in plan.runs.tolist()])
                assert got.dtype == ds.dtype and got.tobytes() == want.tobytes(), (codec, name, threads)
            reader.close()


def test_windows_served_equal_h5py_slices(stored: tuple[Path, str, dict]) -> None:
    """64-row windows (every one, hop 16: many cross the 50-row chunks) through the numpy
    iterator's reader threads."""
    path, codec, _ = stored
    plain = _h5py_items(path, "mel")
    with h5s.open(path) as f:
        ids = list(f.ids)
        want = [w for i in ids for w in (plain[i][o : o + 64] for o in range(0, len(plain[i]) - 63, 16))]
        got = []
        for b in f.iter_batches(dict(x=h5s.Frames("mel", 64, hop=16)), batch_size=9, shuffle=False, threads=2):
            got.extend(b["x"])
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes(), codec


def test_a_fresh_process_with_plain_h5py_and_hdf5plugin_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "z.h5"
    items = _make(path, "zstd", n=12)
    blosc = tmp_path / "b.h5"
    items_b = _make(blosc, "blosc:zstd", n=12)
    code = (
        "import sys, hdf5plugin, h5py, numpy as np\n"
        "for p in sys.argv[1:]:\n"
        "    with h5py.File(p, 'r') as f:\n"
        "        d, ix = f['mel/data'][...], f['mel/index'][...]\n"
        "        sys.stdout.write(p + ' ' + ','.join(str(float(d[a:b].astype(np.float64).sum())) for a, b in ix) + chr(10))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path), str(blosc)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for line, its in zip(out.stdout.splitlines(), (items, items_b)):
        sums = [float(s) for s in line.split(" ", 1)[1].split(",")]
        assert sums == [float(v["mel"].astype(np.float64).sum()) for v in its.values()]


def test_import_h5store_loads_no_codec_library() -> None:
    code = ("import sys, h5store; bad = [m for m in ('hdf5plugin', 'zstandard', 'blosc2') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize(("compression", "opts", "shuffle", "problem"), [
    ("brotli", None, False, "compression must be one of"),
    ("blosc:snappy", None, False, "compression must be one of"),
    ("zstd", 23, False, "a level in [1, 22]"),
    ("blosc", 10, False, "a level in [0, 9]"),
    ("lzf", 4, False, "compression_opts (a level) is for"),
    ("blosc:lz4", None, True, "blosc shuffles bytes itself"),
])
def test_bad_codec_declarations_say_what_to_write(compression: str, opts: Any, shuffle: bool, problem: str) -> None:
    with pytest.raises(SchemaError) as e:
        ColumnSpec(dtype="float32", shape=(None, 4), layout="ragged", compression=compression,
                   compression_opts=opts, shuffle=shuffle)
    assert problem in str(e.value)


def test_levels_are_stored_and_change_the_size(tmp_path: Path) -> None:
    sizes = {}
    rng = np.random.default_rng(0)
    x = _mel_like(rng, 4000)
    for level in (1, 19):
        class Z(h5s.TypedFile):
            mel = h5s.Array(dtype="float32", shape=(None, 80), compression="zstd", compression_opts=level)

        path = tmp_path / f"z{level}.h5"
        with Z(path, mode="w") as f:
            f.add("a", dict(mel=x))
        with h5py.File(path, "r") as f:
            ds = f["mel/data"]
            plist = ds.id.get_create_plist()
            assert plist.get_filter(1)[2] == (level,)
            sizes[level] = ds.id.get_storage_size()
        with h5s.open(path) as f:
            assert f.mel["a"].tobytes() == x.tobytes()
    assert sizes[19] < sizes[1]


# ----------------------------------------------------------------------------- hostile chunks
class Z(h5s.TypedFile):
    x = h5s.Array(dtype="float32", shape=(None, 4), compression="zstd")  # 32 KiB chunks (the default): 2048 rows
    y = h5s.Array(dtype="float32", shape=(None, 4), compression="blosc")


def _make_z(path: Path, n: int = 50) -> None:
    with Z(path, mode="w") as f:
        for i in range(n):
            f.add(f"k{i}", dict(x=np.full((100, 4), i, np.float32), y=np.full((100, 4), -i, np.float32)))


def test_a_zstd_frame_declaring_more_than_its_chunk_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    import zstandard

    path = tmp_path / "zbomb.h5"
    _make_z(path)
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))  # declares its 256 MiB
    assert len(bomb) < 32 << 10 and zstandard.frame_content_size(bomb) == 256 << 20
    plant(path, "x/data", bomb)
    for what in ("read", "verify", "iter"):
        out = measure(path, what)
        assert out["peak"] < 24 << 20, out  # python-zstandard alone would allocate the 256 MiB
        text = str(out)
        assert f"{path}:/x: chunk 0 (rows [0, 2048))" in text and "decodes to more than its 32768 bytes" in text, out


def test_a_zstd_frame_without_a_declared_size_stops_at_the_limit() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(bytes(1 << 20))
    with pytest.raises(_TooLarge):
        _zstd(bomb, 1000)
    assert _zstd(bomb, 1 << 20) == bytes(1 << 20)
    with pytest.raises(ValueError, match="not a zstd frame"):
        _zstd(b"not zstd at all", 1000)


def test_a_blosc_header_declaring_more_than_its_chunk_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    path = tmp_path / "bbomb.h5"
    _make_z(path)
    with h5py.File(path, "r") as f:
        _, raw = f["y/data"].id.read_direct_chunk((0, 0))
    raw = bytearray(raw)
    struct.pack_into("<i", raw, 4, 1 << 30)  # nbytes: 1 GiB
    with pytest.raises(_TooLarge):
        _blosc(bytes(raw), 32768)
    plant(path, "y/data", bytes(raw))
    with pytest.raises(CorruptRecordError) as e, h5s.open(path) as f:
        f.y["k1"]
    assert f"{path}:/y: chunk 0" in str(e.value) and "decodes to more than its 32768 bytes" in str(e.value)
    cut = bytearray(raw)
    struct.pack_into("<i", cut, 4, 32768)
    struct.pack_into("<i", cut, 12, len(cut) + 5)  # a stored size the chunk does not have
    with pytest.raises(ValueError, match="stored bytes"):
        _blosc(bytes(cut), 32768)


@pytest.mark.parametrize("codec", ["zstd", "blosc", "blosc:zstd"])
def test_a_flipped_byte_in_a_compressed_chunk_is_caught(tmp_path: Path, codec: str) -> None:
    path = tmp_path / "flip.h5"
    _make(path, codec, n=30, chunk_rows=None)
    with h5py.File(path, "r") as f:
        ds = f["mel/data"]
        info = ds.id.get_chunk_info(0)
        at, size = info.byte_offset, info.size
    with open(path, "r+b") as fh:  # a byte in the middle of the stored stream
        fh.seek(at + size // 2)
        b = fh.read(1)
        fh.seek(at + size // 2)
        fh.write(bytes([b[0] ^ 0x10]))
    with h5s.open(path) as f, pytest.raises(CorruptRecordError) as e:
        for _ in f.iter_batches(dict(x=h5s.Item("mel")), batch_size=4, shuffle=False, threads=0):
            pass
    assert str(path) in str(e.value)
    from h5store.cli import main

    assert main(["verify", "--deep", str(path)]) != 0


def test_verify_passes_on_a_zstd_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from h5store.cli import main

    path = tmp_path / "ok.h5"
    _make(path, "zstd", n=20)
    assert main(["verify", "--deep", str(path)]) == 0
    assert "ok" in capsys.readouterr().out.lower()
    with pytest.warns(H5StoreSecurityWarning), h5s.open(path, untrusted=True) as f:  # zstd: an allowed filter
        assert f.mel[f.ids[3]].shape[1] == 80


# ----------------------------------------------------------------------------- threads, workers
def test_decode_threads_setting() -> None:
    set_decode_threads(3)
    try:
        assert decode_threads() == 3
    finally:
        set_decode_threads(None)
    assert 1 <= decode_threads() <= 4
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="decode threads"):
            set_decode_threads(bad)  # type: ignore[arg-type]


def test_items_sharing_a_chunk_decode_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "once.h5"
    _make(path, "blosc", n=40, chunk_rows=200)
    with h5py.File(path, "r") as f:
        ds = f["mel/data"]
        reader = ChunkReader.for_dataset(ds, str(path))
        assert reader is not None
        calls: list[tuple[int, int]] = []
        real = reader._decode
        monkeypatch.setattr(reader, "_decode", lambda key: (calls.append(key), real(key))[1])
        n = ds.shape[0]
        starts = np.arange(0, n - 10, 7)
        reader.read_runs(plan_reads(starts, starts + 5))
        assert sorted(calls) == sorted(set(calls)) and len(calls) == -(-n // 200)
        reader.read_runs(plan_reads(starts, starts + 5))  # an epoch later: cached
        assert len(calls) == -(-n // 200)
        reader.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_read_compressed_features(tmp_path: Path, method: str) -> None:
    path = tmp_path / "w.h5"
    items = _make(path, "blosc" if method == "fork" else "zstd", n=24)
    with h5s.open(path) as f:
        ids = list(f.ids)
        f.mel[ids[0]]  # the parent has decoded (and made its pool) before forking
        loader = f.serve(dict(x=h5s.Item("mel"), n=h5s.Position()), batch_size=5, shuffle=True, num_workers=2,
                         multiprocessing_context=method)
        seen = 0
        for b in loader:
            for j, p in enumerate(b["n"].tolist()):
                n = int(b["x_lengths"][j])
                assert b["x"][j, :n].numpy().tobytes() == items[ids[p]]["mel"].tobytes()
                seen += 1
    assert seen == len(ids)


# ----------------------------------------------------------------------------- the reader kit
class TestChunkZstd(_FromFile):
    kw = dict(chunks=(16, 3), shuffle=True, **hdf5plugin.Zstd(clevel=3))
    kind = ChunkReader
    reads_after_fork = True


class TestChunkBlosc(_FromFile):
    kw = dict(chunks=(16, 3), **hdf5plugin.Blosc(cname="lz4", clevel=5, shuffle=hdf5plugin.Blosc.SHUFFLE))
    kind = ChunkReader
    reads_after_fork = True



def test_libblosc2_unshuffle_equals_hdf5s_layout(tmp_path: Path) -> None:
    """The SIMD unshuffle gives numpy's bytes for every length (tails shorter than one
    element included), and both undo what HDF5's shuffle filter wrote."""
    from h5store.codecs import _unshuffle, _unshuffle_numpy

    rng = np.random.default_rng(5)
    for n in (0, 1, 3, 4, 5, 7, 63, 64, 65, 1000, 65539):
        for size in (2, 3, 4, 8, 16):
            raw = rng.integers(0, 256, n).astype(np.uint8)
            assert _unshuffle(raw.tobytes(), size).tobytes() == _unshuffle_numpy(raw, size).tobytes(), (n, size)
    x = rng.standard_normal((301, 3)).astype(">f8")  # 7224 bytes: HDF5 shuffles whole elements
    with h5py.File(tmp_path / "s.h5", "w") as f:
        ds = f.create_dataset("x", data=x, chunks=(301, 3), shuffle=True)
        _, stored = ds.id.read_direct_chunk((0, 0))
    assert _unshuffle(stored, 8).tobytes() == x.tobytes()


@pytest.mark.parametrize("codec", ["zstd", "blosc"])
def test_tf_data_reader_threads_read_compressed_features(tmp_path: Path, codec: str) -> None:
    pytest.importorskip("tensorflow")
    path = tmp_path / "tf.h5"
    _make(path, codec, n=30)
    plain = _h5py_items(path, "mel")
    with h5s.open(path) as f:
        ids = list(f.ids)
        seen = 0
        for b in f.to_tf_dataset(dict(x=h5s.Item("mel"), n=h5s.Position()), 4, shuffle=True, seed=2,
                                 num_parallel_calls=2):
            x, lengths, pos = b["x"].numpy(), b["x_lengths"].numpy(), b["n"].numpy()
            for j, p in enumerate(pos.tolist()):
                assert x[j, : lengths[j]].tobytes() == plain[ids[p]].tobytes()
                seen += 1
    assert seen == len(ids)
