"""`h5store report` / TypedFile.report_html: a self-contained HTML page, rendered in a real browser.

The browser tests run Debian's chromium headless (installed by `make test`'s dev set-up as
root: see the Makefile's `chromium` rule); they are skipped, saying why, only where it is
not installed. Everything else here runs everywhere the `plot` extra is installed.
"""

from __future__ import annotations

import html
import html.parser
import io
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
import wave
from pathlib import Path

import h5py
import numpy as np
import pytest

import h5store as h5s
from h5store.cli import main

matplotlib = pytest.importorskip("matplotlib")
PIL = pytest.importorskip("PIL.Image")

from h5store.column import Column  # noqa: E402 - after the extras check
from h5store.report import SECTIONS  # noqa: E402

SR = 16000


class Speech(h5s.TypedFile):
    mel = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=48, log="db")
    mag = h5s.MagSpectrogram(sr=SR, n_fft=512, hop_length=128)
    label = h5s.DirLabel(pattern=r"\.wav$")
    logs = h5s.Group(loss=h5s.Array(dtype="float32"))


class Pictures(h5s.TypedFile):
    image = h5s.EncodedImage(format="PNG")
    video = h5s.EncodedFrames()
    caption = h5s.Text()
    score = h5s.Scalar(dtype="float32")


class Loudness(h5s.Array):
    """A user's feature that says how it is shown."""

    type_name = "tests.report.Loudness"

    def display_kind(self) -> str:
        return "text"

    def display(self, item: np.ndarray) -> str:
        return f"peak {float(np.max(item)):.1f} dB"


class Broken(h5s.Array):
    type_name = "tests.report.Broken"

    def display(self, item: np.ndarray) -> str:
        raise ValueError("this hook is broken")


class Custom(h5s.TypedFile):
    loud = Loudness(dtype="float32", shape=(None,))
    broken = Broken(dtype="float32", shape=(None,))
    curve = h5s.Array(dtype="float64", shape=(None,))
    grid = h5s.Array(dtype="int16", shape=(None, 3))
    blob = h5s.Array(dtype="uint8", shape=(None,))
    cube = h5s.Array(dtype="float32", shape=(2, 2, 2))


class Tiny(h5s.TypedFile):
    x = h5s.Array(dtype="float32", shape=(None,))
    y = h5s.Scalar(dtype="int64")


@pytest.fixture(scope="module")
def speech_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four short tones and chirps in two class folders (a real create), one undecodable wav
    (a stored ingest failure), and a loss curve in the logs group."""
    import soundfile as sf

    root = tmp_path_factory.mktemp("report")
    t = np.arange(SR * 3 // 4) / SR
    for k in range(4):
        kind = ("tone", "chirp")[k % 2]
        (root / "wavs" / kind).mkdir(parents=True, exist_ok=True)
        x = np.sin(2 * np.pi * (500 + 250 * k) * t) if kind == "tone" else np.sin(2 * np.pi * (300 * t + 2000 * t**2))
        sf.write(root / "wavs" / kind / f"{kind}{k}.wav", (0.3 * x).astype(np.float32), SR)
    (root / "wavs" / "tone" / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really a wav")
    f = Speech.create(root / "speech.h5", root / "wavs", n_workers=1, progress=False)
    assert f.report.n_failed == 1
    f.close()
    with Speech(root / "speech.h5", mode="a") as w:
        w.logs.add("run-1", dict(loss=np.linspace(2.0, 0.1, 300).astype(np.float32)))
        w.logs.add("run-2", dict(loss=np.linspace(1.5, 0.3, 200).astype(np.float32)))
    return root / "speech.h5"


def _frames(k: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(k)
    v = rng.integers(0, 60, (n, 48, 64, 3), dtype=np.uint8)
    for t in range(n):
        v[t, 16:32, (4 * t + 8 * k) % 48 : (4 * t + 8 * k) % 48 + 16] = (250, 220, 60)
    return v


@pytest.fixture(scope="module")
def pictures_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pictures") / "pictures.h5"
    with Pictures(path, mode="w") as f:
        for k in range(5):
            y, x = np.mgrid[0:60, 0:80]
            img = np.stack([(x * 3 + 40 * k) % 256, (y * 4) % 256, np.full_like(x, 50 * k)], axis=-1).astype(np.uint8)
            f.add(f"clip{k}", dict(image=img, video=_frames(k, 8 + k), caption=f"a square moving <right> {k}",
                                   score=np.float32(k / 4)))
    return path


# --------------------------------------------------------------------------- the page's content
def _report(f: h5s.TypedFile, path: Path, **kw: object) -> tuple[str, object]:
    info = f.report_html(path, **kw)
    return path.read_text(encoding="utf-8"), info


@pytest.mark.slow
def test_speech_report_has_every_section_and_what_it_shows(speech_path: Path, tmp_path: Path) -> None:
    with h5s.open(speech_path) as f:
        page, info = _report(f, tmp_path / "r.html", n=3, seed=1)
        ids = list(f.ids)
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in page
    assert len(info.items) == 3 and set(info.items) <= set(ids)
    assert info.items_read == 3 * 3 + 2  # 3 items x (mel, mag, label) + the two loss curves
    # Parameters, versions, sizes; durations from the stored frame rate.
    assert "n_mels=48" in page and "hop_length=128" in page and "h5store.MelSpectrogram" in page
    assert "format version" in page and "duration: total" in page
    # Labels by class name; an audio player per item (Griffin-Lim from the magnitudes, labelled).
    assert re.search(r"(tone|chirp) \(class [01]\)", page)
    assert page.count("<audio ") == 3 and page.count("data:audio/wav;base64,") == 3
    assert "Griffin-Lim from the stored magnitudes" in page
    # The stored ingest failure, by source and reason; a verify pass; the loss curves.
    assert "broken.wav" in page and "SourceError" in page
    assert "OK</b>" in page and "all match their CRC-32" in page
    assert "logs/loss" in page and "run-1" in page
    assert re.search(r"\d+\.\d\d s to build this page", page)
    # The same seed shows the same items; another seed, others.
    with h5s.open(speech_path) as f:
        again = f.report_html(tmp_path / "r2.html", n=3, seed=1)
        seen = {tuple(f.report_html(tmp_path / "r3.html", n=1, seed=s, verify="none").items) for s in range(4)}
    assert again.items == info.items and len(seen) > 1


def test_no_external_url(speech_path: Path, pictures_path: Path, tmp_path: Path) -> None:
    class Refs(html.parser.HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.urls: list[tuple[str, str, str]] = []
            self.tags: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.tags.append(tag)
            for k, v in attrs:
                if k in ("src", "href", "srcset", "poster", "data", "action", "formaction", "xlink:href"):
                    self.urls.append((tag, k, v or ""))

    for source in (speech_path, pictures_path):
        with h5s.open(source) as f:
            page, _ = _report(f, tmp_path / f"{source.stem}.html", n=4)
        parser = Refs()
        parser.feed(page)
        assert parser.urls, "the page embeds its images"
        for tag, attr, url in parser.urls:
            assert url.startswith(("data:", "#")), f"<{tag} {attr}={url[:60]!r}> is not embedded"
        assert "link" not in parser.tags and "iframe" not in parser.tags
        assert not re.search(r"<script[^>]*\bsrc\s*=", page)
        assert not re.search(r"@import|url\(\s*['\"]?(?!data:)", page), "CSS loads nothing"
        assert not re.search(r"https?://", page), "no address of any kind"
        # The browser is told to load nothing else either.
        assert "default-src 'none'" in page and "img-src data:" in page


def test_pictures_report_shows_thumbnails_frames_text_and_values(pictures_path: Path, tmp_path: Path) -> None:
    with h5s.open(pictures_path) as f:
        page, info = _report(f, tmp_path / "p.html", n=5)
        lengths = f.video.lengths
    assert len(info.items) == 5
    # 5 image thumbnails; up to 6 frames of each video, numbered; text escaped; scores as values.
    assert page.count('class="thumb"') == 5
    assert page.count('class="frame"') == 5 * 6
    assert "frame 0</figcaption>" in page and f"frame {int(lengths[4]) - 1}</figcaption>" in page
    assert "a square moving &lt;right&gt; 4" in page and "<right>" not in page
    assert "frames: total</th><td class=num>50<" in page  # 8 + 9 + 10 + 11 + 12 frames, from the index
    assert "<audio" not in page  # nothing here is sound


def test_a_corrupt_item_is_shown_as_such_and_the_page_is_still_written(speech_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.h5"
    shutil.copy(speech_path, path)
    with h5s.open(path) as f:
        start = int(f.mel.index[0, 0])
        first = f.ids[0]
    with h5py.File(path, "r+", locking=False) as h:
        h["mel/data"][start] = h["mel/data"][start] + 1.0  # the item's CRC-32 no longer matches
    with h5s.open(path) as f:
        page, info = _report(f, tmp_path / "bad.html", n=len(f))
    assert first in info.items
    assert "1 failed</b>" in page
    assert re.search(r'<div class="err">[^<]*bad\.h5[^<]*mel[^<]*</div>', page), "the error names file and feature"
    assert page.count("n_mels=48") == 1  # the rest of the page is there


@pytest.mark.slow
def test_bounded_cost_reads_only_the_index_and_the_chosen_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n_items = 200_000
    path = tmp_path / "tiny.h5"
    lens = np.random.default_rng(0).integers(1, 4, n_items)
    with Tiny(path, mode="w") as f:
        f.extend([f"i{i}" for i in range(n_items)],
                 columns=dict(x=[np.full(k, i, np.float32) for i, k in enumerate(lens)], y=np.arange(n_items)))

    read_rows: list[int] = []  # rows of item data asked of any column
    for name in ("read_ranges", "read_scatter", "take", "read_blobs"):
        real = getattr(Column, name)

        def counted(self: Column, *args: object, _real: object = real, _name: str = name, **kw: object) -> object:
            out = _real(self, *args, **kw)  # type: ignore[operator]
            if self.where.endswith(":/ids"):
                pass  # the ids table: read by every open, part of the index (id <-> row)
            elif _name == "read_ranges":
                read_rows.append(int(np.sum(np.asarray(args[1]) - np.asarray(args[0]))))
            elif _name == "take":
                read_rows.append(len(args[0]))  # type: ignore[arg-type]
            else:
                read_rows.append(-1)  # not expected here at all
            return out

        monkeypatch.setattr(Column, name, counted)
    h5_reads: list[str] = []
    real_getitem = h5py.Dataset.__getitem__

    def getitem(self: h5py.Dataset, key: object) -> object:
        h5_reads.append(self.name)
        return real_getitem(self, key)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", getitem)
    tracemalloc.start()
    try:
        with h5s.open(path) as f:
            info = f.report_html(tmp_path / "tiny.html", n=8, seed=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(info.items) == 8 and info.items_read == 16  # 8 items x 2 features
    chosen = [int(i[1:]) for i in info.items]
    # One planned read per feature: the chosen items' rows of x (1-3 each) and of y (1 each).
    assert sorted(read_rows) == sorted([int(lens[chosen].sum()), 8]), read_rows
    assert not [n for n in h5_reads if n.endswith("/data") and not n.startswith("/ids/")], "item data read via h5py"
    assert peak < 200e6, f"{peak / 1e6:.0f} MB traced at the peak"
    page = (tmp_path / "tiny.html").read_text(encoding="utf-8")
    assert "200,000" in page and "items read" in page


def test_user_features_are_shown_their_way_and_a_failing_hook_costs_one_cell(tmp_path: Path) -> None:
    path = tmp_path / "custom.h5"
    with Custom(path, mode="w") as f:
        f.add("a", dict(loud=np.array([1.0, 3.0], np.float32), broken=np.ones(4, np.float32),
                        curve=np.sin(np.arange(50) / 5), grid=np.arange(30, dtype=np.int16).reshape(10, 3),
                        blob=np.arange(40, dtype=np.uint8), cube=np.full((2, 2, 2), 0.5, np.float32)))
    with h5s.open(path) as f:  # the registered classes come back from the stored type names
        assert type(f.loud.feature) is Loudness
        page, info = _report(f, tmp_path / "c.html", n=1)
    assert '<div class="text">peak 3.0 dB</div>' in page
    assert "cannot show this item as curve: ValueError: this hook is broken" in page
    assert 'alt="curve of a"' in page and 'alt="grid of a"' in page  # drawn by h5store.plot
    assert "40 bytes: <code>00 01 02 03" in page
    assert "float32 (2, 2, 2): min 0.5, mean 0.5, max 0.5" in page
    assert info.items_read == 6


class Clips(h5s.TypedFile):
    audio = h5s.Audio(sr=8000)
    words = h5s.Text()


def test_what_the_page_embeds_is_what_h5py_reads(tmp_path: Path) -> None:
    """Stored audio plays as its stored samples (16-bit), text reads as its stored bytes."""
    import base64

    path = tmp_path / "clips.h5"
    rng = np.random.default_rng(1)
    with Clips(path, mode="w") as f:
        for k in range(3):
            f.add(f"c{k}", dict(audio=(0.5 * rng.uniform(-1, 1, 4000 + 1000 * k)).astype(np.float32),
                                words=f"clip {k}: \u00e9t\u00e9 & <b>"))
    with h5s.open(path) as f:
        page, info = _report(f, tmp_path / "clips.html", n=3)
        index = {i: (f.audio.index[k], f.words.index[k]) for k, i in enumerate(f.ids)}
    cards = re.findall(r'<div class="card item"><h3>([^ <]+) ', page)
    assert cards == info.items == ["c0", "c1", "c2"]
    sounds = re.findall(r'src="data:audio/wav;base64,([^"]+)"', page)
    texts = re.findall(r'<div class="text">([^<]*)</div>', page)
    with h5py.File(path, "r", locking=False) as h:
        for item_id, b64, text in zip(info.items, sounds, texts):
            (a0, a1), (w0, w1) = index[item_id]
            stored = h["audio/data"][a0:a1]
            with wave.open(io.BytesIO(base64.b64decode(b64))) as w:
                assert w.getframerate() == 8000
                pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
            np.testing.assert_array_equal(pcm, (np.clip(stored.astype(np.float64), -1, 1) * 32767).astype("<i2"))
            assert html.unescape(text) == h["words/data"][w0:w1].tobytes().decode("utf-8")


# --------------------------------------------------------------------------- the hooks
def test_display_hooks_defaults_and_overrides() -> None:
    assert h5s.Array(dtype="float32", shape=(None,)).display_kind() == "curve"
    assert h5s.Array(dtype="float32", shape=(None, 3)).display_kind() == "matrix"
    assert h5s.Array(dtype="uint8", shape=(None,)).display_kind() == "bytes"
    assert h5s.Array(dtype="uint8", shape=(8, 8, 3)).display_kind() == "image"
    assert h5s.Array(dtype="float32", shape=(2, 3, 4)).display_kind() == "array"
    assert h5s.Scalar().display_kind() == "value"
    assert h5s.Text().display_kind() == "text" and h5s.CSVColumn("m.csv").display_kind() == "text"
    assert h5s.CSVColumn("m.csv", dtype="float32").display_kind() == "value"
    assert h5s.EncodedImage().display_kind() == "image" and h5s.EncodedFrames().display_kind() == "frames"
    assert h5s.MFCC(sr=SR).display_kind() == "spectrogram" and h5s.Audio(sr=SR).display_kind() == "waveform"
    lab = h5s.DirLabel(classes=("cat", "dog"))
    assert lab.display_kind() == "label" and lab.display(0) == "cat (class 0)" and "no name" in lab.display(7)
    assert h5s.MelSpectrogram(sr=SR, hop_length=160).rows_per_second() == 100.0
    assert h5s.Array().sound(np.zeros(3)) is None
    y, sr, how = h5s.Audio(sr=SR).sound(np.zeros((10, 2), np.float32))
    assert y.shape == (10,) and sr == SR and how == "stored audio"
    assert Loudness(dtype="float32", shape=(None,)).display(np.array([1.0, 3.0])) == "peak 3.0 dB"


@pytest.mark.parametrize("log", [False, "db", "log"])
@pytest.mark.parametrize("kind", ["mel", "mag"])
def test_spectrograms_sound_like_their_source(kind: str, log: object) -> None:
    """Griffin-Lim of a stored 1 kHz tone has its energy at 1 kHz, whatever the log scale stored."""
    pytest.importorskip("librosa")
    t = np.arange(SR) / SR
    x = (0.5 * np.sin(2 * np.pi * 1000.0 * t)).astype(np.float32)
    if kind == "mel":
        feat: h5s.Feature = h5s.MelSpectrogram(sr=SR, n_fft=512, hop_length=128, n_mels=64, log=log)
    else:
        feat = h5s.MagSpectrogram(sr=SR, n_fft=512, hop_length=128, log=log, power=2.0)
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, x, SR, format="WAV")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"h5store-report-tone-{os.getpid()}.wav"
    path.write_bytes(buf.getvalue())
    try:
        item = feat.load(h5s.Source(str(path)))
    finally:
        path.unlink()
    y, sr, how = feat.sound(item)
    assert sr == SR and "Griffin-Lim" in how and abs(len(y) - SR) < 1024
    spectrum = np.abs(np.fft.rfft(y[2048:-2048]))
    peak_hz = np.argmax(spectrum) * SR / (2 * (len(spectrum) - 1))
    assert abs(peak_hz - 1000.0) < 60.0, peak_hz


# --------------------------------------------------------------------------- the command line
def test_cli_report(speech_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "cli.html"
    assert main(["report", str(speech_path), "-o", str(out), "-n", "2", "--verify", "deep"]) == 0
    line = capsys.readouterr().out
    assert f"{out}: 2 items shown" in line and "written in" in line
    page = out.read_text(encoding="utf-8")
    assert "CRC-32 checked" in page  # the deep pass read every item
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(speech_path), "-n", "0", "--verify", "none"]) == 0
    assert (tmp_path / "speech-report.html").exists()
    assert main(["report", str(speech_path), "-n", "-1"]) == 1
    assert "-n takes the number of items" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope.h5")]) == 1
    assert "nope.h5" in capsys.readouterr().err


def test_wav_is_valid(speech_path: Path, tmp_path: Path) -> None:
    import base64

    with h5s.open(speech_path) as f:
        page, _ = _report(f, tmp_path / "w.html", n=1, verify="none")
    b64 = re.search(r'src="data:audio/wav;base64,([^"]+)"', page).group(1)  # type: ignore[union-attr]
    with wave.open(io.BytesIO(base64.b64decode(b64))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SR)
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert pcm.size > SR // 2 and 20000 < np.abs(pcm).max() <= 32767  # peak-normalised, not silent


# --------------------------------------------------------------------------- in a real browser
def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed: `make test` installs it as root (apt-get install chromium); "
                    "elsewhere install it to run the browser tests of the report")
    return exe


def _browse(page: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.iterdir()))}"  # one per run: runs never share one
    cmd = [_chromium(), "--headless=new", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", "--mute-audio", f"--user-data-dir={profile}",
           "--virtual-time-budget=8000", *extra, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.parametrize("which", ["speech", "pictures"])
def test_report_renders_in_chromium(which: str, speech_path: Path, pictures_path: Path, tmp_path: Path) -> None:
    source = speech_path if which == "speech" else pictures_path
    out = tmp_path / f"{which}.html"
    with h5s.open(source) as f:
        f.report_html(out, n=4)
    dom = _browse(out, tmp_path, "--dump-dom").stdout
    root = re.search(r"<html[^>]*>", dom).group(0)  # type: ignore[union-attr]
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', root))
    assert attrs.get("checked") == "1", f"the page's script did not run: {root}"
    ok, total = map(int, attrs["images"].split("/"))
    assert total > 0 and ok == total, f"images decoded: {attrs['images']}"
    assert attrs["failed"] == "0" and attrs["refused"] == "0", root
    heard, sounds = map(int, attrs["audio"].split("/"))
    assert heard == sounds and sounds == (4 if which == "speech" else 0), attrs["audio"]
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in dom
    assert re.search(r'<p id="load-problem"[^>]*hidden', dom)

    shot = tmp_path / f"{which}.png"
    _browse(out, tmp_path, f"--screenshot={shot}", "--window-size=1280,1600")
    with PIL.open(shot) as im:
        rgb = np.asarray(im.convert("RGB"))
    assert rgb.shape[:2] == (1600, 1280)
    colours = len(np.unique(rgb.reshape(-1, 3)[::7], axis=0))
    assert rgb.astype(np.float64).var() > 300 and colours > 200, "the screenshot is (nearly) blank"
    header = rgb[5:40, 5:400].reshape(-1, 3).mean(axis=0)
    assert header[2] > header[0] + 20, "the dark blue page header is drawn"


def test_import_h5store_stays_light() -> None:
    code = "import sys, h5store; print(sorted(m for m in ('matplotlib', 'librosa', 'h5store.report') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
