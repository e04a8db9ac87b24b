"""The ``PackedTensor`` pickle format (``mmpack.packed.pickling.format``) is stable: pickles written
by earlier versions load, through ``pickle`` and through ``mmpack.compat.nemo_rl.loads``, and the
same values still pickle to the same bytes."""

from __future__ import annotations

import base64
import pickle
import pickletools
from typing import Any

import pytest
import torch
from mmpack.compat import nemo_rl
from mmpack.packed import PackedTensor as P

# ``pickle.dumps([v, w], protocol)`` of the two values ``_values()`` builds, as written before
# the format moved into its own module.
GOLDEN = {
    2: """
gAJdcQAoY2NvcHlfcmVnCl9yZWNvbnN0cnVjdG9yCnEBY21tcGFjay5wYWNrZWQKUGFja2VkVGVuc29yCnECY19f
YnVpbHRpbl9fCm9iamVjdApxA06HcQRScQV9cQYoWBgAAABfX21tcGFja19wYWNrZWRfdGVuc29yX19xB0sBWAsA
AABkaW1fdG9fcGFja3EISwBYEAAAAHBhZF90b19tYXhfc2hhcGVxCYhYBgAAAGxheW91dHEKY19jb2RlY3MKZW5j
b2RlCnELWCAAAAAAAAAAAAAAAAIAAAAAAAAAAwAAAAAAAAADAAAAAAAAAHEMWAYAAABsYXRpbjFxDYZxDlJxD2gL
WBgAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAABxEGgNhnERUnESaAtYMAAAAAEBAQEBAQEBAQEBAQEBAQECAgIC
AgICAgICAgICAgICAwMDAwMDAwMDAwMDAwMDA3ETaA2GcRRScRWHcRZYCAAAAHNlZ21lbnRzcRcoWBEAAABtbXBh
Y2suc2VnbWVudHMvMnEYaAtYIAAAAAAAAAAAAAAAAAAAAAAAAADDv8O/w7/Dv8O/w7/Dv8O/cRloDYZxGlJxG2gL
WBgAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAABxHGgNhnEdUnEeXXEfaAFoAmgDTodxIFJxIX1xIihoB0sBWAUA
AABncm91cHEjKFgOAAAAbW1wYWNrLmdyb3VwLzFxJGgLWBAAAAAAAAAAAAAAAAEAAAAAAAAAcSVoDYZxJlJxJ2gL
WBAAAAACAAAAAAAAAAIAAAAAAAAAcShoDYZxKVJxKmgLWCAAAAACAAAAAAAAAAMAAAAAAAAAAQAAAAAAAAADAAAA
AAAAAHEraA2GcSxScS1dcS4oWAcAAABmbG9hdDMycS9oC1gbAAAAAAAAAAAAwoA/AAAAQAAAQEAAAMKAQAAAwqBA
cTBoDYZxMVJxMoZxM1gFAAAAaW50MzJxNGgLWAwAAAAHAAAACAAAAAkAAABxNWgNhnE2UnE3hnE4ZXRxOXViYV1x
OnRxO1gFAAAAZXh0cmFxPE51YmgBaAJoA06HcT1ScT59cT8oaAdLAWgISv////9oCYloCk5oFyhoGGgLWBAAAAAA
AAAAAAAAAAAAAAAAAAAAcUBoDYZxQVJxQmgLWBAAAAAAAAAAAAAAAAEAAAAAAAAAcUNoDYZxRFJxRV1xRmghYV1x
R3RxSGg8fXFJWAQAAABub3RlcUpYBAAAAGtlcHRxS3N1YmUu
""",
    5: """
gAWVuQIAAAAAAABdlCiMB2NvcHlyZWeUjA5fcmVjb25zdHJ1Y3RvcpSTlIwNbW1wYWNrLnBhY2tlZJSMDFBhY2tl
ZFRlbnNvcpSTlIwIYnVpbHRpbnOUjAZvYmplY3SUk5ROh5RSlH2UKIwYX19tbXBhY2tfcGFja2VkX3RlbnNvcl9f
lEsBjAtkaW1fdG9fcGFja5RLAIwQcGFkX3RvX21heF9zaGFwZZSIjAZsYXlvdXSUQyAAAAAAAAAAAAIAAAAAAAAA
AwAAAAAAAAADAAAAAAAAAJRDGAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAJRDMAEBAQEBAQEBAQEBAQEBAQECAgIC
AgICAgICAgICAgICAwMDAwMDAwMDAwMDAwMDA5SHlIwIc2VnbWVudHOUKIwRbW1wYWNrLnNlZ21lbnRzLzKUQxgA
AAAAAAAAAAAAAAAAAAAA//////////+UQxgAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAACUXZRoA2gGaAlOh5RSlH2U
KGgNSwGMBWdyb3VwlCiMDm1tcGFjay5ncm91cC8xlEMQAAAAAAAAAAABAAAAAAAAAJRDEAIAAAAAAAAAAgAAAAAA
AACUQyACAAAAAAAAAAMAAAAAAAAAAQAAAAAAAAADAAAAAAAAAJRdlCiMB2Zsb2F0MzKUlhgAAAAAAAAAAAAAAAAA
gD8AAABAAABAQAAAgEAAAKBAlIaUjAVpbnQzMpSWDAAAAAAAAAAHAAAACAAAAAkAAACUhpRldJR1YmFdlHSUjAVl
eHRyYZROdWJoA2gGaAlOh5RSlH2UKGgNSwFoDkr/////aA+JaBBOaBUoaBZDEAAAAAAAAAAAAAAAAAAAAACUQxAA
AAAAAAAAAAEAAAAAAAAAlF2UaBthXZR0lGgsfZSMBG5vdGWUjARrZXB0lHN1YmUu
""",
}
PROVENANCE = [bytes([1]) * 16, bytes([2]) * 16, bytes([3]) * 16]


def _values() -> list[P]:
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.tensor([[7, 8, 9]], dtype=torch.int32)
    v = P(
        [a, b, None],
        0,
        pad_to_max_shape=True,
        _row_offsets=[0, 2, 3, 3],
        _segment_indices=[0, 1, 0],
        _segment_provenance=PROVENANCE,
    )
    w = P([a, b], -1)
    w.note = "kept"  # type: ignore[attr-defined]
    return [v, w]


def _golden(protocol: int) -> bytes:
    return base64.b64decode("".join(GOLDEN[protocol].split()))


def _check(got: Any) -> None:
    v, w = got
    assert type(v) is P and type(w) is P
    assert v._row_offsets == [0, 2, 3, 3] and v._segment_indices == [0, 1, 0]
    assert v._segment_provenance == PROVENANCE
    assert v.dim_to_pack == 0 and v.pad_to_max_shape is True and v.tensors[2] is None
    assert w._row_offsets is None and not w.deduplication_enabled
    assert w.dim_to_pack == -1 and w.pad_to_max_shape is False and w.note == "kept"
    # one tensor object per original tensor, shared between the two values
    assert v.tensors[0] is w.tensors[0] and v.tensors[1] is w.tensors[1]
    want_v, want_w = _values()
    for got_t, want_t in zip(w.tensors, want_w.tensors, strict=True):
        assert got_t.dtype == want_t.dtype and torch.equal(got_t, want_t)
    assert torch.equal(v.as_tensor(), want_v.as_tensor())  # type: ignore[arg-type]
    v.tensors[0].add_(1)  # restored segments are writable


@pytest.mark.parametrize("protocol", sorted(GOLDEN))
def test_earlier_pickles_load(protocol: int) -> None:
    _check(pickle.loads(_golden(protocol)))


@pytest.mark.parametrize("protocol", sorted(GOLDEN))
def test_earlier_pickles_load_through_the_restricted_unpickler(protocol: int) -> None:
    _check(nemo_rl.loads(_golden(protocol)))


@pytest.mark.parametrize("protocol", sorted(GOLDEN))
def test_the_same_values_pickle_to_the_same_bytes(protocol: int) -> None:
    assert pickle.dumps(_values(), protocol=protocol) == _golden(protocol)


def test_reduce_names_only_the_class_and_copyreg() -> None:
    """The globals a pickle references are the reconstructor and the class (never a helper of
    the format module, whose names are free to change)."""
    v, _ = _values()
    func, args, state = v.__reduce_ex__(5)
    assert (func.__module__, func.__name__) == ("copyreg", "_reconstructor")
    assert args == (P, object, None)
    assert state["__mmpack_packed_tensor__"] == 1
    names = {
        arg.split(" ", 1)[0]
        for op, arg, _ in pickletools.genops(pickle.dumps(v, protocol=2))
        if op.name == "GLOBAL"
    }
    assert names == {"copy_reg", "mmpack.packed", "__builtin__", "_codecs"}


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_value_whose_tensors_no_longer_fit_its_layout_is_not_written(protocol: int) -> None:
    """``pickle.dumps`` refuses a value whose pickle would not load, naming the value and both
    counts, instead of writing it."""
    from mmpack.errors import LayoutError, LayoutMismatchError

    dedup = P([torch.ones(2), torch.zeros(3)], 0).enable_deduplication()
    dedup.tensors.append(torch.ones(4))
    with pytest.raises(
        LayoutMismatchError, match=r"3 entries .* provenance for 2 physical"
    ) as info:
        pickle.dumps(dedup, protocol=protocol)
    assert f"{id(dedup):#x}" in str(info.value) and "(3 rows)" in str(info.value)
    assert isinstance(info.value, pickle.PicklingError) and isinstance(info.value, LayoutError)
    csr = P([torch.ones(2), torch.zeros(3)], 0, _row_offsets=[0, 2], _segment_indices=[1, 0])
    csr.tensors.pop()
    with pytest.raises(LayoutMismatchError, match=r"1 entries .* physical segment 1"):
        pickle.dumps([csr], protocol=protocol)
    # NeMo-RL allows an unreferenced extra segment without provenance: it still round-trips
    extra = P([torch.ones(2)], 0, _row_offsets=[0, 1], _segment_indices=[0])
    extra.tensors.append(torch.zeros(3))
    got = pickle.loads(pickle.dumps(extra, protocol=protocol))
    assert len(got.tensors) == 2 and got._segment_indices == [0]
    assert torch.equal(got.as_tensor(), torch.ones(2))


@pytest.mark.parametrize("protocol", [2, 5])
def test_numpy_scalars_in_the_fields_are_written_as_int_and_bool(protocol: int) -> None:
    """``dim_to_pack`` / ``pad_to_max_shape`` given as numpy scalars (or 0 / 1) construct and
    gather; their pickle loads everywhere, as ``int`` and ``bool``."""
    import numpy as np

    for dim, pad in ((np.int64(0), np.bool_(False)), (np.int32(0), 1), (0, np.bool_(True))):
        v = P([torch.ones(2, 3), torch.zeros(1, 3)], dim, pad_to_max_shape=pad)
        for load in (pickle.loads, nemo_rl.loads):
            got = load(pickle.dumps(v, protocol=protocol))
            assert type(got.dim_to_pack) is int and got.dim_to_pack == 0
            assert type(got.pad_to_max_shape) is bool and got.pad_to_max_shape == bool(pad)
            assert torch.equal(got.as_tensor(), v.as_tensor())


@pytest.mark.parametrize(
    ("dim", "pad", "match"),
    [
        (0.0, False, "dim_to_pack must be an int, got 0.0"),
        (True, False, "dim_to_pack must be an int, got True"),
        (0, None, "pad_to_max_shape must be a bool, got None"),
        (0, 2, "pad_to_max_shape must be a bool, got 2"),
    ],
)
def test_fields_a_pickle_cannot_hold_are_refused_when_written(
    dim: Any, pad: Any, match: str
) -> None:
    """A value whose fields would make its pickle unloadable fails in ``pickle.dumps``, where
    the writer sees it, not as a "corrupt pickle" in the process that receives it."""
    from mmpack.errors import LayoutMismatchError

    v = P([torch.ones(2)], dim, pad_to_max_shape=pad)
    with pytest.raises(LayoutMismatchError, match=match):
        pickle.dumps(v)


def _state_with(extra: dict[Any, Any]) -> bytes:
    """A payload that restores a PackedTensor with ``extra`` instance attributes (as a hostile
    writer would make it: mmpack's own writer refuses such a value)."""
    import copyreg

    state = P([torch.ones(2)], 0).__reduce_ex__(2)[2]
    state["extra"] = extra

    class Handmade:
        def __reduce__(self) -> Any:
            return (copyreg._reconstructor, (P, object, None), state)  # type: ignore[attr-defined]

    return pickle.dumps(Handmade(), protocol=2)


def test_a_payload_cannot_replace_the_class_methods() -> None:
    """``extra`` (mmpack's state) or a NeMo-RL ``__dict__`` state naming a method or property
    would make ``as_tensor()`` (or ``len``) return what the payload chose: refused on load,
    through the restricted loader and plain ``pickle`` alike, and refused when written."""
    import collections

    from mmpack.errors import LayoutError, LayoutMismatchError

    for name in ("as_tensor", "iter_logical_segments", "__deepcopy__", "deduplication_enabled"):
        data = _state_with({name: collections.OrderedDict})
        for load in (pickle.loads, nemo_rl.loads):
            with pytest.raises(LayoutError, match=rf"attribute '{name}' would hide"):
                load(data)
    nemo_state = {
        "tensors": [torch.ones(2)],
        "dim_to_pack": 0,
        "pad_to_max_shape": False,
        "as_tensor": collections.OrderedDict,
    }
    with pytest.raises(LayoutError, match="attribute 'as_tensor' would hide"):
        P.__new__(P).__setstate__(nemo_state)
    v = P([torch.ones(2)], 0)
    v.__dict__["as_tensor"] = collections.OrderedDict
    with pytest.raises(LayoutMismatchError, match="'as_tensor' would hide"):
        pickle.dumps(v)
    # ordinary extra attributes still travel
    w = P([torch.ones(2)], 0)
    w.note = "kept"  # type: ignore[attr-defined]
    assert nemo_rl.loads(pickle.dumps(w)).note == "kept"
