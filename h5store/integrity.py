"""Verify an h5store file: its structure, ids and indexes, and (deep) every item's CRC-32.

:func:`verify` opens a file read-only through the same layers every read uses
(:class:`~h5store.handle.FileHandle`, :func:`~h5store.storage.check_root`,
:class:`~h5store.storage.Column`) and reports every problem it finds, named by group,
feature and id, instead of stopping at the first: a report is falsy when anything is wrong.
A truncated file is diagnosed from its superblock (the end-of-file address HDF5 recorded)
and, when what remains can still be parsed, the report says which items were lost.

:func:`verify_in_subprocess` runs the same checks in a child process under memory and
time limits and returns the report as JSON: the way to look at files from strangers (see
``docs/reliability.md``; the checks for hostile files are in :mod:`h5store.safety`).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from typing import Any

import h5py

from h5store.advisories import H5StoreSecurityWarning
from h5store.checker import Checker, error_text
from h5store.errors import FormatError
from h5store.handle import FileHandle
from h5store.objstore import is_remote, remote_object
from h5store.pio import read_into
from h5store.safety import Limits, check_untrusted
from h5store.superblock import Superblock, read_superblock
from h5store.verify_report import Problem, VerifyReport

__all__ = [
    "H5StoreSecurityWarning",
    "Limits",
    "Problem",
    "VerifyReport",
    "check_untrusted",
    "verify",
    "verify_in_subprocess",
]

BLOCK_BYTES = 64 << 20


# --------------------------------------------------------------------------- verify
def verify(path: str | os.PathLike[str], deep: bool = True, untrusted: bool = False, max_errors: int = 1000, *,
           limits: Limits | None = None, block_bytes: int = BLOCK_BYTES, **remote: Any) -> VerifyReport:
    """Check a file and report every problem, by group, feature and id.

    Always: the file opens (a truncated one is diagnosed from its superblock, with the
    items lost), the root attributes and schema, every group's ids table (index bounds,
    each id's CRC-32, valid and unique ids, one row per id in every feature), every
    feature's index (shape, bounds, one row per fixed item, absent items), blob frames,
    and checksum lengths. By default (``deep=True``) every item's bytes are read, at most
    ``block_bytes`` at a time, and compared with its stored CRC-32; ``deep=False`` is the
    quick structure-only check, and its summary says that item data was not read.

    Parameters
    ----------
    path : str or Path
        The file.
    deep : bool
        Read every item and check its CRC-32 (reads the whole file once; the default).
        False: structure only, no item data read (a flipped data byte goes unseen).
    untrusted : bool
        First run :func:`~h5store.safety.check_untrusted`; a refusal is reported as
        ``fatal`` and nothing else is read. BEWARE: HDF5 still parses the file in this
        process; for files from strangers use :func:`verify_in_subprocess`.
    max_errors : int
        Problems kept in the report (all are counted).
    limits : Limits, optional
        For ``untrusted``; also bounds the tables read here.
    block_bytes : int
        Most bytes of items held in memory at once by a deep check.
    **remote
        For an ``s3://`` URL: ``storage_options``, ``timeout``, ``retries``... as for
        :func:`h5store.open`. A remote file is checked read-only through ranged GETs (the
        items' bytes as a batch reads them); problems name the URL.

    Returns
    -------
    VerifyReport
        Falsy when anything is wrong. Raises only ``FileNotFoundError`` (for a URL also
        :class:`~h5store.errors.RemoteError` when the store cannot be reached or refuses).

    Examples
    --------
    >>> report = verify("speech.h5", deep=True)  # doctest: +SKIP
    >>> bool(report), report.summary()  # doctest: +SKIP
    (True, 'speech.h5: OK: 1 group(s), 2 feature(s), 13100 id(s), 26200 item(s), ...')
    """
    path = os.fspath(path)
    if is_remote(path):
        return _verify_remote(path, deep, untrusted, max_errors, limits or Limits(), block_bytes, remote)
    if remote:
        raise TypeError(f"{path}: {sorted(remote)} apply to remote files (s3://) only")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    t0 = time.perf_counter()
    report = VerifyReport(path, deep=deep, untrusted=untrusted, max_errors=max_errors)
    limits = limits or Limits()
    size = os.path.getsize(path)
    sb = read_superblock(path) if size else None
    if isinstance(sb, Superblock) and sb.checksum_ok is not False and sb.eof > size:
        report.truncated = (size, sb.eof)
    handle = FileHandle(path, "r")
    try:
        try:
            f = handle.file
        except FormatError as e:
            if report.truncated is not None and not untrusted:
                _salvage(report, path, size, report.truncated[1], limits, block_bytes)
            else:
                report.fatal = _open_failure(path, size, sb, e)
            return report
        Checker(report, f, path, limits, block_bytes, lost_after=None).run()
    finally:
        handle.close()
        report.seconds = time.perf_counter() - t0
    return report


def _verify_remote(url: str, deep: bool, untrusted: bool, max_errors: int, limits: Limits, block_bytes: int,
                   remote: dict[str, Any]) -> VerifyReport:
    """:func:`verify` of an object in a store: the same pass, read through ranged GETs."""
    t0 = time.perf_counter()
    report = VerifyReport(url, deep=deep, untrusted=untrusted, max_errors=max_errors)
    handle = FileHandle(url, "r", **remote)  # a missing object or a refused key raises, naming the URL
    try:
        try:
            f = handle.file
        except FormatError as e:
            report.fatal = str(e)  # a truncated object: HDF5 refuses it (its end-of-file address lies past the end)
            return report
        size = remote_object(url).size  # the object the handle registered: its HEAD's answer
        Checker(report, f, url, limits, block_bytes, lost_after=None, file_size=size).run()
    finally:
        handle.close()
        report.seconds = time.perf_counter() - t0
    return report


def _open_failure(path: str, size: int, sb: Superblock | str | None, e: BaseException) -> str:
    if size == 0:
        return f"{path}: empty file (0 bytes), not an HDF5 file"
    if isinstance(sb, str):
        return f"{path}: {sb}"
    if sb is not None and sb.checksum_ok is False:
        return f"{path}: the superblock fails its checksum: the file is damaged"
    return str(e)


class _PaddedFile(io.RawIOBase):
    """A truncated file, read-only, extended with zeros to the size its superblock records.

    HDF5 refuses to open a file shorter than its end-of-file address. Through this view it
    opens, so the objects and chunks that lie before the cut can be checked; whatever lay
    past it reads as zeros, which every checksummed structure and every item's CRC-32 rejects.
    """

    def __init__(self, path: str, size: int) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)
        self._real = os.fstat(self._fd).st_size
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        got = read_into(self._fd, view[: max(0, min(n, self._real - self._pos))], self._pos)
        view[got:n] = bytes(n - got)
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def _salvage(report: VerifyReport, path: str, size: int, eof: int, limits: Limits, block_bytes: int) -> None:
    view = _PaddedFile(path, eof)
    try:
        try:
            f = h5py.File(view, "r")
        except Exception as e:  # noqa: BLE001 - whatever HDF5 says, what remains is unreadable
            report.fatal = f"what remains cannot be opened ({error_text(e)})"
            return
        try:
            Checker(report, f, path, limits, block_bytes, lost_after=size).run()
        finally:
            f.close()  # before the view: HDF5 must never call into a closed file object
    finally:
        view.close()



# --------------------------------------------------------------------------- subprocess
_MARK = "H5STORE-VERIFY-REPORT "
_CHILD = """
import json, sys
args = json.loads(sys.argv[1])
from h5store.integrity import _child_main
sys.exit(_child_main(args))
"""


def _child_main(args: dict[str, Any]) -> int:
    """Body of the child process of :func:`verify_in_subprocess` (limits, verify, JSON out)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if args.get("max_memory"):
        base = 0
        try:
            with open("/proc/self/statm") as fh:
                base = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        cap = base + int(args["max_memory"])
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if args.get("timeout"):
        cpu = int(args["timeout"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", H5StoreSecurityWarning)
        try:
            report = verify(args["path"], deep=args["deep"], untrusted=args["untrusted"],
                            max_errors=args["max_errors"], block_bytes=args["block_bytes"])
        except MemoryError:
            report = VerifyReport(args["path"], deep=args["deep"], untrusted=args["untrusted"],
                                  max_errors=args["max_errors"])
            report.fatal = (f"{args['path']}: verification needs more than the {args['max_memory']} bytes of memory "
                            "it may use: refused")
        except FileNotFoundError as e:
            report = VerifyReport(args["path"], deep=args["deep"], untrusted=args["untrusted"],
                                  max_errors=args["max_errors"])
            report.fatal = str(e)
    report.notes.extend(str(w.message) for w in caught if issubclass(w.category, H5StoreSecurityWarning))
    sys.stdout.write(_MARK + json.dumps(report.to_dict()) + "\n")
    sys.stdout.flush()
    return 0


def verify_in_subprocess(path: str | os.PathLike[str], deep: bool = True, untrusted: bool = True, *,
                         timeout: float = 300.0, max_memory: int = 2 << 30, max_errors: int = 1000,
                         block_bytes: int = BLOCK_BYTES) -> VerifyReport:
    """:func:`verify` in a fresh child process limited in memory and time.

    HDF5 parses a file in C: a crafted file can crash it, make it loop, or make it allocate
    without bound, and some published CVEs (see :mod:`h5store.safety`) are memory
    corruption. Here that happens to a child: its address space is capped by
    ``RLIMIT_AS`` (``max_memory`` bytes beyond the interpreter and its imports), its CPU
    time by ``RLIMIT_CPU``, and it is killed after ``timeout`` seconds. The report comes
    back as JSON (never a pickle); a crash, a kill or an exhausted limit becomes the
    report's ``fatal`` reason.

    Parameters
    ----------
    path : str or Path
        The file.
    deep, untrusted, max_errors, block_bytes
        As for :func:`verify`; ``untrusted`` defaults to True here.
    timeout : float
        Seconds before the child is killed.
    max_memory : int
        Bytes the verification may allocate.

    Returns
    -------
    VerifyReport
        Falsy when the file has problems or could not be checked safely.

    Examples
    --------
    >>> report = verify_in_subprocess("download.h5", deep=True, timeout=60)  # doctest: +SKIP
    >>> if not report:  # doctest: +SKIP
    ...     raise SystemExit(report.summary())
    """
    path = os.fspath(path)
    if not is_remote(path) and not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    args = dict(path=path, deep=deep, untrusted=untrusted, max_errors=max_errors,
                block_bytes=block_bytes, max_memory=max_memory, timeout=timeout)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        failed = VerifyReport(path, deep=deep, untrusted=untrusted, max_errors=max_errors)
        failed.fatal = (f"{path}: verification did not finish within {timeout:g} s and was killed "
                        "(a damaged or hostile file can make HDF5 loop): refused")
        return failed
    report = _child_report(path, proc.returncode, proc.stdout, proc.stderr, max_memory)
    report.deep, report.untrusted, report.max_errors = deep, untrusted, max_errors
    for note in report.notes:
        warnings.warn(note, H5StoreSecurityWarning, stacklevel=2)
    return report


def _child_report(path: str, returncode: int, stdout: bytes, stderr: bytes, max_memory: int = 0) -> VerifyReport:
    """The report a verifying child printed, or one saying how the child failed."""
    out = stdout.decode("utf-8", "replace")
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(_MARK)), None)
    if returncode == 0 and line is not None:
        return VerifyReport.from_dict(json.loads(line[len(_MARK) :]))
    if returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"was killed by signal {-returncode}"
    else:
        how = f"exited with status {returncode}"
    tail = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    # Measured: HDF5 may crash (SIGSEGV) instead of failing cleanly when RLIMIT_AS denies it memory.
    memory = f", or when denied more than {max_memory} bytes of memory" if max_memory and returncode < 0 else ""
    failed = VerifyReport(path)
    failed.fatal = (f"{path}: the verifying process {how} (HDF5 cannot parse this file safely{memory}; never "
                    f"open it in-process){': ' + tail[0][:200] if tail[0] else ''}")
    return failed
