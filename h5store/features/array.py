"""Generic features: arrays, scalars and utf-8 text filled through ``add``/``extend``."""

from __future__ import annotations

from typing import Any

import numpy as np

from h5store.errors import SchemaError
from h5store.schema import Feature

__all__ = ["Array", "Scalar", "Text"]


class Array(Feature):
    """Any numeric array per item; the generic feature for logs and custom data.

    Examples
    --------
    >>> import h5store as h5s
    >>> class Run(h5s.TypedFile):
    ...     logs = h5s.Group(loss=h5s.Array(dtype="float32"))
    """

    type_name = "h5store.Array"


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
