"""The h5store exception tree.

One root, :class:`H5StoreError`; every subclass also inherits the builtin exception a
caller would naturally catch, so ``except KeyError`` keeps working around a missing id
and ``except ValueError`` around a foreign file.

Messages name the file, the feature and the id involved, and say what to do.
"""

from __future__ import annotations

__all__ = [
    "CorruptRecordError",
    "DuplicateIdError",
    "FormatError",
    "H5StoreError",
    "LockedError",
    "NotFound",
    "ReadOnlyError",
    "SchemaError",
    "SourceError",
]


class H5StoreError(Exception):
    """Root of every error h5store raises on purpose."""


class NotFound(H5StoreError, KeyError):
    """An id, position or feature that the file does not hold."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument; a sentence reads better.
        return str(self.args[0]) if self.args else ""


class ReadOnlyError(H5StoreError, PermissionError):
    """A write through a file opened read-only."""


class FormatError(H5StoreError, ValueError):
    """A file that is not a valid h5store file of a version this library reads."""


class CorruptRecordError(FormatError):
    """A stored record whose bytes or index fail their integrity checks."""


class SchemaError(H5StoreError, TypeError):
    """A schema declaration, or an array, that does not fit the declared features."""


class DuplicateIdError(H5StoreError, ValueError):
    """An id added to a group that already holds it."""


class SourceError(H5StoreError, ValueError):
    """A source that a feature could not turn into a valid array."""


class LockedError(H5StoreError, BlockingIOError):
    """A second writer on a file that another handle is writing."""
