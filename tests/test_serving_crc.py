"""No silently wrong item reaches training (issue 11, point 7).

One data byte of one item is flipped in a real file (found through the chunk table, as a
disk or a copy would damage it). Serving checks each item it delivers against its stored
CRC-32 by default: ``serve()`` (forked and spawned workers), ``iter_batches`` and
``to_tf_dataset`` raise :class:`CorruptRecordError` naming the file, the feature and the
id; ``verify=False`` delivers the damaged item; ``verify="skip"`` leaves it out, warns
and lists it in ``dataset.skipped`` (shared by every worker). ``h5store verify FILE``
reads every item by default and names the damaged record; ``--quick`` checks structure
only and says that item data was not read.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.cli import main
from h5store.errors import CorruptRecordError
from h5store.serving import CorruptRecordWarning
from h5store.storage import DirectReader
from tests.serving.schemas import Speech, make_speech

N = 24
BAD = 7
BATCH = dict(x=h5s.Item("mel"), y=h5s.Label("label"), pos=h5s.Position())


def flip(path: Path, feature: str, position: int) -> None:
    """XOR one byte in the middle of an item's stored data (the file's bytes, not HDF5's view)."""
    with h5py.File(path, "r", locking=False) as f:
        g = f[feature]
        a, b = (int(v) for v in g["index"][position])
        reader = DirectReader.for_dataset(g["data"], str(path))
        assert reader is not None
        row = (a + b) // 2
        p = int(reader.starts.searchsorted(row, side="right")) - 1
        offset = int(reader.offsets[p]) + (row - int(reader.starts[p])) * reader.row_nbytes
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("crc") / "clean.h5"
    make_speech(path, N, seed=3)
    return path


@pytest.fixture(scope="module")
def damaged(clean: Path) -> Path:
    path = clean.with_name("damaged.h5")
    shutil.copy(clean, path)
    flip(path, "mel", BAD)
    return path


def drain(loader) -> None:
    """Iterate a loader to its end, shutting its workers down before an error leaves here.

    A DataLoader iterator abandoned in an exception's traceback is torn down by a later garbage
    collection, in whatever test runs then; under spawn, torch's teardown of a worker still
    starting reports "worker exited unexpectedly" from there. Shut down here, deterministically.
    """
    it = iter(loader)
    try:
        for _ in it:
            pass
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            with contextlib.suppress(RuntimeError):  # a spawn worker torn down while it started
                shutdown()
        del it


def names_it(e: pytest.ExceptionInfo, path: Path, feature: str = "mel", position: int = BAD) -> None:
    text = str(e.value)
    assert str(path) in text and f"/{feature}" in text and f"id{position:05d}" in text, text


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_serve_raises_naming_file_feature_and_id(damaged, method):
    pytest.importorskip("torch")
    f = Speech(damaged)
    loader = f.serve(BATCH, batch_size=8, num_workers=2, multiprocessing_context=method)
    with pytest.raises(CorruptRecordError) as e:
        drain(loader)
    names_it(e, damaged)


def test_a_window_of_a_damaged_item_raises(damaged):
    pytest.importorskip("torch")
    loader = Speech(damaged).serve(dict(x=h5s.Window("mel", 2)), batch_size=8)
    with pytest.raises(CorruptRecordError) as e:
        drain(loader)
    names_it(e, damaged)


def test_a_damaged_label_raises(clean, tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "label.h5"
    shutil.copy(clean, path)
    flip(path, "label", 3)
    with pytest.raises(CorruptRecordError) as e:
        drain(Speech(path).serve(BATCH, batch_size=8))
    names_it(e, path, "label", 3)


def test_verify_off_delivers_the_damaged_item(clean, damaged):
    pytest.importorskip("torch")
    want = Speech(clean).mel.read_many(range(N))
    got = {}
    for b in Speech(damaged).serve(BATCH, batch_size=8, num_workers=2, verify=False):
        for p, x, n in zip(b["pos"].tolist(), b["x"].numpy(), b["x_lengths"].tolist()):
            got[p] = x[:n]
    assert sorted(got) == list(range(N))
    assert [p for p in range(N) if not np.array_equal(got[p], want[p])] == [BAD]


@pytest.mark.filterwarnings("default::h5store.serving.CorruptRecordWarning")  # in the workers: to stderr
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_skip_leaves_the_item_out_and_reports_it(damaged, method):
    pytest.importorskip("torch")
    loader = Speech(damaged).serve(BATCH, batch_size=8, num_workers=2, multiprocessing_context=method,
                                   verify="skip")
    for epoch in range(2):
        served = [p for b in loader for p in b["pos"].tolist()]
        assert sorted(served) == [p for p in range(N) if p != BAD], epoch
    assert loader.dataset.skipped == loader.skipped == [f"id{BAD:05d}"]


def test_skip_in_process_warns(damaged):
    f = Speech(damaged)
    with pytest.warns(CorruptRecordWarning, match=f"id{BAD:05d}"):
        served = [p for b in f.iter_batches(BATCH, batch_size=5, threads=2, verify="skip") for p in b["pos"]]
    assert sorted(served) == [p for p in range(N) if p != BAD]


def test_iter_batches_raises(damaged):
    with pytest.raises(CorruptRecordError) as e:
        for _ in Speech(damaged).iter_batches(dict(x=h5s.Window("mel", 3)), batch_size=8, threads=2):
            pass
    names_it(e, damaged)


def test_to_tf_dataset_raises(damaged):
    tf = pytest.importorskip("tensorflow")
    ds = Speech(damaged).to_tf_dataset(BATCH, batch_size=8)
    # tf.data carries a Python exception raised in its reader across its C++ runtime as a
    # tf error of its own (InvalidArgumentError); the message is CorruptRecordError's.
    with pytest.raises(tf.errors.InvalidArgumentError, match="CorruptRecordError: ") as e:
        for _ in ds:
            pass
    names_it(e, damaged)


def test_to_tf_dataset_skip_leaves_the_item_out(damaged):
    pytest.importorskip("tensorflow")
    ds = Speech(damaged).to_tf_dataset(BATCH, batch_size=8, verify="skip", drop_last=True, num_parallel_calls=1)
    with pytest.warns(CorruptRecordWarning, match=f"id{BAD:05d}"):
        served = [p for b in ds for p in b["pos"].numpy().tolist()]
    assert len(served) == N - 1 and BAD not in served
    assert ds.h5store_skipped() == [f"id{BAD:05d}"]


def test_cli_verify_reads_every_record_by_default(damaged, capsys):
    assert main(["verify", str(damaged)]) == 1
    out = capsys.readouterr().out
    assert f"id{BAD:05d}" in out and "mel" in out, out


def test_cli_verify_quick_says_data_was_not_read(damaged, capsys):
    assert main(["verify", "--quick", str(damaged)]) == 0
    out = capsys.readouterr().out
    assert "data was not read" in out, out


def test_an_unknown_verify_mode_is_refused(clean):
    from h5store.serving import FileDataset

    with pytest.raises(ValueError, match="verify must be True, False, 'always' or 'skip'"):
        FileDataset(Speech(clean), BATCH, verify="yes")


def _items(path: Path) -> list[np.ndarray]:
    with h5py.File(path, "r", locking=False) as f:
        data, index = f["mel"]["data"][()], f["mel"]["index"][()]
    return [data[a:b] for a, b in index.tolist()]


def _epoch(loader) -> dict[int, np.ndarray]:
    got = {}
    for b in loader:
        for p, x, n in zip(b["pos"].tolist(), b["x"].numpy(), b["x_lengths"].tolist()):
            got[p] = x[:n].copy()
    return got


@pytest.mark.parametrize("workers", [0, 2])
def test_whole_items_are_checked_once_unless_always(clean, tmp_path, workers):
    """verify=True checks an item the first time it is served (in any process of the loader,
    persistent workers or not). A byte flipped afterwards through the file system changes the file
    on disk (its mtime and ctime), so every item is checked again and the flip is caught (it used
    to be served unnoticed; flips below the file system, by the medium, still are, as
    docs/reliability.md says). verify="always" re-checks, and a fresh loader checks again."""
    pytest.importorskip("torch")
    path = tmp_path / "flipped-later.h5"
    shutil.copy(clean, path)
    want = _items(path)
    batch = dict(x=h5s.Item("mel"), pos=h5s.Position())
    once = Speech(path).serve(batch, batch_size=8, num_workers=workers)
    always = Speech(path).serve(batch, batch_size=8, num_workers=workers, verify="always")
    for loader in (once, always):
        got = _epoch(loader)  # every item checked, and equal to h5py's bytes
        assert sorted(got) == list(range(N))
        assert all(np.array_equal(got[p], want[p]) for p in range(N))
    flip(path, "mel", BAD)
    with pytest.raises(CorruptRecordError, match="changed on disk while served") as e:
        drain(once)  # new workers (not persistent): the flags are shared with them, and cleared
    names_it(e, path)
    with pytest.raises(CorruptRecordError) as e:
        drain(always)
    names_it(e, path)
    with pytest.raises(CorruptRecordError):
        drain(Speech(path).serve(batch, batch_size=8, num_workers=workers))  # a fresh loader checks


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_share_the_checked_items(clean, method):
    """Items checked by one worker are not read again by another (the flags live in shared memory)."""
    pytest.importorskip("torch")
    f = Speech(clean)
    loader = f.serve(dict(x=h5s.Item("mel"), pos=h5s.Position()), batch_size=4, num_workers=2,
                     multiprocessing_context=method)
    assert not loader.dataset.files._done("mel").any()
    want = _items(clean)
    got = _epoch(loader)
    assert all(np.array_equal(got[p], want[p]) for p in range(N))
    assert loader.dataset.files._done("mel").all()  # seen from the main process, set by the workers


def test_a_skipped_item_is_never_marked_checked(damaged):
    from h5store.serving import FileDataset

    ds = FileDataset(Speech(damaged), dict(x=h5s.Item("mel"), pos=h5s.Position()), verify="skip")
    with pytest.warns(CorruptRecordWarning):
        b = ds.fetch(range(N))
    assert BAD not in b["pos"].tolist()
    done = ds.files._done("mel")
    assert not done[BAD] and done.sum() == N - 1


def test_without_room_in_dev_shm_the_flags_are_per_process(clean, tmp_path, monkeypatch):
    """A /dev/shm too small for the flags (docker's 64 MB default) still serves, checking per process."""
    from h5store.serving import files as files_mod

    def full(n):
        raise MemoryError("/dev/shm: 0.0 MiB free")

    monkeypatch.setattr(files_mod, "SharedFlags", full)
    path = tmp_path / "no-shm.h5"
    shutil.copy(clean, path)
    want = _items(path)
    loader = Speech(path).serve(dict(x=h5s.Item("mel"), pos=h5s.Position()), batch_size=8)
    assert isinstance(loader.dataset.files._checked["mel"], np.ndarray)
    got = _epoch(loader)
    assert all(np.array_equal(got[p], want[p]) for p in range(N))
    assert loader.dataset.files._done("mel").all()
    flip(path, "mel", BAD)
    with pytest.raises(CorruptRecordError):
        drain(Speech(path).serve(dict(x=h5s.Item("mel"), pos=h5s.Position()), batch_size=8))


def test_a_fileset_unpickled_after_its_loader_is_gone_checks_again(clean):
    """The shared flags travel as their path; where they are gone, the copy keeps its own."""
    import gc
    import pickle

    from h5store.serving import FileDataset

    ds = FileDataset(Speech(clean), dict(x=h5s.Item("mel"), pos=h5s.Position()))
    ds.fetch(range(N))
    blob = pickle.dumps(ds.files)
    assert pickle.loads(blob)._done("mel").all()  # the same flags, while the dataset lives
    del ds
    gc.collect()  # the flags' file is removed with the dataset that made them
    orphan = pickle.loads(blob)
    assert not orphan._done("mel").any()
    items = np.arange(N)
    lengths = orphan.lengths("mel")[items]
    x = orphan.read_padded("mel", items, 0, lengths, int(lengths.max()))
    want = _items(clean)
    assert all(np.array_equal(x[p, :n], want[p]) for p, n in enumerate(lengths.tolist()))
    assert orphan._done("mel").all()


@pytest.mark.filterwarnings("default::h5store.serving.CorruptRecordWarning")
@pytest.mark.parametrize("getter", [h5s.Frames("mel", 5), h5s.Window("mel", 5, pad="skip"),
                                    h5s.Clips("mel", 5, pad="skip")], ids=["Frames", "Window", "Clips"])
def test_an_item_damage_made_too_short_is_not_left_out_unseen(clean, tmp_path, getter):
    """Index damage that shortens an item below a window's length (here to one row) makes the
    getter leave it out of the dataset: it is never read, so no CRC-32 would ever see it.
    Items left out for their length are checked when the dataset is made; those truly short
    pass."""
    lengths = Speech(clean).mel.lengths
    assert lengths[BAD] >= 5 and (lengths < 5).any()  # one item damaged; others left out rightly
    path = tmp_path / "short.h5"
    shutil.copy(clean, path)
    with h5py.File(path, "r+", locking=False) as f:
        a, _ = f["mel/index"][BAD]
        f["mel/index"][BAD] = (a, a + 1)
    batch = dict(x=getter, pos=h5s.Position())
    with pytest.raises(CorruptRecordError) as e:
        list(Speech(path).iter_batches(batch, batch_size=8))
    names_it(e, path)
    with pytest.warns(CorruptRecordWarning, match=f"id{BAD:05d}"):
        it = Speech(path).iter_batches(batch, batch_size=8, verify="skip")
    assert BAD not in [p for b in it for p in b["pos"].tolist()]
    assert it.dataset.skipped == [f"id{BAD:05d}"]
    served = {p for b in Speech(clean).iter_batches(batch, batch_size=8) for p in b["pos"].tolist()}
    assert served == set(np.flatnonzero(lengths >= 5).tolist())


# --------------------------------------------------------------------------- a file rewritten in place
def _two_files(tmp_path: Path) -> tuple[Path, Path, dict]:
    from tests.test_integrity import make_store

    served, other = tmp_path / "served.h5", tmp_path / "other.h5"
    expected = make_store(served, seed=0)
    make_store(other, seed=1)  # same schema and ids, other values
    return served, other, expected[("", "mel")]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_rewritten_in_place_is_not_served_through_old_tables(tmp_path: Path, workers: int) -> None:
    """`cp other.h5 served.h5` (the same inode: not the atomic rename create does) under a
    persistent loader: its next epoch used to serve the other file's bytes through the old
    index, unchecked (every item had passed its CRC-32 in epoch 1). Now the change on disk makes
    every item checked again, and the loader raises, naming the file."""
    from tests.test_integrity import Clip

    served, other, mel = _two_files(tmp_path)
    with Clip(served) as f:
        kw = dict(num_workers=workers, persistent_workers=True, multiprocessing_context="fork") if workers else {}
        loader = f.serve(dict(x=h5s.Item("mel"), i=h5s.Id()), batch_size=4, **kw)
        for b in loader:  # epoch 1: every item checked and flagged
            for i, x, n in zip(b["i"], b["x"], b["x_lengths"]):
                np.testing.assert_array_equal(x[:n].numpy(), mel[i])
        inode = served.stat().st_ino
        shutil.copyfile(other, served)
        assert served.stat().st_ino == inode
        with pytest.raises(CorruptRecordError, match=r"served\.h5.*changed on disk while served.*rewritten in place"):
            for _ in loader:
                pass


def test_a_writers_commits_between_epochs_only_cost_checks(tmp_path: Path) -> None:
    """A writer appending to the served file (logs, ingest) changes it on disk too: the items
    are checked again and served, equal, with no error; iter_batches over one dataset the same."""
    from h5store.serving import FileDataset
    from h5store.serving.numpy_iter import iter_batches
    from tests.test_integrity import Clip

    served, _, mel = _two_files(tmp_path)
    with Clip(served) as f:
        loader = f.serve(dict(x=h5s.Item("mel"), i=h5s.Id()), batch_size=4)
        ds = FileDataset(f, dict(x=h5s.Item("mel"), i=h5s.Id()))
        for epoch in range(3):
            got = {}
            for b in loader:
                got.update({i: x[:n].numpy() for i, x, n in zip(b["i"], b["x"], b["x_lengths"])})
            for b in iter_batches(ds, None, 4, threads=2, epoch=epoch):
                for i, x, n in zip(b["i"], b["x"], b["x_lengths"]):
                    np.testing.assert_array_equal(x[:n], mel[i])
            assert sorted(got) == sorted(mel) and all(np.array_equal(got[i], mel[i]) for i in mel)
            with Clip(served, mode="a") as w:  # a commit: the file changes on disk, its items do not
                w.add(f"new{epoch}", dict(mel=np.ones((3, 4), np.float32), label=np.int64(7)))


def test_the_next_epochs_dataset_starts_from_the_checked_flags(tmp_path: Path) -> None:
    """``f.iter_batches`` makes a FileDataset per epoch: it used to read and check every item
    again each epoch. The flags now stay with the open file, for the next dataset of it, while
    the file is unchanged on disk; a change (a commit, a flip written through the file system)
    or another open file starts from none."""
    from h5store.serving import FileDataset
    from tests.test_integrity import Clip

    served, other, mel = _two_files(tmp_path)
    batch = dict(x=h5s.Item("mel"), i=h5s.Id())
    with Clip(served) as f, Clip(other) as g:
        assert len(list(f.iter_batches(batch, 4, threads=0))) == 3  # epoch 0: every item checked
        ds = FileDataset(f, batch)
        assert ds.files._done("mel").all()  # kept, the file unchanged
        ds.close()
        assert not FileDataset(g, batch).files._done("mel").any()  # another file: its own flags
        with Clip(served, mode="a") as w:  # the file changes on disk
            w.add("new", dict(mel=np.ones((3, 4), np.float32), label=np.int64(7)))
        ds = FileDataset(f, batch)
        assert not ds.files._done("mel").any()
        for b in f.iter_batches(batch, 4, threads=2):
            for i, x, n in zip(b["i"], b["x"], b["x_lengths"]):
                np.testing.assert_array_equal(x[:n], mel[i])
        assert FileDataset(f, batch).files._done("mel").all()  # checked again, kept again


def test_the_next_epochs_dataset_reuses_the_open_copies_until_a_file_changes(tmp_path: Path) -> None:
    """Each ``iter_batches`` used to open its own read-only copy of every file (~5 ms a file,
    every epoch). The copies now stay open for the next dataset of the same source while every
    file is unchanged on disk; a commit, or another file moved to the path, opens new ones, and
    the new state is what is served."""
    import os

    from h5store.serving import FileDataset
    from h5store.serving.files import _KEPT_FILES
    from tests.test_integrity import Clip, make_store

    served, other, mel = _two_files(tmp_path)
    batch = dict(x=h5s.Item("mel"), i=h5s.Id())
    multi = h5s.concat([served])

    def epoch() -> dict[str, np.ndarray]:
        return {i.split("::")[-1]: x[:n] for b in multi.iter_batches(batch, 4, threads=2)
                for i, x, n in zip(b["i"], b["x"], b["x_lengths"])}

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    got = epoch()
    assert sorted(got) == sorted(mel) and all(np.array_equal(got[i], mel[i]) for i in mel)
    copies = _KEPT_FILES[multi][2]
    opened = fds()
    for _ in range(5):
        assert epoch().keys() == mel.keys()
        assert _KEPT_FILES[multi][2] is copies  # unchanged on disk: the same open copies served again
    assert fds() == opened, "descriptors piled up over the epochs"
    with Clip(served, mode="a") as w:  # a commit: once refreshed, the next epoch serves it, through new copies
        w.add("new", dict(mel=np.ones((3, 4), np.float32), label=np.int64(7)))
    assert epoch().keys() == mel.keys()  # the open file's snapshot, as before the commit
    assert _KEPT_FILES[multi][2] is not copies
    copies = _KEPT_FILES[multi][2]
    multi.files[0].refresh()
    got = epoch()
    assert sorted(got) == sorted([*mel, "new"]) and np.array_equal(got["new"], np.ones((3, 4), np.float32))
    assert _KEPT_FILES[multi][2] is copies  # opened after the commit: current
    # Another file moved to the path (as create's rename does): never its bytes through the old
    # file's tables; a new open serves its items.
    fresh = tmp_path / "fresh.h5"
    theirs = make_store(fresh, seed=5)[("", "mel")]
    os.replace(fresh, served)
    with pytest.raises(CorruptRecordError, match="another file was moved to the path"):
        epoch()
    multi = h5s.concat([served])
    got = epoch()
    assert sorted(got) == sorted(theirs) and all(np.array_equal(got[i], theirs[i]) for i in theirs)
    # Two iterators at once never share copies: closing one leaves the other reading.
    epoch()
    it1 = multi.iter_batches(batch, 4, threads=2)
    next(it1)
    it2 = multi.iter_batches(batch, 4, threads=2)
    assert it1.dataset.files.files is not it2.dataset.files.files
    it1.close()
    it1.dataset.close()
    got = {i.split("::")[-1]: x[:n] for b in it2 for i, x, n in zip(b["i"], b["x"], b["x_lengths"])}
    assert sorted(got) == sorted(theirs) and all(np.array_equal(got[i], theirs[i]) for i in theirs)
    # A closed dataset's copies are closed: the next one opens its own.
    ds = FileDataset(multi, batch)
    ds.files.keep_checked()
    assert _KEPT_FILES[multi][2] is ds.files.files
    ds.close()
    assert multi not in _KEPT_FILES
    assert epoch().keys() == theirs.keys()


def test_closing_the_file_closes_the_copies_its_epochs_left_open(tmp_path: Path) -> None:
    import os

    from h5store.serving.files import _KEPT_FILES
    from tests.test_integrity import Clip

    served, _, mel = _two_files(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    f = Clip(served)
    for _ in range(3):
        assert sum(len(b["i"]) for b in f.iter_batches(dict(x=h5s.Item("mel"), i=h5s.Id()), 4, threads=2)) == len(mel)
    copy = _KEPT_FILES[f][2][0]
    assert copy.serves_own_snapshot
    f.close()
    assert f not in _KEPT_FILES and not copy.serves_own_snapshot
    assert len(os.listdir("/proc/self/fd")) <= before, "descriptors outlived the closed file"


def test_files_opened_afresh_every_epoch_keep_a_bounded_number_of_copies_open(tmp_path: Path) -> None:
    """``for e in ...: h5s.open(p).iter_batches(...)`` with every open kept alive: each is a new
    source; at most ``_KEEP_SOURCES`` of them keep their copies open, the others' copies are
    closed when they drop out."""
    from h5store.serving import files as files_module
    from h5store.serving.files import _KEPT_FILES

    served, _, mel = _two_files(tmp_path)
    batch = dict(x=h5s.Item("mel"), i=h5s.Id())
    opened = []
    for e in range(3 * files_module._KEEP_SOURCES):
        f = h5s.open(served)
        assert sum(len(b["i"]) for b in f.iter_batches(batch, 4, threads=2, epoch=e)) == len(mel)
        opened.append(f)  # all still referenced: only the bound limits what stays open
    assert len(_KEPT_FILES) <= files_module._KEEP_SOURCES
    still_open = [c for f in opened if f in _KEPT_FILES for c in _KEPT_FILES[f][2] if c.serves_own_snapshot]
    assert len(still_open) <= files_module._KEEP_SOURCES
    for f in opened:
        f.close()
    assert not [f for f in opened if f in _KEPT_FILES]
