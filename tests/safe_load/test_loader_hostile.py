"""Hand-written payloads that reach PackedTensor's restore code through the restricted loader
with states no pickler writes: each must be refused with a typed error, not load a value whose
parts disagree or reach code outside the loader's budget."""

from __future__ import annotations

import io
import pickle
import struct
import tracemalloc
from collections import OrderedDict

import pytest
import torch
from mmpack.errors import CorruptPickleError, LayoutError, PickleTooLargeError, UnsafePickleError
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


def _nemo_state(**fields: object) -> dict[str, object]:
    return {"tensors": [], "dim_to_pack": 0, "pad_to_max_shape": False, **fields}


def test_stride_zero_row_offsets_are_charged_by_their_elements() -> None:
    # one stored element claims 2**28; converting it to an int64 array would allocate 2 GiB
    big = torch.zeros(1, dtype=torch.int64).as_strided((2**28,), (0,))
    payload = _packed(_nemo_state(_row_offsets=big, _segment_indices=big))
    assert len(payload) < 1000
    with pytest.raises(PickleTooLargeError, match="NeMo-RL state"):
        loads(payload, max_bytes=1 << 20)


def test_row_offsets_holding_a_tensor_are_refused() -> None:
    big = torch.zeros(1, dtype=torch.int64).as_strided((2**28,), (0,))
    payload = _packed(_nemo_state(_row_offsets=[big], _segment_indices=[0]))
    with pytest.raises(LayoutError, match="_row_offsets must be a list of int"):
        loads(payload, max_bytes=1 << 20)


def _unmemoized(value: object) -> bytes:
    out = io.BytesIO()
    pickler = pickle.Pickler(out, 2)
    pickler.fast = True  # no memo: two such bodies can follow each other
    pickler.dump(value)
    return out.getvalue()[2:-1]


def test_a_second_state_for_one_value_is_refused() -> None:
    # the first state's row layout (3 segments) would stay with the second one's empty tensors
    t = torch.ones(2)
    first = _nemo_state(tensors=[t, t, t], _row_offsets=[0, 1, 2, 3], _segment_indices=[0, 1, 2])
    payload = (
        b"\x80\x02cmmpack\nPackedTensor\n)\x81"
        + _unmemoized(first)
        + b"b"
        + _unmemoized(_nemo_state())
        + b"b."
    )
    with pytest.raises(UnsafePickleError, match="second state"):
        loads(payload, max_bytes=1 << 22)


def test_a_long_float_line_is_refused_without_its_repr() -> None:
    # float()'s ValueError holds a repr of the whole line, four times its size
    payload = b"F" + b"\xff" * (1 << 20) + b"\n."
    tracemalloc.start()
    try:
        with pytest.raises(CorruptPickleError, match="FLOAT"):
            loads(payload, max_bytes=4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


class _QuantizedRecord:
    """Pickles as a tensor record over a qint8 storage, which torch.save never writes."""

    def __reduce__(self) -> tuple[object, ...]:
        import torch._utils

        raw = torch.arange(4, dtype=torch.uint8).untyped_storage()
        storage = torch.storage.TypedStorage(wrap_storage=raw, dtype=torch.qint8, _internal=True)
        hooks: OrderedDict[object, object] = OrderedDict()
        return (torch._utils._rebuild_tensor_v2, (storage, 0, (4,), (1,), False, hooks, None))


def test_a_quantized_storage_is_refused() -> None:
    # the tensor rebuilt over it has no quantizer: torch's own asserts fail on first use
    with pytest.raises(UnsafePickleError, match="QInt8Storage"):
        loads(pickle.dumps(_QuantizedRecord(), 2), max_bytes=1 << 20)


def test_an_unreadable_byteorder_entry_is_named_not_echoed() -> None:
    import io
    import zipfile

    import torch
    from mmpack.errors import CorruptPickleError
    from mmpack.safe_load import loads

    buf = io.BytesIO()
    torch.save(torch.arange(3), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"<payload-text>"
            dst.writestr(info.filename, data)
    with pytest.raises(CorruptPickleError, match="byteorder") as caught:
        loads(out.getvalue())
    assert "payload-text" not in str(caught.value)
