"""Video benchmark (issue 17): seed 002's pipeline -- HDF5 files of 100 variable-length JPEG
videos each, random 8-frame clips, batch 16 -- against what its users write.

Data: four files of 100 videos of 8-40 frames (128x96 JPEG, quality 90), 400 videos; an epoch
is one random clip per video. Every pipeline is shuffled and decodes every frame.

tf.data (one process, interleaved rounds; from_generator's malloc change then applies to all):

(G)   the Q&A's answer: ``Dataset.interleave`` over the files of ``from_generator``; the
      generator opens the file with h5py, reads each clip's bytes in one slice and decodes
      the 8 JPEGs with PIL; ``.batch(16)``.
(G3)  the same user's better version: the generator yields the 8 JPEG byte strings,
      ``tf.io.decode_jpeg`` decodes them in a parallel ``map`` (AUTOTUNE).
(T)   ``h5s.interleave(paths, dict(x=h5s.Clips("video", 8), ...), 16)``: clips read and decoded
      (simplejpeg, GIL released) in tf.data's reader threads, files mixed in every batch;
      ``num_parallel_calls`` AUTOTUNE, 1 and 2 (1 vs 2 readers).
(TB)  ``h5s.Clips(..., encoded=True)``: the clip's bytes, decoded by ``tf.io.decode_jpeg`` in a
      parallel map (the other option of point 1, measured to choose).

numpy: ``h5s.concat(paths).iter_batches(...)`` with 1 and 2 reader threads.

PyTorch: ``h5s.concat(paths).serve(...)`` with 0 and 2 workers against a hand-written h5py
``Dataset`` (file opened lazily per worker, index read once, clip bytes in one slice, PIL
decode, default collate), 0 and 2 workers.

Decoders: one 128x96 frame decoded by PIL, simplejpeg and OpenCV (per frame, and two threads
against one: does the decoder release the GIL?).

Images (point 6): an ImageFolder corpus (JPEG files, one folder per class, 200-500 x 150-375
pixels) served as random resized crops (torchvision's rule, scale 0.08-1, ratio 3/4-4/3) to
112x112 + random flip, batch 32, shuffled, 0 and 2 workers: ``h5s.ImageCrop`` over
``EncodedImage`` + ``DirLabel`` against (P) a hand-written PIL ``Dataset`` over the files
(``Image.open().convert("RGB")``, ``resize(box=crop)``, flip: what torchvision's transforms do)
and (W) WebDataset tar shards (4 shards, ``decode("pil")``, the same transform, ``batched``).

Run from the repository root::

    .venv/bin/python benchmarks/bench_video.py                     # full run, writes RESULTS.md
    .venv/bin/python benchmarks/bench_video.py --quick --no-write  # smoke run
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import h5store as h5s
from benchmarks import _common as C

HEADING = "Video and images (issue 17)"


@dataclass
class Config:
    n_files: int = 4
    per_file: int = 100
    lo: int = 8
    hi: int = 40
    height: int = 96
    width: int = 128
    quality: int = 90
    clip: int = 8
    batch: int = 16
    repeat: int = 3
    min_seconds: float = 2.0
    max_seconds: float = 6.0
    min_batches: int = 4
    quick: bool = False


# The smoke run (tests/test_benchmarks_smoke.py): every pipeline and table, tiny (2 files of 8 short
# videos, 16 images), one timed run of each without a warm-up (C.rounds), and one run, not two.
QUICK = Config(n_files=2, per_file=8, hi=16, repeat=1, min_seconds=0.0, max_seconds=0.5, min_batches=1, quick=True)


class Videos(h5s.TypedFile):
    video = h5s.EncodedFrames()
    label = h5s.Scalar(dtype="int64")


# --------------------------------------------------------------------------- data
def frame(rng: np.random.Generator, h: int, w: int, t: int, phase: float) -> np.ndarray:
    """A moving textured frame: smooth gradients plus noise (JPEG sizes like camera frames)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = 128 + 100 * np.sin((x + 3 * t) / 9 + phase)
    g = 128 + 100 * np.cos((y - 2 * t) / 7 + phase)
    b = 128 + 60 * np.sin((x + y + t) / 13)
    a = np.stack([r, g, b], -1) + rng.normal(0, 12, (h, w, 3))
    return np.clip(a, 0, 255).astype(np.uint8)


def jpeg_bytes(a: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def make_files(cfg: Config, cache: Path) -> list[str]:
    key = f"v{cfg.n_files}x{cfg.per_file}_{cfg.lo}-{cfg.hi}_{cfg.width}x{cfg.height}_q{cfg.quality}"
    folder = cache / key
    paths = [str(folder / f"videos{k}.h5") for k in range(cfg.n_files)]
    if all(os.path.exists(p) for p in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k, path in enumerate(paths):
        tmp = path + ".tmp"
        with Videos(tmp, mode="w") as f:
            for i in range(cfg.per_file):
                n = int(rng.integers(cfg.lo, cfg.hi + 1))
                phase = float(rng.uniform(0, 6))
                frames = [jpeg_bytes(frame(rng, cfg.height, cfg.width, t, phase), cfg.quality) for t in range(n)]
                f.add(f"f{k}/v{i:03d}", dict(video=frames, label=int(rng.integers(0, 10))))
        os.replace(tmp, path)
    return paths


# --------------------------------------------------------------------------- what users write
class UserFile:
    """A user's own reader of one file with plain h5py: tables read once, one slice per clip."""

    def __init__(self, path: str) -> None:
        import h5py

        self.h5 = h5py.File(path, "r")
        self.data = self.h5["video/data"]
        self.index = self.h5["video/index"][()]
        self.frames = self.h5["video/frames"][()]
        self.labels = self.h5["label/data"][()]

    def __len__(self) -> int:
        return len(self.index)

    def clip_bytes(self, i: int, k: int, rng: np.random.Generator) -> list[bytes]:
        a, b = self.index[i]
        t0 = a + int(rng.integers(0, b - a - k + 1))
        span = self.frames[t0 : t0 + k]
        base = int(span[0, 0])
        block = self.data[base : int(span[-1, 1])].tobytes()
        return [block[s - base : e - base] for s, e in span.tolist()]

    def close(self) -> None:
        self.h5.close()


def pil_decode(b: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))


class _Gen:
    """The Q&A's callable generator class: one file per call, a new order per call (epoch)."""

    def __init__(self, decode: bool, clip: int) -> None:
        self.decode, self.clip = decode, clip
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, path: bytes) -> Any:
        with self.lock:
            self.calls += 1
            seed = self.calls
        f = UserFile(path.decode())
        rng = np.random.default_rng(seed)
        try:
            for i in rng.permutation(len(f)):
                clip = f.clip_bytes(int(i), self.clip, rng)
                if self.decode:
                    yield np.stack([pil_decode(b) for b in clip]), f.labels[i]
                else:
                    yield np.array(clip, dtype=object), f.labels[i]
        finally:
            f.close()


def user_tf(paths: list[str], decode_in_generator: bool, cfg: Config) -> Any:
    """(G) / (G3): what the seed's users write, in its strongest form."""
    import tensorflow as tf

    k, h, w = cfg.clip, cfg.height, cfg.width
    sig_x = tf.TensorSpec((k, h, w, 3), tf.uint8) if decode_in_generator else tf.TensorSpec((k,), tf.string)
    sig = (sig_x, tf.TensorSpec((), tf.int64))
    gen = _Gen(decode_in_generator, k)
    ds = tf.data.Dataset.from_tensor_slices(paths).interleave(
        lambda p: tf.data.Dataset.from_generator(gen, args=(p,), output_signature=sig),
        cycle_length=len(paths), num_parallel_calls=tf.data.AUTOTUNE)
    if not decode_in_generator:
        def decode(x: Any, y: Any) -> Any:
            frames = tf.stack([tf.io.decode_jpeg(x[t], channels=3) for t in range(k)])
            frames.set_shape((k, h, w, 3))
            return frames, y
        ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(cfg.batch).prefetch(tf.data.AUTOTUNE)
    return lambda: ds


def tuple_size(batch: Any) -> tuple[int, int]:
    x = batch[0] if isinstance(batch, (tuple, list)) else batch["x"]
    return int(x.shape[0]), int(np.prod(x.shape)) if hasattr(x, "shape") else 0


# --------------------------------------------------------------------------- PyTorch: the user's Dataset
class UserDataset:
    """A hand-written map-style Dataset over the files: h5py opened lazily per process, PIL decode."""

    def __init__(self, paths: list[str], k: int) -> None:
        import h5py

        self.paths, self.k = paths, k
        sizes = []
        for p in paths:
            with h5py.File(p, "r") as h:
                sizes.append(len(h["video/index"]))
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.files: dict[int, UserFile] = {}
        self.calls = 0

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        j = int(np.searchsorted(self.starts, i, side="right")) - 1
        f = self.files.get(j)
        if f is None:
            f = self.files[j] = UserFile(self.paths[j])
        self.calls += 1
        rng = np.random.default_rng([i, self.calls, os.getpid()])
        clip = np.stack([pil_decode(b) for b in f.clip_bytes(i - int(self.starts[j]), self.k, rng)])
        return torch.from_numpy(clip), int(f.labels[i - int(self.starts[j])])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "files": {}}


# --------------------------------------------------------------------------- decoders
def decoder_table(cfg: Config, paths: list[str]) -> str:
    """CPU time per frame of each decoder (one thread), two threads against one, pixels against PIL."""
    f = Videos(paths[0])
    blobs = [bytes(b) for b in f.video.frames(0, encoded=True)[:8]]
    f.close()
    import simplejpeg
    import tensorflow as tf

    def each(fn: Any) -> Any:
        return lambda: np.stack([fn(b) for b in blobs])

    fns: dict[str, Any] = {"PIL": each(pil_decode),
                           "simplejpeg (h5store.jpeg)": each(lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB"))}
    try:
        import cv2

        cv2.setNumThreads(1)
        fns["OpenCV imdecode + BGR->RGB"] = each(lambda b: cv2.cvtColor(
            cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB))
    except ImportError:
        pass
    strings = tf.constant(blobs)
    spec = tf.TensorSpec((cfg.height, cfg.width, 3), tf.uint8)
    for label, method in (("tf.io.decode_jpeg (default)", ""), ("tf.io.decode_jpeg (INTEGER_ACCURATE)",
                                                                 "INTEGER_ACCURATE")):
        graph = tf.function(lambda s, m=method: tf.map_fn(lambda x: tf.io.decode_jpeg(x, channels=3, dct_method=m), s,
                                                          fn_output_signature=spec))
        fns[label] = lambda g=graph: g(strings).numpy()
    ref = np.stack([pil_decode(b) for b in blobs])
    n = 50 if cfg.repeat > 1 else 5  # calls of 8 frames

    def one(fn: Any) -> tuple[float, float]:
        c, t = time.process_time(), time.perf_counter()
        for _ in range(n):
            fn()
        return time.process_time() - c, time.perf_counter() - t

    def two(fn: Any) -> float:
        with ThreadPoolExecutor(2) as ex:
            t = time.perf_counter()
            list(ex.map(lambda _: one(fn), range(2)))
            return time.perf_counter() - t

    cpu: dict[str, list[float]] = {k: [] for k in fns}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    pairs: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up (tf traces its function)
    for _ in range(max(3, cfg.repeat)):
        for name, fn in fns.items():
            c, w = one(fn)
            cpu[name].append(c)
            wall[name].append(w)
            pairs[name].append(two(fn))
    frames = 8 * n
    base = min(cpu["PIL"]) / frames
    rows = []
    for name, fn in fns.items():
        diff = int(np.abs(fn().astype(int) - ref).max())
        per = min(cpu[name]) / frames
        scaling = 2 * min(wall[name]) / min(pairs[name])
        rows.append([name, f"{per * 1e6:.0f}", C.fmt_ratio(base / per), C.fmt_ratio(scaling), diff])
    return C.md_table(["decoder", "CPU µs per 128x96 frame", "vs PIL", "2 threads vs 1 (wall)",
                       "max abs diff to PIL"], rows)


# --------------------------------------------------------------------------- images
@dataclass
class ImageConfig:
    n_images: int = 800
    classes: int = 8
    size: int = 112
    batch: int = 32
    shards: int = 4


IMAGE_QUICK = ImageConfig(n_images=16, classes=4, batch=8, shards=2)


class Photos(h5s.TypedFile):
    image = h5s.EncodedImage()
    label = h5s.DirLabel()


def make_images(icfg: ImageConfig, cache: Path) -> tuple[list[str], str, list[str]]:
    """JPEG files in class folders, the h5store file made from them, and WebDataset shards."""
    from PIL import Image

    folder = cache / f"img{icfg.n_images}x{icfg.classes}"
    root = folder / "train"
    path = folder / "photos.h5"
    shards = [str(folder / f"shard{k}.tar") for k in range(icfg.shards)]
    if not path.exists():
        rng = np.random.default_rng(1)
        for i in range(icfg.n_images):
            d = root / f"class{i % icfg.classes}"
            d.mkdir(parents=True, exist_ok=True)
            h, w = int(rng.integers(150, 376)), int(rng.integers(200, 501))
            a = frame(rng, h, w, i, float(rng.uniform(0, 6)))
            Image.fromarray(a).save(d / f"img{i:05d}.jpg", quality=90)
        tmp = folder / "photos.tmp.h5"
        Photos.create(tmp, sources=str(root), n_workers=2, progress=False).close()
        os.replace(tmp, path)
    files = sorted(str(p) for p in root.glob("*/*.jpg"))
    if not all(os.path.exists(s) for s in shards):
        import webdataset as wds

        classes = sorted({Path(p).parent.name for p in files})
        order = np.random.default_rng(2).permutation(len(files))
        for k, shard in enumerate(shards):
            with wds.TarWriter(shard + ".tmp") as sink:
                for j in order[k :: len(shards)].tolist():
                    p = Path(files[j])
                    sink.write({"__key__": f"{p.parent.name}_{p.stem}", "jpg": p.read_bytes(),
                                "cls": classes.index(p.parent.name)})
            os.replace(shard + ".tmp", shard)
    return files, str(path), shards


def rrc(im: Any, size: int, rng: np.random.Generator) -> np.ndarray:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip on a PIL image, by hand."""
    from PIL import Image

    from h5store.serving.getters import crop_boxes

    box = crop_boxes(np.array([im.height]), np.array([im.width]), (0.08, 1.0), (3 / 4, 4 / 3),
                     int(rng.integers(2**31)), 0, np.zeros(1, np.int64))[0]
    top, left, ch, cw = box.tolist()
    out = im.resize((size, size), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    if rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return np.array(out)


class PilFolder:
    """(P) the hand-written ImageFolder Dataset: open, convert, crop + resize, flip."""

    def __init__(self, files: list[str], size: int) -> None:
        self.files, self.size = files, size
        classes = sorted({Path(p).parent.name for p in files})
        self.labels = [classes.index(Path(p).parent.name) for p in files]
        self.calls = 0

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        self.calls += 1
        rng = np.random.default_rng([i, self.calls, os.getpid()])
        with Image.open(self.files[i]) as im:
            x = rrc(im.convert("RGB"), self.size, rng)
        return torch.from_numpy(x), self.labels[i]


class _WdsTransform:
    def __init__(self, size: int) -> None:
        self.size = size
        self.rng: np.random.Generator | None = None

    def __call__(self, sample: tuple[Any, int]) -> tuple[Any, int]:
        if self.rng is None:
            self.rng = np.random.default_rng(os.getpid())
        return rrc(sample[0], self.size, self.rng), sample[1]


def wds_loader(shards: list[str], icfg: ImageConfig, workers: int) -> Any:
    """(W) WebDataset: shards shuffled, samples shuffled in a buffer, decoded with PIL, batched."""
    import torch
    import webdataset as wds

    ds = (wds.WebDataset(shards, shardshuffle=len(shards), nodesplitter=None, empty_check=False)
          .shuffle(256).decode("pil").to_tuple("jpg", "cls").map(_WdsTransform(icfg.size))
          .batched(icfg.batch, collation_fn=_collate_pairs))
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def _collate_pairs(samples: list[tuple[np.ndarray, int]]) -> tuple[Any, Any]:
    import torch

    return torch.from_numpy(np.stack([s[0] for s in samples])), torch.tensor([s[1] for s in samples])


def image_section(icfg: ImageConfig, cfg: Config, cache: Path, run: int) -> str:
    import torch
    from torch.utils.data import DataLoader

    with C.step("images: data"):
        files, path, shards = make_images(icfg, cache)
    C.warm_page_cache([path, *files, *shards])
    load = C.LoadAverage()
    f = Photos(path)
    batch = dict(x=h5s.ImageCrop("image", icfg.size), y=h5s.Label("label"))
    pil = PilFolder(files, icfg.size)
    loaders: dict[str, Any] = {}
    for w in (0, 2):
        extra = dict(persistent_workers=True) if w else {}
        loaders[f"h5store w{w}"] = f.serve(batch, icfg.batch, shuffle=True, num_workers=w, **extra)
        loaders[f"PIL Dataset w{w}"] = DataLoader(pil, icfg.batch, shuffle=True, num_workers=w, **extra)
        loaders[f"WebDataset w{w}"] = wds_loader(shards, icfg, w)
    torch.set_num_threads(1)
    tm = dict(min_seconds=cfg.min_seconds, max_seconds=cfg.max_seconds, min_batches=cfg.min_batches)
    t = C.rounds({k: (lambda ld=ld: C.time_batches(lambda: ld, size=tuple_size, **tm)) for k, ld in loaders.items()},
                 cfg.repeat, "images", warm_up=not cfg.quick)
    load.stop()
    f.close()

    def ratio(a: str, b: str) -> str:
        return C.fmt_ratio(t[a].rate / t[b].rate) if a in t and b in t else "-"

    rows = [[k, C.fmt_rate(v.rate), ratio(k, "PIL Dataset " + k.split()[-1]), ratio(k, "WebDataset " + k.split()[-1])]
            for k, v in t.items()]
    targets = C.md_table(["target", "measured", "met?"], [
        [f"images >= 1.5x the PIL Dataset ({w} workers)", ratio(f"h5store {w}", f"PIL Dataset {w}"),
         _met(t, f"h5store {w}", f"PIL Dataset {w}", 1.5)] for w in ("w0", "w2")])
    return "\n".join([
        "",
        f"### Images: random resized crops, run {run} ({C.today()})",
        "",
        f"{len(files)} JPEG files (200-500 x 150-375, quality 90) in {icfg.classes} class folders; random resized "
        f"crop (scale 0.08-1, ratio 3/4-4/3) to {icfg.size}x{icfg.size} + random flip, batch {icfg.batch}, shuffled; "
        f"images/s of the best of {cfg.repeat} interleaved rounds. (P): a hand-written PIL Dataset over the files; "
        f"(W): WebDataset, {icfg.shards} tar shards, `decode(\"pil\")`, the same transform. " + C.load_note(load.span),
        "",
        C.md_table(["loader", "images/s", "vs PIL Dataset, same workers", "vs WebDataset, same workers"], rows),
        "",
        targets,
    ])


# --------------------------------------------------------------------------- main
def main() -> None:
    ap = C.parser(__doc__, "where the video files are cached")
    ap.add_argument("--runs", type=int, default=None,
                    help="whole measurements, one after the other (all reported; default 2, 1 with --quick)")
    args = ap.parse_args()
    cfg = QUICK if args.quick else Config()
    runs = max(1, args.runs if args.runs is not None else 1 if args.quick else 2)
    started = time.perf_counter()
    cache = Path(args.cache_dir)
    with C.step("data"):
        paths = make_files(cfg, cache)
    command = " ".join(["benchmarks/bench_video.py", *sys.argv[1:]])
    parts = [f"Command: `{command}` ({runs} runs, one after the other, each reported: the machine is "
             "shared, so both are shown)."]
    for run in range(1, runs + 1):
        parts.append(video_section(cfg, paths, run))
        parts.append(image_section(IMAGE_QUICK if args.quick else ImageConfig(), cfg, cache, run))
    C.publish(HEADING, "\n".join(parts), not args.no_write, started)


def video_section(cfg: Config, paths: list[str], run: int) -> str:
    C.warm_page_cache(paths)
    import tensorflow as tf
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    load = C.LoadAverage()
    clip = dict(x=h5s.Clips("video", cfg.clip), y=h5s.Label("label"))
    tb = dict(x=h5s.Clips("video", cfg.clip, encoded=True), y=h5s.Label("label"))
    tm = dict(min_seconds=cfg.min_seconds, max_seconds=cfg.max_seconds, min_batches=cfg.min_batches)

    def tf_decode(b: Any) -> Any:
        flat = tf.reshape(b["x"], [-1])
        frames = tf.map_fn(lambda s: tf.io.decode_jpeg(s, channels=3), flat, parallel_iterations=cfg.batch * cfg.clip,
                           fn_output_signature=tf.TensorSpec((cfg.height, cfg.width, 3), tf.uint8))
        return dict(x=tf.reshape(frames, (-1, cfg.clip, cfg.height, cfg.width, 3)), y=b["y"])

    seeds = iter(range(10**6))

    def mk_t(calls: Any) -> Any:
        ds = h5s.interleave(paths, clip, cfg.batch, shuffle=True, cycle_length=cfg.n_files, num_parallel_calls=calls,
                            seed=next(seeds))
        return lambda: ds

    tb_ds = h5s.interleave(paths, tb, cfg.batch, shuffle=True, cycle_length=cfg.n_files,
                           num_parallel_calls=tf.data.AUTOTUNE).map(tf_decode, num_parallel_calls=tf.data.AUTOTUNE)
    tf_runs = {
        "G": user_tf(paths, True, cfg),
        "G3": user_tf(paths, False, cfg),
        "T": mk_t(tf.data.AUTOTUNE),
        "T1": mk_t(1),
        "T2": mk_t(2),
        "TB": lambda: tb_ds,
    }
    tf_timings = C.rounds({k: (lambda e=e: C.time_batches(e, size=tuple_size, **tm)) for k, e in tf_runs.items()},
                          cfg.repeat, "tf.data", warm_up=not cfg.quick)
    multi = h5s.concat(paths)
    np_timings = C.rounds({
        f"N{t}": (lambda t=t: C.time_batches(lambda: multi.iter_batches(clip, cfg.batch, shuffle=True, threads=t),
                                             size=tuple_size, **tm)) for t in (1, 2)}, cfg.repeat, "numpy",
        warm_up=not cfg.quick)
    user = UserDataset(paths, cfg.clip)
    loaders = {
        "h5store w0": multi.serve(clip, cfg.batch, shuffle=True, num_workers=0),
        "h5store w2": multi.serve(clip, cfg.batch, shuffle=True, num_workers=2, persistent_workers=True),
        "h5py Dataset w0": DataLoader(user, cfg.batch, shuffle=True, num_workers=0),
        "h5py Dataset w2": DataLoader(user, cfg.batch, shuffle=True, num_workers=2, persistent_workers=True),
    }
    torch_timings = C.rounds({k: (lambda ld=ld: C.time_batches(lambda: ld, size=tuple_size, **tm))
                              for k, ld in loaders.items()}, cfg.repeat, "torch", warm_up=not cfg.quick)
    with C.step("decoders"):
        decoders = decoder_table(cfg, paths)
    load.stop()

    def r(t: dict[str, Any], a: str, b: str) -> str:
        return C.fmt_ratio(t[a].rate / t[b].rate) if a in t and b in t else "-"

    rate = {**tf_timings, **np_timings, **torch_timings}
    names = {
        "G": "(G) Q&A: interleave(from_generator), PIL in the generator",
        "G3": "(G3) generator yields JPEG bytes, tf.io.decode_jpeg in a parallel map",
        "T": "(T) h5s.interleave + Clips, decoded in the reader threads (AUTOTUNE)",
        "T1": "(T) ... num_parallel_calls=1",
        "T2": "(T) ... num_parallel_calls=2",
        "TB": "(TB) h5s.interleave + Clips(encoded=True), tf.io.decode_jpeg in a parallel map",
        "N1": "numpy iter_batches, threads=1",
        "N2": "numpy iter_batches, threads=2",
    }
    def cpu(k: str) -> str:
        return f"{rate[k].cpu_us_per_item / 1000:.2f}" if k in rate else "-"

    def cpu_ratio(a: str, b: str) -> str:
        return C.fmt_ratio(rate[b].cpu_us_per_item / rate[a].cpu_us_per_item) if a in rate and b in rate else "-"

    tf_rows = [[names[k], C.fmt_rate(rate[k].rate), f"{rate[k].cores:.2f}", cpu(k), r(rate, k, "G"), r(rate, k, "G3"),
                cpu_ratio(k, "G3")] for k in ("G", "G3", "T", "T1", "T2", "TB", "N1", "N2") if k in rate]
    torch_rows = [[k, C.fmt_rate(t.rate), f"{t.cores:.2f}", cpu(k) if k.endswith("w0") else "-",
                   r(rate, k, "h5py Dataset " + k.split()[-1])] for k, t in torch_timings.items()]
    cores = [t.cores for t in tf_timings.values()]
    notes = (
        f"Reading the figures: each tf.data/numpy pipeline kept {min(cores):.2f}-{max(cores):.2f} cores busy "
        "(column cores) at the load noted above. Where the machine was quiet and a pipeline still stays well "
        "below 2 cores, its own serial part (Python holding the GIL around each batch) limits it, not other jobs. "
        "CPU ms per clip (process CPU time per clip, all threads; workers not counted) is the figure the load "
        "moves least: what a clip costs. ")
    if "T1" in rate and "G3" in rate:
        notes += (f"h5store's tf.data path (T1) spent {cpu_ratio('T1', 'G3')} less CPU per clip than G3 "
                  f"({cpu('T1')} against {cpu('G3')} ms); its throughput also depends on the cores it keeps busy (column cores). ")
    if "T1" in rate and "TB" in rate:
        cheaper = "T" if rate["T1"].cpu_us_per_item < rate["TB"].cpu_us_per_item else "TB"
        notes += (f"Decoding in the reader threads (T1, {cpu('T1')} ms) against tf.io.decode_jpeg in the graph "
                  f"(TB, {cpu('TB')} ms): {cheaper} was cheaper in this run.")
    targets = C.md_table(["target", "measured", "met?"], [
        ["tf.data >= 1.5x G3", r(rate, "T", "G3"), _met(rate, "T", "G3", 1.5)],
        ["2 readers >= 1.7x one (tf.data T2/T1)", r(rate, "T2", "T1"), _met(rate, "T2", "T1", 1.7)],
        ["2 readers >= 1.7x one (numpy N2/N1)", r(rate, "N2", "N1"), _met(rate, "N2", "N1", 1.7)],
        ["torch 2 workers >= 1.8x 0 workers", r(rate, "h5store w2", "h5store w0"),
         _met(rate, "h5store w2", "h5store w0", 1.8)],
    ])
    text = "\n".join([
        "",
        f"### Video clips, run {run} ({C.today()})",
        "",
        f"{cfg.n_files} files x {cfg.per_file} videos of {cfg.lo}-{cfg.hi} frames ({cfg.width}x{cfg.height} JPEG, "
        f"quality {cfg.quality}); one random {cfg.clip}-frame clip per video per epoch, batch {cfg.batch}, shuffled; "
        f"clips/s of the best of {cfg.repeat} interleaved rounds; cores = process CPU time / wall time "
        "(worker processes not counted). " + C.load_note(load.span),
        "",
        "tf.data and numpy:",
        "",
        C.md_table(["pipeline", "clips/s", "cores", "CPU ms per clip", "vs G", "vs G3", "CPU per clip: G3 / this"],
                   tf_rows),
        "",
        "PyTorch (`h5s.concat(paths).serve(...)` against a hand-written h5py Dataset with PIL decode):",
        "",
        C.md_table(["loader", "clips/s", "cores (main process)", "CPU ms per clip", "vs the h5py Dataset, same workers"],
                   torch_rows),
        "",
        "Targets:",
        "",
        targets,
        "",
        notes,
        "",
        "JPEG decoders (one 128x96 frame; best of interleaved rounds):",
        "",
        decoders,
    ])
    return text


def _met(rate: dict[str, Any], a: str, b: str, target: float) -> str:
    if a not in rate or b not in rate:
        return "-"
    return "yes" if rate[a].rate / rate[b].rate >= target else "no"


if __name__ == "__main__":
    main()
