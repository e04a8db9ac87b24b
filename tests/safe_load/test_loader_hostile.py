"""Hand-written payloads that reach PackedTensor's restore code through the restricted loader
with states no pickler writes: each must be refused with a typed error, not load a value whose
parts disagree or reach code outside the loader's budget."""

from __future__ import annotations

import pickle
import struct

import pytest
from mmpack.errors import LayoutError, UnsafePickleError
from mmpack.safe_load import loads

STATE_KEY = "__mmpack_packed_tensor__"


def _packed(state: dict[object, object]) -> bytes:
    """A protocol-2 pickle of a PackedTensor created with NEWOBJ and given ``state``."""
    return b"\x80\x02cmmpack\nPackedTensor\n)\x81" + pickle.dumps(state, 2)[2:-1] + b"b."


def _i64(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def test_object_store_segments_are_refused() -> None:
    # restoring them imports Ray (tens of MiB, uncharged) and keeps the payload's objects as
    # the segments every method reads first
    state = {
        STATE_KEY: 1,
        "dim_to_pack": 0,
        "pad_to_max_shape": False,
        "layout": None,
        "segments": ("mmpack.store-segments/1", _i64(-2), _i64(0), [], ["not a tensor"]),
        "extra": None,
    }
    with pytest.raises(UnsafePickleError, match="object-store segments"):
        loads(_packed(state), max_bytes=1 << 20)


def test_nemo_rl_state_with_store_segments_is_refused() -> None:
    # ``_store`` would shadow ``tensors`` for to(), slicing and gathering
    state = {"tensors": [], "dim_to_pack": 0, "pad_to_max_shape": False, "_store": ["x", 5]}
    with pytest.raises(LayoutError, match="_store"):
        loads(_packed(state), max_bytes=1 << 20)
