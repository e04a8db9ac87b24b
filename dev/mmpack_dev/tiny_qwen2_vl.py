"""Qwen2-VL built offline for training on the CPU: the real processor (image and video processors
from their defaults, with a smaller ``max_pixels``), Qwen2's real tokenizer
(`mmpack_dev.qwen_vocab`), a tiny random-init `Qwen2VLForConditionalGeneration` with the real
vocabulary size, and its summed next-token loss on a THD pack or on padded rows.

Packed sequences reach the model as transformers reads them: one ``[1, T]`` row, and
``position_ids`` of shape ``[4, 1, T]`` whose first row holds the text positions restarting at
every sample (from which the model builds a block-diagonal causal mask) and whose last three are
each sample's own 3-D rope index. Padded rows get ``attention_mask`` and ``mm_token_type_ids``,
and the model computes their rope index itself.

The loss head runs on every position the model ran on (padding included, as a trainer that
feeds the model a fixed shape pays for it). It is a fused linear cross-entropy
(`LinearCrossEntropy`): chunk by chunk, the logits, their softmax and the gradients of the
hidden states and of the output embedding are computed in one reused buffer, so the
``[positions, 151936]`` logits never exist at once and nothing is recomputed in backward.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from mmpack_dev.qwen_vocab import QWEN2_VL_CHAT_TEMPLATE, QWEN2_VL_VOCAB_SIZE, qwen2_vl_tokenizer

__all__ = [
    "MAX_PIXELS",
    "MEDIA_KEYS",
    "MIN_PIXELS",
    "LinearCrossEntropy",
    "build_model",
    "build_processor",
    "packed_loss_sum",
    "padded_loss_sum",
]

#: min/max pixels of the resize policy (the defaults are 56*56 and 28*28*1280)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112
#: the processor outputs the model reads, per media kind
MEDIA_KEYS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}
#: positions whose logits exist at once in the loss
LOSS_CHUNK = 128


def build_processor(chat_template: str = QWEN2_VL_CHAT_TEMPLATE) -> Any:
    """`Qwen2VLProcessor` with the real Qwen2 tokenizer (and `chat_template`), and image and
    video processors built from their defaults with ``MIN_PIXELS`` / ``MAX_PIXELS``."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=qwen2_vl_tokenizer(chat_template),
        video_processor=Qwen2VLVideoProcessor(size=size, cap_pixels_per_frame=True),
    )


def build_model(
    tokenizer: Any,
    *,
    hidden: int = 64,
    layers: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Any:
    """A random-init `Qwen2VLForConditionalGeneration` (seeded): `layers` decoder layers of
    width `hidden`, a one-block vision tower, Qwen2-VL's vocabulary size and special ids, tied
    embeddings (as Qwen2-VL-2B), no dropout."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    heads = max(1, hidden // 16)
    half = hidden // heads // 2  # rope pairs per head, split over (time, height, width)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": QWEN2_VL_VOCAB_SIZE,
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
            },
            "attention_dropout": 0.0,
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": hidden,
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
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(dtype)
    return model.train()


def _media_inputs(media: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's media keyword arguments from a batch's media values (pixels in `dtype`)."""
    out: dict[str, torch.Tensor] = {}
    for values_key, grid_key in MEDIA_KEYS.values():
        if values_key not in media:
            continue
        values = media[values_key].as_tensor()
        if values is None or not values.numel():
            continue
        out[values_key] = values.to(dtype)
        out[grid_key] = media[grid_key].as_tensor()
    return out


def _token_types(model: Any, ids: torch.Tensor) -> torch.Tensor:
    config = model.config
    return (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()


def _sample_grids(
    model: Any, ids: torch.Tensor, cu: list[int], grids: torch.Tensor | None, token_id: int
) -> list[torch.Tensor | None]:
    """Per sample (``ids[cu[i]:cu[i+1]]``), the rows of `grids` its placeholders take, in
    order: an item of grid ``(t, h, w)`` takes ``t*h*w / merge**2`` placeholder tokens."""
    if grids is None:
        return [None] * (len(cu) - 1)
    merge = model.config.vision_config.spatial_merge_size**2
    per_item = (grids.prod(-1) // merge).tolist()
    out: list[torch.Tensor | None] = []
    item = 0
    for a, b in itertools.pairwise(cu):
        n = int((ids[a:b] == token_id).sum())
        first = item
        while n > 0:
            n -= per_item[item]
            item += 1
        out.append(grids[first:item] if item > first else None)
    return out


def packed_positions(model: Any, pack: Any, media: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[4, 1, T]`` position ids of a THD pack: text positions restarting per sample, then
    each sample's own 3-D rope index (Qwen2-VL's ``get_rope_index`` on that sample alone)."""
    config = model.config
    ids = pack.input_ids
    cu = pack.cu_seqlens_padded.tolist()
    images = _sample_grids(model, ids, cu, media.get("image_grid_thw"), config.image_token_id)
    videos = _sample_grids(model, ids, cu, media.get("video_grid_thw"), config.video_token_id)
    rows = []
    for i in range(len(cu) - 1):
        sample = ids[cu[i] : cu[i + 1]]
        if images[i] is None and videos[i] is None:
            rope = torch.arange(len(sample)).expand(3, 1, -1)
        else:
            rope, _ = model.model.get_rope_index(
                sample[None],
                _token_types(model, sample)[None],
                image_grid_thw=images[i],
                video_grid_thw=videos[i],
            )
        rows.append(torch.cat([pack.position_ids[cu[i] : cu[i + 1]].view(1, 1, -1), rope], 0))
    return torch.cat(rows, dim=2)


class LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, labels, ignore_index=ignore, reduction="sum")`` with
    its gradients computed in the forward pass, `LOSS_CHUNK` positions at a time in one
    buffer (the same arithmetic as the unfused loss; the demo's test checks it against
    ``torch.nn.functional.cross_entropy``). With `scale` (``[N]``, no gradient), each
    position's loss is multiplied by its entry before the sum (a policy-gradient loss weighs
    each completion token by its row's advantage)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore: int,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, weight = hidden.detach(), weight.detach()
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight)
        total = hidden.new_zeros(())
        buffer = hidden.new_empty(min(LOSS_CHUNK, hidden.shape[0]), weight.shape[0])
        for start in range(0, hidden.shape[0], LOSS_CHUNK):
            h = hidden[start : start + LOSS_CHUNK]
            y = labels[start : start + LOSS_CHUNK]
            logits = buffer[: h.shape[0]]
            torch.mm(h, weight.T, out=logits)
            rows = torch.nonzero(y != ignore)[:, 0]
            target = logits[rows, y[rows]]
            top = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: the buffer now holds exp(logit - top)
            norm = probs.sum(dim=1, keepdim=True)
            lse = (top + norm.log())[:, 0]
            keep = torch.zeros(h.shape[0], 1, dtype=probs.dtype)
            if scale is None:
                total += (lse[rows] - target).sum()
                keep[rows] = 1
            else:
                factor = scale[start : start + LOSS_CHUNK][rows].to(probs.dtype)
                total += (factor * (lse[rows] - target)).sum()
                keep[rows, 0] = factor
            probs.div_(norm)  # softmax: d loss / d logits, less the one-hot of the target
            probs[rows, y[rows]] -= 1
            probs.mul_(keep)
            torch.mm(probs, weight, out=grad_hidden[start : start + LOSS_CHUNK])
            grad_weight.addmm_(probs.T, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad, grad_weight * grad, None, None, None


def _loss_sum(model: Any, hidden: torch.Tensor, labels: torch.Tensor, ignore: int) -> torch.Tensor:
    """Summed cross-entropy of ``lm_head(hidden)`` ``[N, V]`` against `labels` ``[N]``."""
    result: torch.Tensor = LinearCrossEntropy.apply(hidden, model.lm_head.weight, labels, ignore)
    return result


def packed_loss_sum(model: Any, pack: Any) -> tuple[torch.Tensor, int]:
    """Summed next-token loss of one THD pack (a `mmpack.batch.PackedBatch`; its ``labels``
    are already the next-token targets) and the number of trained predictions."""
    dtype = model.dtype
    media = _media_inputs(pack.media, dtype)
    out = model.model(
        input_ids=pack.input_ids[None],
        position_ids=packed_positions(model, pack, media),
        use_cache=False,  # no cache: the model reads the sample boundaries from the positions
        **media,
    )
    hidden = out.last_hidden_state[0]
    loss = _loss_sum(model, hidden, pack.labels, pack.ignore_index)
    return loss, int(pack.loss_mask.sum())


def padded_loss_sum(model: Any, rows: Any, media: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Summed next-token loss of padded rows (a `mmpack.batch.padded.PaddedBatch`) whose media,
    in row order, is `media`; and the number of trained predictions."""
    dtype = model.dtype
    ids = rows.input_ids
    out = model.model(
        input_ids=ids,
        attention_mask=rows.attention_mask.long(),
        mm_token_type_ids=_token_types(model, ids),
        use_cache=False,
        **_media_inputs(media, dtype),
    )
    hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
    loss = _loss_sum(model, hidden, rows.labels.reshape(-1), rows.ignore_index)
    return loss, int(rows.loss_mask.sum())
