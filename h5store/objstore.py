"""Objects in S3-compatible storage read by byte ranges: :class:`RemoteObject` (s3fs's client).

An h5store file needs few, large reads: its metadata once at open, then one coalesced set of
byte ranges per feature and batch. :meth:`RemoteObject.read` takes a batch's ranges, joins
those closer than ``COALESCE`` bytes into one range, and fetches them all at once (concurrent
GETs through s3fs's client on fsspec's event loop, the calling thread waiting with the GIL
released); each answer is checked to be exactly the bytes asked for, so nothing partial is
ever returned. Every GET requires the ETag the object was opened with (``If-Match``): an
object replaced since (``h5store push --overwrite``) answers 412, raised as a
:class:`~h5store.errors.RemoteError` that says to reopen, and none of its bytes are returned
or cached.

Why s3fs and not obstore: obstore answered a batch 3x faster against the local server, but
its Rust (tokio) runtime does not survive ``fork()``: a forked DataLoader worker of a parent
that had opened the file hung on its first read (measured; obstore's maintainers say it is
not fork safe). fsspec makes its event loop again in a forked child. See
``docs/design-notes.md``.

Credentials and endpoint come from the standard places, as botocore reads them: the
``AWS_*`` environment variables (``AWS_ENDPOINT_URL`` for MinIO, Ceph, R2 and other
compatibles; ``AWS_PROFILE``), the shared config and credential files, instance roles; and
``storage_options`` over them (s3fs's arguments: ``endpoint_url``, ``key``, ``secret``,
``token``, ``anon``, ``profile``, ``client_kwargs``...). Failures: 5xx answers, dropped
connections and timeouts are retried with backoff (``retries``) within ``retry_timeout``
seconds in all; every request has a ``timeout``, so a server that stops answering raises
:class:`~h5store.errors.RemoteError` instead of hanging; 404 raises
:class:`~h5store.errors.RemoteNotFound` and 401/403 :class:`~h5store.errors.RemoteDenied`,
each naming the URL.

With ``cache_dir``, reads go through aligned blocks of ``block_bytes`` kept in a
:class:`~h5store.disk_cache.DiskCache` shared by the processes of a machine: a block is
fetched once per machine (keyed by the object's ETag, so a replaced object is fetched anew).

Processes: the client is made per process (a forked or spawned DataLoader worker makes its
own); a :class:`RemoteObject` pickles as its URL and options. :func:`remote_object` keeps one
per URL and process for the readers, registered by the file handle that opened the URL.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from h5store.disk_cache import DiskCache
from h5store.errors import MissingExtra, RemoteDenied, RemoteError, RemoteNotFound

__all__ = ["REMOTE_SCHEMES", "RemoteObject", "is_remote", "register", "remote_object", "replaced", "split_url"]

REMOTE_SCHEMES = ("s3://",)
BLOCK_BYTES = 4 << 20  # the cache's (and the metadata reads') aligned unit
COALESCE = 1 << 20  # ranges closer than this share one GET


def is_remote(path: Any) -> bool:
    """Whether ``path`` names an object in a store (``s3://bucket/key``), not a local file.

    Examples
    --------
    >>> is_remote("s3://bucket/speech.h5"), is_remote("speech.h5"), is_remote("file:///x.h5")
    (True, False, False)
    """
    return isinstance(path, str) and path.startswith(REMOTE_SCHEMES)


def split_url(url: str) -> tuple[str, str]:
    """``("bucket", "key")`` of ``s3://bucket/key``.

    Examples
    --------
    >>> split_url("s3://data/sets/speech.h5")
    ('data', 'sets/speech.h5')
    """
    rest = url.split("://", 1)[1] if "://" in url else ""
    bucket, _, key = rest.partition("/")
    if not bucket or not key or key.endswith("/"):
        raise ValueError(f"{url}: not an object URL; write s3://BUCKET/KEY")
    return bucket, key


class RemoteObject:
    """One object in an S3-compatible store, read by byte ranges.

    Parameters
    ----------
    url : str
        ``s3://bucket/key``.
    storage_options : dict, optional
        s3fs's arguments over the environment's (``endpoint_url``, ``key``, ``secret``,
        ``token``, ``anon``, ``profile``, ``client_kwargs``...).
    cache_dir : str, optional
        A folder shared by the processes of this machine: blocks fetched once, kept there.
    cache_bytes : int
        The cache folder's bound (least recently used blocks evicted beyond it).
    timeout : float
        Seconds one request may take, and connecting at most a quarter of it.
    retries : int
        Retries of a request that failed with 5xx, a dropped connection or a timeout.
    retry_timeout : float
        Seconds after which a failing request is not retried any more.
    block_bytes : int
        The cache folder's unit: aligned blocks of this many bytes are fetched and kept.

    Examples
    --------
    >>> obj = RemoteObject("s3://bucket/speech.h5", cache_dir="/tmp/h5cache")  # doctest: +SKIP
    >>> obj.size  # doctest: +SKIP
    52428800
    >>> [bytes(b) for b in obj.read([0], [8])]  # doctest: +SKIP
    [b'\\x89HDF\\r\\n\\x1a\\n']
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, cache_dir: str | None = None,
                 cache_bytes: int = 20 << 30, timeout: float = 30.0, retries: int = 4,
                 retry_timeout: float = 60.0, block_bytes: int = BLOCK_BYTES) -> None:
        self.url = url
        self.bucket, self.key = split_url(url)
        self.storage_options = dict(storage_options or {})
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.cache_bytes = int(cache_bytes)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.retry_timeout = float(retry_timeout)
        self.block_bytes = int(block_bytes)
        if self.block_bytes < 1:
            raise ValueError(f"{url}: block_bytes must be >= 1, got {block_bytes!r}")
        self._reset()

    def _reset(self) -> None:
        self._store: Any = None
        self._pid = -1
        self._head: tuple[int, str] | None = None
        self._match: str | None = None  # the ETag every GET requires (If-Match); None: the store gave none
        self._cache = DiskCache(self.cache_dir, self.cache_bytes, self.block_bytes) if self.cache_dir else None
        self._lock = threading.Lock()
        _live.add(self)
        self.requests = 0  # GET requests this process asked for (coalesced ranges count once)

    def options(self) -> dict[str, Any]:
        """What recreates this object (pickling, a worker's reopen)."""
        return dict(storage_options=self.storage_options, cache_dir=self.cache_dir, cache_bytes=self.cache_bytes,
                    timeout=self.timeout, retries=self.retries, retry_timeout=self.retry_timeout,
                    block_bytes=self.block_bytes)

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, **self.options()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<RemoteObject {self.url}>"

    # -- the client ------------------------------------------------------------
    def store(self) -> Any:
        """This process's ``s3fs.S3FileSystem`` (made again in a forked or spawned child)."""
        if self._store is None or self._pid != os.getpid():
            with self._lock:
                if self._store is None or self._pid != os.getpid():
                    self._store, self._pid = self._make_store(), os.getpid()
        return self._store

    def _make_store(self) -> Any:
        try:
            import s3fs
        except ImportError:
            raise MissingExtra(f"{self.url}: s3:// files need s3fs, not installed: pip install 'h5store[s3]'") from None
        opts = dict(self.storage_options)
        config = dict(opts.pop("config_kwargs", {}))
        config.setdefault("connect_timeout", max(1.0, self.timeout / 4))
        config.setdefault("read_timeout", self.timeout)
        # botocore retries 5xx, throttling and dropped connections with backoff ("standard" mode).
        config.setdefault("retries", {"max_attempts": self.retries + 1, "mode": "standard"})
        try:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs=config, **opts)
        except TypeError as e:
            raise TypeError(f"{self.url}: storage_options {sorted(self.storage_options)} ({e}); they are "
                            "s3fs.S3FileSystem's arguments") from None
        fs.retries = 1  # botocore's retries only: s3fs's own loop would multiply them
        return fs

    def _failed(self, e: BaseException) -> RemoteError:
        """s3fs's error as ours, naming the URL and saying what to do next."""
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, FileNotFoundError):
            err: RemoteError = RemoteNotFound(None, f"{self.url}: no such object (HTTP 404): check the bucket and "
                                              "key, and the endpoint (AWS_ENDPOINT_URL)")
        elif type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            err = RemoteDenied(None, f"{self.url}: no S3 credentials found ({text}): set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass storage_options={'key': ..., "
                               "'secret': ...}; for a public bucket, storage_options={'anon': True}")
        elif isinstance(e, TypeError):  # an argument botocore's session does not take
            err = RemoteError(None, f"{self.url}: the S3 client refused storage_options {sorted(self.storage_options)} "
                              f"({text}); they are s3fs.S3FileSystem's arguments (endpoint_url, key, secret, ...)")
        elif isinstance(e, PermissionError):
            err = RemoteDenied(None, f"{self.url}: access denied (HTTP 401/403): check the credentials "
                               "(AWS_ACCESS_KEY_ID / AWS_PROFILE / storage_options) and the bucket policy")
        else:
            err = RemoteError(None, f"{self.url}: the read failed after {self.retries} retries within "
                              f"{self.retry_timeout:g} s ({type(e).__name__}: {text}); the store is unreachable "
                              "or failing")
        err.filename = self.url
        return err

    def _call(self, coro_fn: Any, *args: Any) -> Any:
        """Run an s3fs coroutine on fsspec's loop, bounded by ``retry_timeout`` in all."""
        from fsspec.asyn import sync

        fs = self.store()
        try:
            return sync(fs.loop, coro_fn, *args, timeout=self.retry_timeout)
        except Exception as e:  # noqa: BLE001 - botocore's, aiohttp's and fsspec's errors, mapped
            raise self._failed(e) from None

    def _head_now(self) -> tuple[int, str, str | None]:
        fs = self.store()
        meta = self._call(fs._info, f"{self.bucket}/{self.key}")
        if meta.get("type") == "directory":
            raise self._failed(FileNotFoundError(self.url))
        etag = meta.get("ETag") or meta.get("VersionId") or str(meta.get("LastModified"))
        match = meta.get("ETag")
        return int(meta["size"]), str(etag).strip('"'), None if not match else str(match)

    def head_now(self) -> tuple[int, str]:
        """``(size, etag)`` of the object now: one HEAD, and what this object reads unchanged
        (a handle's check for a new version must not move the reads of the version it opened)."""
        return self._head_now()[:2]

    def head(self, refresh: bool = False) -> tuple[int, str]:
        """``(size, etag)``: one HEAD request (again with ``refresh``).

        A forked child keeps its parent's answer: it reads the object the parent opened
        (with a warm cache folder, a forked DataLoader worker then makes no request at all).
        """
        if self._head is None or refresh:
            size, etag, match = self._head_now()
            self._head, self._match = (size, etag), match
        return self._head

    def _changed(self, etag: str) -> RemoteError:
        """The store refused a GET that required ``etag`` (HTTP 412): the object was replaced.
        This object forgets that version, so that the next open reads the new one."""
        with self._lock:
            if self._head is not None and self._head[1] == etag:
                self._head = self._match = None
        err = RemoteError(None, f"{self.url}: the object changed since it was opened (ETag {etag}): reopen it; "
                          "nothing of the new object was returned or cached")
        err.filename = self.url
        return err

    @property
    def size(self) -> int:
        return self.head()[0]

    @property
    def etag(self) -> str:
        return self.head()[1]

    # -- reads -----------------------------------------------------------------
    async def _fetch(self, spans: list[tuple[int, int]], match: str | None) -> list[Any]:
        """GET each ``[a, z)`` at once, each requiring the ETag ``match`` (If-Match): the
        bytes, or the exception of the span that failed."""
        import asyncio

        fs = self.store()

        async def one(a: int, z: int) -> bytes:
            cond = {"IfMatch": match} if match else {}
            resp = await fs._call_s3("get_object", Bucket=self.bucket, Key=self.key, Range=f"bytes={a}-{z - 1}", **cond)
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        return await asyncio.gather(*(one(a, z) for a, z in spans), return_exceptions=True)

    @staticmethod
    def _precondition_failed(e: BaseException) -> bool:
        cause = e.__cause__ if e.__cause__ is not None else e
        resp = getattr(cause, "response", None) or {}
        code = str(resp.get("Error", {}).get("Code", ""))
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("PreconditionFailed", "412") or status == 412

    def _get(self, starts: Sequence[int], ends: Sequence[int], coalesce: int = COALESCE,
             etag: str | None = None) -> list[Any]:
        """The exact bytes of each ``[starts[j], ends[j])``: ranges closer than ``coalesce``
        joined, all fetched at once, each answer checked. Every GET requires the ETag this
        object opened (``etag``): a replaced object raises, never mixes in new bytes."""
        if not len(starts):
            return []
        order = sorted(range(len(starts)), key=lambda j: starts[j])
        groups: list[list[int]] = []  # [first byte, end byte, ranges...]
        for j in order:
            a, z = int(starts[j]), int(ends[j])
            if groups and a - groups[-1][1] <= coalesce:
                g = groups[-1]
                g[1] = max(g[1], z)
                g.append(j)
            else:
                groups.append([a, z, j])
        if etag is None:
            etag = self.etag
        match = self._match if self._head is not None and self._head[1] == etag else None
        got = self._call(self._fetch, [(g[0], g[1]) for g in groups], match)
        self.requests += len(groups)
        out: list[Any] = [b""] * len(starts)
        for data in got:
            if isinstance(data, BaseException) and self._precondition_failed(data):
                raise self._changed(etag)
        for g, data in zip(groups, got):
            if isinstance(data, BaseException):
                raise self._failed(data)
            if len(data) != g[1] - g[0]:
                err = RemoteError(None, f"{self.url}: bytes [{g[0]}, {g[1]}) came back as {len(data)} bytes: the "
                                  "object changed or is truncated; refused, nothing of it is returned")
                err.filename = self.url
                raise err
            view = memoryview(data)
            for j in g[2:]:
                out[j] = view[int(starts[j]) - g[0] : int(ends[j]) - g[0]]
        return out

    def read(self, starts: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray) -> list[Any]:
        """The bytes ``[starts[j], ends[j])`` (buffers), in one coalesced set of concurrent GETs.

        Through the cache folder when there is one: the aligned blocks the ranges touch, those
        not cached fetched at once and stored.
        """
        starts = np.asarray(starts, np.int64)
        ends = np.asarray(ends, np.int64)
        size, etag = self.head()  # once: the cache key and the GETs' If-Match are the same version
        if len(ends) and int(ends.max()) > size:
            err = RemoteError(None, f"{self.url}: read of bytes up to {int(ends.max())} past the end of the "
                              f"object ({size} bytes): the object is truncated or was replaced")
            err.filename = self.url
            raise err
        if self._cache is None:
            return self._get(starts.tolist(), ends.tolist(), etag=etag)
        return self._read_blocks(starts, ends, size, etag)

    def _read_blocks(self, starts: np.ndarray, ends: np.ndarray, size: int, etag: str) -> list[Any]:
        """Ranges through the cache folder: each from its cached block(s) with one ``pread``;
        the blocks not cached fetched at once (adjacent ones in one GET) and stored."""
        B = self.block_bytes
        cache = self._cache
        assert cache is not None
        key = f"{self.url}|{etag}|{B}|"
        out: list[Any] = [b""] * len(starts)
        todo: list[int] = []
        for j, (a, z) in enumerate(zip(starts.tolist(), ends.tolist())):
            if z <= a:
                continue
            if a // B == (z - 1) // B:  # inside one block: read just these bytes from it
                hit = cache.read_range(key + str(a // B), a - (a // B) * B, z - a)
                if hit is not None:
                    out[j] = hit
                    continue
            todo.append(j)
        if not todo:
            return out
        need = sorted({b for j in todo for b in range(int(starts[j]) // B, (int(ends[j]) - 1) // B + 1)})
        blocks: dict[int, Any] = {}
        missing = []
        for b in need:
            hit = cache.get(key + str(b))
            if hit is not None and len(hit) == min(B, size - b * B):
                blocks[b] = hit
            else:
                missing.append(b)
        if missing:
            got = self._get([b * B for b in missing], [min(size, (b + 1) * B) for b in missing], coalesce=0,
                            etag=etag)
            for b, data in zip(missing, got):
                cache.put(key + str(b), data)
                blocks[b] = data
        for j in todo:
            a, z = int(starts[j]), int(ends[j])
            buf = bytearray(z - a)
            o = 0
            for b in range(a // B, (z - 1) // B + 1):
                lo, hi = max(a, b * B), min(z, (b + 1) * B)
                buf[o : o + hi - lo] = memoryview(blocks[b])[lo - b * B : hi - b * B]
                o += hi - lo
            out[j] = buf
        return out


_OBJECTS: dict[str, RemoteObject] = {}
_OBJECTS_LOCK = threading.Lock()
_live: weakref.WeakSet[RemoteObject] = weakref.WeakSet()  # every RemoteObject of this process


def _locks_anew_in_child() -> None:
    """A forked child's locks made anew: a parent thread that held one at the fork does not
    exist here to release it (a DataLoader worker forked while the parent opened or read)."""
    global _OBJECTS_LOCK
    _OBJECTS_LOCK = threading.Lock()
    for obj in list(_live):
        obj._lock = threading.Lock()


os.register_at_fork(after_in_child=_locks_anew_in_child)


def register(url: str, **options: Any) -> RemoteObject:
    """The :class:`RemoteObject` of ``url`` made with ``options`` and kept for this process's readers.

    The file handle that opens ``url`` registers it; readers find it with :func:`remote_object`.
    One set of options per URL and process: the last open's.

    Examples
    --------
    >>> register("s3://bucket/x.h5", cache_dir=None).url
    's3://bucket/x.h5'
    """
    with _OBJECTS_LOCK:
        obj = _OBJECTS.get(url)
        if obj is None or obj.options() != RemoteObject(url, **options).options():
            obj = _OBJECTS[url] = RemoteObject(url, **options)
        return obj


def remote_object(url: str) -> RemoteObject:
    """This process's :class:`RemoteObject` of ``url`` (the environment's defaults if no open registered one)."""
    with _OBJECTS_LOCK:
        obj = _OBJECTS.get(url)
        if obj is None:
            obj = _OBJECTS[url] = RemoteObject(url)
        return obj


def replaced(url: str) -> None:
    """Say that this process replaced the object at ``url`` (``h5store.publish``): its
    registered :class:`RemoteObject` forgets the size and ETag it had, and asks again (one
    HEAD) at its next use, so the next open reads the new object.

    Examples
    --------
    >>> replaced("s3://bucket/x.h5")
    """
    with _OBJECTS_LOCK:
        obj = _OBJECTS.get(url)
        if obj is not None:
            obj._head = obj._match = None
