"""Hostile files, crafted with plain h5py, refused by h5store.safety.check_untrusted.

Each attack is placed inside an otherwise valid h5store file (tests/test_integrity.make_store),
so nothing but the attack can be the reason for a refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.cli import main
from h5store.errors import CorruptRecordError, FormatError
from h5store.handle import FileHandle
from h5store.integrity import verify, verify_in_subprocess
from h5store.safety import (
    H5StoreSecurityWarning,
    Limits,
    Superblock,
    check_untrusted,
    hdf5_advisories,
    read_superblock,
)
from h5store.superblock import _lookup3
from tests.test_integrity import make_store

SECRET = b"AWS_SECRET_ACCESS_KEY=hunter2-do-not-leak;" * 40


@contextmanager
def advisory_warning() -> Iterator[None]:
    """Expect the HDF5 advisory warning when the HDF5 in use is affected, and nothing else."""
    if hdf5_advisories():
        with pytest.warns(H5StoreSecurityWarning, match=f"HDF5 {h5py.version.hdf5_version}"):
            yield
    else:
        yield


def refuse(path: Path, limits: Limits | None = None) -> str:
    """check_untrusted's refusal message for ``path`` (fails the test when it accepts)."""
    handle = FileHandle(path, "r")
    try:
        with advisory_warning(), pytest.raises(FormatError) as e:
            check_untrusted(handle.file, str(path), limits)
    finally:
        handle.close()
    return str(e.value)


def quiet_verify(path: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", H5StoreSecurityWarning)
        return verify(path, **kw)


def swap(path: Path, name: str, make: Callable[[h5py.Group, str, np.ndarray], Any]) -> None:
    """Replace dataset ``name`` by what ``make(parent, basename, old_values)`` creates."""
    with h5py.File(path, "r+", locking=False) as f:
        old = f[name][...]
        parent, base = f[name].parent, name.rsplit("/", 1)[-1]
        del parent[base]
        make(parent, base, old)


def no_secret(*texts: str) -> None:
    for text in texts:
        for piece in (SECRET[:16], b"hunter2"):
            assert piece.decode() not in text


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "clip.h5"
    make_store(path)
    return path


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "credentials.txt"
    p.write_bytes(SECRET)
    return p


# ----------------------------------------------------------------------------- the baseline
def test_a_valid_file_passes(store: Path) -> None:
    handle = FileHandle(store, "r")
    try:
        with advisory_warning():
            assert check_untrusted(handle.file, str(store)) is None
    finally:
        handle.close()
    with advisory_warning():
        r = verify(store, deep=True, untrusted=True)
    assert r, r.lines()


def test_library_bookkeeping_is_allowed(store: Path) -> None:
    with h5py.File(store, "r+", locking=False) as f:
        f.create_dataset("_h5store/failures", data=np.frombuffer(b"[]", np.uint8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", H5StoreSecurityWarning)
        assert verify(store, untrusted=True)


# ----------------------------------------------------------------------------- (a) external raw storage
def test_external_raw_storage_is_refused_and_never_read(store: Path, secret: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    swap(store, "text/data", lambda g, n, old: g.create_dataset(
        n, shape=old.shape, dtype=np.uint8, external=[(str(secret), 0, old.size)]))
    # Why it matters: a plain read returns another file's bytes.
    with h5py.File(store, "r", locking=False) as f:
        assert f["text/data"][...].tobytes() == SECRET[: f["text/data"].size]
    msg = refuse(store)
    assert msg == f"{store}:/text/data: external raw storage (its bytes live in another file); refused (untrusted file)"
    r = quiet_verify(store, untrusted=True, deep=True)
    assert not r and r.fatal == msg and r.items_verified == 0
    # A trusted open refuses it too (the opt-in reads it, and its CRC-32 fails); trusted
    # verify reports it; none of them shows anything of the secret.
    trusted = verify(store, deep=True)
    assert not trusted and {p.feature for p in trusted.problems} == {"text"}
    with pytest.raises(FormatError) as opened:
        h5s.open(store)
    assert str(opened.value).startswith(f"{store}:/text/data: external raw storage (its bytes live in another "
                                        f"file: '{secret}'); refused") and "allow_external=True" in str(opened.value)
    with h5s.open(store, allow_external=True) as f, pytest.raises(CorruptRecordError) as e:
        f.text["c0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", H5StoreSecurityWarning)
        child = verify_in_subprocess(store, deep=True)
        assert main(["verify", str(store), "--untrusted", "--deep"]) == 1
    out = capsys.readouterr()
    assert not child and child.fatal == msg
    no_secret(msg, str(e.value), str(opened.value), *trusted.lines(), *child.lines(), json.dumps(child.to_dict()),
              out.out, out.err)


# ----------------------------------------------------------------------------- (b, c) links
def test_external_link_is_refused(store: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    make_store(other, seed=1)
    with h5py.File(store, "r+", locking=False) as f:
        del f["text"]
        f["text"] = h5py.ExternalLink(str(other), "/text")
    assert refuse(store) == f"{store}:/text: external link (would open another file); refused (untrusted file)"


def test_soft_link_is_refused(store: Path) -> None:
    with h5py.File(store, "r+", locking=False) as f:
        del f["label/index"]
        f["label/index"] = h5py.SoftLink("/mel/index")
    assert refuse(store) == (f"{store}:/label/index: soft link (may point anywhere in the file); "
                             "refused (untrusted file)")


# ----------------------------------------------------------------------------- (d) virtual datasets
def test_virtual_dataset_mapping_another_file_is_refused(store: Path, tmp_path: Path) -> None:
    other = tmp_path / "secret.h5"
    with h5py.File(other, "w") as f:
        f["secret"] = np.frombuffer(SECRET, np.uint8)

    def vds(g: h5py.Group, name: str, old: np.ndarray) -> None:
        layout = h5py.VirtualLayout(shape=old.shape, dtype=np.uint8)
        layout[:] = h5py.VirtualSource(str(other), "secret", shape=(len(SECRET),))[: old.size]
        g.create_virtual_dataset(name, layout)

    swap(store, "text/data", vds)
    with h5py.File(store, "r", locking=False) as f:
        assert f["text/data"][...].tobytes() == SECRET[: f["text/data"].size]
    msg = refuse(store)
    assert msg == (f"{store}:/text/data: virtual dataset (maps data of other datasets or files); "
                   "refused (untrusted file)")
    no_secret(msg, *quiet_verify(store, untrusted=True).lines())


# ----------------------------------------------------------------------------- (e) declared shapes
def tiny_store(path: Path, rows: int) -> None:
    """A minimal hand-made h5store file whose one item claims ``rows`` float64 rows."""
    schema = {"class": "Tiny", "groups": {"": {"x": {"type": "h5store.Array",
                                                      "params": {"dtype": "float64", "shape": [None]}}}}}
    with h5py.File(path, "w") as f:
        f.attrs["h5store_format"] = 1
        f.attrs["h5store_version"] = "0.1.0"
        f.attrs["h5store_schema"] = json.dumps(schema)
        f["ids/data"] = np.frombuffer(b"a", np.uint8)
        f["ids/index"] = np.array([[0, 1]], np.int64)
        f["ids/checksum"] = np.array([zlib.crc32(b"a")], np.uint32)
        g = f.create_group("x")
        g.attrs["h5store_column"] = json.dumps({"dtype": "float64", "shape": [None], "layout": "ragged"})
        g.create_dataset("data", shape=(rows,), maxshape=(None,), chunks=(1024,), dtype=np.float64)
        g["index"] = np.array([[0, rows]], np.int64)
        g["checksum"] = np.zeros(1, np.uint32)


_MEASURE = """
import json, resource, sys, warnings
import psutil
from h5store.integrity import verify
from h5store.safety import H5StoreSecurityWarning
warnings.simplefilter("ignore", H5StoreSecurityWarning)
proc = psutil.Process()
out = {}
for untrusted in (True, False):
    rss, peak = proc.memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    r = verify(sys.argv[1], deep=True, untrusted=untrusted)
    out[str(untrusted)] = dict(summary=r.summary(), lines=r.lines(), ok=bool(r),
                               rss=proc.memory_info().rss - rss,
                               peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak)
print(json.dumps(out))
"""


def test_huge_declared_shape_is_refused_before_any_allocation(tmp_path: Path) -> None:
    path = tmp_path / "tiny.h5"
    tiny_store(path, 1 << 40)
    size = os.path.getsize(path)
    assert size < 16_000  # kilobytes on disk, 8 TiB declared
    assert refuse(path) == (f"{path}:/x/data: declares {1 << 40} rows ({8 << 40} bytes) in a file of {size} bytes; "
                            "refused (untrusted file)")
    # Memory, measured in a fresh process: untrusted and trusted verification alike stay bounded.
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, timeout=120,
                          env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    out = json.loads(proc.stdout)
    for key in ("True", "False"):
        assert not out[key]["ok"]
        assert out[key]["rss"] < 100 << 20 and out[key]["peak"] < 100 << 20, out
    assert "declares 1099511627776 rows" in out["True"]["summary"]
    assert out["False"]["lines"][1] == (f"  /x: data unreadable (declares {8 << 40} bytes (({1 << 40},) x float64) "
                                        f"in a file of {size} bytes)")


def test_index_past_its_data_is_refused(store: Path) -> None:
    with h5py.File(store, "r+", locking=False) as f:
        f["mel/index"][3] = [0, 1 << 40]
    assert refuse(store) == (f"{store}:/mel: index row 3 = [0, {1 << 40}] points outside the 78 stored rows; "
                             "refused (untrusted file)")


# ----------------------------------------------------------------------------- (f) decompression bombs
def zeros_gzip(nbytes: int) -> bytes:
    """gzip (zlib) stream of ``nbytes`` zeros, compressed piecewise: no big buffer here either."""
    z = zlib.compressobj(9)
    piece = bytes(1 << 20)
    out = [z.compress(piece) for _ in range(nbytes >> 20)]
    return b"".join(out) + z.flush()


def bomb(rows: int) -> Callable[[h5py.Group, str, np.ndarray], None]:
    def make(g: h5py.Group, name: str, old: np.ndarray) -> None:
        ds = g.create_dataset(name, shape=(rows, 4), maxshape=(None, 4), chunks=(rows, 4), dtype=np.float32,
                              compression="gzip")
        ds.id.write_direct_chunk((0, 0), zeros_gzip(rows * 16))

    return make


def test_decompression_bomb_is_refused_by_the_chunk_cap(store: Path) -> None:
    swap(store, "mel/data", bomb(1 << 24))  # one chunk: 256 MiB of zeros in ~256 KB
    size = os.path.getsize(store)
    assert size < 2 << 20
    assert refuse(store) == (f"{store}:/mel/data: chunks of {256 << 20} bytes decompressed (chunk shape "
                             f"({1 << 24}, 4); limit {64 << 20}); refused (untrusted file)")


def test_compression_ratio_is_capped(store: Path) -> None:
    swap(store, "mel/data", bomb(1 << 20))  # 16 MiB of zeros, under the chunk cap
    size = os.path.getsize(store)
    msg = refuse(store, Limits(max_ratio=4))
    assert msg.startswith(f"{store}:/mel/data: declares {16 << 20} bytes of compressed data") and f"{size}" in msg
    assert quiet_verify(store, untrusted=True, deep=False, limits=Limits(max_ratio=1000))  # (its items are zeros)


# ----------------------------------------------------------------------------- (g) filters
def test_scaleoffset_filter_is_refused(store: Path) -> None:
    swap(store, "label/data", lambda g, n, old: g.create_dataset(
        n, data=old, maxshape=(None,), chunks=(64,), scaleoffset=0))
    assert refuse(store) == (f"{store}:/label/data: HDF5 filter 6 (scaleoffset) is not allowed "
                             "(allowed: gzip, shuffle, fletcher32, lzf, blosc, zstd); refused (untrusted file)")


def low_level(filter_id: int, flags: int = 0, values: tuple[int, ...] = ()) -> Callable[..., None]:
    def make(g: h5py.Group, name: str, old: np.ndarray) -> None:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((64, *old.shape[1:]))
        dcpl.set_filter(filter_id, flags, values)
        space = h5py.h5s.create_simple(old.shape, (h5py.h5s.UNLIMITED, *old.shape[1:]))
        tid = h5py.h5t.py_create(old.dtype)
        h5py.Dataset(h5py.h5d.create(g.id, name.encode(), tid, space, dcpl=dcpl))[...] = old

    return make


def test_nbit_filter_is_refused(store: Path) -> None:
    swap(store, "label/data", low_level(h5py.h5z.FILTER_NBIT))
    assert "/label/data: HDF5 filter 5 (nbit) is not allowed" in refuse(store)


def test_unknown_filter_id_is_refused(store: Path) -> None:
    # An optional filter HDF5 does not know is skipped when writing: the file stays readable.
    swap(store, "mel/data", low_level(31999, h5py.h5z.FLAG_OPTIONAL, (1, 2)))
    with h5s.open(store) as f:
        assert f.mel["c2"].shape == (3, 4)
    assert "/mel/data: HDF5 filter 31999 (unknown) is not allowed" in refuse(store)


# ----------------------------------------------------------------------------- foreign objects
def test_objects_outside_the_layout_are_refused(store: Path, tmp_path: Path) -> None:
    cases: dict[str, Callable[[h5py.File], Any]] = {
        "/payload: object not in the h5store layout": lambda f: f.create_dataset("payload", data=np.arange(3)),
        "/mel/extra: object not in the h5store layout": lambda f: f.create_dataset("mel/extra", data=[1]),
        "/logs/x: object not in the h5store layout": lambda f: f.create_group("logs/x"),
        "/_h5store/run: object not in the h5store layout": lambda f: f.create_dataset("_h5store/run", data=[1]),
        "/text/data: datatype class string is not a plain number": lambda f: _vlen_text(f),
        "/label: expected a group, found a dataset": lambda f: _label_as_dataset(f),
    }
    for i, (expect, damage) in enumerate(cases.items()):
        path = tmp_path / f"case{i}.h5"
        path.write_bytes(store.read_bytes())
        with h5py.File(path, "r+", locking=False) as f:
            damage(f)
        assert f"{path}:{expect}" in refuse(path), expect


def _vlen_text(f: h5py.File) -> None:
    del f["text/data"]
    f.create_dataset("text/data", data=np.array(["x" * 10**6], dtype=h5py.string_dtype()))


def _label_as_dataset(f: h5py.File) -> None:
    del f["label"]
    f["label"] = np.arange(3)


def test_oversized_attributes_are_refused(store: Path) -> None:
    with h5py.File(store, "r+", locking=False) as f:
        f["mel"].attrs["notes"] = "x" * 5000
    assert refuse(store, Limits(max_attr_bytes=4096)) == (
        f"{store}:/mel: attribute 'notes' holds 5000 bytes (limit 4096); refused (untrusted file)")
    assert quiet_verify(store, untrusted=True)  # within the default limit


# ----------------------------------------------------------------------------- HDF5 itself
def test_advisories_by_version() -> None:
    ids = {v: " ".join(a.ids for a in hdf5_advisories(v)) for v in ("1.14.6", "2.0.0", "2.1.0", "2.2.0", "2.4.0")}
    assert "CVE-2025-44905" in ids["1.14.6"] and "CVE-2025-44904" in ids["1.14.6"]
    assert "CVE-2025-44905" not in ids["2.0.0"] and "CVE-2025-44904" in ids["2.0.0"]
    assert "CVE-2025-44904" not in ids["2.1.0"] and "CVE-2026-17573" in ids["2.1.0"]
    assert ids["2.2.0"] == "CVE-2026-19025"
    assert ids["2.4.0"] == ""
    for a in hdf5_advisories("1.0.0"):
        assert a.source and a.mitigation and a.summary


def test_superblock_reading_and_its_checksum(tmp_path: Path) -> None:
    assert _lookup3(b"") == 0xDEADBEEF
    # lookup3.c's own self-test values
    assert _lookup3(b"Four score and seven years ago", 0) == 0x17770551
    assert _lookup3(b"Four score and seven years ago", 1) == 0xCD628161
    for libver, version in (("earliest", 0), ("v108", 2), ("latest", 3)):
        p = tmp_path / f"{libver}.h5"
        with h5py.File(p, "w", libver=libver) as f:
            f["x"] = np.arange(10)
        sb = read_superblock(p)
        assert isinstance(sb, Superblock)
        assert (sb.version, sb.eof, sb.checksum_ok) == (version, os.path.getsize(p), None if version < 2 else True)
    p = tmp_path / "userblock.h5"
    with h5py.File(p, "w", userblock_size=1024) as f:
        f["x"] = np.arange(10)
    sb = read_superblock(p)
    assert isinstance(sb, Superblock) and (sb.offset, sb.eof) == (1024, os.path.getsize(p))


def test_open_untrusted_refuses_external_storage_and_a_clean_file_opens(tmp_path):
    """h5store.open(path, untrusted=True) runs the checks before anything is read."""
    import warnings

    import h5py
    import numpy as np

    import h5store as h5s

    class Clean(h5s.TypedFile):
        x = h5s.Array(dtype="float32", shape=(None,))

    good = tmp_path / "good.h5"
    with Clean(good, mode="w") as f:
        f.add("a", dict(x=np.arange(4, dtype=np.float32)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bundled HDF5's CVE warning
        with h5s.open(good, untrusted=True) as f:
            assert f.x["a"].tolist() == [0, 1, 2, 3]
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"TOP-SECRET" * 10)
    bad = tmp_path / "bad.h5"
    bad.write_bytes(good.read_bytes())
    with h5py.File(bad, "a", locking=False) as h:
        del h["x/data"]
        h.create_dataset("x/data", shape=(100,), dtype="uint8", external=[(str(secret), 0, 100)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(h5s.FormatError) as err:
            h5s.open(bad, untrusted=True)
    assert "TOP-SECRET" not in str(err.value)
