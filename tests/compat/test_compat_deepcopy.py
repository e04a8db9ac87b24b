"""``mmpack.compat.nemo_rl.deepcopy.deepcopy`` gives ``copy.deepcopy``'s result: the same values,
and the same sharing (which objects, tensors and storages are one and the same) inside the copy and
with the memo's entries."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import mmpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mmpack.compat.nemo_rl.deepcopy import deepcopy as fast_deepcopy


class Leaf:
    """An object with no fast path (goes to ``copy.deepcopy``)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Leaf) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


class TaggedTensor(torch.Tensor):
    pass


def shape_of(value: Any) -> Any:
    """A description of ``value`` that two equal deep copies share: values, types, tensor
    layouts, and identity classes (the first-seen number of every object and storage)."""
    seen: dict[int, int] = {}
    storages: dict[int, int] = {}
    described: set[int] = set()

    def describe(v: Any) -> Any:
        ref = seen.setdefault(id(v), len(seen))
        if isinstance(v, torch.Tensor):
            storage = storages.setdefault(v.untyped_storage().data_ptr(), len(storages))
            return (
                "T",
                type(v).__name__,
                ref,
                storage,
                v.dtype,
                tuple(v.shape),
                v.stride(),
                v.storage_offset(),
                v.requires_grad,
                v.detach().tolist(),
                sorted(v.__dict__),
            )
        if isinstance(v, (dict, list, tuple)):
            if ref in described:  # a shared or cyclic reference
                return ("R", type(v).__name__, ref)
            described.add(ref)
            if isinstance(v, dict):
                return ("D", ref, [(describe(k), describe(x)) for k, x in v.items()])
            return (type(v).__name__, ref, [describe(x) for x in v])
        if isinstance(v, mmpack.PackedTensor):
            return ("P", ref, [describe(t) for t in v.tensors], v._segment_provenance)
        if isinstance(v, Leaf):
            return ("O", ref, v.value)
        return ("A", type(v).__name__, v)

    return describe(value)


def assert_same_copy(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """Both copies describe the same, or both raise the same error."""
    try:
        theirs = copy.deepcopy(value, dict(memo or {}))
    except Exception as exc:
        with pytest.raises(type(exc)) as raised:
            fast_deepcopy(value, dict(memo or {}))
        assert str(raised.value) == str(exc)
        return None
    ours = fast_deepcopy(value, dict(memo or {}))
    # Described together with the original, so that sharing with it (memo entries) shows.
    assert shape_of([value, ours]) == shape_of([value, theirs])
    return ours


def test_plain_tensors_are_new_storage_with_equal_values() -> None:
    t = torch.arange(6, dtype=torch.int64)
    out = assert_same_copy({"token_ids": t, "role": "user"})
    assert out["token_ids"].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    out["token_ids"][0] = 99
    assert t[0] == 0


def test_views_of_one_storage_still_share_their_copy() -> None:
    base = torch.arange(12.0)
    full = base.view(3, 4)
    part = base[4:8]
    for order in ([base, full, part], [part, base, full], [full, part, base]):
        out = assert_same_copy(order)
        ptrs = {t.untyped_storage().data_ptr() for t in out}
        assert len(ptrs) == 1


def test_tensors_copy_like_torch_in_every_special_case() -> None:
    leaf = torch.randn(3, requires_grad=True)
    with_grad = torch.randn(2)
    with_grad.grad = torch.ones(2)
    tagged = torch.ones(2)
    tagged.note = "kept"
    cases = [
        leaf,
        with_grad,
        tagged,
        torch.randn(3, 4).t(),  # not contiguous
        torch.randn(10)[2:5],  # an offset view
        torch.randn(4)[::2],  # strided
        torch.zeros(0),
        torch.zeros(1, 3).expand(2, 3),  # overlapping
        torch.randn(2, dtype=torch.complex64).conj(),
        torch.ones(2).as_subclass(TaggedTensor),
        torch.tensor(5),
        torch.ones(2, 1, 3)[:, :, 1:],
    ]
    for case in cases:
        assert_same_copy([case, {"again": case}])


def test_shared_and_cyclic_containers() -> None:
    shared = {"k": [1, 2]}
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    tup = (shared, shared)
    assert_same_copy([shared, shared, tup, cyclic, (1, "a", None), (), {}])
    cyc_tuple_holder: list[Any] = []
    t = (cyc_tuple_holder,)
    cyc_tuple_holder.append(t)
    assert_same_copy(t)


def test_memo_entries_are_shared_not_copied() -> None:
    media = Leaf(3)
    image = torch.ones(2)
    row = {"vllm_images": [media, image], "token_ids": torch.arange(3)}
    memo = {id(media): media, id(image): image}
    out = assert_same_copy(row, memo)
    assert out["vllm_images"][0] is media
    assert out["vllm_images"][1] is image
    assert out["token_ids"] is not row["token_ids"]


def test_packed_tensor_values_copy_through_their_own_deepcopy() -> None:
    px = mmpack.PackedTensor(torch.randn(4, 3), dim_to_pack=0).enable_deduplication()
    plain = mmpack.PackedTensor([torch.randn(2), None], dim_to_pack=0)
    out = assert_same_copy([{"pixel_values": px}, {"pixel_values": px}, plain])
    assert out[0]["pixel_values"] is out[1]["pixel_values"]
    assert out[0]["pixel_values"].tensors[0] is px.tensors[0]  # shared immutable media
    assert out[2].tensors[0] is not plain.tensors[0]


def test_errors_are_torch_errors() -> None:
    non_leaf = torch.randn(2, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy([non_leaf])
    with pytest.raises(RuntimeError, match="graph leaves"):
        fast_deepcopy([non_leaf])


atoms = st.one_of(
    st.integers(), st.text(max_size=3), st.none(), st.booleans(), st.floats(allow_nan=False)
)


@st.composite
def message_logs(draw: Any) -> Any:
    pool: list[Any] = []  # objects a later node may reference again

    def tensor() -> torch.Tensor:
        kind = draw(st.sampled_from(["fresh", "view", "again", "grad"]))
        if kind == "again" and pool:
            return draw(st.sampled_from(pool))
        if kind == "view" and any(isinstance(p, torch.Tensor) for p in pool):
            base = draw(st.sampled_from([p for p in pool if isinstance(p, torch.Tensor)]))
            t = base.reshape(-1)[: max(1, base.numel() // 2)] if base.numel() else base
        else:
            t = torch.arange(
                draw(st.integers(0, 5)), dtype=draw(st.sampled_from([torch.int64, torch.float32]))
            )
            if kind == "grad" and t.is_floating_point():
                t.requires_grad_(True)
        pool.append(t)
        return t

    def node(depth: int) -> Any:
        choice = draw(st.integers(0, 5 if depth < 3 else 1))
        if choice == 0:
            return draw(atoms)
        if choice == 1:
            return tensor()
        if choice == 2:
            value = {
                draw(st.text(max_size=2)): node(depth + 1) for _ in range(draw(st.integers(0, 3)))
            }
        elif choice == 3:
            value = [node(depth + 1) for _ in range(draw(st.integers(0, 3)))]
        elif choice == 4:
            value = tuple(node(depth + 1) for _ in range(draw(st.integers(0, 3))))
        else:
            return Leaf(draw(st.integers()))
        if pool and draw(st.booleans()):
            return draw(st.sampled_from(pool))
        pool.append(value)
        return value

    root = [node(0) for _ in range(draw(st.integers(1, 4)))]
    shared = [p for p in pool if draw(st.booleans())] if pool else []
    return root, {id(p): p for p in shared}


@settings(max_examples=300, deadline=None)
@given(message_logs())
def test_property_same_result_as_copy_deepcopy(case: Any) -> None:
    value, memo = case
    assert_same_copy(value, memo)


class StorageHolder:
    """A user object whose own ``__deepcopy__`` copies a tensor's storage through the memo."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __deepcopy__(self, memo: dict[Any, Any]) -> Any:
        return self.t.untyped_storage().__deepcopy__(memo)


def test_storage_copies_are_where_torch_looks_for_them() -> None:
    t = torch.arange(4.0)
    out = fast_deepcopy([t, StorageHolder(t)])
    assert out[1].data_ptr() == out[0].untyped_storage().data_ptr()
    given_copy = torch.UntypedStorage(16)
    memo: dict[Any, Any] = {"torch": {t.untyped_storage()._cdata: given_copy}}
    assert fast_deepcopy([t], memo)[0].untyped_storage().data_ptr() == given_copy.data_ptr()


def test_dtypes_a_clone_would_change_or_refuse_are_copied_byte_for_byte() -> None:
    raw = torch.from_numpy(np.frombuffer(bytes([0, 2, 255]), dtype=np.bool_).copy())
    assert fast_deepcopy(raw).view(torch.uint8).tolist() == [0, 2, 255]
    sub_byte = torch.arange(4, dtype=torch.uint8).view(torch.uint4)
    assert fast_deepcopy(sub_byte).view(torch.uint8).tolist() == [0, 1, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates the quantized dtypes
        quantized_view = torch.arange(4, dtype=torch.int8).view(torch.qint8)
        out = fast_deepcopy(quantized_view)
        assert out.dtype == torch.qint8 and out.view(torch.int8).tolist() == [0, 1, 2, 3]
        assert out.untyped_storage().data_ptr() != quantized_view.untyped_storage().data_ptr()


def test_strided_nested_tensors_raise_what_torch_raises() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided nested layout is a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        assert_same_copy([nested])


def test_torch_modes_see_tensor_deepcopy() -> None:
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Recording(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Recording():
        fast_deepcopy([torch.ones(2)])
    assert "__deepcopy__" in seen


def test_keyword_arguments_are_copy_deepcopys() -> None:
    assert fast_deepcopy(x=[1, [2]], memo={}) == [1, [2]]
