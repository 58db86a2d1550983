"""Serving from object storage: requests, a cold first batch, epochs from the server and the cache.

An S3-compatible server (moto's, tests/s3_server.py) runs in a process of its own on
127.0.0.1 and counts every request. The same file is read from local disk (the baseline,
page cache warm) and as ``s3://``: the open, one batch, the first batch of a cold open, whole
epochs from the server (epoch 1) and from the cache folder (epoch 2), with 0 workers
(``iter_batches``) and 2 DataLoader workers (``serve``). Both clients the issue names are
compared on the same ranges (s3fs, which h5store uses, and obstore when installed).

BEWARE: the server is local and written in Python: no network round trip, but every ranged GET
costs it milliseconds of CPU that grow with the object's size (moto reads the whole object). Against S3 (20-80 ms per request) the request counts matter more and the
remote/local ratios are lower; the cache's figures do not depend on the server.

Run: ``python benchmarks/bench_remote.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import h5store as h5s
from benchmarks import _common as C
from h5store.objstore import register
from tests.s3_server import ProcessS3Server

HEADING = "Serving from object storage (s3://, bench_remote.py)"
PUBLISH_HEADING = "Publishing to object storage and the metadata layout (bench_remote.py --part publish)"

# HDF5 file-space layouts compared for new files (h5py.File's creation / access keywords).
LAYOUTS: dict[str, dict] = {
    "default": {},
    "paged, 64 KiB pages": dict(fs_strategy="page", fs_page_size=64 << 10),
    "paged, 1 MiB pages": dict(fs_strategy="page", fs_page_size=1 << 20),
    "meta_block_size 1 MiB": dict(meta_block_size=1 << 20),
}


class Several(h5s.TypedFile):
    """Several features: ragged unfiltered and gzip, fixed, scalar (the metadata of four columns)."""

    mel = h5s.Array(dtype="float32", shape=(None, 16))
    mag = h5s.Array(dtype="float16", shape=(None, 8), compression="gzip")
    emb = h5s.Array(dtype="float32", shape=(16,))
    label = h5s.Scalar(dtype="int64")


def make_layout(path: str, n: int, layout: str) -> None:
    """A file of ``n`` items written in commits of 1000 (as a create does), with ``LAYOUTS[layout]``."""
    rng = np.random.default_rng(0)
    with Several(path, mode="w", **LAYOUTS[layout]) as w:
        for a in range(0, n, 1000):
            w.extend([(f"spk{i % 50}/u{i:06d}", dict(
                mel=rng.standard_normal((int(rng.integers(5, 40)), 16)).astype("float32"),
                mag=rng.standard_normal((int(rng.integers(5, 40)), 8)).astype("float16"),
                emb=rng.standard_normal(16).astype("float32"), label=np.int64(i % 7))) for i in range(a, min(n, a + 1000))])
            w.commit()


class Speech(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, C.N_MELS))
    label = h5s.Scalar(dtype="int64")


def make(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    with Speech(path, mode="w") as w:
        w.extend([(f"spk{i % 20}/u{i:05d}", dict(mel=rng.standard_normal((int(rng.integers(50, 250)), C.N_MELS))
                                                 .astype("float32"), label=np.int64(i % 7))) for i in range(n)])


def _create_in_child(path: Path, n: int, layout: str) -> C.Run:
    """One create of a layout file in a fresh interpreter (imports not timed: the child times itself)."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from benchmarks.bench_remote import make_layout; "
            "t = time.perf_counter(); make_layout(sys.argv[2], int(sys.argv[3]), sys.argv[4]); "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code, str(C.REPO), str(path), str(n), layout],
                         capture_output=True, text=True, check=True)
    return C.Run(n, float(out.stdout.strip().splitlines()[-1]), path.stat().st_size)


def publish_section(args: Any, work: Path, repeat: int) -> str:
    """Requests of an open + first batch per metadata layout, their local costs; upload vs s3fs."""
    from h5store.publish import upload

    # --quick: one size (its table is the same as the other size's: every layout, every column), with
    # two commits of 1000, as the full run's files have many.
    sizes = (1500,) if args.quick else (2000, 50000)
    warm = not args.quick  # --quick: no untimed warm-up runs (C.rounds), one timed run of each
    twice = 1 if args.quick else repeat * 2
    srv = ProcessS3Server().start()
    os.environ.update(srv.env())
    srv.put("bench", "warm", __file__)  # the bucket
    spec = dict(x=h5s.Window("mel", 4), m=h5s.Item("mag"), e=h5s.Item("emb"), y=h5s.Item("label"))
    # moto copies the whole object for every ranged GET (~0.1 s for 97 MB, more under load): long limits
    slow = dict(timeout=120, retry_timeout=600)
    lines: list[str] = []
    with C.LoadAverage() as load:
        for n in sizes:
            paths = {k: work / f"layout-{n}-{i}.h5" for i, k in enumerate(LAYOUTS)}
            made = C.rounds({k: (lambda p=p, k=k, n=n: _create_in_child(p, n, k)) for k, p in paths.items()},
                            repeat, f"create {n}", warm_up=warm)
            urls = {k: srv.put("bench", p.name, str(p)) for k, p in paths.items()}
            req = {}
            for k, url in urls.items():
                counts = []
                for _ in range(2 if warm else 1):
                    register(url)  # a fresh process's view: nothing in memory
                    srv.reset()
                    with h5s.open(url, **slow) as f:
                        opened = len(srv.gets())
                        next(iter(f.iter_batches(spec, 32, shuffle=True, seed=1)))
                        counts.append((opened, len(srv.gets())))
                req[k] = counts[-1]

            def local_open(p: Path) -> C.Run:
                def go() -> tuple[int, int]:
                    with h5s.open(p) as g:
                        b = next(iter(g.iter_batches(spec, 32, shuffle=True, seed=2)))
                        return len(b["y"]), 0
                return C.timed(go)

            def remote_open(url: str) -> C.Run:
                register(url)

                def go() -> tuple[int, int]:
                    with h5s.open(url, **slow) as g:
                        b = next(iter(g.iter_batches(spec, 32, shuffle=True, seed=2)))
                        return len(b["y"]), 0
                return C.timed(go)

            def serve(p: Path) -> C.Run:
                with h5s.open(p) as g:
                    return C.time_batches(lambda: g.iter_batches(spec, 64, shuffle=True, seed=3), min_seconds=0.0,
                                          whole_epochs=True)

            opens = C.rounds({k: (lambda p=p: local_open(p)) for k, p in paths.items()}, twice, f"open {n}",
                             warm_up=warm)
            ropens = C.rounds({k: (lambda u=u: remote_open(u)) for k, u in urls.items()}, repeat, f"s3 open {n}",
                              warm_up=warm)
            rates = C.rounds({k: (lambda p=p: serve(p)) for k, p in paths.items()}, repeat, f"serve {n}",
                             warm_up=warm)
            b = "default"
            rows = [[k, f"{req[k][0]} + {req[k][1] - req[k][0]}",
                     f"{1e3 * ropens[k].best.seconds:.0f} ms ({C.fmt_ratio(ropens[b].best.seconds / ropens[k].best.seconds)})",
                     f"{p.stat().st_size / 1e6:.1f} MB ({p.stat().st_size / paths[b].stat().st_size:.3f}x)",
                     f"{made[k].best.seconds:.2f} s ({C.fmt_ratio(made[b].best.seconds / made[k].best.seconds)})",
                     f"{1e3 * opens[k].best.seconds:.1f} ms ({C.fmt_ratio(opens[b].best.seconds / opens[k].best.seconds)})",
                     f"{C.fmt_rate(rates[k].rate)} ({C.fmt_ratio(rates[k].rate / rates[b].rate)})"]
                    for k, p in paths.items()]
            lines += [f"{n:,} items, four features (ragged float32, ragged float16 gzip, fixed (16,), scalar), "
                      "written in commits of 1000; speeds in parentheses are vs the default layout (>1x: faster):",
                      "", C.md_table(["layout", "s3:// GETs: open + first batch", "s3:// open + first batch",
                                      "file size", "create (fresh process)", "local open + first batch",
                                      "local epoch, items/s"], rows), ""]

        # -- upload: h5store's upload against s3fs.put_file, same file, same part size and concurrency
        big = paths["default"]
        part = 8 << 20
        fs = register(urls["default"]).store()

        def ours() -> C.Run:
            return C.timed(lambda: (1, upload(big, "s3://bench/up-ours.h5", overwrite=True, part_bytes=part,
                                              concurrency=4).size))

        def theirs() -> C.Run:
            return C.timed(lambda: (1, fs.put_file(str(big), "bench/up-s3fs.h5", chunksize=part, max_concurrency=4)
                                    or big.stat().st_size))

        def theirs_checked() -> C.Run:
            def go() -> tuple[int, int]:
                fs.exists("bench/up-s3fs2.h5")  # what upload() also does: refuse or replace, then check
                fs.put_file(str(big), "bench/up-s3fs2.h5", chunksize=part, max_concurrency=4)
                return 1, int(fs.info("bench/up-s3fs2.h5", refresh=True)["size"])
            return C.timed(go)

        up = C.rounds({"s3fs.put_file": theirs, "s3fs: exists + put_file + info": theirs_checked,
                       "h5store.publish.upload": ours}, twice, "upload", warm_up=warm)
        mb = big.stat().st_size / 1e6
        lines += [f"Upload of the {mb:.0f} MB file ({-(-big.stat().st_size // part)} parts of 8 MiB, 4 at a time), "
                  "best of interleaved rounds; h5store's adds a HEAD before (refuse or replace), a Content-MD5 "
                  "per part, the abort on failure and the size + ETag check after (one HEAD):", "",
                  C.md_table(["uploader", "seconds", "MB/s", "speed vs s3fs.put_file"],
                             [[k, f"{v.best.seconds:.2f}", f"{mb / v.best.seconds:.0f}",
                               C.fmt_ratio(up["s3fs.put_file"].best.seconds / v.best.seconds)]
                              for k, v in up.items()]), ""]
    srv.stop()
    lines += [C.load_note(load.span), "",
              f"Command: `python benchmarks/bench_remote.py --part publish{' --quick' if args.quick else ''}` "
              f"({C.today()}). GETs counted by the server (moto's S3, its own process on 127.0.0.1); an open "
              "also makes one HEAD."]
    return "\n".join(lines)


def main() -> None:
    ap = C.parser(__doc__, "where the benchmark file and the cache folders go")
    ap.add_argument("--part", choices=("serve", "publish", "all"), default="all",
                    help="serve: the serving section; publish: publishing and the metadata layout")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.part in ("publish", "all"):
        work = Path(args.cache_dir) / "remote"
        work.mkdir(parents=True, exist_ok=True)
        C.publish(PUBLISH_HEADING, publish_section(args, work, 1 if args.quick else 2), not args.no_write, started)
        if args.part == "publish":
            return
    # moto's server reads the whole object for every ranged GET (its cost grows with the file):
    # a 29 MB file keeps the full run within minutes.
    n = 64 if args.quick else 600
    repeat = 1 if args.quick else 3
    warm = not args.quick  # --quick: no untimed warm-up runs (C.rounds), one timed run of each
    twice = 1 if args.quick else repeat * 2
    work = Path(args.cache_dir) / "remote"
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"speech-{n}.h5"
    if not path.exists():
        make(path, n)
    srv = ProcessS3Server().start()
    os.environ.update(srv.env())
    url = srv.put("bench", path.name, str(path))
    spec = dict(x=h5s.Window("mel", 64), y=h5s.Item("label"))
    bs = 32
    lines: list[str] = []
    with C.LoadAverage() as load:
        # -- requests: open, one batch in order, one shuffled -------------------------------
        srv.reset()
        t = time.perf_counter()
        f = h5s.open(url)
        open_s = time.perf_counter() - t
        open_req = len(srv._count("GET"))
        it = iter(f.iter_batches(spec, bs, shuffle=True, seed=1))
        next(it)
        srv.reset()
        nb = 1 + sum(1 for _ in it)
        per_batch = len(srv.gets()) / max(1, nb - 1)
        srv.reset()
        seq = list(f.iter_batches(dict(x=h5s.Item("mel")), bs))
        per_seq = len(srv.gets()) / len(seq)
        f.close()
        size_mb = path.stat().st_size / 1e6
        lines += [f"File: {n} items of (50-250, {C.N_MELS}) float32, {size_mb:.0f} MB; batches of {bs}.", "",
                  C.md_table(["what", "requests"], [
                      ["open (HEAD + metadata)", f"{open_req} ({open_s * 1e3:.0f} ms)"],
                      [f"a batch of {bs} random 64-frame windows (after the first)", f"{per_batch:.1f} GETs"],
                      [f"a batch of {bs} whole items in order", f"{per_seq:.2f} GETs"],
                  ]), ""]

        # -- clients on the same ranges --------------------------------------------------
        rng = np.random.default_rng(0)
        starts = np.sort(rng.integers(0, path.stat().st_size - 40_000, 64))
        ends = starts + 20_480
        obj = register(url)

        def s3fs_batch() -> C.Run:
            return C.timed(lambda: (len(obj._get(starts.tolist(), ends.tolist(), coalesce=0)), 0))

        runs = {"s3fs (h5store's client)": s3fs_batch}
        try:
            import obstore
            from obstore.store import S3Store

            store = S3Store("bench", endpoint=srv.endpoint, client_options={"allow_http": True}, region="us-east-1")

            def obstore_batch() -> C.Run:
                return C.timed(lambda: (len(obstore.get_ranges(store, path.name, starts=starts.tolist(),
                                                               ends=ends.tolist(), coalesce=0)), 0))

            runs["obstore"] = obstore_batch
        except ImportError:
            pass
        got = C.rounds(runs, twice, "clients", warm_up=warm)
        base = got["s3fs (h5store's client)"]
        lines += ["64 ranges of 20 KB, not coalesced (64 GETs), one call, best of "
                  f"{twice} interleaved rounds:", "",
                  C.md_table(["client", "ms per call", "speed vs s3fs"],
                             [[k, f"{1e3 * v.best.seconds:.0f}", C.fmt_ratio(v.rate / base.rate)]
                              for k, v in got.items()]), ""]

        # -- the first batch of a cold open ------------------------------------------------
        def first(src: str) -> C.Run:
            register(src) if src.startswith("s3://") else None

            def go() -> tuple[int, int]:
                with h5s.open(src) as g:
                    b = next(iter(g.iter_batches(spec, bs, shuffle=True, seed=2)))
                    return len(b["x"]), int(b["x"].nbytes)
            return C.timed(go)

        cold = C.rounds({"local": lambda: first(str(path)), "s3://": lambda: first(url)}, repeat, "first batch",
                        warm_up=warm)
        lines += ["Open + first batch (a fresh open each run; the local file is in the page cache):", "",
                  C.md_table(["source", "seconds", "speed vs local"],
                             [[k, f"{v.best.seconds:.3f}", C.fmt_ratio(v.rate / cold['local'].rate)]
                              for k, v in cold.items()]), ""]

        # -- epochs: local, remote epoch 1 (server), remote epoch 2 (cache folder) ---------
        rows = []
        for workers in (0, 2):
            def epoch(src: str, cache: str | None, warm: bool, workers: int = workers) -> C.Run:
                kw = {} if cache is None else dict(cache_dir=cache)
                if cache is not None and not warm:
                    shutil.rmtree(cache, ignore_errors=True)  # a cold cache: epoch 1 fetches
                if src.startswith("s3://"):
                    register(src, **kw)
                with h5s.open(src, **kw) as g:
                    if workers:
                        loader = g.serve(spec, bs, shuffle=True, seed=3, num_workers=workers)
                    else:
                        loader = g.iter_batches(spec, bs, shuffle=True, seed=3)
                    return C.time_batches(lambda: loader, min_seconds=0.0, whole_epochs=True)

            warm_dir = str(work / f"cache-warm-{workers}")
            shutil.rmtree(warm_dir, ignore_errors=True)
            epoch(url, warm_dir, warm=False)  # fill it once
            got = C.rounds({
                "local disk": lambda e=epoch: e(str(path), None, False),
                "s3:// epoch 1 (from the server)": lambda e=epoch: e(url, None, False),
                "s3:// epoch 1 (filling the cache folder)": lambda e=epoch: e(url, str(work / "cache-cold"), False),
                "s3:// epoch 2 (from the cache folder)": lambda e=epoch, d=warm_dir: e(url, d, True),
            }, repeat, f"epochs, {workers} workers", warm_up=warm)
            base = got["local disk"]
            rows += [[workers, k, C.fmt_rate(v.rate), C.fmt_ratio(v.rate / base.rate)] for k, v in got.items()]
        lines += ["Whole epochs (shuffled 64-frame windows), items/s, best of interleaved rounds; 0 workers is "
                  "`iter_batches`, 2 is `serve(num_workers=2)` (fork):", "",
                  C.md_table(["workers", "source", "items/s", "vs local"], rows), ""]
    srv.stop()
    lines += [C.load_note(load.span), "",
              f"Command: `python benchmarks/bench_remote.py{' --quick' if args.quick else ''}` ({C.today()}).",
              "The server: moto's S3 in its own process on 127.0.0.1 (no network latency, but milliseconds of "
              "Python per request, growing with the object's size)."]
    C.publish(HEADING, "\n".join(lines), not args.no_write, started)


if __name__ == "__main__":
    main()
