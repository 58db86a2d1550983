"""The feature library. Importing it registers every built-in feature type.

Heavy dependencies (librosa, pillow) are imported inside the loaders that need them.
"""

from h5store.features.array import Array, Scalar, Text

__all__ = ["Array", "Scalar", "Text"]
