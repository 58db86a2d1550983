"""The feature library. Importing it registers every built-in feature type.

Heavy dependencies (soundfile, soxr, scipy.fft, pillow) are imported inside the loaders that
need them: importing this package imports none of them.
"""

from h5store.features.array import Array, Scalar, Text
from h5store.features.audio import MFCC, Audio, MagSpectrogram, MelSpectrogram
from h5store.features.image import EncodedFrames, EncodedImage
from h5store.features.labels import CSVColumn, DirLabel

__all__ = [
    "Array",
    "Audio",
    "CSVColumn",
    "DirLabel",
    "EncodedFrames",
    "EncodedImage",
    "MFCC",
    "MagSpectrogram",
    "MelSpectrogram",
    "Scalar",
    "Text",
]
