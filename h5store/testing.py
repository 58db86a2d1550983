"""A conformance kit for Feature classes: subclass :class:`FeatureTests` in your tests.

Like ``zarr.testing.StoreTests``: the kit's ``test_*`` methods run under pytest for every
subclass whose name starts with ``Test``. Every built-in feature passes it
(``tests/features/test_conformance.py``); a custom feature should too.

This module is only imported by tests; it imports neither pytest nor anything heavy.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

import h5store
from h5store.schema import Feature, Source
from h5store.typed_file import TypedFile

__all__ = ["FeatureTests"]


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
