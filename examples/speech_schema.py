"""The schema of the demo corpus (imported by `h5store create speech_schema:Speech`)."""

from __future__ import annotations

import h5store as h5s

AUDIO = r"(?i)\.(wav|flac|ogg)$"
STFT = dict(sr=22050, n_fft=1024, hop_length=256)


class Speech(h5s.TypedFile):
    mel = h5s.MelSpectrogram(n_mels=80, log="db", **STFT)  # (frames, 80)
    mag = h5s.MagSpectrogram(**STFT)  # (frames, 513)
    label = h5s.DirLabel(pattern=AUDIO)  # class folder -> int
    text = h5s.CSVColumn(path="metadata.csv", column=1)  # LJSpeech-style transcript
    logs = h5s.Group(loss=h5s.Array(dtype="float32"))  # one loss curve per run
    checkpoints = h5s.Group(state=h5s.Array(dtype="uint8", shape=(None,)))  # torch.save bytes
