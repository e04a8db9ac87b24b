"""Qwen2-VL: images (and, with ``--video``, videos) through the real Qwen2-VL processor, packed by
mmpack's Energon task encoder, then the model's forward and loss on the packed batch, compared
with the same samples run one by one.

Offline: the processor is built from its classes' defaults (with a smaller max_pixels, so the
resize policy shows), the tokenizer is word-level with Qwen2-VL's special tokens and chat
template, the model is a 2-layer random-init Qwen2-VL from a config.

    python examples/qwen2_vl.py [--video]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # the synthetic data writer
from common import generic_sample, load_packs, next_token_loss, report, summarize, word_tokenizer
from mmpack_dev.qwen_vocab import QWEN2_VL_CHAT_TEMPLATE
from mmpack_dev.synthetic import mp4_bytes as video_bytes
from mmpack_dev.synthetic import png_bytes

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen2-VL-Instruct's chat template (no generation markers: trainable spans come from the
# rendered message boundaries, checked by mmpack)
CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE
TEMPLATE_WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", "Picture", "Video"]
# min/max pixels of the resize policy (the defaults are 56*56 and 28*28*1280)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def build_processor() -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = word_tokenizer(
        SPECIAL_TOKENS,
        CHAT_TEMPLATE,
        extra_words=TEMPLATE_WORDS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size, cap_pixels_per_frame=True),
    )


def build_model(tokenizer: Any) -> Any:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


def write_samples(root: Path, *, video: bool) -> Path:
    """Eight conversations: images of several sizes (one above max_pixels, one used twice in
    its sample, some sizes declared, others read from the PNG header), text-only ones, and
    with `video` two clips."""
    from mmpack_dev.synthetic import WORDS

    def words(i: int, n: int) -> str:
        return " ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(n))

    samples = []
    sizes = [(56, 56), (84, 56), (200, 150), (112, 84), None, (60, 40), None, (140, 100)]
    for i, size in enumerate(sizes):
        media: list[tuple[str, str, bytes, dict[str, Any]]] = []
        user = words(i, 3 + i % 4)
        if size is not None:
            meta = {"width": size[0], "height": size[1]} if i % 2 == 0 else {}
            media.append(("img.png", "image", png_bytes(*size, seed=i), meta))
            user = "<image> " + user
            if i == 3:  # the same picture twice: stored and processed once
                media.append(("img.png", "image", b"", meta))
                user = user + " <image>"
        if video and i in (1, 6):
            media.insert(0, ("clip.mp4", "video", video_bytes(4, 64, 48, seed=i), {}))
            user = "<video> " + user
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": words(i + 3, 4 + i % 5)},
        ]
        if i % 3 == 2:
            messages += [
                {"role": "user", "content": words(i + 5, 3)},
                {"role": "assistant", "content": words(i + 9, 5)},
            ]
        samples.append(generic_sample(f"q{i:03d}", messages, media))
    from common import write_dataset

    return write_dataset(root / "qwen2vl", samples)


def _positions(model: Any, ids: torch.Tensor, image_grid: Any, video_grid: Any) -> torch.Tensor:
    """Qwen2-VL's 3-D rope index of one sample, with its text positions in front (the
    ``[4, 1, L]`` layout the model reads packed sequences from)."""
    config = model.config
    types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
    rope, _ = model.model.get_rope_index(
        ids[None], types[None], image_grid_thw=image_grid, video_grid_thw=video_grid
    )
    text = torch.arange(ids.shape[0])[None, None]
    return torch.cat([text, rope], dim=0)


def _media_slices(
    pack: Any, ids: torch.Tensor, token_id: int, values_key: str, grid_key: str
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per sample of the pack: its rows of `values_key` and `grid_key` (in placeholder order)."""
    if grid_key not in pack.media or pack.media[grid_key].as_tensor() is None:
        return [None] * len(pack)
    grid = pack.media[grid_key].as_tensor()
    values = pack.media[values_key].as_tensor()
    merge = 4  # spatial_merge_size ** 2
    tokens_per_item = (grid.prod(-1) // merge).tolist()
    patches_per_item = grid.prod(-1).tolist()
    cu = pack.cu_seqlens.tolist()
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    item = patch = 0
    for i in range(len(pack)):
        n = int((ids[cu[i] : cu[i + 1]] == token_id).sum())
        first_item, first_patch = item, patch
        while n > 0:
            n -= tokens_per_item[item]
            patch += patches_per_item[item]
            item += 1
        out.append(
            (values[first_patch:patch], grid[first_item:item]) if item > first_item else None
        )
    return out


def packed_and_unpacked_loss(model: Any, pack: Any) -> tuple[float, float, int]:
    """Mean next-token loss of one pack, run packed (one sequence, per-sample rope index) and
    sample by sample; and the number of trained tokens."""
    config = model.config
    ids = pack.input_ids
    images = _media_slices(pack, ids, config.image_token_id, "pixel_values", "image_grid_thw")
    videos = _media_slices(
        pack, ids, config.video_token_id, "pixel_values_videos", "video_grid_thw"
    )
    cu = pack.cu_seqlens_padded.tolist()
    positions = []
    for i in range(len(pack)):
        grid_i = images[i][1] if images[i] is not None else None
        vgrid_i = videos[i][1] if videos[i] is not None else None
        positions.append(_positions(model, ids[cu[i] : cu[i + 1]], grid_i, vgrid_i))
    kwargs: dict[str, Any] = {}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        value = pack.media[key].as_tensor() if key in pack.media else None
        if value is not None and value.numel():
            kwargs[key] = value
    with torch.no_grad():
        logits = model(
            input_ids=ids[None],
            position_ids=torch.cat(positions, dim=2),
            use_cache=False,  # no cache: the model reads sample boundaries from the positions
            **kwargs,
        ).logits[0]
        packed_sum, count = next_token_loss(logits, pack.labels)
        unpacked_sum = torch.zeros(())
        true = pack.cu_seqlens.tolist()
        for i in range(len(pack)):
            a, b = true[i], true[i + 1]
            sample: dict[str, Any] = {"input_ids": ids[a:b][None]}
            if images[i] is not None:
                sample["pixel_values"], sample["image_grid_thw"] = images[i]
            if videos[i] is not None:
                sample["pixel_values_videos"], sample["video_grid_thw"] = videos[i]
            types = (ids[a:b] == config.image_token_id).int() + 2 * (
                ids[a:b] == config.video_token_id
            ).int()
            # the model computes this sample's own 3-D positions (its get_rope_index)
            out = model(**sample, mm_token_type_ids=types[None], use_cache=False)
            unpacked_sum = unpacked_sum + next_token_loss(out.logits[0], pack.labels[a:b])[0]
    return float(packed_sum / count), float(unpacked_sum / count), count


def run(
    root: Path, *, video: bool = False, loss_mask_mode: str | None = None, workers: int = 0
) -> dict[str, Any]:
    processor = build_processor()
    config = PackingEncoderConfig(
        capacity=160,
        packing_buffer_size=8,
        algorithm="first_fit_decreasing",
        modalities=["image", "video"] if video else ["image"],
        loss_mask_mode=loss_mask_mode,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    # the one line that differs from the synthetic setup: the model's processor (and its
    # tokenizer, with the model's chat template) instead of the synthetic tokenizer and
    # {"patch_size": 16}
    encoder = PackingTaskEncoder(config, processor=processor)
    path = write_samples(root, video=video)
    packs = load_packs(path, encoder, workers=workers)
    model = build_model(processor.tokenizer)
    results = [packed_and_unpacked_loss(model, pack) for pack in packs]
    return summarize(packs, results, encoder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--video", action="store_true", help="also pack two video clips")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp), video=args.video)
    report("Qwen2-VL", result)


if __name__ == "__main__":
    main()
