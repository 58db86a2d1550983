"""h5store: preprocessed training data in one self-describing HDF5 file, served fast.

>>> import h5store as h5s
>>> class Speech(h5s.TypedFile):
...     mel = h5s.Array(dtype="float32", shape=(None, 80))
...     text = h5s.Text()
"""

from h5store.errors import (
    ArgumentError,
    CorruptRecordError,
    DuplicateIdError,
    FormatError,
    H5StoreError,
    JournalError,
    LockedError,
    NotFound,
    ReadOnlyError,
    SchemaError,
    SourceError,
    TargetExistsError,
    WriteError,
)
from h5store.features import (
    MFCC,
    Array,
    Audio,
    CSVColumn,
    DirLabel,
    EncodedFrames,
    EncodedImage,
    MagSpectrogram,
    MelSpectrogram,
    Scalar,
    Text,
)
from h5store.schema import Feature, Group, Schema, Source, feature_types, register_feature
from h5store.serving import interleave, transforms
from h5store.serving.files import concat
from h5store.serving.getters import Clips, Encoded, Frames, Getter, Id, ImageCrop, Item, Label, Position, Window
from h5store.typed_file import TypedFile, open

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "Array",
    "Audio",
    "CSVColumn",
    "Clips",
    "CorruptRecordError",
    "DirLabel",
    "DuplicateIdError",
    "Encoded",
    "EncodedFrames",
    "EncodedImage",
    "Feature",
    "FormatError",
    "Frames",
    "Getter",
    "Group",
    "H5StoreError",
    "Id",
    "ImageCrop",
    "Item",
    "JournalError",
    "Label",
    "LockedError",
    "MFCC",
    "MagSpectrogram",
    "MelSpectrogram",
    "NotFound",
    "Position",
    "ReadOnlyError",
    "Scalar",
    "Schema",
    "SchemaError",
    "Source",
    "SourceError",
    "TargetExistsError",
    "Text",
    "TypedFile",
    "Window",
    "WriteError",
    "__version__",
    "concat",
    "feature_types",
    "interleave",
    "open",
    "register_feature",
    "transforms",
]
