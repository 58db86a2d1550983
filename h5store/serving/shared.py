"""Memory shared by the main process and its DataLoader workers, without a Manager.

Objects backed by a file in ``/dev/shm`` that every process maps:

* :class:`SharedParams` - a few named numbers (``crop``, ``duration``...) that the main
  process changes during training and every worker reads before each batch. A reader
  costs one memory load when nothing changed (a version counter), against a round trip
  to a server process for a ``multiprocessing.Manager`` dict.
* :class:`SharedArray` - a read-only array written once by the main process
  (``in_memory=True`` serving). Forked *and* spawned workers map the same pages, so N
  workers hold one copy, unlike ``driver="core"`` which loads the file once per process.

All pickle as their path (never their bytes). The process that created the file removes
it when the object is garbage collected or at interpreter exit; a process killed with
SIGKILL leaves it behind in ``/dev/shm`` (named ``h5store-*``), where it can be deleted.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["SharedArray", "SharedFlags", "SharedParams", "shm_dir"]

_EPOCH = "_epoch"  # reserved slot: the epoch a batch without its own epoch is drawn from


def shm_dir() -> str:
    """The folder for shared files: ``/dev/shm`` when present (RAM), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _unlink(path: str, pid: int) -> None:
    # Registered by the creator only; forked children inherit the registry, so check.
    if os.getpid() == pid:
        try:
            os.unlink(path)
        except OSError:
            pass


def _new_file(prefix: str, nbytes: int) -> str:
    where = shm_dir()
    free = os.statvfs(where)
    if nbytes > free.f_bavail * free.f_frsize:
        raise MemoryError(
            f"{where}: {nbytes / 2**20:.1f} MiB needed for shared memory, "
            f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB free (in docker, raise --shm-size)"
        )
    fd, path = tempfile.mkstemp(prefix=prefix, dir=where)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


class SharedParams:
    """Named numbers shared by every process that holds a copy of this object.

    Set a value in the main process (``params.crop = 128``); each DataLoader worker sees
    it from the next batch it *fetches*, under fork, spawn and forkserver, also with
    ``persistent_workers=True``.

    Parameters
    ----------
    values : mapping
        Name -> initial value (int, float or bool). The names and their types are fixed
        at construction: a float slot takes ints and floats, an int slot ints only.

    Notes
    -----
    The block is an int64 version counter followed by one 8-byte slot per name. The
    writer makes the counter odd, writes, and makes it even again; a reader re-reads the
    slots only when the counter changed and retries while it is odd or moved during the
    read (a sequence lock). One writer is assumed: set values in the main process.

    BEWARE: the DataLoader prefetches ``prefetch_factor * num_workers`` batches, so a
    change reaches the batches fetched after it, not those already waiting in the queue.

    Examples
    --------
    >>> p = SharedParams({"crop": 64, "gain": 1.0})
    >>> p.crop = 128
    >>> p.crop, p["gain"], dict(p)
    (128, 1.0, {'crop': 128, 'gain': 1.0})
    """

    def __init__(self, values: Mapping[str, int | float | bool] | None = None) -> None:
        values = dict(values or {})
        values.setdefault(_EPOCH, 0)
        kinds = {}
        for name, v in values.items():
            if not isinstance(name, str) or not name.isidentifier() or (name.startswith("_") and name != _EPOCH):
                raise ValueError(f"shared parameter name {name!r}: use an identifier not starting with '_'")
            kinds[name] = _kind_of(name, v)
        names = tuple(values)
        path = _new_file("h5store-params-", 8 * (1 + len(names)))
        self._init(path, names, tuple(kinds[n] for n in names))
        self.__dict__["_finalizer"] = weakref.finalize(self, _unlink, path, os.getpid())
        for n in names:
            self._write(n, values[n])

    def _init(self, path: str, names: tuple[str, ...], kinds: tuple[str, ...]) -> None:
        d = self.__dict__
        d["_path"], d["_names"], d["_kinds"] = path, names, kinds
        d["_slot"] = {n: i + 1 for i, n in enumerate(names)}
        with open(path, "r+b") as fh:
            d["_mm"] = mmap.mmap(fh.fileno(), 8 * (1 + len(names)))
        # memoryviews: indexing one costs ~40 ns, a numpy scalar read several times that.
        d["_i64"] = memoryview(d["_mm"]).cast("q")
        d["_f64"] = memoryview(d["_mm"]).cast("d")
        d["_seen"] = -1
        d["_cache"] = {}
        # Each name becomes a property of a class made for these names: reading
        # `params.crop` is then a plain attribute access, not a failed lookup + __getattr__.
        object.__setattr__(self, "__class__", _params_class(names))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self._path, self._names, self._kinds))

    # -- reading ---------------------------------------------------------------
    def _get(self, name: str) -> Any:
        if self._i64[0] != self._seen:
            self._values()
        return self._cache[name]

    def _values(self) -> dict[str, int | float | bool]:
        i64, f64 = self._i64, self._f64
        v = i64[0]
        if v == self._seen:
            return self._cache
        while True:
            if v & 1:
                v = i64[0]
                continue
            out: dict[str, int | float | bool] = {}
            for n, k in zip(self._names, self._kinds):
                s = self._slot[n]
                out[n] = f64[s] if k == "float" else (bool(i64[s]) if k == "bool" else i64[s])
            again = i64[0]
            if again == v:
                break
            v = again
        self.__dict__["_cache"] = out
        self.__dict__["_seen"] = v
        return out

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_names" not in self.__dict__:
            raise AttributeError(name)
        try:
            return self._values()[name]
        except KeyError:
            raise AttributeError(f"no shared parameter {name!r} (parameters: {list(self)})") from None

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values()[name]
        except KeyError:
            raise KeyError(f"no shared parameter {name!r} (parameters: {list(self)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._slot and name != _EPOCH

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._names if n != _EPOCH)

    def __len__(self) -> int:
        return len(self._names) - 1

    def keys(self) -> list[str]:
        return list(self)

    def items(self) -> list[tuple[str, Any]]:
        vals = self._values()
        return [(n, vals[n]) for n in self]

    def get(self, name: str, default: Any = None) -> Any:
        return self._values().get(name, default) if name in self else default

    @property
    def version(self) -> int:
        """Number of completed writes times two (changes whenever a value is set)."""
        return int(self._i64[0])

    # -- writing ---------------------------------------------------------------
    def _write(self, name: str, value: Any) -> None:
        slot = self._slot.get(name)
        if slot is None:
            raise AttributeError(
                f"no shared parameter {name!r} (parameters: {list(self)}); "
                "declare every parameter when the dataset is made: params=dict(...)"
            )
        kind = self._kinds[slot - 1]
        _check(name, kind, value)
        i64 = self._i64
        i64[0] += 1  # odd: write in progress
        if kind == "float":
            self._f64[slot] = float(value)
        else:
            i64[slot] = int(value)
        i64[0] += 1  # even again: written last

    def __setattr__(self, name: str, value: Any) -> None:
        self._write(name, value)

    def __setitem__(self, name: str, value: Any) -> None:
        self._write(name, value)

    def update(self, values: Mapping[str, Any]) -> None:
        for name, value in values.items():
            self._write(name, value)

    def __repr__(self) -> str:
        return f"SharedParams({dict(self.items())})"


_CLASSES: dict[tuple[str, ...], type[SharedParams]] = {}


def _params_class(names: tuple[str, ...]) -> type[SharedParams]:
    cls = _CLASSES.get(names)
    if cls is None:
        props = {n: property(_getter(n), doc=f"shared parameter {n!r}") for n in names if n != _EPOCH}
        cls = _CLASSES[names] = type("SharedParams", (SharedParams,), {**props, "__module__": __name__})
    return cls


def _getter(name: str) -> Callable[[SharedParams], Any]:
    def get(self: SharedParams) -> Any:
        d = self.__dict__
        if d["_i64"][0] != d["_seen"]:
            self._values()
        return d["_cache"][name]

    return get


def _restore(path: str, names: tuple[str, ...], kinds: tuple[str, ...]) -> SharedParams:
    """Unpickle: map the same block again (a spawned worker's copy of the parameters)."""
    self = object.__new__(SharedParams)
    try:
        self._init(path, tuple(names), tuple(kinds))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: shared parameters are gone (the process that created them ended)") from None
    return self


def _kind_of(name: str, value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    raise TypeError(f"shared parameter {name!r}: expected int, float or bool, got {type(value).__name__}")


def _check(name: str, kind: str, value: Any) -> None:
    ok = {
        "bool": isinstance(value, (bool, np.bool_)),
        "int": isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)),
        "float": isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)),
    }[kind]
    if not ok:
        raise TypeError(f"shared parameter {name!r} holds {kind} values, got {type(value).__name__} {value!r}")


class SharedArray:
    """A read-only array in a shared-memory file, mapped (not copied) by every process.

    Parameters
    ----------
    shape, dtype
        Of the array.
    fill : callable
        ``fill(out)`` writes the values into the writable mapping ``out`` once, in the
        creating process.

    Examples
    --------
    >>> a = SharedArray((3, 2), "float32", lambda out: out.fill(1.5))
    >>> a.array.sum(), a.array.flags.writeable
    (np.float32(9.0), False)
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, fill: Callable[[np.ndarray], None]) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.path = _new_file("h5store-array-", nbytes)
        self._finalizer = weakref.finalize(self, _unlink, self.path, os.getpid())
        self._array: np.ndarray | None = None
        if nbytes:
            with open(self.path, "r+b") as fh, mmap.mmap(fh.fileno(), nbytes) as mm:
                out = np.frombuffer(mm, dtype=self.dtype).reshape(self.shape)
                try:
                    fill(out)
                except BaseException as e:
                    # The failed fill's frames hold `out`: the mapping could not close, and a
                    # BufferError would replace the error that says what went wrong.
                    del out
                    traceback.clear_frames(e.__traceback__)
                    raise
                del out

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def array(self) -> np.ndarray:
        """The values, a read-only view of the shared pages (mapped on first use)."""
        if self._array is None:
            if not self.nbytes:
                self._array = np.empty(self.shape, self.dtype)
            else:
                with open(self.path, "rb") as fh:
                    mm = mmap.mmap(fh.fileno(), self.nbytes, access=mmap.ACCESS_READ)
                self._array = np.frombuffer(mm, dtype=self.dtype).reshape(self.shape)
            self._array.flags.writeable = False
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "shape": self.shape, "dtype": self.dtype.str}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self.shape = tuple(state["shape"])
        self.dtype = np.dtype(state["dtype"])
        self._array = None
        if self.nbytes and not os.path.exists(self.path):
            raise FileNotFoundError(f"{self.path}: shared array is gone (the process that created it ended)")

    def __repr__(self) -> str:
        return f"<SharedArray {self.dtype}{self.shape} at {self.path}>"


class SharedFlags:
    """One flag (a byte) per item, set by any process and seen by all: the items a dataset skipped.

    Backed by a file in ``/dev/shm`` mapped read-write by the main process and every
    DataLoader worker (fork, spawn, forkserver); it pickles as its path.

    Examples
    --------
    >>> flags = SharedFlags(5)
    >>> flags.set(3)
    >>> flags.positions().tolist()
    [3]
    """

    def __init__(self, n: int) -> None:
        self.n = int(n)
        self.path = _new_file("h5store-flags-", max(self.n, 1))
        self._finalizer = weakref.finalize(self, _unlink, self.path, os.getpid())
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            with open(self.path, "r+b") as fh:
                mm = mmap.mmap(fh.fileno(), max(self.n, 1))
            self._array = np.frombuffer(mm, dtype=np.uint8)[: self.n]
        return self._array

    def set(self, position: int) -> None:
        self.array[int(position)] = 1

    def positions(self) -> np.ndarray:
        """The flagged positions, in increasing order."""
        return np.flatnonzero(self.array)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "n": self.n}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.n, self._array = state["path"], int(state["n"]), None
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"{self.path}: shared flags are gone (the process that created them ended)")

