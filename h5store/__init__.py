"""h5store: preprocessed training data in one self-describing HDF5 file, served fast.

>>> import h5store as h5s
>>> class Speech(h5s.TypedFile):
...     mel = h5s.Array(dtype="float32", shape=(None, 80))
...     text = h5s.Text()
"""

from h5store.errors import (
    CorruptRecordError,
    DuplicateIdError,
    FormatError,
    H5StoreError,
    LockedError,
    NotFound,
    ReadOnlyError,
    SchemaError,
    SourceError,
)
from h5store.features import Array, Scalar, Text
from h5store.schema import Feature, Group, Schema, Source, feature_types, register_feature
from h5store.typed_file import TypedFile, open

__version__ = "0.1.0"

__all__ = [
    "Array",
    "CorruptRecordError",
    "DuplicateIdError",
    "Feature",
    "FormatError",
    "Group",
    "H5StoreError",
    "LockedError",
    "NotFound",
    "ReadOnlyError",
    "Scalar",
    "Schema",
    "SchemaError",
    "Source",
    "SourceError",
    "Text",
    "TypedFile",
    "__version__",
    "feature_types",
    "open",
    "register_feature",
]
