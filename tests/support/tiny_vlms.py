"""Tiny random-init vision-language models of the families ``mmpack.vision.encode_once`` adapts
(Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT) and GRPO-shaped micro-batches for them.

Every model is float64, seeded, one decoder layer of width 32 over a small vocabulary and a
one-block vision tower. A micro-batch holds P prompts, each with its own media (images, Qwen
videos), and G rows per prompt with different completions after the prompt. Its media are
mmpack ``PackedTensor`` values (deduplication enabled, then ``repeat_interleave(G)``), one per
model keyword, laid out either as one segment per prompt (NeMo-RL's per-sample media) or one
segment per item (``merge_segments``, so an item may be shared by several prompts). Each item's
placeholder count is the length of the model's own feature tensor for it (what the processor
computes from the config).

The model inputs come in two layouts: ``padded`` (rows right-padded, ``attention_mask``; the
model computes Qwen's rope index itself from ``mm_token_type_ids``) and ``packed`` (THD: one
``[1, T]`` row and ``position_ids`` restarting at every sample, from which transformers builds
a block-diagonal causal mask; for Qwen ``[4, 1, T]``, the text positions then each sample's
own 3-D rope index from the model's ``get_rope_index``).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from mmpack.packed import PackedTensor

__all__ = [
    "FAMILY_NAMES",
    "IMAGE",
    "QWEN",
    "VIDEO",
    "Item",
    "MicroBatch",
    "Prompt",
    "build_model",
    "keep_float64",
    "loss_sum",
    "make_image",
    "make_video",
    "micro_batch",
    "model_inputs",
    "reorder",
    "targets",
    "twin",
]

FAMILY_NAMES = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_next")
QWEN = ("qwen2_vl", "qwen2_5_vl")
VOCAB = 96
PAD, BOS, EOS = 0, 1, 2
IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 92, 93
IGNORE = -100
#: text token ids used for prompts and completions (below every special id)
TEXT_IDS = (3, 80)

_TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
}
_QWEN_TEXT = {
    **_TEXT,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
}
_QWEN_IDS = {
    "image_token_id": IMAGE,
    "video_token_id": VIDEO,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}
#: CLIP tower of the LLaVA models: 8 x 8 pixel tiles of 2 x 2 patches (plus the CLS position)
_CLIP = {
    "model_type": "clip_vision_model",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 8,
    "patch_size": 4,
}
#: LLaVA-NeXT's any-resolution grids (height, width), in pixels
PINPOINTS = [[8, 8], [8, 16], [16, 8], [16, 16]]


def build_model(family: str, seed: int = 0) -> Any:
    """A tiny random-init ``...ForConditionalGeneration`` of ``family`` (float64, eval mode)."""
    import transformers as tf

    if family == "qwen2_vl":
        vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2}
        config: Any = tf.Qwen2VLConfig(
            text_config=_QWEN_TEXT,
            vision_config={**vision, "patch_size": 2, "temporal_patch_size": 2},
            **_QWEN_IDS,
        )
        cls: Any = tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision = {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 2,
            "temporal_patch_size": 2,
            # windows of 2 x 2 merged tokens, and the one block windowed
            "window_size": 8,
            "fullatt_block_indexes": [],
        }
        config = tf.Qwen2_5_VLConfig(text_config=_QWEN_TEXT, vision_config=vision, **_QWEN_IDS)
        cls = tf.Qwen2_5_VLForConditionalGeneration
    elif family == "llava":
        config = tf.LlavaConfig(
            vision_config=_CLIP,
            text_config={**_TEXT, "model_type": "llama"},
            image_token_id=IMAGE,
            image_seq_length=4,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
        )
        cls = tf.LlavaForConditionalGeneration
    elif family == "llava_next":
        config = tf.LlavaNextConfig(
            vision_config=_CLIP,
            text_config={**_TEXT, "model_type": "llama"},
            image_token_id=IMAGE,
            image_grid_pinpoints=PINPOINTS,
            vision_feature_layer=[-2, -1],
            vision_feature_select_strategy="default",
        )
        cls = tf.LlavaNextForConditionalGeneration
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    return cls(config).to(torch.float64).eval()


# --------------------------------------------------------------------------------- media


@dataclass(eq=False)
class Item:
    """One image or video: its entries under each model keyword (dimension 0 runs over the
    item's own entries: Qwen patches, LLaVA images) and its placeholder tokens."""

    kind: str
    segments: dict[str, torch.Tensor]
    tokens: tuple[int, ...]
    #: per keyword, the item's own single-segment ``PackedTensor`` (one-segment-per-item layout)
    values: dict[str, PackedTensor] = field(default_factory=dict)


@torch.no_grad()
def _feature_length(model: Any, kind: str, segments: dict[str, torch.Tensor]) -> int:
    """The placeholder count of one item: the length of the model's own feature tensor."""
    media_key = "pixel_values_videos" if kind == "video" else "pixel_values"
    extra = {k: v for k, v in segments.items() if k in ("image_grid_thw", "video_grid_thw")}
    if "image_sizes" in segments:
        extra["image_sizes"] = segments["image_sizes"]
    call = getattr(model, f"get_{kind}_features")
    (feature,) = call(segments[media_key], **extra, return_dict=True).pooler_output
    return int(feature.shape[0])


def _item(model: Any, kind: str, segments: dict[str, torch.Tensor]) -> Item:
    n = _feature_length(model, kind, segments)
    if model.config.model_type in QWEN:
        token = IMAGE if kind == "image" else VIDEO
        return Item(kind, segments, (VISION_START, *[token] * n, VISION_END))
    return Item(kind, segments, (IMAGE,) * n)


def make_image(model: Any, size: tuple[int, ...], generator: torch.Generator) -> Item:
    """A random image: Qwen ``size`` is its ``(t, h, w)`` patch grid, LLaVA-NeXT's the
    original ``(height, width)`` in pixels; LLaVA's tower takes one fixed size (``size`` is
    ignored)."""
    family = model.config.model_type
    rand = {"generator": generator, "dtype": torch.float64}
    if family in QWEN:
        v = model.config.vision_config
        grid = torch.tensor([size])
        width = v.in_channels * v.temporal_patch_size * v.patch_size**2
        pixels = torch.randn(int(grid.prod()), width, **rand)
        return _item(model, "image", {"pixel_values": pixels, "image_grid_thw": grid})
    side = model.config.vision_config.image_size
    if family == "llava":
        return _item(model, "image", {"pixel_values": torch.randn(1, 3, side, side, **rand)})
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    tiles = image_size_to_num_patches(list(size), model.config.image_grid_pinpoints, side)
    segments = {
        "pixel_values": torch.randn(1, tiles, 3, side, side, **rand),
        "image_sizes": torch.tensor([size]),
    }
    return _item(model, "image", segments)


def make_video(
    model: Any, grid: tuple[int, int, int], generator: torch.Generator, seconds: float = 0.5
) -> Item:
    """A random Qwen video of patch grid ``grid`` (Qwen2.5-VL: ``seconds`` per temporal patch)."""
    v = model.config.vision_config
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    pixels = torch.randn(
        grid[0] * grid[1] * grid[2], width, generator=generator, dtype=torch.float64
    )
    segments = {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([grid])}
    if model.config.model_type == "qwen2_5_vl":
        segments["second_per_grid_ts"] = torch.tensor([seconds], dtype=torch.float64)
    return _item(model, "video", segments)


# --------------------------------------------------------------------------------- batches


@dataclass(eq=False)
class Prompt:
    """A prompt: its media in order (placed after its first text token) and its text."""

    items: list[Item]
    text: list[int]


@dataclass(eq=False)
class MicroBatch:
    """Rows of token ids, where each row's completion starts, each row's prompt and media, and
    the media as ``PackedTensor`` values per model keyword (row ``r`` of each is row ``r``'s)."""

    rows: list[list[int]]
    starts: list[int]
    prompt_of_row: list[int]
    items_of_row: list[list[Item]]
    media: dict[str, PackedTensor]
    layout: str

    @property
    def num_items(self) -> int:
        """Images and videos over all rows (what the logical path encodes)."""
        return sum(len(items) for items in self.items_of_row)

    @property
    def num_unique_items(self) -> int:
        """Images and videos of the distinct segments (what an adapted model encodes): with
        ``per_prompt`` segments, each used prompt's items (an item of two prompts twice)."""
        if self.layout == "per_item":
            return len({id(item) for items in self.items_of_row for item in items})
        rows = zip(self.prompt_of_row, self.items_of_row, strict=True)
        return sum({p: len(items) for p, items in rows}.values())


def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` along dimension 0, zero-padded to their largest other dimensions (what the
    LLaVA-NeXT processor does with its tiles)."""
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = []
    for p in parts:
        pad = [x for d in reversed(range(1, p.dim())) for x in (0, shape[d - 1] - p.shape[d])]
        out.append(F.pad(p, pad) if any(pad) else p)
    return torch.cat(out)


def _keys(prompts: Sequence[Prompt]) -> list[str]:
    keys: list[str] = []
    for prompt in prompts:
        for item in prompt.items:
            keys += [k for k in item.segments if k not in keys]
    return keys


def _per_prompt(prompts: Sequence[Prompt], key: str) -> PackedTensor:
    """One segment per prompt: its items' entries under ``key`` concatenated (``None``: none)."""
    rows: list[torch.Tensor | None] = []
    for prompt in prompts:
        parts = [item.segments[key] for item in prompt.items if key in item.segments]
        rows.append(_cat_padded(parts) if parts else None)
    return PackedTensor(rows, 0, pad_to_max_shape=key == "pixel_values").enable_deduplication()


def _per_item(prompts: Sequence[Prompt], key: str) -> PackedTensor:
    """One segment per item (a shared item is one physical segment with one provenance)."""
    rows = []
    for prompt in prompts:
        values = []
        for item in prompt.items:
            if key not in item.segments:
                continue
            if key not in item.values:
                seg = item.segments[key]
                pad = key == "pixel_values"
                item.values[key] = PackedTensor([seg], 0, pad_to_max_shape=pad)
                item.values[key].enable_deduplication()
            values.append(item.values[key])
        if not values:
            raise ValueError(f"prompt without {key!r} in the one-segment-per-item layout")
        rows.append(PackedTensor.merge_segments(values))
    return PackedTensor.concat(rows)


def micro_batch(
    prompts: Sequence[Prompt],
    group: int,
    *,
    layout: str = "per_prompt",
    generator: torch.Generator | None = None,
) -> MicroBatch:
    """GRPO's micro-batch: ``group`` rows per prompt (prompt ``p``'s rows consecutive), each
    the prompt (text token, media, rest of the text) then its own completion (lengths differ
    within a group). ``layout``: ``per_prompt`` or ``per_item`` segments."""
    generator = generator or torch.Generator().manual_seed(0)
    build = {"per_prompt": _per_prompt, "per_item": _per_item}[layout]
    media = {k: build(prompts, k).repeat_interleave(group) for k in _keys(prompts)}
    rows, starts, prompt_of_row, items_of_row = [], [], [], []
    for p, prompt in enumerate(prompts):
        head = prompt.text[:1] + [t for item in prompt.items for t in item.tokens]
        head += prompt.text[1:]
        for g in range(group):
            completion = torch.randint(*TEXT_IDS, (2 + g,), generator=generator).tolist()
            rows.append(head + completion)
            starts.append(len(head))
            prompt_of_row.append(p)
            items_of_row.append(list(prompt.items))
    return MicroBatch(rows, starts, prompt_of_row, items_of_row, media, layout)


def reorder(batch: MicroBatch, order: Sequence[int]) -> MicroBatch:
    """Rows ``order`` of ``batch`` (``PackedTensor.slice``), each value through a pickle round
    trip, as a micro-batch cut from a bigger batch reaches a worker."""
    order = list(order)
    media = {k: pickle.loads(pickle.dumps(v.slice(order))) for k, v in batch.media.items()}
    return MicroBatch(
        [batch.rows[r] for r in order],
        [batch.starts[r] for r in order],
        [batch.prompt_of_row[r] for r in order],
        [batch.items_of_row[r] for r in order],
        media,
        batch.layout,
    )


# --------------------------------------------------------------------------------- inputs


def _token_types(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMAGE).long() + 2 * (ids == VIDEO).long()


def _row_media(items: list[Item], key: str) -> torch.Tensor | None:
    parts = [item.segments[key] for item in items if key in item.segments]
    return torch.cat(parts) if parts else None


def _qwen_positions(model: Any, batch: MicroBatch) -> torch.Tensor:
    """``[4, 1, T]``: per sample, its text positions from 0, then its own 3-D rope index."""
    parts = []
    for row, items in zip(batch.rows, batch.items_of_row, strict=True):
        ids = torch.tensor(row)
        extra = {}
        if model.config.model_type == "qwen2_5_vl":
            extra["second_per_grid_ts"] = _row_media(items, "second_per_grid_ts")
        rope, _ = model.model.get_rope_index(
            ids[None],
            _token_types(ids)[None],
            image_grid_thw=_row_media(items, "image_grid_thw"),
            video_grid_thw=_row_media(items, "video_grid_thw"),
            **extra,
        )
        parts.append(torch.cat([torch.arange(len(row)).view(1, 1, -1), rope]))
    return torch.cat(parts, dim=2)


def model_inputs(
    model: Any,
    batch: MicroBatch,
    layout: str,
    *,
    unique: bool,
    plain: Sequence[str] = (),
) -> dict[str, Any]:
    """The forward's keyword arguments: media as ``as_tensor()`` (the logical path) or as
    ``unique_segments()`` (keys in ``plain`` stay ``as_tensor()``), tokens in ``layout``
    (``padded`` or ``packed``), without a cache (with one, transformers does not read packed
    position ids as separate samples)."""
    qwen = model.config.model_type in QWEN
    media = {
        k: v.unique_segments() if unique and k not in plain else v.as_tensor()
        for k, v in batch.media.items()
    }
    if layout == "packed":
        ids = torch.tensor([t for row in batch.rows for t in row])[None]
        if qwen:
            positions = _qwen_positions(model, batch)
        else:
            positions = torch.cat([torch.arange(len(row)) for row in batch.rows])[None]
        return {"input_ids": ids, "position_ids": positions, "use_cache": False, **media}
    if layout != "padded":
        raise ValueError(f"unknown layout {layout!r}")
    length = max(map(len, batch.rows))
    ids = torch.full((len(batch.rows), length), PAD)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(batch.rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    out = {"input_ids": ids, "attention_mask": mask, "use_cache": False, **media}
    if qwen:
        out["mm_token_type_ids"] = _token_types(ids)
    return out


def targets(batch: MicroBatch, layout: str) -> torch.Tensor:
    """Next-token targets of the completions (``IGNORE`` elsewhere), shaped like the logits'
    positions of ``layout``."""
    rows = []
    for row, start in zip(batch.rows, batch.starts, strict=True):
        t = torch.full((len(row),), IGNORE)
        t[start - 1 : -1] = torch.tensor(row[start:])
        rows.append(t)
    if layout == "packed":
        return torch.cat(rows)[None]
    length = max(map(len, batch.rows))
    return torch.stack([F.pad(t, (0, length - len(t)), value=IGNORE) for t in rows])


def loss_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the completions."""
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE, reduction="sum")


def _rotary_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import rotate_half

    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rms_norm(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def keep_float64(monkeypatch: Any) -> None:
    """Make the Qwen models compute in their own dtype throughout (``monkeypatch``: a
    ``pytest.MonkeyPatch``). Their vision rotary embedding (and Qwen2.5-VL's RMS norms) round
    to float32 even in a float64 model. The forward rounds alike on both paths, but a backward
    that sums the gradients of G occurrences before that rounding (one encode) differs from one
    that rounds each occurrence's gradient (G encodes) by float32's epsilon, which would hide
    any finer comparison."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2

    monkeypatch.setattr(qwen2, "apply_rotary_pos_emb_vision", _rotary_vision)
    monkeypatch.setattr(qwen2_5, "apply_rotary_pos_emb_vision", _rotary_vision)
    monkeypatch.setattr(qwen2_5.Qwen2_5_VLRMSNorm, "forward", _rms_norm)


def twin(model: Any) -> Any:
    """An independent copy of ``model`` (same weights, no gradients)."""
    clone = copy.deepcopy(model)
    clone.zero_grad(set_to_none=True)
    return clone
