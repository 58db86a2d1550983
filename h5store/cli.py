"""The ``h5store`` command line: create, info, verify, push, recover, plot, report, bench.

Every error is one line on stderr and a non-zero exit status, never a traceback
(``H5STORE_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from h5store.errors import H5StoreError
from h5store.objstore import is_remote
from h5store.typed_file import TypedFile

__all__ = ["PRESETS", "main", "preset"]

PRESETS = {
    "audio-mel": "mel spectrogram + folder label",
    "audio-mel-mag": "mel + magnitude spectrogram + folder label",
    "speech": "mel + magnitude spectrogram + text from an LJSpeech-style metadata.csv",
}


class CLIError(Exception):
    """A usage problem, reported as one line."""


def preset(name: str, sr: int = 22050, n_fft: int = 1024, hop_length: int = 256, n_mels: int = 80) -> type[TypedFile]:
    """A built-in schema by name (see :data:`PRESETS`), with the audio parameters given.

    Examples
    --------
    >>> preset("audio-mel", sr=16000).schema.groups[""]["mel"].sr
    16000
    """
    from h5store.features import CSVColumn, DirLabel, MagSpectrogram, MelSpectrogram

    stft = dict(sr=sr, n_fft=n_fft, hop_length=hop_length)
    feats: dict[str, Any] = {"mel": MelSpectrogram(n_mels=n_mels, **stft)}
    if name in ("audio-mel-mag", "speech"):
        feats["mag"] = MagSpectrogram(**stft)
    if name in ("audio-mel", "audio-mel-mag"):
        feats["label"] = DirLabel()
    if name == "speech":
        feats["text"] = CSVColumn(path="metadata.csv", column=1)
    if name not in PRESETS:
        raise CLIError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    cls = type(name.replace("-", "_"), (TypedFile,), {**feats, "__module__": __name__})
    return cls


def load_schema(spec: str, **audio: int) -> type[TypedFile]:
    """``module:Class`` (imported with the current folder on the path) or a preset name."""
    if ":" not in spec:
        return preset(spec, **audio)
    module, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise CLIError(f"cannot import schema module {module!r}: {e}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise CLIError(f"module {module!r} has no {attr!r}")
    if not (isinstance(obj, type) and issubclass(obj, TypedFile)):
        raise CLIError(f"{spec} is not a TypedFile subclass")
    return obj


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_CREATE_FLAGS = {'mode="w"': "--overwrite", 'mode="a"': "--append", "resume=True": "--resume"}


def _cmd_create(args: argparse.Namespace) -> int:
    cls = load_schema(args.schema, sr=args.sr, n_fft=args.n_fft, hop_length=args.hop_length, n_mels=args.n_mels)
    mode = "a" if args.append else "w" if args.overwrite else None
    try:
        shards = {} if args.shard_size is None and args.shards is None else dict(shard_size=args.shard_size,
                                                                               shards=args.shards)
        f = cls.create(args.out, args.sources, n_workers=args.workers, resume=args.resume, on_error=args.on_error,
                       mode=mode, progress=not args.quiet, **shards)
    except H5StoreError as e:
        # The library names its keyword arguments; say the flags that do the same here.
        msg = str(e)
        for api, flag in _CREATE_FLAGS.items():
            msg = msg.replace(api, flag)
        raise CLIError(msg) from e
    report = f.report  # type: ignore[attr-defined]
    uploaded = getattr(f, "upload", None)  # an s3:// target: built locally, then uploaded
    f.close()
    lines = report.lines()
    print(f"{args.out}: {lines[0]}")
    for line in lines[1:]:
        if args.quiet or not line.startswith("  warning"):  # with progress, create printed them
            print(line)
    if uploaded is not None:
        print(uploaded.summary())
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from h5store.publish import PART_BYTES, push

    if args.part_size is not None and args.part_size < 5:
        raise CLIError(f"--part-size is in MiB, at least 5 (S3's smallest part), got {args.part_size}")
    part = PART_BYTES if args.part_size is None else args.part_size << 20
    from h5store.shards import is_sharded, push_sharded

    send = push_sharded if is_sharded(args.file) else push  # a sharded folder: its shards, then index.json
    try:
        done = send(args.file, args.url, overwrite=args.overwrite, deep=args.deep, part_bytes=part,
                    concurrency=args.concurrency)
    except H5StoreError as e:
        raise CLIError(str(e).replace("overwrite=True", "--overwrite")) from e
    print(done.summary())
    return 0


def _info_sharded(args: argparse.Namespace) -> int:
    from h5store.shards import open_sharded

    with open_sharded(args.file) as ds:
        m = ds.manifest
        print(f"{args.file}: {m.get('class')}, sharded: {len(m['shards'])} shards, {m['items']} ids, "
              f"{_human(sum(e['bytes'] for e in m['shards']))} (schema hash {str(m.get('schema_hash'))[:12]})")
        head = f"{'shard':<28} {'items':>9} {'size':>10} {'crc32':<9} first id .. last id"
        print(head)
        print("-" * len(head))
        for e in m["shards"]:
            print(f"{e['file']:<28} {e['items']:>9} {_human(e['bytes']):>10} {e.get('crc32') or '-':<9} "
                  f"{e.get('first')} .. {e.get('last')}")
        print(f"features: {', '.join(ds.features)}; `h5store info` on one shard shows them in detail")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import h5store
    from h5store.ingest import stored_failures
    from h5store.shards import is_sharded

    if is_sharded(args.file):
        return _info_sharded(args)

    with h5store.open(args.file) as f:
        schema = f.file_schema
        size = f.h5.id.get_filesize() if is_remote(args.file) else os.path.getsize(args.file)
        print(f"{args.file}: {schema.name}, {len(f)} ids, {_human(size)} {'in the store' if is_remote(args.file) else 'on disk'}, "
              f"h5store format {f.h5.attrs.get('h5store_format')} (written by {f.h5.attrs.get('h5store_version')})")
        head = f"{'group/feature':<24} {'type':<26} {'items':>9} {'dtype':<8} {'item shape':<14} {'length p0/p50/p95/max':<24} {'disk':>10} {'compr.':>8}"
        print(head)
        print("-" * len(head))
        for row in f.describe():
            name = f"{row['group'] + '/' if row['group'] else ''}{row['feature']}"
            shape = "(" + ", ".join("T" if d is None else str(d) for d in row["shape"] or ()) + ")"
            if row["shape"] is None or row["dtype"] is None:  # h5s.Array(): fixed by the first item, none yet
                row["dtype"], shape = row["dtype"] or "1st item", shape if row["shape"] is not None else "1st item"
            lens = "/".join(f"{v:.0f}" for v in row["lengths"]) if row["lengths"] else "-"
            comp = row["compression"] or "none"
            ratio = f" x{row['ratio']:.1f}" if row["compression"] and row["ratio"] else ""
            print(f"{name:<24} {row['type']:<26} {row['items']:>9} {row['dtype']:<8} {shape:<14} {lens:<24} "
                  f"{_human(row['disk_bytes']):>10} {comp + ratio:>8}")
        failures = stored_failures(f)
        if failures:
            print(f"{len(failures)} source(s) failed at create:")
            for failure in failures[: args.max_failures]:
                print(f"  {failure}")
            if len(failures) > args.max_failures:
                print(f"  ... and {len(failures) - args.max_failures} more")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import warnings

    from h5store.integrity import H5StoreSecurityWarning, verify, verify_in_subprocess
    from h5store.shards import is_sharded, verify_sharded

    if is_sharded(args.file):
        if is_remote(args.file) or args.untrusted:
            raise CLIError(f"{args.file}: a sharded dataset is verified locally and trusted; verify its shards "
                           "one by one (h5store verify --untrusted SHARD)")
        sharded = verify_sharded(args.file, deep=not args.quick, max_errors=args.max_errors)
        print("\n".join(sharded.lines()))
        return 0 if sharded else 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", H5StoreSecurityWarning)
        if args.untrusted:
            # Files from strangers are parsed by a child process under memory and time limits.
            report = verify_in_subprocess(args.file, deep=not args.quick, untrusted=True, timeout=args.timeout,
                                          max_memory=args.max_memory << 20, max_errors=args.max_errors)
        else:
            report = verify(args.file, deep=not args.quick, max_errors=args.max_errors)
    for note in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, H5StoreSecurityWarning)):
        print(f"h5store: note: {note}", file=sys.stderr)
    print("\n".join(report.lines()))
    return 0 if report else 1


def _cmd_recover(args: argparse.Namespace) -> int:
    from h5store.journal import recover

    if is_remote(args.file):
        raise CLIError(f"{args.file}: recover writes to the file; an object in a store is read-only and has no "
                       "journal: check it with `h5store verify`, upload a good copy with `h5store push --overwrite`")
    report = recover(args.file, apply=args.apply)
    print("\n".join(report.lines))
    if not report.changed:
        return 0 if report.ok else 1
    from h5store.integrity import verify

    checked = verify(args.file)
    print("\n".join(checked.lines()))
    return 0 if report.ok and checked else 1


def _key(ids: Any, key: str) -> str | int:
    """An id as typed on the command line; a number that is not an id is a position."""
    if key in ids:
        return key
    try:
        return int(key)
    except ValueError:
        return key  # reported as a missing id by the read


def _cmd_plot(args: argparse.Namespace) -> int:
    import h5store

    try:
        from h5store.plot import plottable, save_plot

        with h5store.open(args.file) as f:
            feature = args.feature
            if feature is None:
                names = plottable(f)
                if not names:
                    raise CLIError(f"{args.file}: no plottable feature in the root group; name one with --feature")
                feature = names[0]
            group = feature.strip("/").rpartition("/")[0]
            out = args.output or f"{feature.strip('/').replace('/', '-')}.png"
            ids = f.group(group).ids
            key = _key(ids, args.id)
            save_plot(f, key, out, feature=feature, size=(args.width, args.height), dpi=args.dpi)
            drawn = f"id {ids[key]!r} (position {key})" if isinstance(key, int) else f"id {key!r}"
    except ImportError as e:  # matplotlib is the `plot` extra
        raise CLIError(str(e)) from None
    print(f"{out}: {feature} of {drawn} ({round(args.width * args.dpi)} x {round(args.height * args.dpi)} pixels)")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    import h5store

    if args.n < 0:
        raise CLIError(f"-n takes the number of items to show (>= 0), got {args.n}")
    name = args.file.rstrip("/").rpartition("/")[2] if is_remote(args.file) else os.path.basename(args.file)
    out = args.output or f"{os.path.splitext(name)[0]}-report.html"
    try:
        with h5store.open(args.file) as f:
            info = f.report_html(out, n=args.n, seed=args.seed, verify=args.verify)
    except ImportError as e:  # matplotlib is the `plot` extra
        raise CLIError(str(e)) from None
    print(info.summary())
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CLIError(f"{flag} takes comma-separated integers, e.g. 0,2,4; got {text!r}") from None
    if not values or min(values) < 0:
        raise CLIError(f"{flag} takes integers >= 0, got {text!r}")
    return values


def _bench_run(f: Any, getter: Any, items: Any, batch_size: int, workers: int, seconds: float) -> tuple[float, float, float]:
    """(items/s, MB/s of the batch arrays, seconds to the first batch) of one served configuration."""
    import time

    from h5store.benchmark import time_batches

    t0 = time.perf_counter()
    loader = f.serve(dict(x=getter), batch_size=batch_size, shuffle=True, num_workers=workers,
                     persistent_workers=workers > 0, items=items)
    it = iter(loader)
    next(it)  # start-up (workers, open files, first read) is reported apart, not timed with the rate
    first = time.perf_counter() - t0
    # Later epochs follow in the same run: persistent workers stay up.
    run = time_batches(lambda: loader, min_seconds=seconds, started=it)
    return run.rate, run.payload / run.seconds / 1e6, first  # returning drops the loader: its workers shut down


def _cmd_bench(args: argparse.Namespace) -> int:
    import numpy as np

    import h5store
    import h5store.serving.loader  # torch's import now: it is no part of the file's start-up time
    from h5store.schema import Feature
    from h5store.serving import Item, Window

    workers = _int_list(args.workers, "--workers")
    if args.batch_size <= 0 or args.seconds <= 0 or args.window <= 0:
        raise CLIError("--batch-size, --seconds and --window must be > 0")
    with h5store.open(args.file) as f:
        if args.feature:
            names = [n.strip() for n in args.feature.split(",") if n.strip()]
        else:
            rows = [r for r in f.describe() if r["group"] == "" and r["items"]]
            if not rows:
                raise CLIError(f"{args.file}: no feature of the root group holds items")
            names = [max(rows, key=lambda r: r["data_bytes"])["feature"]]
            others = sorted(r["feature"] for r in rows if r["feature"] != names[0])
            print(f"feature: {names[0]} (the largest; --feature to choose{': ' + ', '.join(others) if others else ''})")
        results = []
        for name in names:
            group, _, short = name.strip("/").rpartition("/")
            view = f.group(group).feature(short)
            feat, spec = view.feature, view.feature.spec()
            items = np.flatnonzero(view.present)
            if not items.size:
                raise CLIError(f"{view.where}: no item to serve")
            getters = [("Item", Item(name))]
            if spec.layout == "blobs" or (spec.layout == "ragged" and type(feat).decode is Feature.decode):
                getters.append((f"Window {args.window}", Window(name, args.window)))
            shape = "(" + ", ".join("T" if d is None else str(d) for d in spec.shape) + ")"
            mean = float(view.lengths[items].mean()) if spec.layout != "fixed" else None
            print(f"{args.file}:{view.where.partition(':')[2]}  {type(feat).__name__} {spec.dtype} {shape} "
                  f"{spec.layout}, {items.size:,} items" + (f", mean length {mean:,.0f}" if mean is not None else "")
                  + f"; batch {args.batch_size}, shuffled, {args.seconds:g} s per run")
            head = f"  {'getter':<14} {'workers':>7} {'items/s':>11} {'MB/s':>9} {'first batch':>12}"
            print(head)
            print("  " + "-" * (len(head) - 2))
            for label, getter in getters:
                for w in workers:
                    rate, mbs, first = _bench_run(f, getter, items, args.batch_size, w, args.seconds)
                    results.append((rate, name, label, w))
                    print(f"  {label:<14} {w:>7} {rate:>11,.0f} {mbs:>9,.1f} {first:>10.2f} s", flush=True)
        print("MB/s counts the batch arrays delivered (decoded, padded); 'first batch' is the start-up "
              "(workers, file opens, first read), left out of the rates.")
        for name in names:
            for label in dict.fromkeys(r[2] for r in results if r[1] == name):
                rate, _, _, w = max(r for r in results if r[1] == name and r[2] == label)
                print(f"fastest {name} {label}: {w} worker{'s' if w != 1 else ''} ({rate:,.0f} items/s)")
    return 0


# The audio parameters of the presets (see :func:`preset`): flag, default, what it sets.
_PRESET_FLAGS = (("--sr", 22050, "sample rate"), ("--n-fft", 1024, "FFT size"), ("--hop-length", 256, "hop length"),
                 ("--n-mels", 80, "mel bands"))


def build_parser() -> argparse.ArgumentParser:
    from h5store import __version__

    p = argparse.ArgumentParser(prog="h5store", description="Pack training data into one HDF5 file and inspect it.")
    p.add_argument("--version", action="version", version=f"h5store {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("create", help="build a file from raw sources in parallel")
    c.add_argument("schema", help=f"module:Class, or a preset: {', '.join(PRESETS)}")
    c.add_argument("out", help="the .h5 file to write, or s3://bucket/key (built in TMPDIR, then uploaded)")
    c.add_argument("sources", nargs="+", help="folders, globs, CSV manifests or files")
    c.add_argument("--workers", "-j", type=int, default=None, help="worker processes (default: all cores)")
    c.add_argument("--resume", action="store_true", help="continue an interrupted create")
    sharding = c.add_mutually_exclusive_group()
    sharding.add_argument("--shard-size", type=int, default=None,
                          help="ids per shard: OUT becomes a folder of shard files and index.json (docs/shards.md)")
    sharding.add_argument("--shards", type=int, default=None, help="the number of shards (instead of --shard-size)")
    existing = c.add_mutually_exclusive_group()
    existing.add_argument("--append", action="store_true",
                          help="add to an existing file the sources it does not hold yet")
    existing.add_argument("--overwrite", action="store_true",
                          help="replace an existing file (without --append or --overwrite, an existing file is refused)")
    c.add_argument("--on-error", choices=("skip", "raise"), default="skip")
    c.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    for flag, default, what in _PRESET_FLAGS:
        c.add_argument(flag, type=int, default=default, help=f"presets: {what}")
    c.set_defaults(run=_cmd_create)

    i = sub.add_parser("info", help="what a file holds")
    i.add_argument("file")
    i.add_argument("--max-failures", type=int, default=20)
    i.set_defaults(run=_cmd_info)

    v = sub.add_parser("verify", help="check a file's structure, ids, indexes and every item's CRC-32 "
                                      "(--quick: structure only, item data not read)")
    v.add_argument("file")
    v.add_argument("--quick", action="store_true",
                   help="check structure, ids and indexes only: item data is not read (not checked)")
    v.add_argument("--deep", action="store_true", help="accepted for older scripts: every item is checked by default")
    v.add_argument("--untrusted", action="store_true",
                   help="refuse links, external storage, unusual filters and oversized declarations, "
                        "checking in a memory- and time-limited child process")
    v.add_argument("--max-errors", type=int, default=1000, help="problems listed (all are counted)")
    v.add_argument("--timeout", type=float, default=600.0, help="--untrusted: seconds before the check is killed")
    v.add_argument("--max-memory", type=int, default=2048, help="--untrusted: MiB the check may allocate")
    v.set_defaults(run=_cmd_verify)

    pu = sub.add_parser("push", help="upload a file to object storage (s3://bucket/key), checked first; readers "
                                     "see the old object or the whole new one")
    pu.add_argument("file", help="the local h5store file, or a sharded dataset's folder (its shards go up first, "
                                 "index.json last)")
    pu.add_argument("url", help="s3://bucket/key (a sharded dataset: s3://bucket/prefix; endpoint and credentials: "
                                "AWS_ENDPOINT_URL, AWS_* variables)")
    pu.add_argument("--overwrite", action="store_true", help="replace an object already at the URL")
    pu.add_argument("--deep", action="store_true",
                    help="also check every item's CRC-32 before uploading (reads the whole file)")
    pu.add_argument("--part-size", type=int, default=None, help="MiB per part of a multipart upload (default 64)")
    pu.add_argument("--concurrency", type=int, default=4, help="parts uploaded at once")
    pu.set_defaults(run=_cmd_push)

    r = sub.add_parser("recover", help="inspect a rollback journal left by a crash; --apply restores what it can")
    r.add_argument("file")
    r.add_argument("--apply", action="store_true",
                   help="restore the pages that check out, truncate to the committed size, keep a damaged "
                        "journal as <journal>.damaged-<time>, then verify the file")
    r.set_defaults(run=_cmd_recover)

    pl = sub.add_parser("plot", help="draw one item of a feature (spectrograms with Hz and seconds) to a PNG")
    pl.add_argument("file")
    pl.add_argument("id", help="the item's id (or its position)")
    pl.add_argument("--feature", "-f", default=None, help="feature name, or group/name (default: the first spectrogram)")
    pl.add_argument("--output", "-o", default=None, help="image file, format from its extension (default: <feature>.png)")
    for flag, default, unit in (("--width", 10.0, "inches"), ("--height", 4.0, "inches"),
                                ("--dpi", 100.0, "pixels per inch")):
        pl.add_argument(flag, type=float, default=default, help=unit)
    pl.set_defaults(run=_cmd_plot)

    rp = sub.add_parser("report", help="one self-contained HTML page: schema, length histograms, random items "
                                       "drawn and played, ingest failures, verify, logs")
    rp.add_argument("file")
    rp.add_argument("--output", "-o", default=None, help="the HTML file (default: <file name>-report.html)")
    rp.add_argument("-n", type=int, default=8, help="random items to show (only these are read)")
    rp.add_argument("--seed", type=int, default=0, help="which random items (the same seed shows the same ones)")
    rp.add_argument("--verify", choices=("quick", "deep", "none"), default="quick",
                    help="quick: structure, ids and indexes (default); deep: every item's CRC-32 (reads the "
                         "whole file); none")
    rp.set_defaults(run=_cmd_report)

    b = sub.add_parser("bench", help="serving speed on this file: items/s and MB/s per getter and worker count")
    b.add_argument("file")
    b.add_argument("--feature", "-f", default=None, help="feature(s), comma-separated (default: the largest)")
    b.add_argument("--batch-size", "-b", type=int, default=16)
    b.add_argument("--workers", "-j", default="0,2", help="DataLoader worker counts to try, comma-separated")
    b.add_argument("--seconds", type=float, default=3.0, help="timed seconds per configuration")
    b.add_argument("--window", type=int, default=64, help="rows of the Window getter (variable-length features)")
    b.set_defaults(run=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``h5store`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # a closed pipe is reported here, not by the interpreter at exit
        return code
    except KeyboardInterrupt:
        print("h5store: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `h5store info f.h5 | head`: the reader left; exit quietly, as cat and ls do. Point
        # stdout at /dev/null so the interpreter's final flush does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a killed writer
    except (H5StoreError, CLIError, OSError, ValueError, KeyError) as e:
        if os.environ.get("H5STORE_DEBUG"):
            raise
        msg = str(e) if not isinstance(e, KeyError) or isinstance(e, H5StoreError) else str(e.args[0])
        print(f"h5store: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
