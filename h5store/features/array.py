"""Generic features: arrays, scalars and utf-8 text filled through ``add``/``extend``."""

from __future__ import annotations

from typing import Any

import numpy as np

from h5store.errors import SchemaError
from h5store.schema import Feature

__all__ = ["Array", "Scalar", "Text"]


class Array(Feature):
    """Any numeric array per item; the generic feature for logs and custom data.

    Parameters
    ----------
    dtype : str or None
        numpy dtype of the stored values. None (the default): the dtype of the first item
        stored (numeric or bool; text goes to :class:`Text`).
    shape : tuple or None
        Per-item shape, ``None`` as first dim for a variable number of rows. None (the
        default): ``(None, *first_item.shape[1:])``, ragged along the first axis with the
        first item's trailing dims, or ``()`` (one scalar per item) when the first item is
        a scalar.
    **kwargs
        The storage parameters of :class:`~h5store.Feature` (``compression``, ``pattern``...).

    Notes
    -----
    What the first item fixes is written to the file's schema, so a later open, with the
    class or with :func:`h5store.open`, sees the concrete dtype and shape. Later items must
    fit it: the same trailing dims, and a dtype that converts without loss (int16 into an
    int64 column, float32 into float64; not float into int), else
    :class:`~h5store.errors.SchemaError` names both shapes. A declared dtype or shape stays
    binding, as for every feature.

    Examples
    --------
    >>> import h5store as h5s, numpy as np, tempfile, os
    >>> class Logs(h5s.TypedFile):
    ...     x = h5s.Array()
    >>> path = os.path.join(tempfile.mkdtemp(), "logs.h5")
    >>> with Logs(path, mode="w") as f:
    ...     _ = f.add("a", dict(x=np.zeros((42, 7))))
    ...     try:
    ...         f.add("b", dict(x=np.zeros((42, 8))))
    ...     except h5s.SchemaError as e:
    ...         print(str(e).split(": ", 2)[2])
    expected shape (T, 7) (fixed by the first item stored), got (42, 8)
    >>> with h5s.open(path) as f:
    ...     f.x["a"].shape, f.x["a"].dtype.name, f.file_schema.feature("", "x").shape
    ((42, 7), 'float64', (None, 7))
    """

    type_name = "h5store.Array"
    dtype: str | None = None  # type: ignore[assignment]
    shape: tuple[int | None, ...] | None = None  # type: ignore[assignment]


class Scalar(Feature):
    """One number per item (a class index, a duration, a score).

    Examples
    --------
    >>> import h5store as h5s
    >>> h5s.Scalar(dtype="int64").spec().shape
    ()
    """

    type_name = "h5store.Scalar"
    dtype: str = "int64"
    shape: tuple[int | None, ...] = ()


class Text(Feature):
    """A utf-8 string per item, stored as ragged uint8 bytes and decoded on read.

    Examples
    --------
    >>> import h5store as h5s
    >>> h5s.Text().encode("héllo").tobytes().decode()
    'héllo'
    """

    type_name = "h5store.Text"
    dtype: str = "uint8"
    shape: tuple[int | None, ...] = (None,)

    def problems(self) -> list[str]:
        out = super().problems()
        if self.dtype != "uint8" or tuple(self.shape) != (None,):
            out.append("Text is stored as dtype uint8, shape (None,): do not override them")
        return out

    def encode(self, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray) and value.dtype == np.uint8:
            value = value.tobytes()
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SchemaError(f"bytes are not valid utf-8 ({e})") from None
        if not isinstance(value, str):
            raise SchemaError(f"expected a str, got {type(value).__name__}")
        return np.frombuffer(value.encode("utf-8"), dtype=np.uint8)

    def decode(self, raw: Any) -> str:
        return np.asarray(raw, dtype=np.uint8).tobytes().decode("utf-8")

    def display_kind(self) -> str:
        return "text"
