"""Limits hold in every mode: decompression bombs, duplicated ids, storage outside the file.

The bombs are built the way an attacker would: a valid h5store file with a compressed
feature, one chunk's stored bytes replaced (``write_direct_chunk``, so HDF5's chunk index
stays consistent) by a stream that inflates far past the chunk's declared size. Memory is
measured in a fresh process (peak RSS); nothing here is timed.
"""

from __future__ import annotations

import json
import os
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
from h5store.errors import CorruptRecordError, FormatError
from h5store.layout import plan_reads
from h5store.safety import H5StoreSecurityWarning
from h5store.storage import ChunkReader, _fletcher32, _lzf, _lzf_decode, _TooLarge


class Gz(h5s.TypedFile):
    x = h5s.Array(dtype="float32", shape=(None, 4), compression="gzip", shuffle=True, chunk_rows=4096)  # 64 KiB
    y = h5s.Array(dtype="int16", shape=(None,), compression="lzf", chunk_rows=1 << 15)  # 64 KiB chunks


def make(path: Path, n: int = 50) -> dict[str, np.ndarray]:
    out = {}
    with Gz(path, mode="w") as f:
        for i in range(n):
            x = np.full((100, 4), i, np.float32)
            f.add(f"k{i}", dict(x=x, y=np.arange(i, i + 30, dtype=np.int16)))
            out[f"k{i}"] = x
    return out


def zeros_zlib(nbytes: int) -> bytes:
    z = zlib.compressobj(9)
    piece = bytes(1 << 20)
    return b"".join(z.compress(piece) for _ in range(nbytes >> 20)) + z.compress(bytes(nbytes % (1 << 20))) + z.flush()


def lzf_zeros(nbytes: int) -> bytes:
    """An LZF stream of ``nbytes`` zeros: one literal, then 264-byte back references (88:1)."""
    ops, left = [b"\x00\x00"], nbytes - 1
    while left >= 264:
        ops.append(b"\xe0\xff\x00")
        left -= 264
    if left >= 3:  # a last, shorter reference
        ops.append(bytes([(left - 2) << 5, 0]) if left - 2 < 7 else bytes([0xE0, left - 9, 0]))
    elif left:
        ops.append(bytes([left - 1]) + bytes(left))
    return b"".join(ops)


def plant(path: Path, name: str, raw: bytes) -> None:
    """Replace the stored bytes of chunk 0 of ``name`` (mask 0: every filter applies)."""
    with h5py.File(path, "r+", locking=False) as f:
        ds = f[name]
        ds.id.write_direct_chunk((0,) * ds.ndim, raw)


_MEASURE = r"""
import json, resource, sys, warnings
import numpy as np
import h5store as h5s
from h5store.integrity import verify
warnings.simplefilter("ignore")
path, what = sys.argv[1], sys.argv[2]
peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = {}
try:
    if what == "read":
        with h5s.open(path) as f:
            f.x["k1"]
    elif what == "read_many":
        with h5s.open(path) as f:
            f.x.read_many([0, 1, 2], verify=False)
    elif what == "lzf":
        with h5s.open(path) as f:
            f.y["k1"]
    elif what == "verify":
        r = verify(path, deep=True)
        out["lines"] = r.lines()[:3]
    elif what == "iter":
        with h5s.open(path) as f:
            for _ in f.iter_batches(dict(x=h5s.Item("x")), batch_size=4, shuffle=False, epoch=0):
                pass
    elif what == "serve":
        from h5store.serving import FileDataset
        with h5s.open(path) as f:
            FileDataset(f, dict(x=h5s.Item("x"))).fetch(np.arange(4))
    elif what == "in_memory":
        from h5store.serving import FileDataset
        with h5s.open(path) as f:
            FileDataset(f, dict(x=h5s.Item("x")), in_memory=True).fetch(np.arange(4))
    out["error"] = None
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak0
print(json.dumps(out))
"""


def measure(path: Path, what: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(path), what], capture_output=True, timeout=300,
                          env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout.decode().splitlines()[-1])


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bombs")
    out = {}
    # 256 MiB of zeros in ~250 KB, stored as chunk 0 (declared 64 KiB) of the gzip+shuffle feature.
    out["big"] = d / "big.h5"
    make(out["big"])
    plant(out["big"], "x/data", zeros_zlib(256 << 20))
    # A stream no larger than a valid chunk may store (64 KiB) that inflates to 64 MiB.
    out["small"] = d / "small.h5"
    make(out["small"])
    small = zeros_zlib(64 << 20)
    assert len(small) <= 64 << 10
    plant(out["small"], "x/data", small)
    # lzf: h5py's filter grows its buffer until the stream ends (up to 100 MB); 88 bytes out
    # per stored byte, so 40 KB that a valid 64 KiB chunk may store decode to 3.5 MB.
    out["lzf"] = d / "lzf.h5"
    make(out["lzf"])
    plant(out["lzf"], "y/data", lzf_zeros(55 << 16))
    # A table compressed by hand (h5store writes them plain): the index of x, 64 MiB in 64 KiB.
    out["table"] = d / "table.h5"
    make(out["table"])
    with h5py.File(out["table"], "r+", locking=False) as f:
        old = f["x/index"][...]
        del f["x/index"]
        ds = f.create_dataset("x/index", data=old, maxshape=(None, 2), chunks=(4096, 2), compression="gzip")
        ds.id.write_direct_chunk((0, 0), small)
    return out


@pytest.mark.parametrize("what", ["read", "read_many", "verify", "iter", "serve", "in_memory"])
@pytest.mark.parametrize("kind", ["big", "small"])
def test_a_gzip_bomb_is_refused_before_it_is_inflated_in_every_read_path(bombs: dict[str, Path], kind: str,
                                                                         what: str) -> None:
    path = bombs[kind]
    out = measure(path, what)
    # Before: the 256 MiB (64 MiB) were allocated in every path (peak +260 MiB, +70 MiB).
    assert out["peak"] < 24 << 20, out
    text = json.dumps(out)
    assert f"{path}:/x: chunk 0 (rows [0, 4096))" in text, out
    assert ("stores" if kind == "big" else "decodes to more than its 65536 bytes") in text, out
    if what == "verify":
        assert "unreadable" in out["lines"][1]
    else:
        assert out["error"].startswith("CorruptRecordError"), out


def test_an_lzf_bomb_is_refused_before_it_is_decoded(bombs: dict[str, Path]) -> None:
    out = measure(bombs["lzf"], "lzf")
    assert out["peak"] < 24 << 20, out
    assert out["error"].startswith("CorruptRecordError") and "/y: chunk 0" in out["error"], out
    assert "decodes to more than its" in out["error"], out


# ----------------------------------------------------------------------------- same values as h5py
def _datasets(f: h5py.File) -> list[h5py.Dataset]:
    rng = np.random.default_rng(7)
    made = []
    specs = [
        dict(dtype="float32", shape=(1000, 4), chunks=(64, 4), compression="gzip"),
        dict(dtype="float32", shape=(1000, 4), chunks=(64, 4), compression="gzip", shuffle=True),
        dict(dtype="float64", shape=(1000,), chunks=(100,), compression="lzf"),
        dict(dtype="int16", shape=(1000, 3), chunks=(50, 3), compression="lzf", shuffle=True, fletcher32=True),
        dict(dtype=">i4", shape=(777, 5), chunks=(64, 2), compression="gzip", compression_opts=1),  # split rows
        dict(dtype="uint8", shape=(999,), chunks=(128,), compression="gzip", fletcher32=True),
        dict(dtype="complex64", shape=(300, 2), chunks=(32, 2), compression="gzip", shuffle=True),
    ]
    for k, spec in enumerate(specs):
        shape = spec["shape"]
        dt = np.dtype(spec["dtype"])
        if dt.kind == "c":
            values = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
        elif dt.kind == "f":
            values = np.round(rng.standard_normal(shape), 2).astype(dt)  # compressible, not trivially
        else:
            values = rng.integers(0, 50, shape).astype(dt)
        ds = f.create_dataset(f"d{k}", maxshape=(None, *shape[1:]), data=values, **spec)
        made.append(ds)
    # Unallocated chunks read as the fill value, as through HDF5.
    ds = f.create_dataset("sparse", shape=(500, 2), maxshape=(None, 2), chunks=(64, 2), dtype="float32",
                          compression="gzip", fillvalue=-1.5)
    ds[200:300] = 7
    made.append(ds)
    return made


def test_the_chunk_reader_returns_exactly_what_h5py_returns(tmp_path: Path) -> None:
    path = tmp_path / "many.h5"
    rng = np.random.default_rng(1)
    with h5py.File(path, "w", libver=("v108", "latest")) as f:
        names = [ds.name for ds in _datasets(f)]
    with h5py.File(path, "r") as f:
        for name in names:
            ds = f[name]
            reader = ChunkReader.for_dataset(ds, str(path))
            assert reader is not None, name
            n = ds.shape[0]
            starts = rng.integers(0, n, 40)
            stops = np.minimum(n, starts + rng.integers(0, 150, 40))  # many cross chunk boundaries
            starts[:2], stops[:2] = [0, 0], [n, 0]
            plan = plan_reads(starts, stops)
            got = reader.read_runs(plan)
            parts = [ds[a:b] for a, b in plan.runs.tolist()]
            want = np.concatenate(parts).astype(parts[0].dtype)  # (numpy would make it native-endian)
            assert got.dtype == parts[0].dtype == ds.dtype and got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name
            reader.close()


def test_feature_reads_equal_the_stored_items_in_reader_and_writer_mode(tmp_path: Path) -> None:
    path = tmp_path / "gz.h5"
    items = make(path, n=80)  # 8000 rows: items cross the 4096-row chunks
    with h5s.open(path) as f:
        reader = f.group().store.columns["x"].reader()
        assert type(reader) is ChunkReader and reader.ds is None  # pread + zlib, no HDF5
        for k in ("k0", "k40", "k79"):
            assert f.x[k].tobytes() == items[k].tobytes()
        got = f.x.read_many([f"k{i}" for i in range(80)])
        assert all(g.tobytes() == items[f"k{i}"].tobytes() for i, g in enumerate(got))
        assert f.y["k5"].tolist() == list(range(5, 35))
    with Gz(path, mode="a") as f:  # a writer asks HDF5 for each chunk: they move, and sit in its caches
        f.add("new", dict(x=np.full((10, 4), 99, np.float32), y=np.arange(3, dtype=np.int16)))
        assert (f.x["new"] == 99).all() and f.x["new"].shape == (10, 4)
        reader = f.group().store.columns["x"].reader()
        assert type(reader) is ChunkReader and reader.ds is not None
        assert f.x["k41"].tobytes() == items["k41"].tobytes()
        f.x["k41"] = np.full((100, 4), -3, np.float32)  # rewrites (and moves) a compressed chunk
        assert (f.x["k41"] == -3).all() and f.x["k42"].tobytes() == items["k42"].tobytes()
    with h5s.open(path) as f:
        assert (f.x["k41"] == -3).all() and (f.x["new"] == 99).all()


# ----------------------------------------------------------------------------- the decoders
def test_fletcher32_matches_hdf5(tmp_path: Path) -> None:
    path = tmp_path / "f.h5"
    rng = np.random.default_rng(3)
    samples = [b"", b"\x01", bytes(1000), b"\xff" * 7, rng.bytes(1), rng.bytes(999), rng.bytes(4096),
               b"\xff\xff" * 5000, rng.bytes(70001)]
    with h5py.File(path, "w") as f:
        for k, s in enumerate(samples):
            if s:
                f.create_dataset(f"s{k}", data=np.frombuffer(s, np.uint8), chunks=(len(s),), fletcher32=True)
    with h5py.File(path, "r") as f:
        for k, s in enumerate(samples):
            if s:
                _, raw = f[f"s{k}"].id.read_direct_chunk((0,))
                assert raw[:-4] == s
                assert _fletcher32(s) == int.from_bytes(raw[-4:], "little"), k


@pytest.mark.parametrize("decode", [_lzf, _lzf_decode], ids=["liblzf", "python"])
def test_lzf_decoders_stop_at_the_limit_and_agree_with_h5py(decode: Any, tmp_path: Path) -> None:
    assert bytes(decode(lzf_zeros(1000), 1000)) == bytes(1000)
    with pytest.raises(_TooLarge):
        decode(lzf_zeros(1001), 1000)
    with pytest.raises(zlib.error):
        decode(b"\xe0\xff\x00", 1000)  # a reference with nothing before it
    with pytest.raises(zlib.error):
        decode(b"\x05ab", 1000)  # a literal run past the end
    rng = np.random.default_rng(5)
    values = np.round(rng.standard_normal(30_000), 1)
    with h5py.File(tmp_path / "l.h5", "w") as f:
        ds = f.create_dataset("v", data=values, chunks=(5000,), compression="lzf")
        for c in range(6):
            mask, raw = ds.id.read_direct_chunk((c * 5000,))
            assert mask == 0 and len(raw) < 40_000
            assert bytes(decode(raw, 40_000)) == values[c * 5000 : (c + 1) * 5000].tobytes()


def test_a_truncated_or_short_chunk_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.h5"
    make(path)
    good = zlib.compress(bytes(4096 * 16))
    plant(path, "x/data", good[:-10])  # cut short: no end of stream
    with h5s.open(path) as f, pytest.raises(CorruptRecordError, match=r"/x: chunk 0 .* does not decode"):
        f.x["k0"]
    plant(path, "x/data", zlib.compress(bytes(1000)))  # a complete stream of fewer bytes than the chunk
    with h5s.open(path) as f, pytest.raises(CorruptRecordError, match=r"decodes to 1000 bytes, not its 65536"):
        f.x["k0"]


# ----------------------------------------------------------------------------- duplicated ids
def test_untrusted_open_refuses_a_duplicated_id(tmp_path: Path) -> None:
    path = tmp_path / "dup.h5"

    class One(h5s.TypedFile):
        v = h5s.Scalar(dtype="int64")

    with One(path, mode="w") as f:
        for i in range(4):
            f.add(f"k{i}", dict(v=np.int64(i)))
    with h5py.File(path, "r+", locking=False) as f:  # ['k0', 'k0', 'k2', 'k3']: k1 unreachable
        data = f["ids/data"][...]
        idx = f["ids/index"][...]
        a, b = idx[1]
        data[a:b] = np.frombuffer(b"k0", np.uint8)
        f["ids/data"][...] = data
        f["ids/checksum"][1] = zlib.crc32(b"k0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", H5StoreSecurityWarning)
        with pytest.raises(FormatError) as e:
            h5s.open(path, untrusted=True)
    assert str(e.value) == (f"{path}:/ids: the id at row 1 repeats the id at row 0 (ids must be unique: "
                            "the second cannot be reached); refused (untrusted file)")
    from h5store.integrity import verify

    r = verify(path)
    assert not r and "duplicate of the id at row 0" in r.lines()[1]


# ----------------------------------------------------------------------------- data outside the file
class Plain(h5s.TypedFile):
    x = h5s.Array(dtype="uint8", shape=(None,))


def plain(path: Path) -> None:
    with Plain(path, mode="w") as f:
        f.add("a", dict(x=np.arange(100, dtype=np.uint8)))


def test_trusted_open_refuses_external_storage_unless_the_caller_opts_in(tmp_path: Path) -> None:
    path = tmp_path / "ext.h5"
    plain(path)
    with h5py.File(path, "r+", locking=False) as f:  # the feature's bytes: /etc/passwd's first 100
        del f["x/data"]
        f.create_dataset("x/data", shape=(100,), maxshape=(100,), dtype=np.uint8, external=[("/etc/passwd", 0, 100)])
    for opener in (lambda **kw: h5s.open(path, **kw), lambda **kw: Plain(path, **kw)):
        with pytest.raises(FormatError) as e:
            opener()
        assert str(e.value) == (
            f"{path}:/x/data: external raw storage (its bytes live in another file: '/etc/passwd'); refused: "
            "h5store reads only data stored inside the file. Open it with allow_external=True only if you "
            "trust the file and what it points to")
    with pytest.raises(FormatError):
        Plain(path, mode="a")  # a writer too: its writes would go to the other file
    with open("/etc/passwd", "rb") as fh:
        head = fh.read(100)
    with h5s.open(path, allow_external=True) as f:  # the opt-in reads it (checksum fails: not its bytes)
        assert f.x.read_many([0], verify=False)[0].tobytes() == head[: len(head)]


def test_trusted_open_refuses_links_and_virtual_datasets(tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    plain(other)
    path = tmp_path / "links.h5"
    plain(path)
    with h5py.File(path, "r+", locking=False) as f:
        del f["x"]
        f["x"] = h5py.ExternalLink(str(other), "/x")
    for kw in ({}, dict(allow_external=True)):  # (HDF5 cannot follow it through h5store's file object)
        with pytest.raises(FormatError, match=rf"^{path}:/x: external link to '/x' in '{other}' \(would open "
                           r"another file\); refused: h5store opens files through a file object"):
            h5s.open(path, **kw)
    plain(path)
    with h5py.File(path, "r+", locking=False) as f:
        del f["x/index"]
        f["x/index"] = h5py.SoftLink("/ids/index")
    with pytest.raises(FormatError, match=r":/x/index: soft link .*; refused: .* allow_external=True"):
        h5s.open(path)
    with h5s.open(path, allow_external=True) as f, pytest.raises(CorruptRecordError):
        f.x["a"]  # the opt-in follows it: the ids' index is no index of x
    plain(path)
    with h5py.File(path, "r+", locking=False) as f:
        layout = h5py.VirtualLayout(shape=(100,), dtype=np.uint8, maxshape=(None,))
        layout[:] = h5py.VirtualSource(str(other), "x/data", shape=(100,))
        del f["x/data"]
        f["x"].create_virtual_dataset("data", layout)
    for kw in ({}, dict(allow_external=True)):  # measured: reading it through h5store's file object crashed HDF5
        with pytest.raises(FormatError, match=rf":/x/data: virtual dataset \(maps data of other datasets or files: "
                           rf"'{other}'\); refused: h5store opens files through a file object"):
            h5s.open(path, **kw)


def test_the_opt_in_travels_to_dataloader_style_copies(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "ext.h5"
    plain(path)
    payload = tmp_path / "payload.bin"
    payload.write_bytes(bytes(range(100)))
    with h5py.File(path, "r+", locking=False) as f:
        del f["x/data"]
        f.create_dataset("x/data", shape=(100,), maxshape=(100,), dtype=np.uint8, external=[(str(payload), 0, 100)])
    with pytest.raises(FormatError, match="allow_external"):
        h5s.open(path)
    with h5s.open(path, allow_external=True) as f:
        g = pickle.loads(pickle.dumps(f))  # what a DataLoader worker gets
        assert g.x["a"].tolist() == list(range(100))  # the same bytes: its checksum passes
        g.close()


@pytest.mark.parametrize("what", ["read", "verify"])
def test_a_bomb_in_a_table_is_refused_before_it_is_inflated(bombs: dict[str, Path], what: str) -> None:
    out = measure(bombs["table"], what)
    assert out["peak"] < 24 << 20, out
    assert f"{bombs['table']}:/x/index: chunk 0 (rows [0, 50)) decodes to more than its 65536 bytes" in json.dumps(out)


def test_a_reader_reads_rows_that_a_commit_added_to_a_chunk_it_had_decoded(tmp_path: Path) -> None:
    path = tmp_path / "grow.h5"
    make(path, n=5)  # 500 of the 4096 rows of chunk 0
    with h5s.open(path) as r:
        assert (r.x["k4"] == 4).all()  # chunk 0 decoded (and kept) by the reader
        with Gz(path, mode="a") as w:
            w.add("k5", dict(x=np.full((100, 4), 5, np.float32), y=np.arange(2, dtype=np.int16)))
        assert r.refresh() == 1
        assert (r.x["k5"] == 5).all() and (r.x["k4"] == 4).all()


def test_a_huge_declared_compressed_dataset_costs_only_its_stored_chunks(tmp_path: Path) -> None:
    """2^40 rows declared, one chunk stored: the chunk table holds what HDF5 lists, not 2^30 slots."""
    path = tmp_path / "huge.h5"

    class One(h5s.TypedFile):
        x = h5s.Array(dtype="float64", shape=(None,), compression="gzip")

    with One(path, mode="w") as f:
        f.add("a", dict(x=np.arange(10, dtype=np.float64)))
    with h5py.File(path, "r+", locking=False) as f:
        f["x/data"].resize((1 << 40,))
    code = ("import resource, sys, h5store as h5s\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            "with h5s.open(sys.argv[1]) as f:\n"
            "    print(f.x['a'].tolist())\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120,
                          env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().strip() == str(list(map(float, range(10))))
