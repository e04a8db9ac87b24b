"""NeMo-RL's micro-batches under dynamic batching: for each position of the shards' rows, the
longest row there over all shards (rounded up to ``round_to``, at most the padded ``width``);
a micro-batch grows while its row count times its longest fits ``cap``. Every shard runs these
same micro-batches, padded to their lengths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["dynamic_micro_batches"]


def dynamic_micro_batches(
    shard_lengths: Sequence[Sequence[Any]], cap: Any, round_to: Any, width: int
) -> tuple[list[list[int]], list[Any]] | None:
    """The spans (``[start, end)`` positions) and padded lengths of one global batch's
    micro-batches, ``shard_lengths`` giving each shard's row lengths in its order; ``None``
    where a position's length exceeds ``cap`` (NeMo-RL refuses it with its own message)."""
    spans = [[0, 0]]
    spans_lengths = [0]
    longest_in_mb = 0
    for r in range(len(shard_lengths[0]) if shard_lengths else 0):
        # in NeMo-RL's order: 0, then each shard's length
        longest = max([0, *(lengths[r] for lengths in shard_lengths)])
        longest = min((longest + round_to - 1) // round_to * round_to, width)
        if not longest <= cap:  # NaN included
            return None
        longest_in_mb = max(longest_in_mb, longest)
        if (spans[-1][1] - spans[-1][0] + 1) * longest_in_mb <= cap:
            spans[-1][-1] += 1
            spans_lengths[-1] = longest_in_mb
        else:
            spans.append([r, r + 1])
            longest_in_mb = longest
            spans_lengths.append(longest_in_mb)
    return spans, spans_lengths
