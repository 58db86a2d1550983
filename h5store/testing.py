"""Conformance kits: subclass :class:`FeatureTests` (a Feature) or :class:`ReaderTests` (a Reader).

Like ``zarr.testing.StoreTests``: the kit's ``test_*`` methods run under pytest for every
subclass whose name starts with ``Test``. Every built-in feature passes
:class:`FeatureTests` (``tests/features/test_conformance.py``), every built-in reader
:class:`ReaderTests` (``tests/test_readers.py``); a custom one should too.

This module is only imported by tests; it imports neither pytest nor anything heavy.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

import h5store
from h5store.errors import CorruptRecordError
from h5store.layout import gather, plan_reads
from h5store.readers import Reader
from h5store.schema import Feature, Source
from h5store.typed_file import TypedFile

__all__ = ["FeatureTests", "ReaderTests"]


class FeatureTests:
    """Reusable pytest tests that a Feature must pass.

    A subclass provides the hooks :meth:`make_feature`, :meth:`make_source` and
    :meth:`expected`; features that are filled with ``add`` rather than from sources
    override :meth:`make_value` too. The tests:

    ``test_round_trip``
        prepare, load and encode a source, ``add`` it to a new file, close, reopen with
        the TypedFile class and with :func:`h5store.open`: both decode to :meth:`expected`.
    ``test_pickle``
        the feature (as declared and as prepared) survives :meth:`roundtrip` with equal
        parameters and loads the same item; an opened file survives it and reads the same.
    ``test_dtype_shape``
        the stored dataset and every raw item have the declared dtype and shape.
    ``test_params_in_attrs``
        :meth:`~h5store.Feature.params` is JSON, stored in the file's schema attribute,
        shown by ``FeatureView.attrs``, and rebuilds an equal feature with ``from_params``.
    ``test_problems_valid``
        the feature of :meth:`make_feature` reports no problems.

    Examples
    --------
    >>> import numpy as np
    >>> from h5store.testing import FeatureTests
    >>> class TestLoudness(FeatureTests):  # doctest: +SKIP
    ...     def make_feature(self):
    ...         return Loudness(pattern=r"\\.wav$")
    ...     def make_source(self, tmp_path):
    ...         return write_wav(tmp_path / "a.wav")
    ...     def expected(self, source):
    ...         return np.array([...])
    """

    #: Relative tolerance of :meth:`assert_same` for float arrays (0: exact).
    rtol: float = 0.0
    #: Name of the feature in the TypedFile the kit declares.
    name: str = "feat"

    # ------------------------------------------------------------------ hooks
    def make_feature(self) -> Feature:
        """The feature under test."""
        raise TypeError(f"{type(self).__name__} must define make_feature()")

    def make_source(self, tmp_path: Path) -> str | Source:
        """Write one sample source under ``tmp_path`` and return it (a path or a Source)."""
        raise TypeError(f"{type(self).__name__} must define make_source(tmp_path)")

    def expected(self, source: Source) -> Any:
        """What reading the item made from ``source`` must return."""
        raise TypeError(f"{type(self).__name__} must define expected(source)")

    def make_value(self, feature: Feature, source: Source) -> Any:
        """The value to ``encode`` and add: ``feature.load(source)`` unless overridden."""
        return feature.load(source)

    def roundtrip(self, obj: Any) -> Any:
        """Serialise and restore ``obj`` as a worker process would receive it.

        The default reduces it with :func:`copy.deepcopy` (which uses the same
        ``__reduce_ex__`` protocol as pickling); test modules override it with a
        byte-level pickle round trip.
        """
        return copy.deepcopy(obj)

    def assert_same(self, got: Any, want: Any) -> None:
        """Compare a decoded item with the expected one (``rtol`` for float arrays)."""
        if isinstance(want, (str, bytes, int, float, bool)) and not isinstance(want, np.generic):
            assert type(got) is type(want), f"decoded {type(got).__name__} {got!r}, expected {type(want).__name__}"
            assert got == want, f"decoded {got!r}, expected {want!r}"
            return
        g, w = np.asarray(got), np.asarray(want)
        assert g.shape == w.shape, f"decoded shape {g.shape}, expected {w.shape}"
        assert g.dtype == w.dtype, f"decoded dtype {g.dtype}, expected {w.dtype}"
        if self.rtol and w.dtype.kind in "fc":
            np.testing.assert_allclose(g, w, rtol=self.rtol, atol=0)
        else:
            np.testing.assert_array_equal(g, w)

    # ------------------------------------------------------------------ helpers
    def source(self, tmp_path: Path) -> Source:
        """:meth:`make_source` as a :class:`~h5store.Source` (id: the file stem)."""
        s = self.make_source(tmp_path)
        if isinstance(s, Source):
            return s
        p = str(s)
        return Source(p, id=Path(p.rstrip("/")).stem, root=os.path.dirname(p.rstrip("/")))

    def file_class(self, feature: Feature) -> type[TypedFile]:
        """A TypedFile subclass declaring ``feature`` under :attr:`name`."""
        return type(f"{type(self).__name__}File", (TypedFile,), {self.name: feature})

    def write(self, tmp_path: Path) -> tuple[type[TypedFile], Feature, Source, str]:
        """Prepare, load, encode and store the sample source in a new file.

        Returns the file class, the prepared feature, the source and the file's path.
        """
        src = self.source(tmp_path)
        declared = self.make_feature()
        feature = declared.prepare([src], None)
        assert isinstance(feature, type(declared)), f"prepare() returned {type(feature).__name__}"
        cls = self.file_class(feature)
        path = str(tmp_path / "conformance.h5")
        with cls(path, mode="w") as f:
            f.add(src.id, {self.name: feature.encode(self.make_value(feature, src))})
        return cls, feature, src, path

    # ------------------------------------------------------------------ tests
    def test_round_trip(self, tmp_path: Path) -> None:
        cls, feature, src, path = self.write(tmp_path)
        want = self.expected(src)
        with cls(path) as f:
            self.assert_same(getattr(f, self.name)[src.id], want)
            self.assert_same(getattr(f, self.name)[0], want)
        with h5store.open(path) as f:
            stored = f.file_schema.feature("", self.name)
            assert type(stored) is type(feature), f"h5store.open rebuilt {type(stored).__name__}, not {type(feature).__name__}"
            self.assert_same(f.feature(self.name)[src.id], want)
            self.assert_same(f.feature(self.name).read_many([0, 0])[1], want)

    def test_pickle(self, tmp_path: Path) -> None:
        cls, feature, src, path = self.write(tmp_path)
        for original in (self.make_feature(), feature):
            copy_ = self.roundtrip(original)
            assert type(copy_) is type(original)
            assert copy_.params() == original.params()
        prepared = self.roundtrip(feature)
        self.assert_same(prepared.decode(prepared.encode(self.make_value(prepared, src))), self.expected(src))
        with h5store.open(path) as f:
            want = f.feature(self.name)[src.id]
            g = self.roundtrip(f)
            try:
                self.assert_same(g.feature(self.name)[src.id], want)
            finally:
                g.close()

    def test_dtype_shape(self, tmp_path: Path) -> None:
        cls, feature, src, path = self.write(tmp_path)
        spec = feature.spec()
        with cls(path) as f:
            view = getattr(f, self.name)
            data = view.data
            assert data.dtype == spec.np_dtype, f"stored {data.dtype}, declared {spec.np_dtype}"
            assert tuple(data.shape[1:]) == spec.inner, f"stored rows {data.shape[1:]}, declared {spec.inner}"
            raw = view.column.read_items([0])[0]
            if spec.layout == "blobs":
                assert all(np.asarray(b).dtype == spec.np_dtype and np.ndim(b) == 1 for b in raw)
                return
            raw = np.asarray(raw)
            assert raw.dtype == spec.np_dtype, f"raw item {raw.dtype}, declared {spec.np_dtype}"
            assert raw.ndim == len(spec.shape), f"raw item shape {raw.shape}, declared {spec.shape}"
            for got, exp in zip(raw.shape, spec.shape):
                assert exp is None or got == exp, f"raw item shape {raw.shape}, declared {spec.shape}"

    def test_params_in_attrs(self, tmp_path: Path) -> None:
        cls, feature, src, path = self.write(tmp_path)
        params = feature.params()
        as_json = json.loads(json.dumps(params))  # raises if a parameter is not JSON
        with cls(path) as f:
            schema = json.loads(f.h5.attrs["h5store_schema"])
        entry = schema["groups"][""][self.name]
        assert entry["type"] == feature.type_name
        assert entry["params"] == as_json
        with h5store.open(path) as f:
            assert json.loads(json.dumps(f.feature(self.name).attrs)) == as_json
        rebuilt = type(feature).from_params(as_json)
        assert rebuilt.params() == params
        assert rebuilt.spec() == feature.spec()

    def test_problems_valid(self) -> None:
        feature = self.make_feature()
        assert feature.problems() == [], feature.problems()
        self.file_class(feature)  # declaring it raises SchemaError on any problem


class ReaderTests:
    """Reusable pytest tests that a :class:`~h5store.readers.Reader` must pass.

    A subclass provides :meth:`make_reader` (a reader of ``data``, the array the kit
    chose, stored as the reader reads it) and may override :meth:`make_data`. The tests:

    ``test_protocol``
        it is a :class:`~h5store.readers.Reader`: the attributes and methods, of their types.
    ``test_read_runs``
        planned reads of ranges that repeat, overlap, touch, are empty, in any order, return
        ``data``'s rows (and so does a plan whose runs join across a gap).
    ``test_read_scatter``
        rows land in a caller's buffer at ``out[dest[j], :counts[j]]``, nothing else written.
    ``test_take``
        one row each, in the order asked, repeats included.
    ``test_past_the_end``
        a read past the last row raises :class:`~h5store.errors.CorruptRecordError`.
    ``test_close_reopens``
        ``open``/``close`` in any order, twice; a read after ``close`` reopens.
    ``test_threads``
        four threads reading at once read the right rows.
    ``test_pickle``
        (:attr:`picklable`) a copy made by :meth:`roundtrip` (as a spawned worker receives
        it) reads the same.
    ``test_after_fork``
        (:attr:`survives_fork`, or the reader's own) a forked child reads the same with it.

    Examples
    --------
    >>> class TestMyReader(ReaderTests):  # doctest: +SKIP
    ...     def make_reader(self, tmp_path, data):
    ...         return MyReader.for_array(data)
    """

    #: A pickled copy of the reader reads the same (False for readers holding HDF5 objects).
    picklable: bool = True
    #: Whether the same reader reads in a forked child (None: the reader's ``survives_fork``).
    reads_after_fork: bool | None = None

    # ------------------------------------------------------------------ hooks
    def roundtrip(self, obj: Any) -> Any:
        """Serialise and restore ``obj`` as a spawned worker would receive it.

        The default reduces it with :func:`copy.deepcopy` (the same ``__reduce_ex__``
        protocol as pickling, with no bytes to parse); test modules override it with a
        byte-level pickle round trip, as :class:`FeatureTests` users do.
        """
        return copy.deepcopy(obj)

    def make_data(self) -> np.ndarray:
        """The rows the reader must read (default: 257 rows of float32 ``(3,)``)."""
        return np.arange(257 * 3, dtype=np.float32).reshape(257, 3) * 0.5 - 7

    def make_reader(self, tmp_path: Path, data: np.ndarray) -> Reader:
        """A reader of ``data`` (stored under ``tmp_path`` as the reader under test reads it)."""
        raise TypeError(f"{type(self).__name__} must define make_reader(tmp_path, data)")

    # ------------------------------------------------------------------ helpers
    def ranges(self, n: int, seed: int = 0, k: int = 40) -> tuple[np.ndarray, np.ndarray]:
        """``k`` random ``[start, stop)`` ranges inside ``n`` rows, plus the awkward ones."""
        rng = np.random.default_rng(seed)
        starts = rng.integers(0, n, k)
        stops = np.minimum(n, starts + rng.integers(0, 40, k))
        extra = np.array([[0, n], [0, 0], [n, n], [n - 1, n], [5, 9], [5, 9], [9, 12], [0, 1]])
        extra = np.clip(extra, 0, n)
        return np.concatenate([starts, extra[:, 0]]), np.concatenate([stops, extra[:, 1]])

    def reader_and_data(self, tmp_path: Path) -> tuple[Reader, np.ndarray]:
        data = self.make_data()
        return self.make_reader(tmp_path, data), data

    def check_runs(self, reader: Reader, data: np.ndarray, seed: int = 0) -> None:
        starts, stops = self.ranges(len(data), seed)
        for gap in (0, 7):
            plan = plan_reads(starts, stops, max_gap=gap)
            buf = reader.read_runs(plan)
            assert buf.shape == (plan.total, *data.shape[1:]), f"read_runs gave {buf.shape}"
            assert buf.dtype == data.dtype, f"read_runs gave {buf.dtype}, data is {data.dtype}"
            for a, b, got in zip(starts.tolist(), stops.tolist(), gather(plan, buf)):
                np.testing.assert_array_equal(got, data[a:b], err_msg=f"rows [{a}, {b})")

    # ------------------------------------------------------------------ tests
    def test_protocol(self, tmp_path: Path) -> None:
        reader, _ = self.reader_and_data(tmp_path)
        assert isinstance(reader, Reader), f"{type(reader).__name__} lacks part of the Reader protocol"
        for name in ("stable", "releases_gil", "resident", "survives_fork"):
            assert isinstance(getattr(reader, name), bool), f"{name} is {getattr(reader, name)!r}, not a bool"
        assert isinstance(reader.max_gap, int) and reader.max_gap >= 0

    def test_read_runs(self, tmp_path: Path) -> None:
        reader, data = self.reader_and_data(tmp_path)
        self.check_runs(reader, data)
        empty = reader.read_runs(plan_reads(np.zeros(0, np.int64), np.zeros(0, np.int64)))
        assert empty.shape == (0, *data.shape[1:])

    def test_read_scatter(self, tmp_path: Path) -> None:
        reader, data = self.reader_and_data(tmp_path)
        starts, stops = self.ranges(len(data), seed=1)
        counts = stops - starts
        width = int(counts.max()) + 2
        out = np.full((len(starts) + 3, width, *data.shape[1:]), 99, dtype=data.dtype)
        dest = np.random.default_rng(2).permutation(len(out))[: len(starts)]
        reader.read_scatter(out, dest, starts, counts)
        want = np.full_like(out, 99)
        for j, a, c in zip(dest.tolist(), starts.tolist(), counts.tolist()):
            want[j, :c] = data[a : a + c]
        np.testing.assert_array_equal(out, want)

    def test_take(self, tmp_path: Path) -> None:
        reader, data = self.reader_and_data(tmp_path)
        rows = np.array([len(data) - 1, 0, 3, 3, 100 % len(data), 2], dtype=np.int64)
        got = reader.take(rows)
        np.testing.assert_array_equal(got, data[rows])

    def test_past_the_end(self, tmp_path: Path) -> None:
        reader, data = self.reader_and_data(tmp_path)
        n = len(data)
        try:
            reader.read_runs(plan_reads(np.array([n - 2]), np.array([n + 3])))
        except CorruptRecordError:
            pass
        else:
            raise AssertionError("a read past the end returned instead of raising CorruptRecordError")

    def test_close_reopens(self, tmp_path: Path) -> None:
        reader, data = self.reader_and_data(tmp_path)
        reader.close()
        reader.open()
        reader.open()
        self.check_runs(reader, data)
        reader.close()
        reader.close()
        self.check_runs(reader, data, seed=3)
        reader.close()

    def test_threads(self, tmp_path: Path) -> None:
        reader, data = self.reader_and_data(tmp_path)
        reader.open()
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            try:
                for k in range(5):
                    self.check_runs(reader, data, seed=seed * 10 + k)
            except BaseException as e:  # noqa: BLE001 - reported by the test's thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(j,)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        reader.close()
        if errors:
            raise errors[0]

    def test_pickle(self, tmp_path: Path) -> None:
        if not self.picklable:
            return
        reader, data = self.reader_and_data(tmp_path)
        reader.open()
        copy_ = self.roundtrip(reader)
        self.check_runs(copy_, data)
        copy_.close()
        self.check_runs(reader, data)  # the original's descriptor is its own
        reader.close()

    def test_after_fork(self, tmp_path: Path) -> None:
        reader, data = self.reader_and_data(tmp_path)
        forks = reader.survives_fork if self.reads_after_fork is None else self.reads_after_fork
        if not forks or not hasattr(os, "fork"):
            return
        reader.open()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            code = 1
            try:
                self.check_runs(reader, data, seed=5)
                reader.close()
                code = 0
            finally:
                os.write(w, bytes([code]))
                os._exit(code)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert got == b"\x00", "the reader failed in a forked child"
        self.check_runs(reader, data)  # the child's close left the parent's descriptor open
        reader.close()
