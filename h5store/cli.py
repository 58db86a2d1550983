"""The ``h5store`` command line: create, info.

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


def _cmd_create(args: argparse.Namespace) -> int:
    cls = load_schema(args.schema, sr=args.sr, n_fft=args.n_fft, hop_length=args.hop_length, n_mels=args.n_mels)
    f = cls.create(args.out, args.sources, n_workers=args.workers, resume=args.resume, on_error=args.on_error,
                   mode="a" if args.append else "w", progress=not args.quiet)
    report = f.report  # type: ignore[attr-defined]
    f.close()
    print(f"{args.out}: {report.summary()}")
    for failure in report.failures:
        print(f"  failed: {failure}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import h5store
    from h5store.ingest import stored_failures

    with h5store.open(args.file) as f:
        schema = f.file_schema
        size = os.path.getsize(args.file)
        print(f"{args.file}: {schema.name}, {len(f)} ids, {_human(size)} on disk, "
              f"h5store format {f.h5.attrs.get('h5store_format')} (written by {f.h5.attrs.get('h5store_version')})")
        head = f"{'group/feature':<24} {'type':<26} {'items':>9} {'dtype':<8} {'item shape':<14} {'length p0/p50/p95/max':<24} {'disk':>10} {'compr.':>8}"
        print(head)
        print("-" * len(head))
        for row in f.describe():
            name = f"{row['group'] + '/' if row['group'] else ''}{row['feature']}"
            shape = "(" + ", ".join("T" if d is None else str(d) for d in row["shape"]) + ")"
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


def build_parser() -> argparse.ArgumentParser:
    from h5store import __version__

    p = argparse.ArgumentParser(prog="h5store", description="Pack training data into one HDF5 file and inspect it.")
    p.add_argument("--version", action="version", version=f"h5store {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("create", help="build a file from raw sources in parallel")
    c.add_argument("schema", help=f"module:Class, or a preset: {', '.join(PRESETS)}")
    c.add_argument("out", help="the .h5 file to write")
    c.add_argument("sources", nargs="+", help="folders, globs, CSV manifests or files")
    c.add_argument("--workers", "-j", type=int, default=None, help="worker processes (default: all cores)")
    c.add_argument("--resume", action="store_true", help="continue an interrupted create")
    c.add_argument("--append", action="store_true", help="add the sources the file does not hold yet")
    c.add_argument("--on-error", choices=("skip", "raise"), default="skip")
    c.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    c.add_argument("--sr", type=int, default=22050, help="presets: sample rate")
    c.add_argument("--n-fft", type=int, default=1024, help="presets: FFT size")
    c.add_argument("--hop-length", type=int, default=256, help="presets: hop length")
    c.add_argument("--n-mels", type=int, default=80, help="presets: mel bands")
    c.set_defaults(run=_cmd_create)

    i = sub.add_parser("info", help="what a file holds")
    i.add_argument("file")
    i.add_argument("--max-failures", type=int, default=20)
    i.set_defaults(run=_cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``h5store`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("h5store: interrupted", file=sys.stderr)
        return 130
    except (H5StoreError, CLIError, OSError, ValueError, KeyError) as e:
        if os.environ.get("H5STORE_DEBUG"):
            raise
        msg = str(e) if not isinstance(e, KeyError) or isinstance(e, H5StoreError) else str(e.args[0])
        print(f"h5store: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
