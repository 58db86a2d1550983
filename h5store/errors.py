"""The h5store exception tree.

One root, :class:`H5StoreError`; every subclass also inherits the builtin exception a
caller would naturally catch, so ``except KeyError`` keeps working around a missing id
and ``except ValueError`` around a foreign file.

Messages name the file, the feature and the id involved, and say what to do.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "CorruptRecordError",
    "DuplicateIdError",
    "FormatError",
    "H5StoreError",
    "JournalError",
    "LockedError",
    "MissingExtra",
    "NotFound",
    "ReadOnlyError",
    "RemoteDenied",
    "RemoteError",
    "RemoteNotFound",
    "SchemaError",
    "SourceError",
    "WriteError",
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

    @classmethod
    def opened(cls, where: str) -> ReadOnlyError:
        """The error for a write to ``where`` (a file, or a group or column in one), saying what to do.

        Examples
        --------
        >>> str(ReadOnlyError.opened("s3://b/speech.h5"))
        's3://b/speech.h5: a remote file is read-only; extend a local copy, then upload it (h5store push)'
        """
        if str(where).startswith("s3://"):
            return cls(f"{where}: a remote file is read-only; extend a local copy, then upload it (h5store push)")
        return cls(f"{where}: file is open read-only (mode 'r'); reopen with mode 'a'")


class FormatError(H5StoreError, ValueError):
    """A file that is not a valid h5store file of a version this library reads."""


class CorruptRecordError(FormatError):
    """A stored record whose bytes or index fail their integrity checks."""


class JournalError(FormatError):
    """A rollback journal that cannot be applied safely: damaged (a header, batch or record
    fails its CRC-32), written for another file (one since replaced or deleted), or one that
    an open through another name could not find (a file hard-linked from another folder).

    Nothing of it was applied and nothing deleted. The message names the file and the
    journal; ``h5store recover FILE`` says what the journal holds and what it can restore.
    """


class SchemaError(H5StoreError, TypeError):
    """A schema declaration, or an array, that does not fit the declared features."""


class ArgumentError(H5StoreError, TypeError, ValueError):
    """A call with an argument h5store does not take, or a value it cannot use (an unknown
    keyword, ``batch_size=0``). Both ``except TypeError`` and ``except ValueError`` catch it."""


class DuplicateIdError(H5StoreError, ValueError):
    """An id added to a group that already holds it."""


class SourceError(H5StoreError, ValueError):
    """A source that a feature could not turn into a valid array."""


class LockedError(H5StoreError, BlockingIOError):
    """A second writer on a file that another handle is writing."""


class WriteError(H5StoreError, OSError):
    """A write, fsync or commit that the operating system refused: disk full (``ENOSPC``),
    quota (``EDQUOT``), an I/O error (``EIO``).

    ``errno`` is the operating system's and ``filename`` the file. Everything committed
    before is intact; what was added since the last commit was not written. The open file
    takes no more writes: ``close()`` it (that releases the writer lock), free space, and
    reopen it to add the records again.
    """

    def __str__(self) -> str:
        return str(self.strerror)  # the whole sentence; OSError's "[Errno 28] ..." form hides it


class MissingExtra(H5StoreError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class TargetExistsError(H5StoreError, FileExistsError):
    """``create``/``merge`` onto a file that exists, without saying whether to replace or extend it."""


class RemoteError(H5StoreError, OSError):
    """A remote object (``s3://...``) could not be read: the server kept failing (5xx) or
    stopped answering after the retries, or refused the request. The message names the URL."""

    def __str__(self) -> str:
        return str(self.strerror) if self.strerror else super().__str__()


class RemoteNotFound(RemoteError, FileNotFoundError):
    """The remote object or its bucket does not exist (HTTP 404)."""


class RemoteDenied(RemoteError, PermissionError):
    """The store refused the credentials (HTTP 401/403)."""
