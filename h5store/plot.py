"""Look at one stored item: spectrograms drawn with their real axes, from the stored parameters.

A mel spectrogram is drawn on a mel-scaled frequency axis labelled in Hz (from the stored
``sr``, ``fmin``, ``fmax`` and ``n_mels``), a magnitude spectrogram on a log-frequency axis
in Hz (from ``sr`` and ``n_fft``), both against time in seconds (from ``sr`` and
``hop_length``) with a colour bar. The file does not need its class: ``h5store.open``
restores the parameters, so this works on any file a colleague sends.

matplotlib is the ``plot`` extra (``pip install h5store[plot]``), imported when a plot is
drawn, never by ``import h5store``. Without an ``ax`` and with pyplot not imported, the
figure is drawn on matplotlib's Agg canvas (no display needed, the global backend is left
alone); with pyplot already imported (a notebook, a script that calls ``plt.show()``), the
figure is made by pyplot so it shows as usual.

The command line does the same: ``h5store plot speech.h5 LJ001-0001 --feature mel -o mel.png``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from h5store.access import FeatureView
from h5store.errors import SchemaError
from h5store.features.audio import MFCC, Audio, MagSpectrogram, MelSpectrogram
from h5store.schema import Feature

__all__ = ["draw", "hz_to_mel", "mel_to_hz", "plot", "plot_feature", "plottable", "save_plot"]

_HZ_TICKS = (32, 64, 125, 250, 500, 1000, 2000, 4000, 8000, 16000, 32000)
_MEL_TICKS = (0, 100, 200, 500, 1000, 2000, 4000, 8000, 16000, 32000)
_SPECTRAL = (MelSpectrogram, MagSpectrogram, MFCC)
_TOP_DB = 80.0


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("h5store's plots need matplotlib: pip install h5store[plot]") from None
    return matplotlib


# --------------------------------------------------------------------------- the mel scale
def hz_to_mel(hz: Any) -> np.ndarray:
    """Slaney's mel scale (librosa's default, ``htk=False``): linear below 1 kHz, log above.

    Examples
    --------
    >>> float(hz_to_mel(1000.0)), round(float(mel_to_hz(hz_to_mel(4000.0))), 6)
    (15.0, 4000.0)
    """
    f = np.asarray(hz, dtype=np.float64)
    logstep = np.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / logstep, f / (200.0 / 3))


def mel_to_hz(mel: Any) -> np.ndarray:
    """The inverse of :func:`hz_to_mel`."""
    m = np.asarray(mel, dtype=np.float64)
    logstep = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), m * (200.0 / 3))


def _hz_label(hz: float) -> str:
    return f"{hz / 1000:g}k" if hz >= 1000 else f"{hz:g}"


def _spaced(positions: list[float], labels: list[str], span: float) -> tuple[list[float], list[str]]:
    """Drop ticks closer than 6% of the axis to the previous one kept."""
    keep_p: list[float] = []
    keep_l: list[str] = []
    for p, lab in zip(positions, labels):
        if not keep_p or p - keep_p[-1] >= 0.06 * span:
            keep_p.append(p)
            keep_l.append(lab)
    return keep_p, keep_l


# --------------------------------------------------------------------------- drawing
def _to_db(values: np.ndarray, feat: Any) -> tuple[np.ndarray, str, float | None]:
    """Values to show, the colour bar's label and its lowest value, from how the feature stored them."""
    log = getattr(feat, "log", False)
    if log is True or log == "log":
        return values, "ln", None
    if log == "db":
        shown, unit = values, "dB"
    else:
        # Linear power or magnitude is all black on a linear colour scale: show it in dB.
        shown, unit = (20.0 / float(feat.power)) * np.log10(np.maximum(values, 1e-10)), "dB (computed for display)"
    top = float(np.max(shown)) if shown.size else 0.0
    return shown, unit, top - _TOP_DB  # as librosa's top_db: the last 80 dB hold what there is to see


def _new_axes(ax: Any, size: tuple[float, float], dpi: float) -> Any:
    if ax is not None:
        return ax
    if "matplotlib.pyplot" in sys.modules:  # the user's session: let pyplot manage (and show) it
        return sys.modules["matplotlib.pyplot"].subplots(figsize=size, dpi=dpi)[1]
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig.add_subplot()


def _time_extent(n: int, feat: Any) -> tuple[float, float]:
    dt = feat.hop_length / feat.sr
    return -0.5 * dt, (n - 0.5) * dt


def _draw_mel(ax: Any, values: np.ndarray, feat: MelSpectrogram) -> None:
    shown, unit, vmin = _to_db(values, feat)
    fmax = feat.fmax if feat.fmax is not None else feat.sr / 2
    n = feat.n_mels
    im = ax.imshow(shown.T, origin="lower", aspect="auto", cmap="magma", interpolation="nearest", vmin=vmin,
                   extent=(*_time_extent(len(values), feat), -0.5, n - 0.5))
    # Bands are equally spaced in mel between fmin and fmax (n + 2 edges, the centres inside).
    centres = np.linspace(hz_to_mel(feat.fmin), hz_to_mel(fmax), n + 2)[1:-1]
    hz = [h for h in _MEL_TICKS if feat.fmin <= h <= fmax]
    pos = np.interp(hz_to_mel(np.array(hz, dtype=float)), centres, np.arange(n)).tolist()
    pos, labels = _spaced(pos, [_hz_label(h) for h in hz], n)
    ax.set_yticks(pos, labels)
    ax.set_ylabel("frequency (Hz, mel scale)")
    ax.figure.colorbar(im, ax=ax, label=unit)


def _draw_mag(ax: Any, values: np.ndarray, feat: MagSpectrogram) -> None:
    shown, unit, vmin = _to_db(values, feat)
    df = feat.sr / feat.n_fft
    k = values.shape[1]
    # Bin k is centred on k * sr / n_fft; the DC bin has no place on a log axis.
    y_edges = (np.arange(1, k + 1) - 0.5) * df
    t0, t1 = _time_extent(len(values), feat)
    x_edges = np.linspace(t0, t1, len(values) + 1)
    mesh = ax.pcolormesh(x_edges, y_edges, shown[:, 1:].T, cmap="magma", shading="flat", vmin=vmin,
                         rasterized=True)
    ax.set_yscale("log")
    hz = [h for h in _HZ_TICKS if y_edges[0] <= h <= y_edges[-1]]
    ax.set_yticks(hz, [_hz_label(h) for h in hz])
    ax.yaxis.set_minor_locator(_matplotlib().ticker.NullLocator())
    ax.set_ylim(y_edges[0], y_edges[-1])
    ax.set_ylabel("frequency (Hz, log scale)")
    ax.figure.colorbar(mesh, ax=ax, label=unit)


def _draw_image(ax: Any, values: np.ndarray, ylabel: str, extent: tuple[float, float] | None, label: str) -> None:
    n = values.shape[1]
    x0, x1 = extent if extent is not None else (-0.5, len(values) - 0.5)
    im = ax.imshow(values.T, origin="lower", aspect="auto", cmap="viridis", interpolation="nearest",
                   extent=(x0, x1, -0.5, n - 0.5))
    ax.set_ylabel(ylabel)
    ax.figure.colorbar(im, ax=ax, label=label)


def plottable(file: Any, group: str = "") -> list[str]:
    """Names of the features of ``group`` that :func:`plot` can draw, spectrograms first.

    Examples
    --------
    >>> plottable(h5store.open("speech.h5"))  # doctest: +SKIP
    ['mel', 'mag']
    """
    return _ranked(file.group(group).features)


def _ranked(feats: dict[str, Feature]) -> list[str]:
    spectral = [n for kind in _SPECTRAL for n, ft in feats.items() if isinstance(ft, kind)]
    return spectral + [n for n, ft in feats.items() if n not in spectral and _drawable(ft)]


def _drawable(feat: Any) -> bool:
    spec = feat.spec()
    if isinstance(feat, Audio):
        return True
    if type(feat).decode is not Feature.decode:
        return False  # decodes to something else (text, images, a class name): not rows of numbers
    return spec.layout == "ragged" and len(spec.shape) in (1, 2) and spec.np_dtype.kind in "biuf"


def plot(view: FeatureView, id: str | int, ax: Any = None) -> Any:
    """Draw one item of a feature and return the matplotlib ``Axes``.

    Parameters
    ----------
    view : FeatureView
        A feature of an open file: ``f.mel``, ``h5store.open(path).mag``, ``f.logs.loss``.
    id : str or int
        The item: its id, or its position.
    ax : matplotlib Axes, optional
        Where to draw (default: a new 10 x 4 inch figure).

    Returns
    -------
    matplotlib.axes.Axes

    Notes
    -----
    ``MelSpectrogram``: a mel-scaled frequency axis labelled in Hz; ``MagSpectrogram``: a
    log-frequency axis in Hz (the DC bin is left out); ``MFCC``: coefficient number; all
    three against seconds, with a colour bar. Values stored linear (``log=False``) are shown
    in dB. ``Audio`` draws the waveform. Any other variable-length numeric feature draws as
    an image (rows x columns) or a curve (a loss log, for instance).

    Examples
    --------
    >>> import h5store, h5store.plot
    >>> f = h5store.open("speech.h5")  # doctest: +SKIP
    >>> ax = h5store.plot.plot(f.mel, f.ids[0])  # doctest: +SKIP
    >>> ax.figure.savefig("mel.png")  # doctest: +SKIP
    """
    if not isinstance(view, FeatureView):
        raise TypeError(f"plot takes a feature of an open file (f.mel), got {type(view).__name__}; "
                        "for a file and a feature name use plot_feature(f, id, feature='mel')")
    feat = view.feature
    name = view.refs[id] if isinstance(id, (int, np.integer)) else id
    values = view[id]
    if not isinstance(values, np.ndarray) or values.dtype.kind not in "biuf" or values.ndim not in (1, 2) \
            or not _drawable(feat):
        raise SchemaError(f"{view.where}: {type(feat).__name__} items cannot be drawn as a spectrogram, an image "
                          f"of rows or a curve; features that can: {_ranked(view.group.features)}")
    return draw(feat, values, ax=ax, name=view.name, title=f"{view.name}: {name}")


def draw(feature: Feature, values: np.ndarray, ax: Any = None, name: str = "value", title: str | None = None) -> Any:
    """Draw values already read (one item of ``feature``) with the feature's axes; return the Axes.

    What :func:`plot` draws, for an item in hand: the HTML report (:mod:`h5store.report`)
    reads its items in one batch and draws each with this.

    Parameters
    ----------
    feature : Feature
        Whose parameters give the axes (``f.mel.feature``).
    values : numpy.ndarray
        The item, 1-D or 2-D numbers.
    ax : matplotlib Axes, optional
        Where to draw (default: a new 10 x 4 inch figure).
    name : str
        The y label of a curve.
    title : str, optional
        The title; the item's length and its unit are added.

    Examples
    --------
    >>> import numpy as np, h5store as h5s
    >>> from h5store.plot import draw
    >>> ax = draw(h5s.Array(dtype="float32"), np.linspace(1, 0, 50), name="loss", title="run-1")
    >>> ax.get_title()
    'run-1 (50 rows)'
    """
    feat = feature
    ax = _new_axes(ax, (10.0, 4.0), 100.0)
    if isinstance(feat, MelSpectrogram):
        _draw_mel(ax, values, feat)
    elif isinstance(feat, MagSpectrogram):
        _draw_mag(ax, values, feat)
    elif isinstance(feat, MFCC):
        _draw_image(ax, values, "MFCC coefficient", _time_extent(len(values), feat), "")
    elif isinstance(feat, Audio):
        t = np.arange(len(values)) / feat.sr if feat.sr else np.arange(len(values))
        ax.plot(t, values, linewidth=0.5)
        ax.set_ylabel("amplitude")
    elif values.ndim == 2:
        _draw_image(ax, values, "column", None, "value")
    else:
        ax.plot(np.arange(len(values)), values)
        ax.set_ylabel(name)
    timed = isinstance(feat, (*_SPECTRAL, Audio)) and getattr(feat, "sr", None)
    ax.set_xlabel("time (s)" if timed else "row")
    unit = "samples" if isinstance(feat, Audio) else ("frames" if timed else "rows")
    if title is not None:
        ax.set_title(f"{title} ({len(values)} {unit})")
    return ax


def plot_feature(file: Any, id: str | int, feature: str | None = None, ax: Any = None) -> Any:
    """Draw item ``id`` of ``feature`` of an open file (see :func:`plot`).

    Parameters
    ----------
    file : TypedFile or FeatureView
        An open file (``h5store.open(path)`` or your class), or a feature view.
    id : str or int
        The item's id or position.
    feature : str, optional
        ``"mel"``, or ``"group/name"`` for a feature of a group. Default: the first
        spectrogram of the root group (:func:`plottable`).
    ax : matplotlib Axes, optional

    Examples
    --------
    >>> import h5store
    >>> from h5store.plot import plot_feature
    >>> with h5store.open("speech.h5") as f:  # doctest: +SKIP
    ...     plot_feature(f, 0, feature="mag").figure.savefig("mag.png")
    """
    if isinstance(file, FeatureView):
        return plot(file, id, ax=ax)
    if not callable(getattr(file, "group", None)):
        raise TypeError(f"plot_feature takes an open h5store file (h5store.open(path)), got {type(file).__name__}")
    if feature is None:
        names = plottable(file)
        if not names:
            raise SchemaError(f"{file.path}: no feature of the root group can be plotted; name one with feature=")
        feature = names[0]
    group, _, name = feature.strip("/").rpartition("/")
    return plot(file.group(group).feature(name), id, ax=ax)


def save_plot(file: Any, id: str | int, path: str, feature: str | None = None,
              size: tuple[float, float] = (10.0, 4.0), dpi: float = 100.0) -> str:
    """Draw item ``id`` and write it to ``path`` (PNG, SVG, PDF: from the extension).

    The image is ``size`` inches at ``dpi`` (1000 x 400 pixels by default), drawn on the
    Agg canvas whatever backend pyplot uses. Returns ``path``.

    Examples
    --------
    >>> save_plot(h5store.open("speech.h5"), "LJ001-0001", "mel.png", feature="mel")  # doctest: +SKIP
    'mel.png'
    """
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    plot_feature(file, id, feature=feature, ax=fig.add_subplot())
    fig.savefig(path, dpi=dpi)
    return path
