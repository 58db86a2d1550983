"""h5store's s3:// files against WebDataset tar shards and LitData chunks streamed from the same S3 server.

What a WebDataset user writes to train from object storage: the corpus as tar shards of
``.npy`` samples in a bucket, streamed with ``pipe:curl`` (a public bucket or presigned URLs;
the fastest opener: no Python per byte), shard-shuffled, buffer-shuffled, decoded, cropped
and batched with ``np.stack``, with WebDataset's own ``cache_dir`` for later epochs. h5store
serves one HDF5 file from the same server by ranged GETs, with its cache folder. Both serve
the same 600 items as random 64-frame windows (shorter items zero-padded) in batches of 32,
shuffled, with 0 workers and with 2 DataLoader workers; both read from local disk too (the
tars and the .h5 in the page cache), for reference.

LitData (pipeline C, when ``litdata`` is installed: ``pip install -e ".[bench]"``; skipped with a
note otherwise): the same items written with LitData's ``BinaryWriter`` as chunks of as many items
as a WebDataset shard (so as many chunks as shards) plus its ``index.json``, uploaded to the same
bucket and streamed with ``StreamingDataset("s3://...", shuffle=True, cache_dir=...)`` and
``StreamingDataLoader`` (the crop in the collate, batches by ``np.stack``). LitData always downloads
whole chunks into its cache folder: its "epoch 1 from the server" is an epoch with an empty
``cache_dir`` (the same run fills its cache), its epoch 2 reads the filled one. Its local-disk row
reads the chunk folder in place. It is pointed at the server by ``storage_options={"endpoint_url":
...}`` (boto3 reads ``AWS_ENDPOINT_URL`` as well); its chunk GETs go through obstore, whose client
options LitData fixes without ``allow_http`` (obstore refuses ``http://`` endpoints then, and an
``AWS_ALLOW_HTTP`` variable does not reach it), so this script adds ``allow_http`` to them: see
:func:`lit_allow_http`. After the 0-worker runs have started obstore in this process, LitData's
forked workers download with boto3 (its own fallback: obstore's runtime is not fork-safe).

Shuffling differs, in WebDataset's and LitData's favour: h5store draws a full random permutation per epoch;
WebDataset shuffles the shard order and then within a 256-sample buffer (consecutive items of
a shard stay close), which is what lets it read whole shards sequentially; LitData shuffles the chunk order and the items
within each chunk. h5store's like for
like is ``shuffle="chunks"`` (batches drawn from runs of neighbouring chunks, in random order),
measured beside the full shuffle.

BEWARE: moto's server reads the whole object for every GET, ranged or not: the cost of one of
h5store's ranged GETs grows with the file's size (29 MB here), while a WebDataset shard or a LitData
chunk is read once per epoch. Against S3 a GET costs 20-80 ms of latency instead; see RESULTS.md's note.

Run: ``python benchmarks/bench_stream.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import h5store as h5s
from benchmarks import _common as C
from h5store.objstore import register
from tests.s3_server import ProcessS3Server

HEADING = "h5store s3:// against WebDataset and LitData streaming (bench_stream.py)"
WINDOW = 64
BS = 32


class Speech(h5s.TypedFile):
    mel = h5s.Array(dtype="float32", shape=(None, C.N_MELS))
    label = h5s.Scalar(dtype="int64")


def make(work: Path, n: int, shards: int, lit: bool) -> tuple[Path, list[Path], Path | None]:
    """The same items as one h5store file, as ``shards`` WebDataset tar shards and (``lit``) as a
    LitData folder of as many chunks."""
    import webdataset as wds

    rng = np.random.default_rng(0)
    items = [(f"spk{i % 20}/u{i:05d}", rng.standard_normal((int(rng.integers(50, 250)), C.N_MELS)).astype("float32"),
              i % 7) for i in range(n)]
    h5 = work / f"speech-{n}.h5"
    with Speech(h5, mode="w") as w:
        w.extend([(k, dict(mel=m, label=np.int64(y))) for k, m, y in items])
    tars = []
    per = -(-n // shards)
    for s in range(shards):
        p = work / f"shard-{s:06d}.tar"
        with wds.TarWriter(str(p)) as tw:
            for k, m, y in items[s * per : (s + 1) * per]:
                tw.write({"__key__": k.replace("/", "_"), "mel.npy": m, "cls": y})
        tars.append(p)
    if not lit:
        return h5, tars, None
    from litdata.streaming.writer import BinaryWriter

    chunks = work / "litdata"
    writer = BinaryWriter(str(chunks), chunk_size=per)
    for i, (_k, m, y) in enumerate(items):
        writer[i] = {"mel": m, "label": y}
    writer.done()
    writer.merge()
    return h5, tars, chunks


def crop(mel: np.ndarray) -> np.ndarray:
    """A random 64-frame window (zero-padded when shorter), as h5s.Window serves."""
    n = len(mel)
    if n <= WINDOW:
        out = np.zeros((WINDOW, mel.shape[1]), mel.dtype)
        out[:n] = mel
        return out
    a = np.random.randint(0, n - WINDOW + 1)
    return mel[a : a + WINDOW]


def collate(samples: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    return np.stack([s[0] for s in samples]), np.asarray([s[1] for s in samples], np.int64)


def lit_collate(samples: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """LitData's items (``{"mel", "label"}``) cropped and batched as the WebDataset pipeline does."""
    return collate([(crop(s["mel"]), int(s["label"])) for s in samples])


def lit_allow_http(endpoint: str) -> None:
    """Let LitData's chunk downloads reach a plain-``http://`` endpoint (the test server).

    LitData 0.2.x fetches ``index.json`` with boto3 (endpoint from ``storage_options`` or
    ``AWS_ENDPOINT_URL``) but each chunk with an obstore ``S3Store`` built on that client's
    endpoint with fixed client options (``litdata/streaming/downloader.py``)::

        _OBSTORE_CLIENT_OPTIONS = cast("ClientConfig", {"timeout": "200s", "pool_max_idle_per_host": "32",
                                                         "pool_idle_timeout": "90s"})
        ...
        return S3Store(bucket, config=..., credential_provider=..., client_options=_OBSTORE_CLIENT_OPTIONS)

    obstore allows only HTTPS unless the client options say ``allow_http`` ("HTTP error: builder
    error", BadScheme); explicit client options replace the ones from the environment, so
    ``AWS_ALLOW_HTTP=true`` does not help. Against S3 (https) nothing here applies; the same
    obstore path is measured, with one more key in its options.
    """
    if not endpoint.startswith("http://"):
        return
    from litdata.streaming import downloader

    opts = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(opts, dict):
        opts["allow_http"] = "true"


def lit_loader(src: str, cache_dir: str | None, workers: int, storage_options: dict[str, str] | None) -> Any:
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(src, shuffle=True, cache_dir=cache_dir, storage_options=storage_options)
    return StreamingDataLoader(ds, batch_size=BS, num_workers=workers, collate_fn=lit_collate)


def wds_pipeline(urls: list[str], cache_dir: str | None) -> Any:
    import webdataset as wds

    kw: dict[str, Any] = {} if cache_dir is None else dict(cache_dir=cache_dir)
    return (wds.WebDataset(urls, shardshuffle=100, workersplitter=wds.split_by_worker, empty_check=False, **kw)
            .shuffle(256)
            .decode()
            .to_tuple("mel.npy", "cls")
            .map_tuple(crop, int)
            .batched(BS, collation_fn=collate, partial=True))


def wds_loader(urls: list[str], cache_dir: str | None, workers: int) -> Any:
    ds = wds_pipeline(urls, cache_dir)
    if not workers:
        return ds
    import torch.utils.data

    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)


def tuple_size(b: Any) -> tuple[int, int]:
    x = b[0]
    return len(x), int(x.nbytes)


def main() -> None:
    ap = C.parser(__doc__, "where the benchmark files and the cache folders go")
    args = ap.parse_args()
    started = time.perf_counter()
    n = 64 if args.quick else 600
    shards = 4 if args.quick else 8
    repeat = 1 if args.quick else 3
    warm = not args.quick  # --quick: no untimed warm-up runs (C.rounds), one timed run of each
    work = Path(args.cache_dir) / "stream"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lit = importlib.util.find_spec("litdata") is not None
    if not lit:
        print("litdata is not installed: LitData (pipeline C) is skipped; pip install -e '.[bench]' to measure it",
              file=sys.stderr)
    h5, tars, chunks = make(work, n, shards, lit)
    srv = ProcessS3Server().start()
    os.environ.update(srv.env())
    url = srv.put("bench", h5.name, str(h5))
    for p in tars:
        srv.put("bench", p.name, str(p))
    lit_url = "s3://bench/litdata"
    lit_opts = dict(endpoint_url=srv.endpoint)
    if chunks is not None:
        for p in sorted(chunks.glob("*")):
            if p.is_file():  # index.json and the chunks (reading the folder adds a checkpoints/ folder)
                srv.put("bench", f"litdata/{p.name}", str(p))
        lit_allow_http(srv.endpoint)
    import boto3

    s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1")
    # Presigned GETs (the bucket is private): what a WebDataset user hands to curl.
    http = [f"pipe:curl -s -f '{s3.generate_presigned_url('get_object', Params=dict(Bucket='bench', Key=p.name))}'"
            for p in tars]
    local_tars = [str(p) for p in tars]
    spec = dict(x=h5s.Window("mel", WINDOW), y=h5s.Item("label"))
    h5_mb = h5.stat().st_size / 1e6
    tar_mb = sum(p.stat().st_size for p in tars) / 1e6
    if chunks is not None:
        import litdata

        n_chunks = len(list(chunks.glob("*.bin")))
        lit_mb = sum(p.stat().st_size for p in chunks.glob("*") if p.is_file()) / 1e6
        lit_data = f", or {n_chunks} LitData {litdata.__version__} chunks ({lit_mb:.0f} MB in all)"
        lit_shuffle = ", LitData the chunk order and the items within each chunk"
    else:
        lit_data = " (LitData skipped: litdata is not installed)"
        lit_shuffle = ""
    lines = [f"Data: {n} items of (50-250, {C.N_MELS}) float32 log-mels and a label: one {h5_mb:.0f} MB h5store "
             f"file, or {shards} WebDataset tar shards of .npy samples ({tar_mb:.0f} MB in all){lit_data}, in one "
             f"moto S3 server on 127.0.0.1 (its own process). Random {WINDOW}-frame windows, batches of {BS}, "
             "shuffled: h5store a full permutation per epoch, WebDataset the shard order and a 256-sample "
             f"buffer{lit_shuffle}.", ""]
    with C.LoadAverage() as load:
        # -- the first batch of a cold open / a fresh pipeline -----------------------------
        def h5_first() -> C.Run:
            register(url)

            def go() -> tuple[int, int]:
                with h5s.open(url) as g:
                    return tuple_size(tuple(next(iter(g.iter_batches(spec, BS, shuffle=True))).values()))
            return C.timed(go)

        def wds_first() -> C.Run:
            return C.timed(lambda: tuple_size(next(iter(wds_pipeline(http, None)))))

        def lit_first() -> C.Run:
            # A new folder each run: the last run's loader may still be prefetching into its own.
            cache = tempfile.mkdtemp(prefix="lit-first-", dir=work)
            return C.timed(lambda: tuple_size(next(iter(lit_loader(lit_url, cache, 0, lit_opts)))))

        firsts = {"h5store s3://": h5_first, "WebDataset (curl)": wds_first}
        if chunks is not None:
            firsts["LitData (s3://, empty cache_dir)"] = lit_first
        first = C.rounds(firsts, repeat, "first batch", warm_up=warm)
        base = first["WebDataset (curl)"]
        lines += ["Open + first batch, a fresh open / pipeline each run (best of interleaved rounds):", "",
                  C.md_table(["pipeline", "seconds", "speed vs WebDataset"],
                             [[k, f"{v.best.seconds:.3f}", C.fmt_ratio(v.rate / base.rate)] for k, v in first.items()]),
                  ""]

        # -- whole epochs: streamed, from each library's cache, from local disk ----------------
        rows = []
        for workers in (0, 2):
            def h5_epoch(src: str, cache: str | None, warm: bool, workers: int = workers,
                         shuffle: bool | str = True) -> C.Run:
                kw = {} if cache is None else dict(cache_dir=cache)
                if cache is not None and not warm:
                    shutil.rmtree(cache, ignore_errors=True)
                if src.startswith("s3://"):
                    register(src, **kw)
                with h5s.open(src, **kw) as g:
                    loader = (g.serve(spec, BS, shuffle=shuffle, num_workers=workers) if workers
                              else g.iter_batches(spec, BS, shuffle=shuffle))
                    return C.time_batches(lambda: loader, min_seconds=0.0, whole_epochs=True,
                                          size=lambda b: tuple_size(tuple(b.values())))

            def wds_epoch(urls: list[str], cache: str | None, warm: bool, workers: int = workers) -> C.Run:
                if cache is not None and not warm:
                    shutil.rmtree(cache, ignore_errors=True)
                if cache is not None:
                    os.makedirs(cache, exist_ok=True)
                loader = wds_loader(urls, cache, workers)
                return C.time_batches(lambda: loader, min_seconds=0.0, whole_epochs=True, size=tuple_size)

            def lit_epoch(src: str, cache: str | None, warm: bool, workers: int = workers) -> C.Run:
                if cache is not None and not warm:
                    shutil.rmtree(cache, ignore_errors=True)
                loader = lit_loader(src, cache, workers, lit_opts if src.startswith("s3://") else None)
                return C.time_batches(lambda: loader, min_seconds=0.0, whole_epochs=True, size=tuple_size)

            h5_warm, wds_warm = str(work / f"h5-cache-{workers}"), str(work / f"wds-cache-{workers}")
            lit_warm = str(work / f"lit-cache-{workers}")
            h5_epoch(url, h5_warm, warm=False)  # fill each cache once
            wds_epoch(http, wds_warm, warm=False)
            if chunks is not None:
                lit_epoch(lit_url, lit_warm, warm=False)
            runs = {
                "h5store: epoch 1 from the server": lambda e=h5_epoch: e(url, None, False),
                "WebDataset: epoch 1 from the server": lambda e=wds_epoch: e(http, None, False),
                "h5store: epoch 1 from the server, shuffle='chunks'": lambda e=h5_epoch: e(url, None, False,
                                                                                           shuffle="chunks"),
                "h5store: epoch 1 filling its cache folder": lambda e=h5_epoch: e(url, str(work / "h5-cold"), False),
                "WebDataset: epoch 1 filling its cache_dir": lambda e=wds_epoch: e(http, str(work / "wds-cold"), False),
                "h5store: epoch 2 from its cache folder": lambda e=h5_epoch, d=h5_warm: e(url, d, True),
                "WebDataset: epoch 2 from its cache_dir": lambda e=wds_epoch, d=wds_warm: e(http, d, True),
                "h5store: local file": lambda e=h5_epoch: e(str(h5), None, False),
                "WebDataset: local tar shards": lambda e=wds_epoch: e(local_tars, None, False),
            }
            if chunks is not None:
                runs.update({
                    # LitData has no uncached mode: epoch 1 from the server fills an empty cache_dir.
                    "LitData: epoch 1 from the server (empty cache_dir)":
                        lambda e=lit_epoch: e(lit_url, str(work / "lit-cold"), False),
                    "LitData: epoch 2 from its cache_dir": lambda e=lit_epoch, d=lit_warm: e(lit_url, d, True),
                    "LitData: local chunks": lambda e=lit_epoch: e(str(chunks), None, False),
                })
            got = C.rounds(runs, repeat, f"epochs, {workers} workers", warm_up=warm)
            lit_cold = "epoch 1 from the server (empty cache_dir)"
            for label, hk, wk, lk in (
                    ("epoch 1 from the server", "epoch 1 from the server", "epoch 1 from the server", lit_cold),
                    ("epoch 1 from the server (h5store: `shuffle=\"chunks\"`)",
                     "epoch 1 from the server, shuffle='chunks'", "epoch 1 from the server", lit_cold),
                    ("epoch 1 filling the cache", "epoch 1 filling its cache folder", "epoch 1 filling its cache_dir",
                     lit_cold),
                    ("epoch 2 from the cache", "epoch 2 from its cache folder", "epoch 2 from its cache_dir",
                     "epoch 2 from its cache_dir"),
                    ("local disk", "local file", "local tar shards", "local chunks")):
                h, w = got[f"h5store: {hk}"], got[f"WebDataset: {wk}"]
                row = [workers, label, C.fmt_rate(h.rate), C.fmt_rate(w.rate)]
                if chunks is not None:
                    li = got[f"LitData: {lk}"]
                    row += [C.fmt_rate(li.rate), C.fmt_ratio(h.rate / w.rate), C.fmt_ratio(h.rate / li.rate)]
                else:
                    row += [C.fmt_ratio(h.rate / w.rate)]
                rows.append(row)
        head = ["workers", "epoch", "h5store", "WebDataset", "h5store vs WebDataset"]
        if chunks is not None:
            head = [*head[:4], "LitData", "h5store vs WebDataset", "h5store vs LitData"]
        if chunks is None:
            how = ("0 workers: h5store's `iter_batches`, the WebDataset pipeline iterated directly; 2 workers: "
                   "`serve(num_workers=2)` and `DataLoader(pipeline, batch_size=None, num_workers=2)` (fork):")
        else:
            how = ("0 workers: h5store's `iter_batches`, the WebDataset pipeline iterated directly, "
                   "`StreamingDataLoader(num_workers=0)`; 2 workers: `serve(num_workers=2)`, `DataLoader(pipeline, "
                   "batch_size=None, num_workers=2)` and `StreamingDataLoader(num_workers=2)` (fork). LitData always "
                   "caches whole chunks: its three epoch-1 rows are one measurement, an epoch with an empty "
                   "`cache_dir`:")
        lines += [f"Whole epochs, items/s, best of interleaved rounds; {how}", "", C.md_table(head, rows), ""]
    srv.stop()
    lines += [C.load_note(load.span), "",
              f"Command: `python benchmarks/bench_stream.py{' --quick' if args.quick else ''}` ({C.today()}).",
              "moto's server reads the whole object for every GET: each of h5store's ranged GETs costs it the "
              f"{h5_mb:.0f} MB file's read, each WebDataset shard{' or LitData chunk' if chunks else ''} one read "
              "per epoch. On S3 a GET costs 20-80 ms of latency whatever its size, which favours the fewer, larger "
              "requests of the libraries' caches."
              + ("" if chunks is None else
                 " LitData's chunk GETs go through obstore with `allow_http` added to the client options LitData "
                 "fixes (the test server is plain http; see `lit_allow_http`); once its 0-worker runs have started "
                 "obstore in this process, its forked workers download with boto3 (LitData's own fallback).")]
    C.publish(HEADING, "\n".join(lines), not args.no_write, started)


if __name__ == "__main__":
    main()
