"""Plain-Python/torch loss-mask functions, the way SFT pipelines write them today: per message
``torch.ones``/``torch.zeros`` and ``torch.cat``, validation with elementwise torch ops.

The oracle for ``mmpack.batch.masks`` and its benchmark baseline. Same semantics, and errors of
the same kinds (`reference.errors`, compared by class name; messages may differ in wording).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from reference.errors import LossMaskError, MessageSpanError, TurnStructureError

__all__ = ["from_fragments", "from_roles", "turn_spans", "validate"]


def _name(sample_id: Hashable | None) -> str:
    return "<unnamed>" if sample_id is None else repr(sample_id)


def _spans(lengths, flags, num_tokens, sample_id, what) -> torch.Tensor:
    lengths = [int(n) for n in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
    flags = list(flags)
    if len(lengths) != len(flags):
        raise MessageSpanError(
            f"loss mask spans of sample {_name(sample_id)} are inconsistent: "
            f"{len(lengths)} {what} lengths but {len(flags)} flags"
        )
    parts = []
    for i, (n, flag) in enumerate(zip(lengths, flags, strict=True)):
        if n < 0:
            raise MessageSpanError(
                f"loss mask spans of sample {_name(sample_id)} are inconsistent: "
                f"{what} {i} has negative length {n}"
            )
        make = torch.ones if flag else torch.zeros
        parts.append(make(n, dtype=torch.bool))
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    if num_tokens is not None and mask.numel() != num_tokens:
        raise MessageSpanError(
            f"loss mask spans of sample {_name(sample_id)} are inconsistent: {what} lengths "
            f"sum to {mask.numel()} but the sample has {num_tokens} tokens"
        )
    return mask


def from_roles(
    message_lengths: Sequence[int],
    message_roles: Sequence[str],
    train_roles: Sequence[str] = ("assistant",),
    *,
    num_tokens: int | None = None,
    sample_id: Hashable | None = None,
) -> torch.Tensor:
    """One ``ones``/``zeros`` tensor per message, concatenated (bool)."""
    flags = [role in tuple(train_roles) for role in message_roles]
    return _spans(message_lengths, flags, num_tokens, sample_id, "message")


def from_fragments(
    fragment_lengths: Sequence[int],
    trainable: Sequence[bool],
    *,
    num_tokens: int | None = None,
    sample_id: Hashable | None = None,
) -> torch.Tensor:
    flags = [bool(t) for t in (trainable.tolist() if hasattr(trainable, "tolist") else trainable)]
    return _spans(fragment_lengths, flags, num_tokens, sample_id, "fragment")


def validate(
    mask,
    num_tokens: int,
    *,
    sample_id: Hashable | None = None,
    require_trainable: bool = False,
) -> None:
    """Length, values in {0, 1} (first bad position), at least one 1 when required."""
    mask = torch.as_tensor(mask)
    if mask.dim() != 1:
        raise LossMaskError(f"loss mask of sample {_name(sample_id)} is not 1-D")
    if mask.numel() != num_tokens:
        raise LossMaskError(
            f"loss mask of sample {_name(sample_id)} has {mask.numel()} values but the sample "
            f"has {num_tokens} tokens (rule: mask length equals token count)"
        )
    bad = ~((mask == 0) | (mask == 1))
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise LossMaskError(
            f"loss mask of sample {_name(sample_id)} has value {mask[position].item()} at "
            f"position {position} (rule: values are only 0 and 1)"
        )
    if require_trainable and not bool((mask == 1).any()):
        raise LossMaskError(
            f"loss mask of sample {_name(sample_id)} has no trainable token "
            "(rule: at least one value is 1)"
        )


def turn_spans(token_ids, turn_marker_ids, *, sample_id: Hashable | None = None) -> np.ndarray:
    """Pairs of (user marker, assistant marker) positions; see ``mmpack.batch.masks.turn_spans``."""
    tokens = torch.as_tensor(token_ids)
    markers = torch.as_tensor(list(turn_marker_ids), dtype=tokens.dtype)
    positions = torch.isin(tokens, markers).nonzero().flatten().tolist()
    if len(positions) == 0 or len(positions) % 2:
        raise TurnStructureError(
            f"sample {_name(sample_id)} has {len(positions)} turn markers; turns must come in "
            "user/assistant pairs"
        )
    rows = []
    for k in range(0, len(positions), 2):
        end = positions[k + 2] if k + 2 < len(positions) else tokens.numel()
        rows.append([positions[k], positions[k + 1], positions[k + 1], end])
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)
