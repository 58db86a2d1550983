"""Publishing to object storage: ``create`` onto an ``s3://`` target, and :func:`push`.

An object in S3 (and its compatibles) appears only when its upload completes: a single
``PutObject`` is atomic, and a multipart upload becomes visible at
``CompleteMultipartUpload``, never before. So a file is built locally, in a temporary folder
(``TMPDIR``), then uploaded, and a reader sees the old object or the whole new one, never a
half-uploaded one:

- Files up to ``part_bytes`` go up in one ``PutObject``; larger ones as a multipart upload
  of ``part_bytes`` parts (at least 5 MiB, S3's minimum), ``concurrency`` at a time, read
  from the file as they are sent (memory: ``concurrency * part_bytes``). Every request
  carries its body's MD5 (``Content-MD5``), which the store checks.
- A failed or interrupted upload (an error, ``KeyboardInterrupt``) aborts its multipart
  upload: nothing becomes visible, an old object at the URL stays. A process killed outright
  (``SIGKILL``) leaves an incomplete multipart upload, invisible to readers, that the
  bucket's lifecycle rule ``AbortIncompleteMultipartUpload`` removes (``docs/remote.md``).
- Afterwards the object's size and ETag (the MD5 of the file, or of its parts' MD5s with
  ``-N`` for N parts, computed while reading them) are checked against the file.

An existing object is replaced only with ``overwrite=True`` (``mode="w"`` for ``create``),
else :class:`~h5store.errors.TargetExistsError` names the URL, before anything is built.

A sharded dataset goes up the same way, file by file, with this module's parts
(:func:`h5store.shards.push_sharded`; a sharded ``create`` onto ``s3://`` builds its folder in
``TMPDIR`` first): every shard, then the manifest ``index.json`` last, so a reader never finds
a manifest naming a shard that is not there yet.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from h5store.errors import (
    FormatError,
    ReadOnlyError,
    RemoteDenied,
    RemoteError,
    RemoteNotFound,
    TargetExistsError,
)
from h5store.integrity import verify
from h5store.objstore import RemoteObject, is_remote, replaced, split_url

if TYPE_CHECKING:
    from h5store.typed_file import TypedFile

__all__ = ["MIN_PART_BYTES", "PART_BYTES", "ShardedUpload", "Upload", "create_remote", "push", "upload"]

PART_BYTES = 64 << 20  # a multipart upload's part (and the largest file sent in one PutObject)
MIN_PART_BYTES = 5 << 20  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's most parts per upload
_TMP_PREFIX = "h5store-publish-"


@dataclass(frozen=True)
class Upload:
    """What an upload did: the URL, its size, ETag, number of parts and seconds."""

    url: str
    size: int
    etag: str
    parts: int
    seconds: float
    etag_checked: bool = True

    def summary(self) -> str:
        """One line, as ``h5store push`` prints it."""
        how = f"{self.parts} parts" if self.parts > 1 else "one request"
        checked = "size and ETag checked" if self.etag_checked else "size checked (the store's ETag is no MD5 here)"
        return (f"{self.url}: uploaded {self.size / 1e6:,.1f} MB in {how} in {self.seconds:.1f} s "
                f"(ETag {self.etag}; {checked})")


@dataclass(frozen=True)
class ShardedUpload:
    """What the upload of a sharded dataset did: the manifest's URL and each file's :class:`Upload`
    (the shards in the manifest's order, then ``index.json``)."""

    url: str
    uploads: tuple[Upload, ...]
    seconds: float

    @property
    def size(self) -> int:
        return sum(u.size for u in self.uploads)

    @property
    def parts(self) -> int:
        return sum(u.parts for u in self.uploads)

    def summary(self) -> str:
        """One line, as ``h5store push`` and ``h5store create --shard-size`` print it."""
        checked = ("sizes and ETags checked" if all(u.etag_checked for u in self.uploads)
                   else "sizes checked (the store's ETags are no MD5 here)")
        return (f"{self.url}: uploaded {len(self.uploads) - 1} shards, then the manifest, {self.size / 1e6:,.1f} MB "
                f"in {self.parts} requests in {self.seconds:.1f} s ({checked})")


# --------------------------------------------------------------------------- checks
def _check_local(path: str, deep: bool) -> None:
    """Refuse what is not a readable, undamaged h5store file, in one line naming it."""
    if os.path.isdir(path):
        raise FileNotFoundError(f"{path}: a folder, not a file; a sharded dataset's folder goes up with "
                                "`h5store push FOLDER URL` (h5store.shards.push_sharded)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    report = verify(path, deep=deep)
    if not report:
        first = report.fatal or (str(report.problems[0]) if report.problems else report.summary())
        if not first.startswith(path):
            first = f"{path}: {first}"
        more = f" (and {report.n_problems - 1} more problems)" if report.n_problems > 1 else ""
        raise FormatError(f"{first}{more}; not uploaded: check it with `h5store verify {path}`")


def _denied(url: str, doing: str) -> RemoteDenied:
    err = RemoteDenied(None, f"{url}: access denied (HTTP 401/403) {doing}: check the credentials "
                       "(AWS_ACCESS_KEY_ID / AWS_PROFILE / storage_options) and the bucket policy (s3:PutObject)")
    err.filename = url
    return err


def _no_bucket(url: str) -> RemoteNotFound:
    bucket, _ = split_url(url)
    err = RemoteNotFound(None, f"{url}: no such bucket {bucket!r} (HTTP 404): create it first, or check the "
                         "endpoint (AWS_ENDPOINT_URL)")
    err.filename = url
    return err


def _target(url: str, overwrite: bool, obj: RemoteObject, how: str = "overwrite=True") -> None:
    """Before anything is built or sent: the bucket exists, and an existing object at ``url``
    is replaced only with ``overwrite``."""
    try:
        obj.head(refresh=True)
    except RemoteNotFound:
        bucket, _ = split_url(url)
        fs = obj.store()
        try:
            _run(fs, fs._call_s3("head_bucket", Bucket=bucket), timeout=obj.retry_timeout)
        except FileNotFoundError:
            raise _no_bucket(url) from None
        except PermissionError:
            pass  # allowed to write objects, not to look at the bucket: the upload will tell
        except Exception as e:  # noqa: BLE001 - mapped as reads' failures are
            raise obj._failed(e) from None
        return
    except RemoteDenied:
        raise _denied(url, "looking whether the object exists") from None
    except RemoteError as e:
        err = RemoteError(None, f"{url}: the store did not answer whether the object exists "
                          f"({str(e).partition('(')[2].rpartition(')')[0] or e}); nothing was sent: "
                          "check the endpoint (AWS_ENDPOINT_URL / storage_options) and the network")
        err.filename = url
        raise err from None
    if not overwrite:
        raise _exists(url, how)


def _exists(url: str, how: str, when: str = "already exists") -> TargetExistsError:
    return TargetExistsError(f"{url} {when}: pass {how} to replace it (readers see the old object until the new "
                             "one is whole)")


# --------------------------------------------------------------------------- the upload
def _run(fs: Any, coro: Any, timeout: float | None = None) -> Any:
    """Run ``coro`` on s3fs's event loop and wait; interrupted here (Ctrl-C), it is
    cancelled there, which aborts a multipart upload in progress."""
    fut = asyncio.run_coroutine_threadsafe(coro, fs.loop)
    try:
        return fut.result(timeout)
    except BaseException:
        if not fut.done():
            fut.cancel()
            concurrent.futures.wait([fut], timeout=30)
        raise


def _md5(data: bytes) -> tuple[bytes, str]:
    d = hashlib.md5(data, usedforsecurity=False).digest()
    return d, base64.b64encode(d).decode()


async def _send(fs: Any, bucket: str, key: str, fd: int, size: int, part_bytes: int,
                concurrency: int, if_absent: bool = False) -> tuple[str, int]:
    """Upload the file open as ``fd``; the ETag it must get and the number of parts. With
    ``if_absent``, the store is asked to refuse it if an object is at the key by then
    (``If-None-Match: *`` on the put or the multipart completion)."""
    loop = asyncio.get_running_loop()
    cond = {"IfNoneMatch": "*"} if if_absent else {}
    if size <= part_bytes:
        body = await loop.run_in_executor(None, os.pread, fd, size, 0)
        if len(body) != size:
            raise OSError(f"read {len(body)} of {size} bytes: the file shrank while it was uploaded")
        d, b64 = _md5(body)
        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=body, ContentMD5=b64, **cond)
        return d.hex(), 1
    n = -(-size // part_bytes)
    digests: list[bytes] = [b""] * n
    etags: list[str] = [""] * n
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = mpu["UploadId"]
    slots = asyncio.Semaphore(concurrency)

    def read(i: int) -> tuple[bytes, bytes, str]:  # in a thread: hashing releases the GIL, off the event loop
        want = min(part_bytes, size - i * part_bytes)
        data = os.pread(fd, want, i * part_bytes)
        if len(data) != want:
            raise OSError(f"part {i + 1}: read {len(data)} of {want} bytes: the file shrank while it was uploaded")
        return (data, *_md5(data))

    async def part(i: int) -> None:
        async with slots:  # at most `concurrency` parts in memory
            data, digests[i], b64 = await loop.run_in_executor(None, read, i)
            got = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                    PartNumber=i + 1, Body=data, ContentMD5=b64)
            etags[i] = got["ETag"]

    tasks = [asyncio.ensure_future(part(i)) for i in range(n)]
    try:
        try:
            await asyncio.gather(*tasks)
        finally:  # one failed part (or a cancel) stops the others before the abort
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": etags[i]} for i in range(n)]},
                          **cond)
    except BaseException:
        # Failed, or cancelled (an interrupt): nothing becomes visible, nothing is left billed.
        with contextlib.suppress(Exception):
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        raise
    return hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{n}", n


def _upload_failed(url: str, e: BaseException) -> RemoteError:
    if isinstance(e, RemoteError):
        return e
    if isinstance(e, PermissionError):
        return _denied(url, "uploading")
    if isinstance(e, FileNotFoundError):
        return _no_bucket(url)
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    err = RemoteError(None, f"{url}: the upload failed ({type(e).__name__}: {text}); nothing was published "
                      "(an object already there is unchanged): check the store and try again")
    err.filename = url
    return err


def _not_implemented(e: BaseException) -> bool:
    """The store answered 501 NotImplemented (an S3-compatible store without conditional writes)."""
    cause = e.__cause__ if e.__cause__ is not None else e
    resp = getattr(cause, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    return isinstance(e, NotImplementedError) or code == "NotImplemented" or \
        resp.get("ResponseMetadata", {}).get("HTTPStatusCode") == 501


def _upload(path: str, obj: RemoteObject, part_bytes: int, concurrency: int, if_absent: bool = False) -> Upload:
    """Upload ``path`` to ``obj``; with ``if_absent``, refused (:class:`TargetExistsError`,
    nothing replaced) when an object appeared at the key since it was checked."""
    url = obj.url
    if part_bytes < MIN_PART_BYTES:
        raise ValueError(f"part_bytes={part_bytes}: S3 parts are at least {MIN_PART_BYTES} bytes (5 MiB)")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if -(-size // part_bytes) > MAX_PARTS:
            part_bytes = -(-size // MAX_PARTS)
        fs = obj.store()
        try:
            try:
                want, parts = _run(fs, _send(fs, obj.bucket, obj.key, fd, size, part_bytes, concurrency, if_absent))
            except Exception as e:
                if not (if_absent and _not_implemented(e)):
                    raise
                # A store without conditional writes (If-None-Match) refused the request whole:
                # nothing was replaced. The existence check just before is then all there is.
                _target(url, False, obj)
                want, parts = _run(fs, _send(fs, obj.bucket, obj.key, fd, size, part_bytes, concurrency))
        except Exception as e:
            if isinstance(e, TargetExistsError):
                raise
            if if_absent and (isinstance(e, FileExistsError) or RemoteObject._precondition_failed(e)):
                raise _exists(url, "overwrite=True", "appeared while this upload ran; it is unchanged") from None
            raise _upload_failed(url, e) from None
    finally:
        os.close(fd)
    try:
        head = _run(fs, fs._call_s3("head_object", Bucket=obj.bucket, Key=obj.key), timeout=obj.retry_timeout)
    except Exception as e:  # noqa: BLE001
        raise obj._failed(e) from None
    got_size, etag = int(head["ContentLength"]), str(head.get("ETag", "")).strip('"')
    encrypted = head.get("ServerSideEncryption") == "aws:kms" or "SSECustomerAlgorithm" in head
    if got_size != size or (etag != want and not encrypted):
        err = RemoteError(None, f"{url}: the store holds {got_size} bytes with ETag {etag}, the upload of "
                          f"{path} sent {size} bytes with ETag {want}: another writer replaced it meanwhile, "
                          "or the store changed the bytes; do not use it, upload again")
        err.filename = url
        raise err
    replaced(url)  # this process's next open of the URL reads the new object
    return Upload(url, size, etag, parts, time.perf_counter() - t0, etag_checked=not encrypted)


def upload(path: str | os.PathLike[str], url: str, *, overwrite: bool = False, part_bytes: int = PART_BYTES,
           concurrency: int = 4, storage_options: dict[str, Any] | None = None, timeout: float = 120.0,
           retries: int = 4) -> Upload:
    """Upload a local file to ``url`` atomically, without checking what it holds (see :func:`push`).

    Parameters are those of :func:`push`, less ``deep``.

    Examples
    --------
    >>> upload("speech.h5", "s3://bucket/speech.h5", overwrite=True).parts  # doctest: +SKIP
    1
    """
    path = os.fspath(path)
    obj = _remote(url, storage_options, timeout, retries)
    _target(url, overwrite, obj)
    return _upload(path, obj, part_bytes, concurrency, if_absent=not overwrite)


_CLIENTS: dict[tuple[int, str, float, int], Any] = {}  # (pid, options, timeout, retries) -> s3fs client


def _remote(url: str, storage_options: dict[str, Any] | None, timeout: float, retries: int) -> RemoteObject:
    """The object at ``url`` for an upload, on this process's client for these options (making
    a client costs ~0.4 s: uploads in a loop share one)."""
    if not is_remote(url):
        raise ValueError(f"{url}: not an object URL; write s3://BUCKET/KEY")
    split_url(url)  # a bucket and a key
    obj = RemoteObject(url, storage_options=storage_options, timeout=timeout, retries=retries,
                       retry_timeout=max(60.0, timeout))
    key = (os.getpid(), repr(sorted((storage_options or {}).items())), float(timeout), int(retries))
    if key not in _CLIENTS:
        _CLIENTS[key] = obj.store()
    obj._store, obj._pid = _CLIENTS[key], os.getpid()  # the client RemoteObject.store() would make
    return obj


def push(path: str | os.PathLike[str], url: str, *, overwrite: bool = False, deep: bool = False,
         part_bytes: int = PART_BYTES, concurrency: int = 4, storage_options: dict[str, Any] | None = None,
         timeout: float = 120.0, retries: int = 4) -> Upload:
    """Upload an existing h5store file to object storage (``h5store push FILE URL``); a sharded
    dataset's folder goes up with :func:`h5store.shards.push_sharded` (``h5store push FOLDER URL``).

    The file is checked first (``h5store verify --quick``: it opens, its schema, ids and
    indexes hold; with ``deep`` also every item's CRC-32): a foreign or damaged file is
    refused with :class:`~h5store.errors.FormatError` naming it, and nothing is sent. Then it
    is uploaded so that readers see the old object or the whole new one (module docstring),
    and the object's size and ETag are checked against the file.

    Parameters
    ----------
    path : str or Path
        The local h5store file.
    url : str
        ``s3://bucket/key``; the bucket must exist.
    overwrite : bool
        Replace an object already at ``url`` (else :class:`~h5store.errors.TargetExistsError`).
    deep : bool
        Also check every item's CRC-32 before uploading (reads the whole file once).
    part_bytes : int
        Files larger than this go up as a multipart upload of parts this size (>= 5 MiB).
    concurrency : int
        Parts in flight at once.
    storage_options : dict, optional
        s3fs's arguments (``endpoint_url``, ``key``, ``secret``...) over the ``AWS_*``
        environment, as for reads (``docs/remote.md``).
    timeout : float
        Seconds one request may take (a part's upload included).
    retries : int
        Retries of a request that failed with 5xx, a dropped connection or a timeout.

    Returns
    -------
    Upload
        The URL, size, ETag, number of parts and seconds.

    Examples
    --------
    >>> push("speech.h5", "s3://bucket/speech.h5").summary()  # doctest: +SKIP
    's3://bucket/speech.h5: uploaded 120.4 MB in 2 parts in 1.9 s (ETag 5d41...-2; size and ETag checked)'
    """
    path = os.fspath(path)
    obj = _remote(url, storage_options, timeout, retries)
    _check_local(path, deep)
    _target(url, overwrite, obj)
    return _upload(path, obj, part_bytes, concurrency, if_absent=not overwrite)


# --------------------------------------------------------------------------- create
def _host_tag() -> str:
    """This machine's name as it goes into build folders' names (no ``-``: the next field is the pid)."""
    return "".join(c if c.isalnum() or c == "." else "_" for c in socket.gethostname()) or "host"


_LOCK_NAME = ".h5store-build.lock"


def _clean_stale(folder: str) -> None:
    """Remove the build folders of publishing processes that died (killed mid-create).

    TMPDIR may be shared by several machines (a Dask cluster's shared filesystem): a folder
    is removed only when its name carries this machine's name *and* nobody holds the
    ``flock`` that its create takes for its whole life. The lock (released by the kernel
    however the process ended) is the proof of death; a pid's absence from ``/proc`` is
    not (another PID namespace, a container, shows other pids). The host name guards a
    filesystem whose locks are not seen across machines. A folder whose lock file is not
    there yet (a create between making it and locking it) counts as alive while its pid is.
    """
    mine = f"{_TMP_PREFIX}{_host_tag()}-"
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if not name.startswith(mine):
                continue  # another machine's, or an older h5store's: never removed here
            path = os.path.join(folder, name)
            pid = name[len(mine):].partition("-")[0]
            try:
                fd = os.open(os.path.join(path, _LOCK_NAME), os.O_RDWR)
            except FileNotFoundError:
                if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                    shutil.rmtree(path, ignore_errors=True)
                continue
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: a create is running
            else:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)


def _build_folder(tmp: str) -> tuple[str, int]:
    """A fresh build folder in ``tmp`` (dead creates' folders removed first) and the fd of the
    lock that marks it in use: hold it until the folder is removed, then close it."""
    _clean_stale(tmp)
    folder = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{_host_tag()}-{os.getpid()}-", dir=tmp)
    part = os.path.join(folder, _LOCK_NAME + ".new")
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.replace(part, os.path.join(folder, _LOCK_NAME))  # seen by cleaners only once held
    except BaseException:
        os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, fd


def _keep_build(local: str, tmp: str, url: str, e: BaseException) -> None:
    """Move a built file (or a sharded dataset's folder) whose upload failed out of the folder
    about to be removed, and say in ``e``'s message where it is and how to upload it."""
    folder = os.path.isdir(local)
    try:
        if folder:
            kept = tempfile.mkdtemp(prefix="h5store-unpublished-", suffix=f"-{os.path.basename(local)}", dir=tmp)
            os.rmdir(kept)  # the name, taken; the built folder moves there
        else:
            fd, kept = tempfile.mkstemp(prefix="h5store-unpublished-", suffix=f"-{os.path.basename(local)}", dir=tmp)
            os.close(fd)
        os.replace(local, kept)
    except OSError:
        return
    what = "sharded dataset (shards and index.json)" if folder else "file"
    _add_to_message(e, f"; the built {what} is kept at {kept}: upload it with `h5store push {kept} {url}`, then "
                       "delete it")


def _add_to_message(e: BaseException, note: str) -> None:
    """Append ``note`` to what ``str(e)`` says (the CLI prints that line)."""
    if isinstance(e, OSError) and e.strerror:
        e.strerror = f"{e.strerror}{note}"
    elif len(e.args) == 1 and isinstance(e.args[0], str):
        e.args = (f"{e.args[0]}{note}",)
    else:
        e.add_note(note.lstrip("; "))


def _build_and_upload(name: str, build: Callable[[str], Any], upload: Callable[[str], Any], url: str,
                     built_whole: str, room_for: str) -> tuple[Any, Any]:
    """``build(local)`` in a fresh build folder in ``TMPDIR`` (``local`` = ``folder/name``), then
    ``upload(local)``; the folder is removed afterwards, whatever happened.

    What an ``s3://`` create (one file or sharded) shares: a full ``TMPDIR`` names itself in
    the error (``"<built_whole> in TMPDIR (...) before the upload: point TMPDIR at a disk with
    room for <room_for>"``), and a build whose upload failed is kept there
    (``h5store-unpublished-*``) with the ``h5store push`` command for ``url`` in the error.
    Returns the build's ``.report`` and what ``upload`` returned.

    Examples
    --------
    >>> report, done = _build_and_upload("speech.h5", lambda p: Speech.create(p, "wavs/"),  # doctest: +SKIP
    ...                                 lambda p: push(p, "s3://b/speech.h5"), "s3://b/speech.h5",
    ...                                 "s3://b/speech.h5 is built whole", "the whole file")
    """
    tmp = tempfile.gettempdir()
    folder, lock = _build_folder(tmp)
    try:
        local = os.path.join(folder, name)
        try:
            built = build(local)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                _add_to_message(e, f"; {built_whole} in TMPDIR ({tmp}) before the upload: point TMPDIR at a disk with "
                                   f"room for {room_for} (TMPDIR=/big/tmp)")
            raise
        report = getattr(built, "report", None)
        built.close()
        try:
            done = upload(local)
        except BaseException as e:
            _keep_build(local, tmp, url, e)  # hours of create are not lost to a network error
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)
    return report, done


def create_remote(cls: type[TypedFile], url: str, build: Callable[[str], TypedFile], *, mode: str | None,
                  resume: bool, storage_options: dict[str, Any] | None = None,
                  part_bytes: int = PART_BYTES) -> TypedFile:
    """``create`` onto ``s3://``: ``build(local_path)`` in a temporary folder, upload, open remotely.

    Called by :func:`h5store.ingest.create` for an ``s3://`` target. The temporary folder is
    made in ``TMPDIR`` (:func:`tempfile.gettempdir`; it needs room for the whole file) and
    removed afterwards, whatever happened; folders left by killed creates are removed by the
    next one. When the build succeeded but its upload failed, the built file is kept in
    ``TMPDIR`` (``h5store-unpublished-*``) and the error says where, for ``h5store push``. ``mode="a"`` and ``resume=True`` are refused: both would need the object
    downloaded and a partial file kept across runs; do them on a local file, then
    :func:`push` it.

    Returns
    -------
    TypedFile
        The uploaded file opened read-only from ``url``, with ``.report`` (the create's) and
        ``.upload`` (:class:`Upload`).

    Examples
    --------
    >>> f = Speech.create("s3://bucket/speech.h5", sources="wavs/")  # doctest: +SKIP
    >>> f.upload.parts, f.path  # doctest: +SKIP
    (3, 's3://bucket/speech.h5')
    """
    if mode == "a":
        raise ReadOnlyError(f'{url}: mode="a" is not supported for an s3:// target (an object cannot be appended '
                            'to in place): create or append to a local file, then `h5store push FILE URL --overwrite`')
    if resume:
        raise ValueError(f"{url}: resume=True is not supported for an s3:// target (its partial file lives in a "
                         "temporary folder removed when create ends): create locally with resume=True, then "
                         "`h5store push FILE URL`")
    obj = _remote(url, storage_options, 120.0, 4)
    _target(url, mode == "w", obj, 'mode="w"')  # before the build: a refusal costs nothing

    def upload(local: str) -> Upload:
        # Again now, after a build of maybe hours: an object published meanwhile is not
        # replaced (and the store itself refuses, with If-None-Match, one put in between).
        _target(url, mode == "w", obj, 'mode="w"')
        return _upload(local, obj, part_bytes, 4, if_absent=mode != "w")

    report, done = _build_and_upload(os.path.basename(obj.key), build, upload, url,
                                    f"{url} is built whole", "the whole file")
    out = cls(url, mode="r", **({"storage_options": storage_options} if storage_options else {}))
    out.report = report  # type: ignore[attr-defined]
    out.upload = done  # type: ignore[attr-defined]
    return out


def _delete(obj: RemoteObject, doing: str) -> None:
    """Delete the object (gone already: nothing to do); refused: :class:`RemoteDenied` saying ``doing``."""
    fs = obj.store()
    try:
        _run(fs, fs._call_s3("delete_object", Bucket=obj.bucket, Key=obj.key), timeout=obj.retry_timeout)
    except FileNotFoundError:
        pass
    except PermissionError:
        raise _denied(obj.url, doing) from None
    except Exception as e:  # noqa: BLE001 - mapped as reads' failures are
        raise obj._failed(e) from None
    replaced(obj.url)
