"""Python's ``random`` module emulated in Rust, where packing must shuffle exactly as NeMo-RL does
(``random.Random(seed).shuffle`` or the global ``random.shuffle``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from mmpack import _native
from mmpack._coerce import packing_int
from mmpack.errors import PackingArgumentError
from mmpack.packing.result import IntArray

__all__ = ["shuffle_order"]

_MAX_ITEMS = 2**32 - 1


def shuffle_order(n: int, rng: random.Random | None) -> IntArray:
    """``random.shuffle(list(range(n)))`` done in Rust from ``rng``'s state (the global
    ``random`` module when ``rng`` is None), advancing that state exactly as Python would.
    ``PackingArgumentError`` naming ``n`` for a count that is no integer (a bool included),
    negative, above ``2**32 - 1`` (the generator draws 32-bit words) or whose permutation
    cannot be allocated."""
    count = packing_int(n, "n", 0)
    if count > _MAX_ITEMS:
        raise PackingArgumentError(
            f"invalid packing argument n: must be <= {_MAX_ITEMS} (32-bit draws), got {count}"
        )
    source: Any = random if rng is None else rng
    version, words, gauss = source.getstate()
    state = np.array(words[:624], dtype=np.uint32)
    shuffled = _native.shuffle_permutation(state, int(words[624]), count)
    source.setstate((version, (*shuffled.state.tolist(), shuffled.pos), gauss))
    return shuffled.permutation
