"""See a dataset: one self-contained HTML page about an h5store file (``h5store report``).

The page answers what a person opening an unfamiliar training set asks first: what is in
it (the schema, stored parameters, sizes on disk, format and library versions), how long
the items are (a histogram and summary statistics per feature, from the index alone), what
a few random items look and sound like (spectrograms with real axes, thumbnails, text,
class names, an audio player), what went wrong at create (the stored ingest failures) and
whether the file checks out (a verify pass), and the training logs stored beside the data
(loss curves).

Bounded cost: statistics come from the index tables (no item is read), and only the ``n``
chosen items (plus the curves of log groups) are read, in one planned read per feature,
each checked against its CRC-32. A report of a file of a million items costs what its
index tables cost. ``verify="deep"`` reads every item (the whole file): ask for it.

The page holds everything it shows: PNG images and WAV audio as ``data:`` URIs, inline CSS,
one small inline script that records whether every image and sound decoded, and a
Content-Security-Policy that forbids the browser any other load. It opens from disk with
no network. matplotlib (the ``plot`` extra) draws the figures; librosa (Griffin-Lim, to
hear spectrograms) is imported only when a spectrogram is turned into sound; neither is
imported by ``import h5store``.

Each feature says how it is shown (:meth:`Feature.display_kind <h5store.Feature.display_kind>`,
:meth:`~h5store.Feature.display`, :meth:`~h5store.Feature.sound`,
:meth:`~h5store.Feature.rows_per_second`), so user-defined features appear sensibly too.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import os
import sys
import time
import wave
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from h5store.errors import H5StoreError
from h5store.features.audio import Audio, MagSpectrogram
from h5store.ingest_report import stored_failures
from h5store.integrity import verify as verify_file
from h5store.objstore import is_remote, remote_object
from h5store.plot import draw
from h5store.schema import Feature

__all__ = ["SECTIONS", "ReportInfo", "write_report"]

#: The page's sections, by their HTML id, in order (each is always present, empty or not).
SECTIONS = ("overview", "schema", "lengths", "items", "ingest", "verify", "logs")
_VERIFY = ("quick", "deep", "none")
_DRAWN = ("spectrogram", "waveform", "curve", "matrix")
_MAX_CLIP_S = 30.0  # seconds of audio embedded per item
_MAX_TEXT = 2000  # characters of a text item shown
_MAX_FAILURES = 200  # ingest failures listed one by one (all are counted)
_MAX_CURVES = 20  # ids of a log group drawn
_MAX_POINTS = 4000  # points of a curve drawn (longer ones are averaged in blocks)
_THUMB = 256  # pixels: longest side of an image thumbnail
_FRAMES_SHOWN = 6


@dataclass
class ReportInfo:
    """What :func:`write_report` did.

    Attributes
    ----------
    path : str
        The HTML file written.
    items : list of str
        The ids shown (root group), in file order.
    items_read : int
        Items read from the file (the shown ones, per feature, and the curves of log groups).
    seconds : dict
        Wall seconds per stage (``statistics``, ``items``, ``verify``, ``logs``, ``total``).
    bytes : int
        Size of the HTML file.
    """

    path: str
    items: list[str] = field(default_factory=list)
    items_read: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: int = 0

    def summary(self) -> str:
        return (f"{self.path}: {len(self.items)} items shown, {self.items_read} items read, "
                f"{self.bytes / 1e6:.1f} MB, written in {self.seconds.get('total', 0.0):.1f} s")


# --------------------------------------------------------------------------- encoders
def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("h5store's report needs matplotlib: pip install h5store[plot]") from None
    return matplotlib


def _figure(w: float, h: float) -> Any:
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _fig_uri(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _img(uri: str, alt: str, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f'<img{c} src="{uri}" alt="{html.escape(alt)}">'


def _pixels_uri(a: np.ndarray) -> str:
    """A thumbnail (longest side at most ``_THUMB`` pixels) of ``(H, W[, C])`` uint8 pixels."""
    from PIL import Image  # matplotlib's own dependency

    a = np.asarray(a, dtype=np.uint8)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    im = Image.fromarray(np.ascontiguousarray(a))
    if max(im.size) > _THUMB:
        scale = _THUMB / max(im.size)
        im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    if im.mode in ("L", "RGB"):
        im.save(buf, format="JPEG", quality=88)
        kind = "jpeg"
    else:
        im.save(buf, format="PNG")
        kind = "png"
    return f"data:image/{kind};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _wav_uri(y: np.ndarray, sr: int, normalise: bool) -> str:
    """16-bit PCM WAV of mono float samples (peak-normalised for reconstructions)."""
    y = np.nan_to_num(np.asarray(y, dtype=np.float64)[: int(_MAX_CLIP_S * sr)])
    if normalise and y.size and np.max(np.abs(y)) > 0:
        y = 0.9 * y / np.max(np.abs(y))
    pcm = (np.clip(y, -1.0, 1.0) * 32767.0).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sr))
        w.writeframes(pcm.tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    h, rest = divmod(int(round(s)), 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d} h" if h else f"{m}:{sec:02d} min"


def _e(x: Any) -> str:
    return html.escape(str(x))


def _short(x: Any, limit: int = 300) -> str:
    if isinstance(x, np.ndarray):
        text = np.array2string(x, threshold=20, precision=4, edgeitems=3)
    elif isinstance(x, (np.generic, float)):
        text = f"{x:.6g}" if isinstance(x, (float, np.floating)) else str(x)
    else:
        text = repr(x) if not isinstance(x, str) else x
    return text if len(text) <= limit else text[:limit] + " ..."


def _shape(shape: Any) -> str:
    if shape is None:
        return "(set by the 1st item)"
    return "(" + ", ".join("T" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


# --------------------------------------------------------------------------- sections
def _overview(f: Any, n_shown: int, seed: int, verify: str) -> str:
    h5 = f.h5
    version = getattr(sys.modules.get("h5store"), "__version__", "?")
    groups = [g for g in f.file_schema.groups if g]
    rows = [
        ("file", f.path if is_remote(f.path) else os.path.abspath(f.path)),
        ("schema class", f.file_schema.name),
        ("ids", f"{len(f):,}" + (f" (groups: {', '.join(f'{g} {len(f.group(g)):,}' for g in groups)})" if groups else "")),
        ("size on disk", _human(remote_object(f.path).size if is_remote(f.path) else os.path.getsize(f.path))),
        ("format version", h5.attrs.get("h5store_format", "?")),
        ("written by", f"h5store {h5.attrs.get('h5store_version', '?')}"),
        ("this report", f"h5store {version}, {datetime.datetime.now().isoformat(timespec='seconds')}; "
                        f"{n_shown} random items (seed {seed}); verify: {verify}"),
    ]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}<tr><th>time</th><td id="timing">@@TIMING@@</td></tr></table>'


_STORAGE_PARAMS = ("compression", "compression_opts", "shuffle", "chunk_rows", "attrs")  # shown unless default
_HIDDEN_PARAMS = ("dtype", "shape", "layout", "pattern", "finite")  # in the columns, or how sources were chosen


def _params(feat: Feature) -> str:
    """The parameters that say what the items are (``sr=22050 n_mels=80``...), as code chips."""
    base = Feature()
    out = []
    for k, v in feat.params().items():
        if k in _HIDDEN_PARAMS or (k in _STORAGE_PARAMS and v == getattr(base, k, None)):
            continue
        if isinstance(v, (list, tuple)) and len(v) > 12:
            v = [*v[:12], f"... {len(v) - 12} more"]
        out.append(f"<code>{_e(k)}={_e(_short(v, 200))}</code>")
    return " ".join(out)


def _schema(f: Any, described: list[dict[str, Any]]) -> str:
    head = ("<tr><th>group/feature</th><th>type</th><th>shown as</th><th>dtype</th><th>item shape</th><th>layout</th>"
            "<th>items</th><th>on disk</th><th>compression</th><th>stored parameters</th></tr>")
    rows = []
    for r in described:
        feat = f.file_schema.groups[r["group"]][r["feature"]]
        name = f"{r['group'] + '/' if r['group'] else ''}{r['feature']}"
        comp = r["compression"] or "none"
        if r["compression"] and r["ratio"]:
            comp += f" (x{r['ratio']:.1f})"
        rows.append(
            f"<tr><td><b>{_e(name)}</b></td><td>{_e(r['type'])}</td><td>{_e(feat.display_kind())}</td>"
            f"<td>{_e(r['dtype'] or '1st item')}</td><td>{_e(_shape(r['shape']))}</td><td>{_e(r['layout'] or '-')}</td>"
            f"<td class=num>{r['items']:,} / {r['ids']:,}</td><td class=num>{_e(_human(r['disk_bytes']))}</td>"
            f"<td>{_e(comp)}</td><td class=params>{_params(feat)}</td></tr>")
    return f'<table class="grid">{head}{"".join(rows)}</table>'


def _unit(feat: Feature, layout: str | None) -> str:
    kind = feat.display_kind()
    if isinstance(feat, Audio):
        return "samples"
    if kind in ("frames", "spectrogram"):
        return "frames"
    if kind in ("text", "bytes", "image") and layout != "blobs":
        return "bytes"  # text as utf-8, images encoded
    return "blobs" if layout == "blobs" else "rows"


def _lengths(f: Any, described: list[dict[str, Any]]) -> str:
    cards, fixed = [], []
    for r in described:
        if not r["items"]:
            continue
        group, name = r["group"], r["feature"]
        view = f.group(group).feature(name)
        feat = view.feature
        label = f"{group + '/' if group else ''}{name}"
        if r["layout"] == "fixed":
            fixed.append(f"{label} {_shape(r['shape'])}")
            continue
        lengths = view.lengths[view.present]  # the index table only
        unit = _unit(feat, r["layout"])
        rate = feat.rows_per_second()
        q = np.percentile(lengths, [0, 5, 50, 95, 100])
        stats = [("items", f"{lengths.size:,}"), ("missing", f"{r['ids'] - lengths.size:,}"),
                 (f"{unit}: min / 5% / median / 95% / max", " / ".join(f"{v:,.0f}" for v in q)),
                 (f"{unit}: mean", f"{lengths.mean():,.1f}"), (f"{unit}: total", f"{int(lengths.sum()):,}")]
        if rate:
            stats.append(("duration: total", _duration(float(lengths.sum()) / rate)))
            stats.append(("duration: min / median / max", " / ".join(f"{v / rate:.2f} s" for v in (q[0], q[2], q[4]))))
        table = "".join(f"<tr><th>{_e(k)}</th><td class=num>{_e(v)}</td></tr>" for k, v in stats)
        if q[0] == q[4]:
            plot = f"<p>Every item has {q[0]:,.0f} {unit}.</p>"
        else:
            fig = _figure(4.6, 2.2)
            ax = fig.add_subplot()
            x = lengths / rate if rate else lengths
            span = int(q[4] - q[0])
            bins = min(60, span + 1) if not rate and span < 60 else 60
            ax.hist(x, bins=bins, color="#3b6ea8")
            ax.set_xlabel("seconds per item" if rate else f"{unit} per item")
            ax.set_ylabel("items")
            ax.set_title(label, fontsize=10)
            plot = _img(_fig_uri(fig), f"histogram of {label} lengths", "hist")
        cards.append(f'<div class="card"><h3>{_e(label)}</h3>{plot}<table class="kv small">{table}</table></div>')
    if not cards and not fixed:
        return "<p>No feature holds items yet.</p>"
    same = f"<p>Of fixed shape (no length to show): {_e(', '.join(fixed))}.</p>" if fixed else ""
    return ('<p class="note">From the index tables alone: no item was read for these.</p>'
            f'{same}<div class="cards">{"".join(cards)}</div>')


def _draw_uri(feat: Feature, values: np.ndarray, name: str, title: str, kind: str) -> str:
    tall = kind in ("spectrogram", "matrix")
    fig = _figure(6.2, 2.5 if tall else 1.9)
    ax = fig.add_subplot()
    draw(feat, values, ax=ax, name=name, title=title)
    ax.title.set_fontsize(9)
    return _fig_uri(fig)


def _show(feat: Feature, name: str, item_id: str, item: Any) -> str:
    """One item of one feature as HTML, the way its display kind says."""
    kind = feat.display_kind()
    value = feat.display(item)
    if kind in _DRAWN:
        a = np.asarray(value)
        if a.dtype.kind in "biuf" and a.ndim in (1, 2) and a.size:
            if kind == "waveform" and a.ndim == 2:
                a = a.mean(axis=1)
            return _img(_draw_uri(feat, a, name, name, kind), f"{name} of {item_id}", "plot")
        kind = "array"
    if kind == "image":
        a = np.asarray(value)
        return _img(_pixels_uri(a), f"{name} of {item_id}", "thumb") + f'<div class="cap">{_e(_shape(a.shape))} uint8</div>'
    if kind == "frames":
        a = np.asarray(value)
        if not len(a):
            return "<i>no frames</i>"
        picks = np.unique(np.linspace(0, len(a) - 1, min(_FRAMES_SHOWN, len(a))).round().astype(int))
        cells = "".join(f'<figure>{_img(_pixels_uri(a[k]), f"frame {k} of {item_id}", "frame")}'
                        f"<figcaption>frame {k}</figcaption></figure>" for k in picks)
        return f'<div class="frames">{cells}</div><div class="cap">{len(a)} frames of {a.shape[1]}x{a.shape[2]}</div>'
    if kind in ("text", "label"):
        text = str(value)
        cut = text[:_MAX_TEXT] + (f" ... ({len(text):,} characters)" if len(text) > _MAX_TEXT else "")
        return f'<div class="{kind}">{_e(cut)}</div>'
    if kind == "bytes":
        b = value if isinstance(value, (bytes, bytearray)) else np.asarray(value, dtype=np.uint8).tobytes()
        return f'<div class="value">{len(b):,} bytes: <code>{_e(b[:16].hex(" "))}{" ..." if len(b) > 16 else ""}</code></div>'
    if kind == "array" and isinstance(value, np.ndarray) and value.size and value.dtype.kind in "biuf":
        return (f'<div class="value">{_e(value.dtype)} {_e(value.shape)}: min {value.min():.4g}, '
                f"mean {value.mean():.4g}, max {value.max():.4g}</div>")
    return f'<div class="value">{_e(_short(value))}</div>'


def _sound_order(feats: dict[str, Feature]) -> list[str]:
    """Features to hear an item by, best first: stored audio, then magnitudes, then the rest."""
    def rank(name: str) -> int:
        ft = feats[name]
        return 0 if isinstance(ft, Audio) else 1 if isinstance(ft, MagSpectrogram) else 2
    return sorted(feats, key=rank)


def _items(f: Any, n: int, seed: int, info: ReportInfo, sampled: dict[str, Any]) -> str:
    group = f.group("")
    n_ids = len(group)
    if not n_ids or n <= 0:
        return "<p>No item to show.</p>" if not n_ids else "<p>No item asked for (n=0).</p>"
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(n_ids, size=min(n, n_ids), replace=False)).astype(np.int64)
    ids = [group.ids[int(r)] for r in rows]
    info.items = ids
    feats = {name: group.feature(name).feature for name in group.features}
    read: dict[str, dict[int, Any]] = {}
    errors: dict[tuple[str, int], str] = {}
    for name in feats:
        view = group.feature(name)
        try:
            present = view.present
        except H5StoreError as e:
            for r in rows:
                errors[(name, int(r))] = str(e)
            continue
        if not len(present):  # awaiting its first item
            continue
        have = rows[present[rows]]
        got: dict[int, Any] = {}
        try:
            got = dict(zip(have.tolist(), view.read_many(have, verify=True)))
        except H5StoreError:  # one bad item: read them one by one to name it
            for r in have.tolist():
                try:
                    got[r] = view.read_many([r], verify=True)[0]
                except H5StoreError as e:
                    errors[(name, r)] = str(e)
        info.items_read += len(have)
        read[name] = got
    sampled.update(checked=sum(len(v) for v in read.values()), failed=errors)
    # Words first (labels, text, values), then pictures, then what is drawn: a card reads top down.
    first = ("label", "text", "value", "bytes", "array", "image", "frames")
    shown_order = sorted(feats.items(), key=lambda kv: first.index(k) if (k := kv[1].display_kind()) in first else 9)
    cards = []
    for r, item_id in zip(rows.tolist(), ids):
        parts = []
        for name in _sound_order(feats):
            if r not in read.get(name, {}):
                continue
            try:
                heard = feats[name].sound(read[name][r])
            except ImportError as e:  # librosa missing: say so, show the rest
                parts.append(f'<div class="err">no sound from {_e(name)}: {_e(e)}</div>')
                break
            if heard is not None:
                y, sr, how = heard
                stored = how == "stored audio"
                parts.append(f'<div class="sound"><audio controls preload="metadata" '
                             f'src="{_wav_uri(y, sr, normalise=not stored)}"></audio>'
                             f'<span class="cap">{_e(name)}: {_e(how)}</span></div>')
                break
        for name, feat in shown_order:
            if (name, r) in errors:
                body = f'<div class="err">{_e(errors[(name, r)])}</div>'
            elif r in read.get(name, {}):
                try:
                    body = _show(feat, name, item_id, read[name][r])
                except Exception as e:  # noqa: BLE001 - a user's display hook must not cost the whole page
                    body = (f'<div class="err">cannot show this item as {_e(feat.display_kind())}: '
                            f"{_e(type(e).__name__)}: {_e(e)}</div>")
            else:
                body = '<div class="cap">(no item)</div>'
            parts.append(f'<div class="feat"><div class="fname">{_e(name)} <span class="kind">'
                         f'{_e(feat.display_kind())}</span></div>{body}</div>')
        cards.append(f'<div class="card item"><h3>{_e(item_id)} <span class="cap">position {r:,}</span></h3>'
                     f'{"".join(parts)}</div>')
    return (f'<p class="note">{len(ids)} of {n_ids:,} items, drawn at random with seed {seed}, '
            f'each read once and checked against its CRC-32.</p><div class="cards items">{"".join(cards)}</div>')


def _ingest(f: Any) -> str:
    failures = stored_failures(f)
    if not failures:
        return "<p>No failure stored: every source the creates and appends saw was stored.</p>"
    by = Counter((x.feature, x.error) for x in failures)
    counts = "".join(f"<tr><td>{_e(ft)}</td><td>{_e(err)}</td><td class=num>{k:,}</td></tr>"
                     for (ft, err), k in by.most_common())
    listed = "".join(f"<tr><td>{_e(x.source)}</td><td>{_e(x.id)}</td><td>{_e(x.feature)}</td><td>{_e(x.error)}</td>"
                     f"<td>{_e(x.message)}</td></tr>" for x in failures[:_MAX_FAILURES])
    more = f"<p>... and {len(failures) - _MAX_FAILURES:,} more.</p>" if len(failures) > _MAX_FAILURES else ""
    sources = len({x.source for x in failures})
    return (f"<p><b>{sources:,}</b> source(s) failed and were not stored ({len(failures):,} feature errors).</p>"
            f'<table class="grid"><tr><th>feature</th><th>error</th><th>sources</th></tr>{counts}</table>'
            f'<table class="grid"><tr><th>source</th><th>id</th><th>feature</th><th>error</th><th>reason</th></tr>'
            f"{listed}</table>{more}")


def _verify(f: Any, verify: str, sampled: dict[str, Any]) -> str:
    checked, failed = sampled.get("checked", 0), sampled.get("failed", {})
    crc = (f"<p>The {checked} items read to show the random ids (each of their features): "
           + ("all match their CRC-32.</p>" if not failed else f"<b class=bad>{len(failed)} failed</b> "
              "(shown in red above).</p>"))
    if verify == "none":
        return crc + "<p>No verify pass (asked for none). <code>h5store verify FILE</code> checks every item.</p>"
    report = verify_file(f.path, deep=verify == "deep", max_errors=50)
    cls = "ok" if report else "bad"
    lines = "".join(f"<li>{_e(p)}</li>" for p in report.problems)
    more = f"<li>... and {report.n_problems - len(report.problems)} more</li>" if report.n_problems > len(report.problems) else ""
    note = "" if verify == "deep" else (" A quick pass read the structure, ids and indexes only; "
                                         "<code>h5store verify FILE</code> (or <code>--verify deep</code>) reads every item.")
    return (f'<p class="{cls}"><b>{"OK" if report else "PROBLEMS"}</b>: {_e(report.summary())}</p>'
            f"{'<ul>' + lines + more + '</ul>' if lines else ''}<p class=note>"
            f"Checked in {report.seconds:.2f} s.{note}</p>{crc}")


def _thin(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a curve, averaged in blocks to at most ``_MAX_POINTS`` points."""
    y = np.asarray(y, dtype=np.float64).ravel()
    if y.size <= _MAX_POINTS:
        return np.arange(y.size), y
    k = -(-y.size // _MAX_POINTS)
    m = y.size // k
    return np.arange(m) * k + (k - 1) / 2, y[: m * k].reshape(m, k).mean(axis=1)


def _logs(f: Any, info: ReportInfo) -> str:
    out = []
    for gname in f.file_schema.groups:
        if not gname:
            continue
        group = f.group(gname)
        n_ids = len(group)
        for name, feat in group.features.items():
            label = f"{gname}/{name}"
            view = group.feature(name)
            if not n_ids or not len(view.present) or not view.present.any():
                out.append(f'<div class="card"><h3>{_e(label)}</h3><p>No item yet.</p></div>')
                continue
            rows = np.flatnonzero(view.present)
            if feat.display_kind() != "curve":
                total = int(view.lengths[rows].sum())
                out.append(f'<div class="card"><h3>{_e(label)}</h3><p>{rows.size:,} item(s) ({_e(feat.display_kind())}, '
                           f"{total:,} {_unit(feat, view.feature.spec().layout)} in all): not drawn.</p></div>")
                continue
            shown = rows[-_MAX_CURVES:]
            curves = view.read_many(shown, verify=True)
            info.items_read += len(shown)
            fig = _figure(7.0, 2.8)
            ax = fig.add_subplot()
            for r, y in zip(shown.tolist(), curves):
                x, yy = _thin(y)
                ax.plot(x, yy, linewidth=1.0, label=group.ids[r])
            ax.set_xlabel("step")
            ax.set_ylabel(name)
            ax.set_title(label, fontsize=10)
            if len(shown) > 1:
                ax.legend(fontsize=7, ncols=2 if len(shown) > 6 else 1)
            note = f" (the last {len(shown)} of {rows.size:,})" if rows.size > len(shown) else ""
            names = ", ".join(f"{group.ids[r]} ({len(y):,} steps)" for r, y in zip(shown.tolist(), curves))
            out.append(f'<div class="card wide"><h3>{_e(label)}{_e(note)}</h3>'
                       f'{_img(_fig_uri(fig), f"{label} curves", "plot")}<div class="cap">{_e(names)}</div></div>')
    if not out:
        return "<p>No other group than the items' (no logs stored).</p>"
    return f'<div class="cards">{"".join(out)}</div>'


# --------------------------------------------------------------------------- the page
_CSS = """
:root { --fg:#1d232b; --muted:#5d6875; --line:#d8dee6; --bg:#f5f7fa; --card:#fff; --accent:#3b6ea8; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color:var(--fg);
       background:var(--bg); }
header { background:#1f3550; color:#fff; padding:14px 24px; }
header h1 { margin:0; font-size:20px; font-weight:600; }
header .sub { color:#c9d6e6; font-size:13px; }
nav { position:sticky; top:0; z-index:2; background:#fff; border-bottom:1px solid var(--line); padding:6px 24px; }
nav a { margin-right:16px; color:var(--accent); text-decoration:none; font-weight:500; }
main { padding:8px 24px 40px; }
section { margin-top:18px; }
h2 { font-size:17px; margin:0 0 8px; border-bottom:2px solid var(--line); padding-bottom:4px; }
h3 { font-size:14px; margin:0 0 6px; }
table { border-collapse:collapse; background:var(--card); margin:6px 0 10px; }
table.grid th, table.grid td { border:1px solid var(--line); padding:4px 8px; text-align:left; vertical-align:top; }
table.grid th { background:#eef2f7; }
table.kv th { text-align:left; padding:2px 14px 2px 0; color:var(--muted); font-weight:500; }
table.kv td { padding:2px 0; }
table.small { font-size:12.5px; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
td.params code { display:inline-block; margin:1px 4px 1px 0; }
code { background:#eef2f7; padding:0 3px; border-radius:3px; font-size:12.5px; }
.cards { display:grid; grid-template-columns:repeat(auto-fill, minmax(380px, 1fr)); gap:12px; }
.cards.items { grid-template-columns:repeat(auto-fill, minmax(560px, 1fr)); }
.card { background:var(--card); border:1px solid var(--line); border-radius:6px; padding:10px 12px; }
.card.wide { grid-column:1 / -1; }
.card img.plot, .card img.hist { max-width:100%; height:auto; display:block; }
.feat { margin-top:8px; }
.fname { font-weight:600; font-size:12.5px; color:var(--muted); }
.kind { font-weight:400; background:#eef2f7; border-radius:3px; padding:0 4px; }
.cap { color:var(--muted); font-size:12px; font-weight:400; }
.text { white-space:pre-wrap; background:#fbfbf3; border-left:3px solid #d9cf8f; padding:4px 8px; }
.label { display:inline-block; background:#e5f0e1; border:1px solid #b6d3ac; border-radius:12px; padding:1px 10px; }
.value { font-family:ui-monospace, monospace; font-size:12.5px; white-space:pre-wrap; }
.sound { display:flex; align-items:center; gap:8px; }
.sound audio { height:32px; width:300px; }
img.thumb { max-width:100%; border:1px solid var(--line); }
.frames { display:flex; flex-wrap:wrap; gap:4px; }
.frames figure { margin:0; text-align:center; font-size:11px; color:var(--muted); }
img.frame { display:block; max-height:64px; border:1px solid var(--line); }
.err, .bad { color:#b3261e; }
.ok { color:#23683a; }
.note { color:var(--muted); font-size:12.5px; }
"""

# Records, on <html>, whether every image and sound decoded and whether anything was refused:
# the browser test reads these from the DOM; a person sees a red line at the top if not.
_SCRIPT = """
(function () {
  var root = document.documentElement, failed = 0, refused = 0;
  root.dataset.failed = "0"; root.dataset.refused = "0";
  document.addEventListener("error", function (e) {
    if (e.target && e.target !== window && e.target.tagName) { failed++; root.dataset.failed = String(failed); }
  }, true);
  document.addEventListener("securitypolicyviolation", function () { refused++; root.dataset.refused = String(refused); });
  function check() {
    var imgs = document.images, ok = 0, i;
    for (i = 0; i < imgs.length; i++) { if (imgs[i].complete && imgs[i].naturalWidth > 0) { ok++; } }
    var sounds = document.querySelectorAll("audio"), heard = 0;
    for (i = 0; i < sounds.length; i++) { if (sounds[i].readyState >= 1 && sounds[i].duration > 0) { heard++; } }
    root.dataset.images = ok + "/" + imgs.length;
    root.dataset.audio = heard + "/" + sounds.length;
    var bad = document.getElementById("load-problem");
    if (bad) { bad.hidden = (ok === imgs.length && failed === 0 && refused === 0); }
    root.dataset.checked = "1";
  }
  window.addEventListener("load", function () { check(); setTimeout(check, 300); setTimeout(check, 1500); });
})();
"""

_CSP = ("default-src 'none'; img-src data:; media-src data:; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; base-uri 'none'; form-action 'none'")


def _page(title: str, sections: dict[str, tuple[str, str]]) -> str:
    nav = "".join(f'<a href="#{sid}">{_e(head)}</a>' for sid, (head, _) in sections.items())
    body = "".join(f'<section id="{sid}"><h2>{_e(head)}</h2>{content}</section>'
                   for sid, (head, content) in sections.items())
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style><script>{_SCRIPT}</script></head><body>"
        f'<header><h1>{_e(title)}</h1><div class="sub">an h5store report</div></header>'
        f'<nav>{nav}</nav><main><p id="load-problem" class="bad" hidden>Some images or sounds of this page '
        f"did not load.</p>{body}</main></body></html>\n"
    )


def write_report(file: Any, path: str | os.PathLike[str], n: int = 8, seed: int = 0, verify: str = "quick",
                 title: str | None = None) -> ReportInfo:
    """Write one self-contained HTML page about an open file: see :mod:`h5store.report`.

    Parameters
    ----------
    file : TypedFile
        An open file (``h5store.open(path)`` or your class).
    path : str or Path
        The HTML file to write (replaced if it exists).
    n : int
        Random items of the root group to show (read, drawn, played).
    seed : int
        Which items: the same seed shows the same items.
    verify : {"quick", "deep", "none"}
        The verify pass shown: "quick" checks structure, ids and indexes (no item data
        read, so the cost stays bounded); "deep" also reads every item and checks its
        CRC-32 (reads the whole file); "none" skips it. The shown items are always checked.
    title : str, optional
        The page title (default: the file's name).

    Returns
    -------
    ReportInfo
        The path, the ids shown, how many items were read, the seconds per stage.

    Examples
    --------
    >>> import h5store
    >>> from h5store.report import write_report
    >>> with h5store.open("speech.h5") as f:  # doctest: +SKIP
    ...     print(write_report(f, "speech.html", n=12).summary())
    speech.html: 12 items shown, 48 items read, 3.1 MB, written in 4.2 s
    """
    if verify not in _VERIFY:
        raise ValueError(f"verify must be one of {', '.join(_VERIFY)}, got {verify!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an int >= 0 (items to show), got {n!r}")
    _matplotlib()
    out = os.fspath(path)
    info = ReportInfo(out)
    t0 = time.perf_counter()
    described = file.describe()  # index tables and HDF5 metadata only
    sections: dict[str, tuple[str, str]] = {}
    sections["overview"] = ("Overview", _overview(file, min(n, len(file)), seed, verify))
    sections["schema"] = ("Schema", _schema(file, described))
    sections["lengths"] = ("Item lengths", _lengths(file, described))
    t1 = time.perf_counter()
    sampled: dict[str, Any] = {}
    sections["items"] = ("Random items", _items(file, int(n), seed, info, sampled))
    t2 = time.perf_counter()
    sections["ingest"] = ("Ingest failures", _ingest(file))
    sections["verify"] = ("Verify", _verify(file, verify, sampled))
    t3 = time.perf_counter()
    sections["logs"] = ("Logs", _logs(file, info))
    t4 = time.perf_counter()
    info.seconds = dict(statistics=t1 - t0, items=t2 - t1, verify=t3 - t2, logs=t4 - t3)
    timing = ", ".join(f"{k} {v:.2f} s" for k, v in info.seconds.items())
    page = _page(title or file.path.rstrip("/").rpartition("/")[2], sections)
    info.seconds["total"] = time.perf_counter() - t0
    page = page.replace("@@TIMING@@", _e(f"{info.seconds['total']:.2f} s to build this page ({timing}); "
                                         f"{info.items_read} items read"), 1)
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, out)
    info.bytes = os.path.getsize(out)
    return info
