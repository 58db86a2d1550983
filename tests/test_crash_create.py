"""SIGKILL at random moments of ``create``: the target is the previous file or the new one, never a mix.

What this proves (the reliability acceptance criterion): a create killed with SIGKILL at a
random moment (start-up, loading, one of its ~10 periodic commits of the partial file, the
final commit / fsync / ``os.replace`` / directory fsync, or after it returned) leaves at the
target path either the previous file (byte for byte, verify-clean) or the complete new file
(verify-clean, every id and value equal to an uninterrupted reference create), never anything
else; and ``resume=True`` from the partial file the kill left then finishes with exactly the
reference content, verify-clean, with no partial, journal or writer-lock file left behind.

Each of the 100 trials is a real child process, killed by a real SIGKILL while it runs the real
``PacedNums.create(...)``. The children are forked from a zygote: one helper process per test
run (``python -c ZYGOTE``) that imports numpy, h5py, h5store, joblib, tqdm and the schemas once
(a fresh interpreter per trial spent ~0.55 CPU-seconds on that alone), sets
``h5store.ingest._COMMIT_SECONDS = 0.01`` and then only obeys commands on its stdin; it opens no
file, so no HDF5 handle crosses a fork (h5store's ``register_at_fork`` hook has nothing to do).
On ``fork`` it forks a child, which calls ``os.setsid()`` (its own process group: ``os.killpg``
reaches it with its loky workers and resource tracker), says its pid, starts its loky pool when
``n_workers=2`` (fresh worker interpreters, as in any create), says ``ready``, waits for ``go``
(relayed by the zygote through a pipe), says ``start`` and runs the create with a 0.5 ms load
delay per source, so that it lasts a few tenths of a second. A child says each one-line message,
tagged with its number, in one ``write`` to the zygote's stdout, so lines never mix. The test
waits for ``start``, sleeps a random time in ``[0, T]`` and SIGKILLs the child's process group;
it waits until no process of the group is alive, then has the zygote reap the child
(``os.waitpid``: the zygote reaps only when asked, so the group id cannot be reused while the
test may still signal it) and waits for its ``exit`` report before it looks at the disk.
``T`` is 1.3 x the median of uninterrupted child creates measured first, corrected when the
machine's load drifts; a quarter of the trials aim at the end of the create, where the final
commit and the rename happen. Mostly ``n_workers=1``; 10 trials use ``n_workers=2`` (the child
starts its pool before the clock). Children are forked a few trials ahead, so their pools start
while the trials before them run. The trials alternate between two folders: right after a kill
the test lists the folder and compares the target with the previous file, then starts the next
trial in the other folder while a checker thread runs the slow checks (verify, content, resume)
and puts the previous file back; the kill times stay those of the schedule (the summary gives
how late the kills were sent).

Reproduce: every failure message starts with ``seed=... trial=...``. Run
``H5STORE_CRASH_SEED=<seed> H5STORE_CRASH_TRIAL=<trial> pytest tests/test_crash_create.py -s``
to replay that trial alone (same n_workers and kill time as a fraction of ``T``; ``T`` is
measured again, so the kill lands at about the same stage of the create);
``H5STORE_CRASH_SEED`` alone replays the whole schedule. The summary line (``-s``) gives
the outcome counts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict, deque
from pathlib import Path

import numpy as np
import pytest

from h5store.integrity import verify
from tests.ingest_schemas import PacedNums

ROOT = Path(__file__).resolve().parents[1]

# Trials by n_workers. With 2, the child starts its loky pool (which create reuses) before the
# clock: a cold pool takes seconds to start, and the kills would mostly hit its start-up.
TRIALS = {1: 90, 2: 10}
N_SOURCES = 120
LOAD_DELAY = 0.0005  # seconds per source, in the children only: a create of a few tenths of a second
COMMIT_SECONDS = 0.01  # the children's h5store.ingest._COMMIT_SECONDS: ~10 commits per create
PIPELINE = 2  # children forked ahead of the one running
POOL_AHEAD = 6  # children with a loky pool (~1 s to start) are forked this many steps ahead
MIN_EACH_OUTCOME = 5
# Trials of one n_workers after which T is corrected for a drifting machine load (and for the
# checker thread's load, which the calibration does not see): 5 for the 10 n_workers=2 trials.
ADAPT_EVERY = {1: 15, 2: 5}
MIN_RESUMES = 20
WORD_TIMEOUT = 120.0  # seconds without an expected message from a child: it hangs (or died)

# argv: ROOT, COMMIT_SECONDS. Commands on stdin, one JSON list per line:
#   ["fork", tag, target, src, n_workers, stderr_log]  fork child number `tag`
#   ["go", tag]                                        let it start its create
#   ["reap", tag]                                      os.waitpid it (the test killed it), say "<tag> exit <code>"
# EOF: kill and reap whatever is left, exit.
ZYGOTE = r"""
import json, os, signal, sys, time, traceback, warnings
sys.path.insert(0, sys.argv[1])
import h5store.ingest
import joblib, tqdm.auto  # create imports them: done here, once, before any fork
from tests.ingest_schemas import PacedNumbers, PacedNums
h5store.ingest._COMMIT_SECONDS = float(sys.argv[2])
# numpy's OpenBLAS keeps a thread, which survives fork through its own pthread_atfork
# handlers; Python >= 3.12 would warn about forking a multi-threaded process.
warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)


def say(text):
    os.write(1, (text + "\n").encode())  # one write of < PIPE_BUF bytes: never mixed with another


def child(tag, target, src, n_workers, log, go):
    os.setsid()  # before the pid is said: from then on killpg(pid) reaches everything it starts
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    os.close(err)
    say(f"{tag} pid {os.getpid()}")
    if n_workers > 1:  # start the loky pool (create reuses it) and import the schema in it
        joblib.Parallel(n_jobs=n_workers)(joblib.delayed(PacedNumbers.params)(PacedNumbers()) for _ in range(4))
    say(f"{tag} ready")
    if os.read(go, 1) != b"g":
        raise SystemExit("the zygote closed the go pipe")
    say(f"{tag} start")
    t0 = time.perf_counter()
    PacedNums.create(target, src, n_workers=n_workers, mode="w", progress=False).close()
    seconds = time.perf_counter() - t0
    sys.stdout.flush()  # anything create printed comes before "done" (and breaks the protocol)
    say(f"{tag} done {seconds:.6f}")


go_pipes, pids, buf = {}, {}, b""
while data := os.read(0, 65536):
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        cmd, tag, *args = json.loads(line)
        if cmd == "fork":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(w)
                    for fd in go_pipes.values():
                        os.close(fd)
                    child(tag, *args, r)
                except BaseException:
                    code = 1
                    traceback.print_exc()
                    say(f"{tag} failed")
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)  # never back into this loop, no atexit handler of the zygote
            os.close(r)
            go_pipes[tag], pids[tag] = w, pid
        elif cmd == "go":
            try:
                os.write(go_pipes[tag], b"g")
            except BrokenPipeError:
                pass  # it died: the test hears "failed" or nothing, not "start"
        elif cmd == "reap":
            os.close(go_pipes.pop(tag))
            _, status = os.waitpid(pids.pop(tag), 0)
            say(f"{tag} exit {os.waitstatus_to_exitcode(status)}")
        else:
            raise ValueError(f"unknown command {line!r}")
for pid in pids.values():  # the test is done (or gone): nothing it forked may outlive it
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.waitpid(pid, 0)
"""


def write_numbers(root: Path, n: int, offset: float, prefix: str) -> dict[str, np.ndarray]:
    """n .txt sources of 1 to 9 numbers in a few folders (names with spaces and unicode)."""
    expected = {}
    for i in range(n):
        folder = f"{prefix} {i % 3}"
        name = f"ütt {i:03d}" if i % 4 == 0 else f"utt-{i:03d}"
        values = (np.arange(i % 9 + 1, dtype=np.float32) * 0.5 + i + offset).astype(np.float32)
        p = root / folder / f"{name}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(" ".join(repr(float(v)) for v in values), encoding="utf-8")
        expected[f"{folder}/{name}"] = values
    return expected


def read_all(f: PacedNums) -> dict[str, np.ndarray]:
    return {i: f.nums[i] for i in f.ids}


def assert_content(f: PacedNums, reference: dict[str, np.ndarray], ctx: str) -> None:
    ids = list(f.ids)
    assert len(ids) == len(set(ids)), f"{ctx}: duplicate ids: {sorted(i for i, c in Counter(ids).items() if c > 1)}"
    assert sorted(ids) == sorted(reference), (
        f"{ctx}: ids differ from the reference: missing {sorted(set(reference) - set(ids))[:5]}, "
        f"extra {sorted(set(ids) - set(reference))[:5]}")
    for i, v in reference.items():
        got = f.nums[i]
        assert got.dtype == v.dtype, f"{ctx}: {i!r} dtype {got.dtype} != {v.dtype}"
        np.testing.assert_array_equal(got, v, err_msg=f"{ctx}: values of {i!r}")


def assert_verify_clean(path: Path, ctx: str) -> None:
    report = verify(path, deep=True)
    assert report, f"{ctx}: verify {path.name}:\n" + "\n".join(report.lines())


def live_group_members(pgid: int) -> list[int]:
    """Pids of living (not zombie) processes in process group ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(name))
    return out


class Zygote:
    """The helper process that has imported everything once and forks one child per create."""

    def __init__(self, log: Path) -> None:
        self.log = log
        env = dict(os.environ, H5STORE_TEST_LOAD_DELAY=str(LOAD_DELAY))  # inherited by children and their workers
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", ZYGOTE, str(ROOT), str(COMMIT_SECONDS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, env=env,
            )
        self.inbox: defaultdict[int, deque[list[str]]] = defaultdict(deque)  # messages by child tag
        self._rest = b""

    def send(self, *command: object) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise AssertionError(f"the zygote exited ({self.proc.wait(timeout=30)}); its stderr:\n{self.stderr()}") from None

    def receive(self, tag: int) -> list[str]:
        """The next message of child ``tag`` (those of the others are kept for them)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()  # read with os.read only: the buffered reader stays empty
        deadline = time.monotonic() + WORD_TIMEOUT
        while not self.inbox[tag]:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise AssertionError(f"child {tag} said nothing in {WORD_TIMEOUT:.0f} s")
            data = os.read(fd, 65536)
            if not data:
                raise AssertionError(f"the zygote exited ({self.proc.poll()}); its stderr:\n{self.stderr()}")
            *lines, self._rest = (self._rest + data).split(b"\n")
            for line in lines:
                words = line.decode(errors="replace").split()
                if len(words) < 2 or not words[0].isdigit():
                    raise AssertionError(f"a stray line on the children's stdout: {line!r}")
                self.inbox[int(words[0])].append(words[1:])
        return self.inbox[tag].popleft()

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """EOF on its stdin: it kills and reaps any child left, and exits."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class Child:
    """A create in a child forked from the zygote ahead of its turn, in its own session (so killpg reaches its workers)."""

    def __init__(self, zygote: Zygote, tag: int, target: Path, src: Path, n_workers: int, log: Path) -> None:
        self.zygote, self.tag, self.log = zygote, tag, log
        zygote.send("fork", tag, str(target), str(src), n_workers, str(log))
        self.pid: int | None = None  # said by the child after os.setsid(): also its process group id
        self.said: list[str] = []
        self.exit_code: int | None = None  # reported by the zygote once it reaped the child
        self.t_start = 0.0

    def _receive(self) -> list[str]:
        words = self.zygote.receive(self.tag)
        self.said.append(words[0])
        if words[0] == "pid":
            self.pid = int(words[1])
        elif words[0] == "exit":
            self.exit_code = int(words[1])
        return words

    def expect(self, word: str) -> list[str]:
        words = self._receive()
        while words[0] == "pid":
            words = self._receive()
        if words[0] != word:
            self.kill()
            raise AssertionError(f"child {self.tag} said {words}, expected {word!r}; stderr:\n{self.stderr()}")
        return words

    def go(self) -> None:
        """Let the create start; returns when the child is about to call create."""
        self.expect("ready")
        self.zygote.send("go", self.tag)
        self.expect("start")
        self.t_start = time.perf_counter()

    def finish(self) -> float:
        """Wait for the create to complete; its duration seen from here."""
        self.expect("done")
        seconds = time.perf_counter() - self.t_start
        self.kill()
        return seconds

    def kill(self) -> bool:
        """SIGKILL the child's process group, wait until none of it lives, have the zygote reap the
        child; True when the child had said 'done'."""
        if self.exit_code is not None:
            return "done" in self.said  # reaped already: its pid (and group id) may belong to someone else now
        while self.pid is None and "failed" not in self.said:
            self._receive()  # its first word, unless it failed before os.setsid()
        if self.pid is not None:
            # Unreaped, the child (a zombie at worst) holds its pid and group id: this reaches its group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while (left := live_group_members(self.pid)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not left, f"processes of the killed create survived: {left}"
            # What its loky pool leaves in /dev/shm when SIGKILL takes its resource tracker too.
            for name in glob.glob(f"/dev/shm/sem.loky-{self.pid}-*"):
                with contextlib.suppress(OSError):
                    os.unlink(name)
            for name in glob.glob(f"/dev/shm/joblib_memmapping_folder_{self.pid}_*"):
                shutil.rmtree(name, ignore_errors=True)
            # And h5store's own result spool (a later create would remove it after 10 min).
            for name in glob.glob(f"/dev/shm/h5store-ingest-{self.pid}-*"):
                shutil.rmtree(name, ignore_errors=True)
        self.zygote.send("reap", self.tag)
        while self.exit_code is None:
            self._receive()
        return "done" in self.said

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.mark.slow
def test_sigkill_at_random_times_leaves_previous_or_new_file_and_resume_finishes(tmp_path):
    seed = int(os.environ.get("H5STORE_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    only = os.environ.get("H5STORE_CRASH_TRIAL")
    rng = random.Random(seed)
    workers = [n for n, count in TRIALS.items() for _ in range(count)]
    rng.shuffle(workers)
    # A kill time as a fraction of T (T = 1.3 x a create): 3/4 uniform over the whole run,
    # 1/4 around the end of the create (final commit, fsync, rename, directory fsync).
    fractions = [rng.uniform(0.0, 1.0) if rng.random() < 0.75 else rng.uniform(0.65, 0.9) for _ in workers]
    trials = [int(only)] if only else list(range(len(workers)))
    t_test = time.perf_counter()

    # The schedule: uninterrupted creates first (they measure T, and must equal the reference),
    # three with n_workers=1, one with n_workers=2 (its pool starts meanwhile); then the trials,
    # alternately in two folders: while a trial's create runs in one, the checker thread
    # inspects the other.
    used = {workers[k] for k in trials}
    schedule = [("calibrate", n) for n in (1, 1, 1, 2) if n in used]
    schedule += [("trial", k) for k in trials]
    src, logs = tmp_path / "src", tmp_path / "logs"
    works = [tmp_path / "work0", tmp_path / "work1"]
    for d in (logs, *works):
        d.mkdir()

    def n_workers_of(i: int) -> int:
        kind, x = schedule[i]
        return x if kind == "calibrate" else workers[x]

    def target_of(i: int) -> Path:
        kind, _ = schedule[i]
        return tmp_path / f"calibrate-{i}" / "out.h5" if kind == "calibrate" else works[i % 2] / "out.h5"

    zygote = Zygote(logs / "zygote.err")
    forked: dict[int, Child] = {}

    def fork_ahead(i: int) -> None:
        """Fork the children of the next PIPELINE steps, and those with a loky pool POOL_AHEAD steps
        ahead (they wait for "go" before touching any file): their start-up overlaps what runs now."""
        for j in range(i + 1, min(len(schedule), i + 1 + POOL_AHEAD)):
            if j not in forked and (j <= i + PIPELINE or n_workers_of(j) > 1):
                kind, x = schedule[j]
                name = f"calibrate-{j}" if kind == "calibrate" else f"trial-{x}"
                target_of(j).parent.mkdir(exist_ok=True)
                forked[j] = Child(zygote, j, target_of(j), src, n_workers_of(j), logs / f"{name}.err")

    checker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="crash-checks")
    checking: dict[Path, concurrent.futures.Future[tuple[bool, bool]]] = {}  # by folder
    switch_interval = sys.getswitchinterval()
    child: Child | None = None
    try:
        fork_ahead(-1)  # the first pools start while the files below are written
        expected = write_numbers(src, N_SOURCES, 0.0, "spk")
        write_numbers(tmp_path / "src_prev", 40, 1000.0, "old")
        with PacedNums.create(tmp_path / "ref.h5", src, n_workers=1, progress=False) as f:
            assert list(f.ids) == sorted(expected)
            assert_content(f, expected, f"seed={seed} reference create")
            reference = read_all(f)  # what every complete or resumed create must hold
        PacedNums.create(tmp_path / "previous.h5", tmp_path / "src_prev", n_workers=1, progress=False).close()
        assert_verify_clean(tmp_path / "previous.h5", "previous file")
        previous = (tmp_path / "previous.h5").read_bytes()
        for work in works:
            shutil.copyfile(tmp_path / "previous.h5", work / "out.h5")

        def check(target: Path, is_new: bool, files: list[str], ctx: str) -> tuple[bool, bool]:
            """The slow checks of one trial, in the checker thread while the next trial runs in the
            other folder; then the previous file back in place. Returns (resumed, resumed from
            committed sources)."""
            if not is_new:
                assert_verify_clean(target, ctx + " (previous file)")
            else:
                assert_verify_clean(target, ctx + " (the target is neither the previous file nor a clean one)")
                with PacedNums(target) as f:
                    assert_content(f, reference, ctx + " (the target is neither the previous file nor the complete new one)")
            # Resume from the partial file (without one it would be a plain create): it loads only
            # what the partial file lacks, and ends with the reference content.
            resumed = from_committed = False
            if ".out.h5.partial" in files:
                with PacedNums.create(target, src, n_workers=1, mode="w", resume=True, progress=False) as f:
                    report = f.report
                    assert report.ok, f"{ctx}: resume failures {report.failures}"
                    assert report.n_stored + report.n_skipped == N_SOURCES, f"{ctx}: resume {report.summary()}"
                    assert_content(f, reference, ctx + " (after resume)")
                resumed, from_committed = True, report.n_skipped > 0
                assert_verify_clean(target, ctx + " (after resume)")
                left = sorted(os.listdir(target.parent))
                assert left == ["out.h5"], f"{ctx}: after resume: {left}"
            shutil.copyfile(tmp_path / "previous.h5", target)  # for the trial after next
            return resumed, from_committed

        durations: dict[int, list[float]] = {n: [] for n in TRIALS}
        T: dict[int, float] = {}
        outcomes: Counter[str] = Counter()
        by_workers: Counter[str] = Counter()
        on_disk: Counter[str] = Counter()
        resumes = resumed_from_partial = 0
        late: list[float] = []  # how much later than planned each kill was sent (seconds)
        window: dict[int, list[bool]] = {n: [] for n in TRIALS}  # outcome "new" of the latest trials

        def collect(folder: Path) -> None:
            nonlocal resumes, resumed_from_partial
            if folder in checking:
                resumed, from_committed = checking.pop(folder).result()  # raises what the check raised
                resumes += resumed
                resumed_from_partial += from_committed

        # The checker thread holds the GIL for up to the switch interval when this thread wakes
        # up to kill: 0.5 ms instead of 5 ms (the kill times are recorded in `late`).
        sys.setswitchinterval(0.0005)
        for i, (kind, x) in enumerate(schedule):
            target = target_of(i)
            collect(target.parent)  # the trial before the last one ran in this folder: checked and restored
            child = forked.pop(i)
            child.go()
            fork_ahead(i)
            if kind == "calibrate":
                durations[x].append(child.finish())
                T[x] = 1.3 * float(np.median(durations[x]))
                with PacedNums(target) as f:
                    assert_content(f, reference, f"seed={seed} uninterrupted create in a child, n_workers={x}")
                assert sorted(os.listdir(target.parent)) == ["out.h5"]
                continue
            k = x
            n_workers = workers[k]
            delay = fractions[k] * T[n_workers]
            ctx = (f"seed={seed} trial={k} n_workers={n_workers} kill {delay:.3f} s after start "
                   f"(fraction {fractions[k]:.3f} of T={T[n_workers]:.3f} s) in {target.parent.name}")
            time.sleep(max(0.0, delay - (time.perf_counter() - child.t_start)))
            late.append(time.perf_counter() - child.t_start - delay)
            finished = child.kill()  # returns once no process of its group lives and it is reaped
            stderr = child.stderr()

            # What the kill left, before anything opens a file (an open may roll a journal back).
            files = sorted(os.listdir(target.parent))
            ctx += f"; after the kill: {files}; child finished: {finished}"
            on_disk[" ".join(name.replace("out.h5", "*") for name in files)] += 1
            assert stderr == "" or finished, f"{ctx}: the child wrote to stderr:\n{stderr}"
            assert "out.h5" in files, f"{ctx}: the target is missing"
            assert "out.h5-journal" not in files and "out.h5.writer" not in files, f"{ctx}: the target was opened for writing"
            is_new = target.read_bytes() != previous
            if not is_new:
                assert not finished, f"{ctx}: the create returned but the target still holds the previous file"
            else:
                assert files == ["out.h5"], f"{ctx}: the new file is in place but sidecar files remain"
            outcomes["new" if is_new else "previous"] += 1
            by_workers[f"n_workers={n_workers} {'new' if is_new else 'previous'}"] += 1
            checking[target.parent] = checker.submit(check, target, is_new, files, ctx)
            # T aims at ~30% of the kills after the create completed. The machine's load drifts:
            # when far fewer or far more of the latest kills came after completion, correct T.
            window[n_workers].append(is_new)
            if len(window[n_workers]) == ADAPT_EVERY[n_workers]:
                share = sum(window[n_workers]) / ADAPT_EVERY[n_workers]
                T[n_workers] *= 1.4 if share < 0.12 else 1 / 1.4 if share > 0.6 else 1.0
                window[n_workers].clear()
        for work in works:
            collect(work)
    finally:
        sys.setswitchinterval(switch_interval)
        checker.shutdown(wait=True, cancel_futures=True)
        for c in (child, *forked.values()):
            if c is not None:
                with contextlib.suppress(AssertionError, OSError):  # do not mask the failure being raised
                    c.kill()
        zygote.close()
    assert zygote.proc.returncode == 0 and zygote.stderr() == "", (
        f"the zygote exited with {zygote.proc.returncode}; its stderr:\n{zygote.stderr()}")

    seconds = time.perf_counter() - t_test
    summary = (f"seed={seed}: {len(trials)} trials in {seconds:.1f} s, T={ {n: round(t, 3) for n, t in T.items()} }: "
               f"{dict(outcomes)} ({dict(sorted(by_workers.items()))}); {resumes} resumes, {resumed_from_partial} of them from committed sources; "
               f"files after the kill: {dict(on_disk)}; kills late by {1000 * np.median(late):.2f} ms median, "
               f"{1000 * max(late):.2f} ms at most")
    print(summary)
    if only:
        return
    assert outcomes["previous"] >= MIN_EACH_OUTCOME and outcomes["new"] >= MIN_EACH_OUTCOME, summary
    assert resumes >= MIN_RESUMES and resumed_from_partial >= MIN_EACH_OUTCOME, summary
