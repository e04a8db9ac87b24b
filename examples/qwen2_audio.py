"""Qwen2-Audio: audio clips through the real Qwen2-Audio processor (Whisper's feature extractor:
log-mel ``input_features`` and their ``feature_attention_mask``; tokens per clip from the
extractor's window settings), packed by mmpack's Energon task encoder, then the model's forward
and loss on the packed batch, compared with the same samples run one by one.

Offline: the processor is built from its classes' constructors (128 mel bins, as Qwen2-Audio
reads), the tokenizer is word-level with Qwen2-Audio's special tokens and chat template, the
model is a 2-layer random-init Qwen2-Audio from a config.

    python examples/qwen2_audio.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # the synthetic data writer
from common import (
    generic_sample,
    load_packs,
    next_token_loss,
    report,
    summarize,
    word_tokenizer,
    write_dataset,
)
from mmpack_dev.synthetic import WORDS, wav_bytes

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
]
TEMPLATE_WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", "Audio"]
TEMPLATE_WORDS += [str(i) for i in range(1, 10)]


def build_processor() -> Any:
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    # the processor's own chat template (Qwen2-Audio-Instruct's) goes to the tokenizer too
    template = Qwen2AudioProcessor.default_chat_template.fget(None)  # type: ignore[attr-defined]
    tokenizer = word_tokenizer(
        SPECIAL_TOKENS,
        template,
        extra_words=TEMPLATE_WORDS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    return Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=tokenizer,
        chat_template=template,
    )


def build_model(tokenizer: Any) -> Any:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2AudioConfig(
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "pad_token_id": ids("<|endoftext|>"),
        },
        audio_token_id=ids("<|AUDIO|>"),
    )
    torch.manual_seed(0)
    return Qwen2AudioForConditionalGeneration(config).eval()


def write_samples(root: Path) -> Path:
    """Six conversations: clips of 0.4 to 1.5 s (one at 22.05 kHz, resampled to the
    extractor's 16 kHz; durations declared for some, read from the WAV header for others),
    and text-only ones."""

    def words(i: int, n: int) -> str:
        return " ".join(WORDS[(i * 5 + j * 19) % len(WORDS)] for j in range(n))

    clips = [(0.5, 16000), None, (1.5, 16000), (0.8, 22050), None, (0.4, 16000)]
    samples = []
    for i, clip in enumerate(clips):
        media: list[tuple[str, str, bytes, dict[str, Any]]] = []
        user = words(i, 3 + i % 3)
        if clip is not None:
            seconds, rate = clip
            meta = {"duration": seconds} if i % 2 == 0 else {}
            media.append(("clip.wav", "audio", wav_bytes(seconds, rate, freq=200.0 + 50 * i), meta))
            user = "<audio> " + user
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": words(i + 2, 4 + i % 4)},
        ]
        samples.append(generic_sample(f"a{i:03d}", messages, media))
    return write_dataset(root / "qwen2audio", samples)


def packed_and_unpacked_loss(model: Any, pack: Any) -> tuple[float, float, int]:
    """Mean next-token loss of one pack, run packed (positions restart per sample) and sample
    by sample; and the number of trained tokens."""
    ids = pack.input_ids
    audio_id = model.config.audio_token_id
    features = pack.media["input_features"].as_tensor()
    feature_mask = pack.media["feature_attention_mask"].as_tensor()
    cu = pack.cu_seqlens_padded.tolist()
    positions = torch.cat([torch.arange(cu[i + 1] - cu[i]) for i in range(len(pack))])
    kwargs: dict[str, Any] = {}
    if features is not None and features.numel():
        kwargs = {"input_features": features, "feature_attention_mask": feature_mask}
    with torch.no_grad():
        logits = model(
            input_ids=ids[None], position_ids=positions[None], use_cache=False, **kwargs
        ).logits[0]
        packed_sum, count = next_token_loss(logits, pack.labels)
        unpacked_sum = torch.zeros(())
        true = pack.cu_seqlens.tolist()
        clip = 0
        for i in range(len(pack)):
            a, b = true[i], true[i + 1]
            sample: dict[str, Any] = {"input_ids": ids[a:b][None], "use_cache": False}
            if (ids[a:b] == audio_id).any():  # one clip per sample in this dataset
                sample["input_features"] = features[clip : clip + 1]
                sample["feature_attention_mask"] = feature_mask[clip : clip + 1]
                clip += 1
            out = model(**sample)
            unpacked_sum = unpacked_sum + next_token_loss(out.logits[0], pack.labels[a:b])[0]
    return float(packed_sum / count), float(unpacked_sum / count), count


def run(root: Path, *, loss_mask_mode: str | None = None) -> dict[str, Any]:
    processor = build_processor()
    config = PackingEncoderConfig(
        capacity=160,
        packing_buffer_size=6,
        algorithm="first_fit_decreasing",
        modalities=["audio"],
        loss_mask_mode=loss_mask_mode,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    encoder = PackingTaskEncoder(config, processor=processor)
    packs = load_packs(write_samples(root), encoder)
    model = build_model(processor.tokenizer)
    results = [packed_and_unpacked_loss(model, pack) for pack in packs]
    return summarize(packs, results, encoder)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp))
    report("Qwen2-Audio", result)


if __name__ == "__main__":
    main()
