"""Audio as the model's processor makes it: the packed ``input_features`` and
``feature_attention_mask`` of clips at several sampling rates equal Qwen2-Audio's own batched
output on the same WAV files loaded as its documentation shows (``librosa.load(path,
sr=processor.feature_extractor.sampling_rate)``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.media import MediaHandle
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack_dev.synthetic import wav_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import qwen2_audio
from support.conversations import cooked_conversation

#: (seconds, sampling rate) of each clip: native, resampled from 22.05 and 44.1 kHz
CLIPS = ((0.7, 16000), (2.0, 22050), (1.3, 44100))


def conversation(key: str, clip: Path) -> Conversation:
    handle = MediaHandle(
        kind="audio",
        key=clip.name,
        sample_key=key,
        source=("test", clip.name),
        data=clip.read_bytes(),
    )
    return cooked_conversation(
        key,
        [
            Turn("user", (Part(media=handle), Part(text="What is it?"))),
            Turn("assistant", (Part(text="A tone."),)),
        ],
    )


# librosa.load imports its audioread fallback, which imports deprecated stdlib modules
@pytest.mark.filterwarnings("ignore:'aifc' is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:'sunau' is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:'audioop' is deprecated:DeprecationWarning")
def test_packed_features_equal_the_processors_own_on_the_same_files(tmp_path: Path) -> None:
    import librosa

    processor = qwen2_audio.build_processor()
    clips = []
    for i, (seconds, rate) in enumerate(CLIPS):
        path = tmp_path / f"clip{i}.wav"
        path.write_bytes(wav_bytes(seconds, rate, freq=220.0 * (i + 1)))
        clips.append(path)
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=["audio"]), processor=processor)
    decoded = [
        enc.postencode_sample(enc.encode_conversation(conversation(f"s{i}", clip)))
        for i, clip in enumerate(clips)
    ]
    pack = enc.build_pack(decoded)
    rate = processor.feature_extractor.sampling_rate
    waves = [librosa.load(str(p), sr=rate)[0] for p in clips]
    theirs = processor(
        text=[processor.audio_token * len(clips)],
        audio=waves,
        sampling_rate=rate,
        return_tensors="pt",
    )
    for name in ("input_features", "feature_attention_mask"):
        ours = pack.media[name].as_tensor()
        assert ours.shape == theirs[name].shape, name
        assert torch.equal(ours, theirs[name]), name
    audio_id = processor.tokenizer.convert_tokens_to_ids(processor.audio_token)
    assert int((pack.input_ids == audio_id).sum()) == int((theirs["input_ids"] == audio_id).sum())


@pytest.mark.parametrize("rate", [16000, 22050])
def test_the_feature_window_is_the_unit_of_media_capacity(rate: int) -> None:
    processor = qwen2_audio.build_processor()
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=["audio"]), processor=processor)
    clip = MediaHandle(
        kind="audio",
        key="a.wav",
        sample_key="s0",
        source=("t", str(rate)),
        data=wav_bytes(1.0, rate),
    )
    encoded = enc.encode_conversation(
        cooked_conversation(
            "s0",
            [Turn("user", (Part(media=clip),)), Turn("assistant", (Part(text="ok"),))],
        )
    )
    assert encoded.media_units == processor.feature_extractor.nb_max_frames == 3000
