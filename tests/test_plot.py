"""`h5store plot` and h5store.plot: spectrograms drawn with axes from the stored parameters."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import h5store as h5s
from h5store.cli import main

matplotlib = pytest.importorskip("matplotlib")
PIL = pytest.importorskip("PIL.Image")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402 - after the extras check
from matplotlib.figure import Figure  # noqa: E402

from h5store import plot as hplot  # noqa: E402

SR = 16000


class Speech(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=48, fmin=50.0, fmax=7000.0, log="db")
    mag = h5s.MagSpectrogram(sr=SR, n_fft=512, hop_length=128)
    mfcc = h5s.MFCC(sr=SR, n_fft=512, hop_length=128, n_mfcc=13)
    label = h5s.DirLabel(pattern=r"\.wav$")
    text = h5s.Text()
    logs = h5s.Group(loss=h5s.Array(dtype="float32"))


@pytest.fixture(scope="module")
def speech_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two 1-second chirps (real wavs, real create), plus a loss curve in the logs group."""
    import soundfile as sf

    root = tmp_path_factory.mktemp("plot")
    t = np.arange(SR) / SR
    for k, kind in enumerate(("up", "down")):
        (root / "wavs" / kind).mkdir(parents=True)
        f0 = 300.0 if kind == "up" else 3000.0
        x = 0.3 * np.sin(2 * np.pi * (f0 * t + (2500.0 if kind == "up" else -1300.0) * t**2))
        sf.write(root / "wavs" / kind / f"c{k}.wav", x.astype(np.float32), SR)
    f = Speech.create(root / "speech.h5", root / "wavs", n_workers=1, progress=False)
    f.close()
    with Speech(root / "speech.h5", mode="a") as w:
        w.logs.add("run-1", dict(loss=np.linspace(2.0, 0.1, 40)))
    return root / "speech.h5"


def _png_stats(path: Path) -> tuple[tuple[int, int], float, int]:
    with PIL.open(path) as im:
        rgb = np.asarray(im.convert("RGB"))
        size = im.size
    colours = len(np.unique(rgb.reshape(-1, 3), axis=0))
    return size, float(rgb.astype(np.float64).var()), colours


@pytest.mark.parametrize("feature", ["mel", "mag"])
def test_cli_writes_a_png_that_is_not_blank(speech_path: Path, tmp_path: Path, feature: str) -> None:
    out = tmp_path / f"{feature}.png"
    proc = subprocess.run([sys.executable, "-m", "h5store.cli", "plot", str(speech_path), "up/c0", "--feature",
                           feature, "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"{out}: {feature} of id 'up/c0' (1000 x 400 pixels)" in proc.stdout
    size, variance, colours = _png_stats(out)
    assert size == (1000, 400)
    assert variance > 500 and colours > 100  # an image with a colour map, not a blank canvas


def test_cli_size_position_default_feature_and_errors(speech_path: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.png"
    assert main(["plot", str(speech_path), "1", "-o", str(out), "--width", "6", "--height", "3", "--dpi", "50"]) == 0
    # The first spectrogram; "1" is a position (no such id): the output names the id it drew.
    assert re.search(r"mel of id '[^']+' \(position 1\)", capsys.readouterr().out)
    assert _png_stats(out)[0] == (300, 150)
    assert main(["plot", str(speech_path), "nope", "-o", str(out)]) == 1
    assert "no id 'nope'" in capsys.readouterr().err
    assert main(["plot", str(speech_path), "up/c0", "--feature", "label", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("h5store: error:") and "cannot be drawn" in err and "'mel'" in err
    assert main(["plot", str(speech_path), "run-1", "--feature", "logs/loss", "-o", str(out)]) == 0


def _axes() -> object:
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    return fig.add_subplot()


def test_mel_axes_come_from_the_stored_parameters(speech_path: Path) -> None:
    librosa = pytest.importorskip("librosa")
    with h5s.open(speech_path) as f:  # no class: the parameters come from the file
        mel = f.mel["up/c0"]
        ax = hplot.plot(f.mel, "up/c0", ax=_axes())
    assert ax.get_xlabel() == "time (s)" and "Hz" in ax.get_ylabel() and "mel" in ax.get_ylabel()
    hop = 128 / SR
    assert ax.get_xlim() == pytest.approx((-0.5 * hop, (len(mel) - 0.5) * hop))
    ticks = {t.get_text(): pos for t, pos in zip(ax.get_yticklabels(), ax.get_yticks())}
    assert "1k" in ticks and "4k" in ticks and "8k" not in ticks  # fmax is 7 kHz
    # Band b is centred on librosa's mel frequency b + 1 of n_mels + 2 between fmin and fmax.
    centres = librosa.mel_frequencies(48 + 2, fmin=50.0, fmax=7000.0)[1:-1]
    assert np.interp(ticks["1k"], np.arange(48), centres) == pytest.approx(1000.0, rel=0.01)
    assert np.interp(ticks["4k"], np.arange(48), centres) == pytest.approx(4000.0, rel=0.01)
    assert len(ax.figure.axes) == 2  # the image and its colour bar
    assert ax.figure.axes[1].get_ylabel() == "dB"


def test_mel_scale_matches_librosa() -> None:
    librosa = pytest.importorskip("librosa")
    hz = np.array([0.0, 50.0, 700.0, 1000.0, 1500.0, 8000.0, 11025.0])
    np.testing.assert_allclose(hplot.hz_to_mel(hz), librosa.hz_to_mel(hz), rtol=1e-9)
    np.testing.assert_allclose(hplot.mel_to_hz(hplot.hz_to_mel(hz)), hz, atol=1e-6)


def test_magnitude_is_log_frequency_in_hz(speech_path: Path) -> None:
    with h5s.open(speech_path) as f:
        ax = hplot.plot_feature(f, 0, feature="mag", ax=_axes())
    assert ax.get_yscale() == "log"
    df = SR / 512
    assert ax.get_ylim() == pytest.approx((0.5 * df, (257 - 0.5) * df))  # bins 1..256, centred on k * sr / n_fft
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "1k" in labels and "250" in labels
    assert "computed for display" in ax.figure.axes[1].get_ylabel()  # stored linear, shown in dB


def test_other_features_and_refusals(speech_path: Path) -> None:
    with h5s.open(speech_path) as f:
        assert hplot.plottable(f) == ["mel", "mag", "mfcc"]
        assert hplot.plottable(f, "logs") == ["loss"]
        assert hplot.plot_feature(f, "down/c1", feature="mfcc", ax=_axes()).get_ylabel() == "MFCC coefficient"
        ax = hplot.plot_feature(f, "run-1", feature="logs/loss", ax=_axes())
        assert ax.get_title() == "loss: run-1 (40 rows)"
        with pytest.raises(h5s.SchemaError, match="cannot be drawn"):
            hplot.plot(f.label, 0, ax=_axes())
        with pytest.raises(TypeError, match="plot_feature"):
            hplot.plot(f, 0)  # type: ignore[arg-type]
        path = hplot.save_plot(f, "up/c0", str(speech_path.parent / "default.png"))
    assert _png_stats(Path(path))[0] == (1000, 400)


def test_importing_h5store_plot_does_not_import_matplotlib() -> None:
    code = "import sys, h5store, h5store.plot; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
