"""What trainers compute from a batch, and the unpacked reference they must agree with.

* ``unpacked`` runs a causal LM on each sample alone (no padding, positions ``0..n-1``) and sums
  the cross entropy of every trainable next token: the reference loss (float64).
* ``megatron_loss``: Megatron-Core's GPT loss, the real
  ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` times ``loss_mask``, summed
  and divided by ``loss_mask.sum()`` (``pretrain_gpt.loss_func``). Needs model-parallel state
  (``megatron_parallel_state``).
* ``nemo_rl_nll``: NeMo-RL's NLL loss: ``token_mask[1:]`` with ``logits[:-1]`` and
  ``input_ids[1:]``, per sample (``cu_seqlens_padded``) or per row, normalized by the number of
  trained tokens.
* Hugging Face's loss is the model's own (``model(..., labels=, shift_labels=)``), called by
  the tests.

Plus a tiny random-init Llama built from a config (nothing downloaded) and the block-diagonal
causal mask of a pack.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "block_causal_mask",
    "gradients",
    "megatron_loss",
    "megatron_parallel_state",
    "nemo_rl_nll",
    "relative",
    "tiny_llama",
    "unpacked",
]

VOCAB = 64


def tiny_llama(seed: int = 0, attn_implementation: str = "sdpa") -> Any:
    """A 2-layer Llama (hidden 32, vocab 64) in float64, random weights, no cache.

    Float64 end to end: Hugging Face's Llama RMSNorm (and its eager attention's softmax) round
    through float32, which turns the 1e-16 summation-order noise between a pack and its
    samples into 1e-8 rounding flips; the norms here keep the model's dtype and attention is
    SDPA's (float64 on the CPU), so packed and unpacked agree to 1e-12 or better.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class ExactRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
        attn_implementation=attn_implementation,
        # larger weights than a pretraining init: peaked logits, so per-token losses differ
        # widely and a loss scored at the wrong positions shows
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    for module in model.modules():
        if type(module) is LlamaRMSNorm:
            module.__class__ = ExactRMSNorm
    model.eval()  # no dropout: identical maths packed and unpacked
    return model


def gradients(model: Any, loss: torch.Tensor) -> list[torch.Tensor]:
    """d loss / d parameters (the graph is kept for further losses)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))


def relative(got: Any, want: Any) -> float:
    """``|got - want| / |want|`` over tensors or lists of tensors (Frobenius norms)."""
    if isinstance(got, torch.Tensor):
        got, want = [got], [want]
    num = sum(float((g - w).double().norm() ** 2) for g, w in zip(got, want, strict=True))
    den = sum(float(w.double().norm() ** 2) for w in want)
    return (num / den) ** 0.5 if den else num**0.5


def unpacked(
    model: Any, samples: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Each ``(token_ids, trainable)`` sample run alone: its logits, the summed cross entropy
    of every trainable token after the first (predicted by the token before it), and how many
    such predictions there are."""
    logits, total, count = [], torch.zeros((), dtype=torch.float64), 0
    for tokens, trainable in samples:
        n = tokens.numel()
        out = model(tokens[None], position_ids=torch.arange(n)[None]).logits[0]
        logits.append(out)
        targets = trainable[1:].bool()
        if bool(targets.any()):
            ce = F.cross_entropy(out[:-1], tokens[1:], reduction="none")
            total = total + ce[targets].sum()
            count += int(targets.sum())
    return logits, total, count


def block_causal_mask(cu_seqlens_padded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[1, 1, T, T]`` mask of a pack: each position attends to the earlier
    positions of its own sample (padding included), nothing across samples."""
    widths = torch.diff(cu_seqlens_padded.long())
    sample = torch.repeat_interleave(torch.arange(len(widths)), widths)
    t = int(cu_seqlens_padded[-1])
    pos = torch.arange(t)
    allowed = (sample[:, None] == sample[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(t, t, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def megatron_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> Any:
    """Megatron-Core's GPT loss: ``vocab_parallel_cross_entropy(logits, labels)`` (float32
    inside, as Megatron computes it) times ``loss_mask``, over ``loss_mask.sum()``."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    losses = vocab_parallel_cross_entropy(logits.contiguous(), labels.contiguous())
    mask = loss_mask.reshape(-1).float()
    return torch.sum(losses.reshape(-1) * mask) / mask.sum()


def nemo_rl_nll(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    token_mask: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """NeMo-RL's NLL: log-probabilities of ``input_ids[1:]`` from ``logits[:-1]``, masked by
    ``token_mask[1:]``, per sample of a pack (``cu_seqlens_padded``) or per row of ``[B, L]``
    tensors; summed and divided by the number of masked-in tokens."""
    if cu_seqlens_padded is not None:
        bounds = cu_seqlens_padded.tolist()
        rows = [
            (logits[a:b], input_ids[a:b], token_mask[a:b]) for a, b in itertools.pairwise(bounds)
        ]
    else:
        rows = list(zip(logits, input_ids, token_mask, strict=True))
    total, count = torch.zeros((), dtype=logits.dtype), 0
    for lg, ids, tm in rows:
        logprobs = torch.log_softmax(lg[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
        mask = tm[1:].to(logprobs.dtype)
        total = total - (logprobs * mask).sum()
        count += int(tm[1:].sum())
    return total / count


@contextlib.contextmanager
def megatron_parallel_state() -> Iterator[None]:
    """torch.distributed (gloo, world size 1) and Megatron's model-parallel groups (TP = PP =
    1), torn down afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
