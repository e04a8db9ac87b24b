"""The batch wing: batches for trainers. Encoded samples packed into Megatron's THD layout
(``pack_samples``), several packs as one THD micro-batch (``micro_batch``), or padded ``[B, L]``
rows (``pad_samples``).

Every field is computed in the Rust core in one native call (layout, masks, labels and checks,
with the GIL released); this module converts inputs and wraps the outputs as torch tensors
(zero-copy from numpy). A batch whose fields disagree cannot be built: ``PackedBatch`` and
``PaddedBatch`` check every rule below when constructed (``BatchLayoutError`` names the field,
sample and position) and are frozen (``to`` moves every tensor together).

Batch fields. One alignment per field, named for the trainer that reads it; ``p`` is a
position, ``ignore_index`` the batch's (default ``-100``). Shapes: ``[T]`` for a pack
(``T = cu_seqlens_padded[-1]``; ``unsqueeze(0)`` where a ``[1, T]`` row is expected), ``[B, L]``
for padded rows.

====================  =======  ===================================  ==============================
field                 dtype    alignment                            read by, and how
====================  =======  ===================================  ==============================
``input_ids``         int64    the tokens; ``pad_token_id`` on      every model's input
                               padding
``labels``            int64    shifted: ``labels[p]`` is token      Megatron GPT: ``labels=``;
                               ``p + 1`` of the same sample when    Hugging Face:
                               that token is trainable, else        ``shift_labels=labels`` (with
                               ``ignore_index`` (so every           ``labels=labels`` for the
                               sample's last token and all          model to compute a loss; never
                               padding)                             ``labels=`` alone, which shifts
                                                                    again); ``cross_entropy(...,
                                                                    ignore_index=)``
``loss_mask``         bool     aligned with ``labels``:             Megatron GPT loss:
                               ``loss_mask[p] == (labels[p] !=      ``sum(losses * loss_mask) /
                               ignore_index)``, always (a           loss_mask.sum()``
                               sample's first token and padding
                               included)
``token_mask``        bool     aligned with ``input_ids``: the      NeMo-RL NLL: ``token_mask[1:]``
                               token at ``p`` is trainable (0 on    with ``logits[:-1]`` and
                               padding)                             ``input_ids[1:]``, per sample
                                                                    (``cu_seqlens_padded``) or row
``position_ids``      int64    restart at 0 per sample (row),       Hugging Face
                               count on through its padding         ``position_ids=`` (a pack:
                                                                    sample boundaries for
                                                                    sdpa / eager / flash
                                                                    attention); Megatron RoPE
``cu_seqlens``        int32    ``[n + 1]`` sample offsets without   ``PackedSeqParams.cu_seqlens_q
                               padding                              / kv``; flash-attn varlen
``cu_seqlens_padded`` int32    ``[n + 1]`` sample offsets with      ``PackedSeqParams.cu_seqlens_q
                               padding: sample ``i`` starts at      / kv_padded``; slicing logits
                               ``cu_seqlens_padded[i]``             per sample
``max_seqlen``        int      the longest padded sample            ``PackedSeqParams.max_seqlen_q
                                                                    / kv``
``attention_mask``    bool     padded rows only: ``p <              Hugging Face
                               lengths[r]`` (from the lengths,      ``attention_mask=``
                               never from token values)
``lengths``           int64    padded rows only: tokens per row     NeMo-RL ``input_lengths``
====================  =======  ===================================  ==============================

``loss_mask.sum()`` (equal to ``(labels != ignore_index).sum()``) is the number of predictions
trained on; ``token_mask.sum()`` also counts trainable first tokens, which no prediction in the
sample can reach.

Layout (THD). Sample ``i`` occupies ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i)``,
followed by ``padded_len_i - len_i`` padding positions: ``len_i`` rounded up to
``pad_to_multiple_of`` and, when ``cp_size > 1``, to the least common multiple of that and
``2 * cp_size`` (each sequence splits into ``2 * cp_size`` equal chunks for Megatron's
load-balanced context parallelism). With ``pad_to_length`` (one shape per micro-batch, as
pipeline parallelism needs) the last sample also absorbs the padding up to that total. The
tensors hold the whole pack; sharding by CP rank is the trainer's job.

Worked example (7 tokens, the assistant's answer is tokens 4-6): ``token_mask`` is
``[0,0,0,0,1,1,1]``, ``labels`` ``[-100,-100,-100,t4,t5,t6,-100]`` and ``loss_mask``
``[0,0,0,1,1,1,0]``: the predictions of tokens 4, 5 and 6, made at positions 3, 4 and 5. Both
``loss_mask_mode`` values give the same fields for the same mask.

Options. ``BatchOptions`` holds every option of the builders (mask mode, trained roles,
padding, ``ignore_index``, ``cp_size``, ``pad_to_length``), checked once when made; each
builder takes one as ``options=`` or builds one from the same keyword arguments.
``BatchOptions.padded_length(n)`` is the positions a sample of ``n`` tokens takes (``padded_len``
above), what a packer plans on so that a pack fits a fixed ``pad_to_length``.

Rooms: ``options`` (``BatchOptions``), ``samples`` (``EncodedSample``), ``thd``
(``PackedBatch``, ``pack_samples``, ``micro_batch``), ``padded`` (``PaddedBatch``,
``pad_samples``), ``fields`` (the field declaration and rules), ``masks`` (loss masks from
roles, spans and chat templates).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpack.batch.options import BatchOptions
    from mmpack.batch.padded import PaddedBatch, pad_samples
    from mmpack.batch.samples import EncodedSample
    from mmpack.batch.thd import PackedBatch, merge_media, micro_batch, pack_samples

# Imported on first use: the batch builders need torch, masks need numpy alone.
_EXPORTS = {
    "BatchOptions": "mmpack.batch.options",
    "EncodedSample": "mmpack.batch.samples",
    "PackedBatch": "mmpack.batch.thd",
    "merge_media": "mmpack.batch.thd",
    "micro_batch": "mmpack.batch.thd",
    "pack_samples": "mmpack.batch.thd",
    "PaddedBatch": "mmpack.batch.padded",
    "pad_samples": "mmpack.batch.padded",
}

__all__ = [
    "BatchOptions",
    "EncodedSample",
    "PackedBatch",
    "PaddedBatch",
    "merge_media",
    "micro_batch",
    "pack_samples",
    "pad_samples",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
