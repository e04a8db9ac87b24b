"""``install(accelerate=True)`` sends plain tensors (a ``BatchedDataDict``'s among them) through
Ray's object store as out-of-band bytes (``mmpack.compat.nemo_rl.ray_tensors``). What comes back
must be what torch's own pickling gives through the same store, value by value, identities
included: the oracle is the same value sent with the accelerations off."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator
from typing import Any

import mmpack
import numpy as np
import pytest
import ray
import torch
from mmpack.compat import nemo_rl as compat
from mmpack.compat.nemo_rl.ray_tensors import tensor_from_bytes
from mmpack.errors import CorruptPickleError
from mmpack.packed.buffers import BUFFER_DTYPES
from ray._private.worker import global_worker
from support import nemo_rl_reference
from support.nemo_rl_reference import ReferenceBatchedDataDict, ReferenceSlicedDataDict
from support.nemo_rl_standins import installed_standins


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session: Any) -> Iterator[None]:
    # the workers do not have tests/ on sys.path: ship the stand-in classes by value
    ray.cloudpickle.register_pickle_by_value(nemo_rl_reference)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(nemo_rl_reference)
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def standins() -> Iterator[None]:
    with installed_standins():
        yield


class Marked(torch.Tensor):
    """A tensor subclass: torch pickles it with its type."""


def every_kind_of_value() -> ReferenceSlicedDataDict:
    """Every dtype the byte path takes, with bytes a conversion would change (bool bytes other
    than 0 and 1, NaN payloads, -0.0), beside every kind of value that must keep torch's own
    pickling."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    values: dict[str, Any] = {}
    for dtype in BUFFER_DTYPES:
        width = torch.empty((), dtype=dtype).element_size()
        values[f"bytes_{dtype}"] = raw[: 48 * width].clone().view(dtype).view(6, -1)
    values["scalar"] = torch.tensor(7.5)
    values["column"] = torch.arange(12).view(12, 1)
    base = torch.arange(40.0)
    values["view_head"] = base[:10]  # a view into a larger storage: torch sends all of it
    values["view_tail"] = base[30:]
    values["transposed"] = torch.arange(12).view(3, 4).t()
    # contiguous by is_contiguous (it ignores size-1 dimensions), with other strides
    values["row_transposed"] = torch.arange(4.0).reshape(1, 4).t()
    values["column_transposed"] = torch.arange(4.0).reshape(4, 1).t()
    values["permuted"] = torch.randn(1, 5, 4, generator=gen).permute(1, 0, 2)
    values["one_channel_last"] = torch.randn(2, 1, 3, 3, generator=gen).to(
        memory_format=torch.channels_last
    )
    values["empty"] = torch.empty(0, 5)
    values["grad"] = torch.ones(3, requires_grad=True)
    values["subclass"] = torch.arange(4).as_subclass(Marked)
    values["parameter"] = torch.nn.Parameter(torch.ones(2))
    attributed = torch.arange(3)
    attributed.tag = "kept"  # type: ignore[attr-defined]
    values["attributed"] = attributed
    values["conj"] = torch.tensor([1 + 2j, 3 - 1j]).conj()
    values["neg"] = torch.tensor([1.0, 2.0])._neg_view()
    shared = torch.arange(6)
    values["same_a"] = shared
    values["same_b"] = shared
    values["nested"] = [torch.arange(3), {"deep": torch.ones(2)}, shared]
    values["strings"] = ["a", "b"]
    values["packed"] = mmpack.PackedTensor([torch.arange(4.0), torch.arange(2.0)], dim_to_pack=0)
    out = ReferenceSlicedDataDict(values)
    out.micro_batch_indices = [[[0, 3]]]
    out.micro_batch_lengths = [[8]]
    out.extra = shared  # type: ignore[attr-defined]
    return out


def through_store(value: Any) -> Any:
    return ray.get(ray.put(value))


def describe(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything of a tensor a consumer can observe, bytes included."""
    storage = t.untyped_storage()
    return (
        type(t),
        t.dtype,
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        storage.nbytes(),
        bytes(storage),
        t.requires_grad,
        t.is_conj(),
        t.is_neg(),
        dict(t.__dict__),
    )


def assert_same_received(expected: Any, got: Any) -> None:
    assert type(got) is type(expected)
    assert list(got.keys()) == list(expected.keys())
    for attr in ("micro_batch_indices", "micro_batch_lengths", "elem_counts_per_gb"):
        assert getattr(got, attr) == getattr(expected, attr)
    for key, want in expected.items():
        have = got[key]
        if isinstance(want, torch.Tensor):
            assert describe(have) == describe(want), key
        elif isinstance(want, mmpack.PackedTensor):
            assert torch.equal(have.as_tensor(), want.as_tensor()), key
        elif key == "nested":
            assert torch.equal(have[0], want[0]) and torch.equal(have[1]["deep"], want[1]["deep"])
        else:
            assert have == want, key
    assert_same_identities(expected, got)


def identities(value: ReferenceSlicedDataDict) -> list[bool]:
    """Which references to the one shared tensor arrive as one object."""
    shared = value["same_a"]
    return [value["same_b"] is shared, value["nested"][2] is shared, value.extra is shared]  # type: ignore[attr-defined]


def assert_same_identities(expected: ReferenceSlicedDataDict, got: ReferenceSlicedDataDict) -> None:
    assert identities(got) == identities(expected)


def test_every_value_comes_back_as_torch_pickling_gives_it(standins: None) -> None:
    value = every_kind_of_value()
    oracle = through_store(value)
    compat.install(accelerate=True)
    assert_same_received(oracle, through_store(value))


def test_one_tensor_stays_one_object_across_the_values_of_one_put(standins: None) -> None:
    shared = torch.arange(8)
    first = ReferenceBatchedDataDict({"ids": shared})
    second = ReferenceBatchedDataDict({"ids": shared, "nested": [shared]})
    value = (first, second, {"sibling": shared}, shared)

    def shape(received: Any) -> list[bool]:
        one = received[0]["ids"]
        return [
            received[1]["ids"] is one,
            received[1]["nested"][0] is one,
            received[2]["sibling"] is one,
            received[3] is one,
        ]

    oracle = shape(through_store(value))
    compat.install(accelerate=True)
    got = through_store(value)
    assert shape(got) == oracle == [True, True, True, True]
    assert torch.equal(got[0]["ids"], shared)


def test_the_byte_path_is_taken_for_plain_tensors_only(standins: None) -> None:
    context = global_worker.get_serialization_context()
    plain = ReferenceBatchedDataDict({"input_ids": torch.arange(1 << 16)})
    before = context.serialize(plain).to_bytes()
    compat.install(accelerate=True)
    after = context.serialize(plain).to_bytes()
    assert b"tensor_from_bytes" in after and b"tensor_from_bytes" not in before
    # a bare tensor too: the reduction is the tensor's own
    assert b"tensor_from_bytes" in context.serialize(torch.arange(1 << 16)).to_bytes()
    # a value that keeps torch's pickling is written the way it was
    graded = ReferenceBatchedDataDict({"grad": torch.ones(4, requires_grad=True)})
    assert b"tensor_from_bytes" not in context.serialize(graded).to_bytes()


def test_a_serializer_registered_with_ray_for_tensors_comes_first(standins: None) -> None:
    compat.install(accelerate=True)
    calls = []

    def serialize(t: torch.Tensor) -> list[float]:
        calls.append(t)
        return [42.0] * t.numel()

    ray.util.register_serializer(torch.Tensor, serializer=serialize, deserializer=torch.tensor)
    try:
        got = through_store(ReferenceBatchedDataDict({"x": torch.arange(4.0)}))
    finally:
        ray.util.deregister_serializer(torch.Tensor)
    assert len(calls) == 1
    assert got["x"].tolist() == [42.0] * 4


def test_received_tensors_are_private_writable_and_resizable(standins: None) -> None:
    compat.install(accelerate=True)
    original = torch.arange(1 << 20)
    ref = ray.put(ReferenceBatchedDataDict({"ids": original}))
    first = ray.get(ref)["ids"]
    first.add_(1)  # would corrupt the store if it aliased it
    first.resize_(1 << 21)
    again = ray.get(ref)["ids"]
    assert torch.equal(again, original)


def test_plain_pickles_are_unchanged(standins: None) -> None:
    value = ReferenceBatchedDataDict({"ids": torch.arange(100), "mask": torch.ones(3, 4)})
    before = pickle.dumps(value, protocol=5)
    compat.install(accelerate=True)
    assert pickle.dumps(value, protocol=5) == before


def test_uninstall_restores_torchs_reduction(standins: None) -> None:
    torchs = torch.Tensor.__dict__["__reduce_ex__"]
    compat.install(accelerate=True)
    assert torch.Tensor.__dict__["__reduce_ex__"] is not torchs
    compat.uninstall()
    assert torch.Tensor.__dict__["__reduce_ex__"] is torchs
    assert "__reduce_ex__" not in ReferenceBatchedDataDict.__dict__


@ray.remote
def checksums(batch: Any) -> dict[str, Any]:
    return {
        key: (str(v.dtype), tuple(v.shape), v.double().sum().item())
        for key, v in batch.items()
        if isinstance(v, torch.Tensor)
    }


def test_a_worker_receives_the_same_tensors(standins: None) -> None:
    compat.install(accelerate=True)
    value = ReferenceSlicedDataDict(
        {
            "input_ids": torch.randint(0, 1000, (64, 300)),
            "logprobs": torch.randn(64, 300).bfloat16(),
            "mask": torch.rand(64, 300) > 0.5,
        }
    )
    want = {
        key: (str(v.dtype), tuple(v.shape), v.double().sum().item()) for key, v in value.items()
    }
    assert ray.get(checksums.remote(value)) == want


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.arange(4).numpy().view("uint8"), "int64", (5,)), "needs 40 bytes"),
        ((torch.arange(4).numpy().view("uint8"), "qint8", (4,)), "unknown dtype"),
        ((torch.arange(4).numpy().view("uint8"), "int64", (-1, 4)), "malformed"),
        ((b"\x00" * 8, "int64", (1,)), "malformed"),
        ((torch.arange(4).numpy().view("uint8"), "int64", [4]), "malformed"),
        # every other byte: a strided array would be read as if contiguous
        ((np.arange(16, dtype=np.uint8)[::2], "uint8", (8,)), "malformed"),
        # refused before anything is allocated
        ((np.zeros(8, dtype=np.uint8), "int64", (1 << 40, 1 << 20)), "needs"),
    ],
)
def test_corrupt_tensor_bytes_are_refused_by_name(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(CorruptPickleError, match=message):
        tensor_from_bytes(*args)


def test_a_receiver_with_another_default_device_gets_cpu_tensors(standins: None) -> None:
    compat.install(accelerate=True)
    ref = ray.put(ReferenceBatchedDataDict({"ids": torch.arange(16.0)}))
    torch.set_default_device("meta")
    try:
        got = ray.get(ref)["ids"]
    finally:
        torch.set_default_device("cpu")
    assert got.device.type == "cpu"
    assert torch.equal(got, torch.arange(16.0))


def test_sending_leaves_the_senders_storage_resizable(standins: None) -> None:
    compat.install(accelerate=True)
    sent = torch.zeros(8)
    ref = ray.put(ReferenceBatchedDataDict({"ids": sent}))
    assert (
        b"tensor_from_bytes" in global_worker.get_serialization_context().serialize(sent).to_bytes()
    )
    sent.resize_(16)  # torch's own pickling leaves the storage resizable too
    sent.untyped_storage().resize_(0)
    assert torch.equal(ray.get(ref)["ids"], torch.zeros(8))


def test_a_tensor_with_backward_hooks_keeps_torchs_warning(standins: None) -> None:
    hooked = torch.ones(3)
    hooked._backward_hooks = {0: lambda *_: None}  # type: ignore[assignment]
    compat.install(accelerate=True)
    with pytest.warns(UserWarning, match="backward hook"):
        got = through_store(hooked)
    assert torch.equal(got, hooked)


def test_a_shape_torch_cannot_allocate_is_refused_by_name() -> None:
    with pytest.raises(CorruptPickleError, match="refused"):
        tensor_from_bytes(np.zeros(0, dtype=np.uint8), "float32", (1 << 63, 0))
