"""LLaVA-1.5: images through the real LLaVA processor (CLIP image processor: resize, center
crop, mean/std normalisation; a fixed number of tokens per image), packed by mmpack's Energon
task encoder, then the model's forward and loss on the packed batch, compared with the same
samples run one by one.

LLaVA's chat template marks assistant output with ``{% generation %}``: only the answers are
trained, not the ``ASSISTANT:`` header.

Offline: the processor is built from its classes' constructors (a 56-pixel crop instead of 336,
so the example stays small: 16 tokens per image instead of 576), the tokenizer is word-level
with LLaVA's image token and chat template, the model is a 2-layer random-init LLaVA from a
config.

    python examples/llava.py
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
from mmpack_dev.synthetic import WORDS, png_bytes

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<image>"]
# llava-hf/llava-1.5's chat template: images first, then the text; answers in generation blocks
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
CROP = 56
PATCH = 14


def build_processor() -> Any:
    from transformers import CLIPImageProcessor, LlavaProcessor

    tokenizer = word_tokenizer(
        SPECIAL_TOKENS,
        CHAT_TEMPLATE,
        extra_words=["USER", "ASSISTANT"],
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": CROP}, crop_size={"height": CROP, "width": CROP}
    )
    # LLaVA-1.5's processor settings: the CLS feature is dropped ("default" strategy)
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: Any) -> Any:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    ids = tokenizer.convert_tokens_to_ids
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=CROP,
            patch_size=PATCH,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
        ),
        image_token_id=ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=(CROP // PATCH) ** 2,
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval()


def write_samples(root: Path) -> Path:
    """Eight conversations, five with images of different sizes (all cropped to the same
    token count)."""

    def words(i: int, n: int) -> str:
        return " ".join(WORDS[(i * 11 + j * 17) % len(WORDS)] for j in range(n))

    samples = []
    sizes = [(64, 48), None, (120, 90), (56, 56), None, (80, 200), (30, 40), None]
    for i, size in enumerate(sizes):
        media: list[tuple[str, str, bytes, dict[str, Any]]] = []
        user = words(i, 3 + i % 4)
        if size is not None:
            media.append(("img.png", "image", png_bytes(*size, seed=i), {}))
            user = "<image> " + user
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": words(i + 3, 4 + i % 5)},
        ]
        samples.append(generic_sample(f"l{i:03d}", messages, media))
    return write_dataset(root / "llava", samples)


def packed_and_unpacked_loss(model: Any, pack: Any) -> tuple[float, float, int]:
    """Mean next-token loss of one pack, run packed (positions restart per sample) and sample
    by sample; and the number of trained tokens."""
    ids = pack.input_ids
    image_id = model.config.image_token_id
    per_image = model.config.image_seq_length
    pixels = pack.media["pixel_values"].as_tensor()
    cu = pack.cu_seqlens_padded.tolist()
    positions = torch.cat([torch.arange(cu[i + 1] - cu[i]) for i in range(len(pack))])
    kwargs = {"pixel_values": pixels} if pixels is not None and pixels.numel() else {}
    with torch.no_grad():
        logits = model(
            input_ids=ids[None], position_ids=positions[None], use_cache=False, **kwargs
        ).logits[0]
        packed_sum, count = next_token_loss(logits, pack.labels)
        unpacked_sum = torch.zeros(())
        true = pack.cu_seqlens.tolist()
        image = 0
        for i in range(len(pack)):
            a, b = true[i], true[i + 1]
            n = int((ids[a:b] == image_id).sum()) // per_image
            sample: dict[str, Any] = {"input_ids": ids[a:b][None], "use_cache": False}
            if n:
                sample["pixel_values"] = pixels[image : image + n]
                image += n
            out = model(**sample)
            unpacked_sum = unpacked_sum + next_token_loss(out.logits[0], pack.labels[a:b])[0]
    return float(packed_sum / count), float(unpacked_sum / count), count


def run(root: Path, *, loss_mask_mode: str | None = None) -> dict[str, Any]:
    processor = build_processor()
    config = PackingEncoderConfig(
        capacity=96,
        packing_buffer_size=8,
        algorithm="first_fit_decreasing",
        modalities=["image"],
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
    report("LLaVA", result)


if __name__ == "__main__":
    main()
