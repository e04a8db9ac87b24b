"""Every group writes the bytes the pickle format defines (``mmpack.packed.pickling.format``),
whatever mix of shapes, dtypes and layouts its members have, and reads back to views equal to
them: member ``j``'s dtype index, rank and dims in the tables, and each dtype's buffer holding
its members' values back to back in C order."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from mmpack.packed import PackedTensor as P
from mmpack.packed.buffers import BUFFER_DTYPES


def _i64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _expected_group(members: list[torch.Tensor]) -> tuple[Any, ...]:
    """The group state as the format describes it, computed member by member."""
    order: list[torch.dtype] = []
    for t in members:
        if t.dtype not in order:
            order.append(t.dtype)
    dims = [d for t in members for d in t.shape]
    buffers = [
        (
            BUFFER_DTYPES[dtype],
            b"".join(
                t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                for t in members
                if t.dtype == dtype
            ),
        )
        for dtype in order
    ]
    return (
        "mmpack.group/1",
        _i64([order.index(t.dtype) for t in members]),
        _i64([t.dim() for t in members]),
        _i64(dims),
        buffers,
    )


def _written_group(value: P, protocol: int) -> tuple[Any, ...]:
    """The state the value's own group writes (the group's ``__reduce_ex__``, as a pickler
    calls it right after the value's)."""
    _, _, state = value.__reduce_ex__(protocol)
    groups = state["segments"][3]
    assert len(groups) == 1
    _, _, group_state = groups[0].__reduce_ex__(protocol)
    fmt, dtypes, ranks, dims, buffers = group_state["group"]
    return (fmt, dtypes, ranks, dims, [(name, bytes(memoryview(b))) for name, b in buffers])


def _channels_last() -> torch.Tensor:
    return torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2).to(memory_format=torch.channels_last)


CASES = {
    "same trailing dims": lambda: [torch.randn(k, 5) for k in (1, 3, 2, 0, 4)],
    "one member": lambda: [torch.randn(3, 2)],
    "different trailing dims": lambda: [torch.randn(2, 3), torch.randn(2, 4), torch.randn(1, 3)],
    "different ranks": lambda: [torch.randn(3), torch.randn(2, 2), torch.randn(1, 1, 2)],
    "1-d empty among 2-d": lambda: [torch.randn(2, 3), torch.empty(0), torch.randn(1, 3)],
    "zero-sized trailing dim": lambda: [torch.empty(3, 0), torch.empty(1, 0)],
    "scalars": lambda: [torch.tensor(1.5), torch.tensor(-2.0)],
    "scalar among 1-d": lambda: [torch.arange(3.0), torch.tensor(7.0)],
    "channels_last": lambda: [_channels_last(), _channels_last() + 1],
    "transposed": lambda: [torch.randn(3, 4).t(), torch.randn(5, 4).t()],
    "strided slices": lambda: [torch.arange(20.0).reshape(4, 5)[:, ::2], torch.randn(4, 3)],
    "bool": lambda: [torch.rand(3, 2) > 0.5, torch.rand(1, 2) > 0.5],
    "bfloat16": lambda: [torch.randn(2, 3).bfloat16(), torch.randn(4, 3).bfloat16()],
    "complex": lambda: [torch.randn(2, 2, dtype=torch.complex64) for _ in range(3)],
    "mixed dtypes": lambda: [torch.randn(2, 3), torch.arange(3), torch.randn(1, 3)],
}


@pytest.mark.parametrize("protocol", [2, 5])
@pytest.mark.parametrize("case", sorted(CASES))
def test_groups_write_the_format_and_read_back(case: str, protocol: int) -> None:
    torch.manual_seed(0)
    members = CASES[case]()
    value = P(list(members), 0)
    assert _written_group(value, protocol) == _expected_group(members)
    back = pickle.loads(pickle.dumps(value, protocol=protocol))
    assert len(back.tensors) == len(members)
    for got, want in zip(back.tensors, members, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.is_contiguous() and torch.equal(got, want)
    back.tensors[0].zero_()  # restored members are writable views of the payload's buffer
    assert not back.tensors[0].any()


@pytest.mark.parametrize(
    "special",
    [
        lambda: torch.randn(2, 3).requires_grad_(),
        lambda: torch.randn(2, 3)._neg_view(),
        lambda: torch.randn(2, 3, dtype=torch.complex64).conj(),
        lambda: torch.nn.Parameter(torch.randn(2, 3), requires_grad=False),
    ],
    ids=["requires_grad", "neg bit", "conj bit", "parameter"],
)
def test_members_a_group_cannot_hold_are_pickled_on_their_own(special: Any) -> None:
    """Among plain tensors of the same dtype, a segment with autograd, a lazy bit or a
    subclass is written as itself (``others``), and the group holds the rest."""
    plain = [torch.randn(2, 3, dtype=torch.complex64) for _ in range(2)]
    odd = special()
    if not odd.is_complex():
        plain = [p.real.contiguous() for p in plain]
    value = P([plain[0], odd, plain[1]], 0)
    _, _, state = value.__reduce_ex__(5)
    codes = np.frombuffer(state["segments"][1], dtype="<i8").tolist()
    assert codes == [0, -2, 0]
    assert state["segments"][4] == [odd]
    back = pickle.loads(pickle.dumps(value, protocol=5))
    assert type(back.tensors[1]) is type(odd)
    assert back.tensors[1].requires_grad == odd.requires_grad
    for got, want in zip(back.tensors, value.tensors, strict=True):
        assert torch.equal(
            got.detach().resolve_neg().resolve_conj(), want.detach().resolve_neg().resolve_conj()
        )
