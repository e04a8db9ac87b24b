"""Native materialization (``mmpack.packed.gather``, ``mmpack.packed.transfer``) against the plain
torch path.

The oracle is NeMo-RL's algorithm as the plain-Python reference ``PackedTensor`` implements it
(``tests/reference/packed_tensor.py``): build the logical list, drop ``None`` s, pad, ``torch.cat``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mmpack import _native
from mmpack.errors import (
    MmpackError,
    OutBufferError,
    PackedTensorError,
    PinMemoryUnavailableError,
    SegmentMismatchError,
)
from mmpack.packed import gather as _gather
from mmpack.packed import transfer as _transfer
from reference.packed_tensor import PackedTensor as RefPT

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.complex64,
]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=gen, dtype=torch.float32) * 4
        return base.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen).to(dtype)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    # byte-exact (NaN-safe, fp8-safe)
    return bool(torch.equal(_bytes(a), _bytes(b)))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # standard strides
    fresh.copy_(t)
    return fresh.reshape(-1).view(torch.uint8)


@pytest.fixture(autouse=True)
def _native_gather_for_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the native gather: small outputs take it too (normally they are
    joined by one torch.cat; see test_small_outputs_are_one_torch_cat_with_the_same_result)."""
    monkeypatch.setattr(_gather, "SMALL_OUTPUT_BYTES", 0)


def _native_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = _native.gather_into

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(_native, "gather_into", counting)
    return calls


def _reference(
    tensors: list[Any], indices: list[int] | None, dim: int, pad: bool
) -> torch.Tensor | None:
    if indices is None:
        ref = RefPT(list(tensors), dim, pad_to_max_shape=pad)
    else:
        ref = RefPT(
            list(tensors),
            dim,
            pad_to_max_shape=pad,
            _row_offsets=list(range(len(indices) + 1)),
            _segment_indices=list(indices),
        )
    return ref.as_tensor()


def _ours(
    tensors: list[Any], indices: list[int] | None, dim: int, pad: bool, **kw: Any
) -> torch.Tensor | None:
    order = None if indices is None else np.asarray(indices, dtype=np.int64)
    return _gather.as_tensor(list(tensors), order, dim, pad, **kw)


# ------------------------------------------------------------------------------------ examples


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_matches_torch_cat(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    segs: list[Any] = [_rand((3, 5), dtype, gen), None, _rand((2, 5), dtype, gen)]
    indices = [0, 1, 2, 0, 2, 2, 1]
    calls = _native_calls(monkeypatch)
    monkeypatch.setattr(_gather, "COMPACT_MIN_SEGMENTS", 10**9)
    got = _ours(segs, indices, 0, False)
    assert calls, "the native gather was not used"
    assert _same(got, _reference(segs, indices, 0, False))


@pytest.mark.parametrize("dim", [1, -1, 2, -2, 0, -3])
def test_non_leading_pack_dim_is_strided_placement(dim: int) -> None:
    gen = torch.Generator().manual_seed(2)
    base = [(2, 3, 4), (2, 3, 4)]
    segs: list[Any] = []
    for shape in base:
        shape_l = list(shape)
        shape_l[dim] += len(segs)  # vary the pack dim only
        segs.append(_rand(tuple(shape_l), torch.float32, gen))
    indices = [1, 0, 1, 1]
    got = _ours(segs, indices, dim, False)
    ref = _reference(segs, indices, dim, False)
    assert got is not None and ref is not None
    assert _same(got, ref)


def test_non_contiguous_segments() -> None:
    gen = torch.Generator().manual_seed(3)
    a = _rand((6, 4), torch.float32, gen).t()  # (4, 6), transposed
    b = _rand((5, 12), torch.float32, gen)[:, ::2]  # (5, 6), strided
    c = _rand((2, 3, 6), torch.float32, gen)[1]  # (3, 6), offset view
    segs: list[Any] = [a, b, c]
    for dim in (0, -2):
        got = _ours(segs, [2, 0, 1, 0], dim, False)
        assert _same(got, _reference(segs, [2, 0, 1, 0], dim, False))
    assert not a.is_contiguous()  # inputs untouched


@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_pad_to_max_shape(dim: int) -> None:
    gen = torch.Generator().manual_seed(4)
    segs: list[Any] = [
        _rand((2, 3, 5), torch.bfloat16, gen),
        _rand((4, 1, 2), torch.bfloat16, gen),
        None,
        _rand((1, 3, 3), torch.bfloat16, gen),
    ]
    indices = [0, 1, 2, 1, 3, 0]
    got = _ours(segs, indices, dim, True)
    assert _same(got, _reference(segs, indices, dim, True))


def test_legacy_layout_and_none_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    segs: list[Any] = [None, _rand((2, 2), torch.int64, gen), None, _rand((1, 2), torch.int64, gen)]
    assert _same(_ours(segs, None, 0, False), _reference(segs, None, 0, False))


@pytest.mark.parametrize(
    ("tensors", "indices"),
    [([None, None], None), ([None], [0, 0]), ([torch.ones(2)], []), ([], [])],
)
def test_nothing_left_returns_none(tensors: list[Any], indices: list[int] | None) -> None:
    out = torch.full((3,), 7.0)
    assert _ours(tensors, indices, 0, False, out=out) is None
    assert torch.equal(out, torch.full((3,), 7.0))


def test_large_output_parallel_gather() -> None:
    gen = torch.Generator().manual_seed(6)
    segs: list[Any] = [_rand((64, 1024), torch.float32, gen) for _ in range(3)]
    indices = [i % 3 for i in range(40)]  # ~10 MiB, crosses the parallel threshold
    got = _ours(segs, indices, 0, False)
    assert _same(got, _reference(segs, indices, 0, False))
    got_t = _ours(segs, indices, 1, False)  # strided, large
    assert _same(got_t, _reference(segs, indices, 1, False))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_many_small_segments_take_the_compacted_path(
    dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = _native.gather_ranges_into

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(_native, "gather_ranges_into", counting)
    gen = torch.Generator().manual_seed(9)
    n = _gather.COMPACT_MIN_SEGMENTS * 2
    segs: list[Any] = []
    for i in range(n):
        shape = [2, 3, 2]
        shape[dim] = 1 + i % 3
        t = _rand(tuple(shape), torch.int64, gen)
        segs.append(t if i % 5 else t.transpose(0, 2).contiguous().transpose(0, 2))
    segs[7] = None
    indices = [i % n for i in range(n * 16)]
    assert _same(_ours(segs, indices, dim, False), _reference(segs, indices, dim, False))
    assert calls


def test_one_element_segments_with_odd_strides() -> None:
    # contiguous by torch's rules (size-1 dims may carry any stride), yet not viewable as bytes
    x = torch.arange(10.0)[::5][:1]
    y = torch.arange(12.0).reshape(4, 3)[1:2, 1:2]
    assert x.stride() == (5,) and x.is_contiguous()
    segs: list[Any] = [x, y.reshape(1)]
    assert _same(_ours(segs, [0, 1, 0], 0, False), _reference(segs, [0, 1, 0], 0, False))
    views = _transfer._stage([x], torch.device("cpu"), non_blocking=False, pin_memory=False)
    assert _same(views[0], x)


def test_zero_size_segments() -> None:
    segs: list[Any] = [torch.zeros(0, 3), torch.ones(2, 3), torch.zeros(2, 0)]
    assert _same(_ours(segs, [0, 1, 0], 0, False), _reference(segs, [0, 1, 0], 0, False))
    assert _same(_ours(segs, [2, 2], 1, False), _reference(segs, [2, 2], 1, False))
    # NeMo-RL's torch.cat quirk: 1-D empty tensors are skipped whatever the other ranks
    quirk: list[Any] = [torch.zeros(0), torch.ones(2, 3)]
    assert _same(_ours(quirk, [0, 1], 0, False), _reference(quirk, [0, 1], 0, False))


# ------------------------------------------------------------------------------ out= and pinning


def test_out_buffer_is_reused() -> None:
    gen = torch.Generator().manual_seed(7)
    segs: list[Any] = [_rand((3, 4), torch.float16, gen), _rand((1, 4), torch.float16, gen)]
    first = _ours(segs, [0, 1, 1], 0, False)
    assert first is not None
    out = torch.empty_like(first)
    got = _ours(segs, [1, 1, 0], 0, False, out=out)
    assert got is out
    assert _same(out, _reference(segs, [1, 1, 0], 0, False))


@pytest.mark.parametrize(
    ("make_out", "match"),
    [
        (lambda: torch.empty(4, 4), "shape"),
        (lambda: torch.empty(5, 4, dtype=torch.float64), "dtype"),
        (lambda: torch.empty(4, 5).t(), "contiguous"),
        (lambda: [0.0] * 20, "torch.Tensor"),
        (lambda: torch.empty(5, 4, device="meta"), "device"),
    ],
)
def test_out_buffer_errors(make_out: Any, match: str) -> None:
    segs: list[Any] = [torch.ones(3, 4), torch.ones(1, 4)]
    with pytest.raises(OutBufferError, match=match) as info:
        _ours(segs, [0, 1, 1], 0, False, out=make_out())
    assert isinstance(info.value, MmpackError)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


@pytest.mark.parametrize("many", [False, True], ids=["few segments", "compacted"])
def test_out_buffer_may_not_overlap_inputs(many: bool) -> None:
    """Overlap is judged by the bytes each side really covers: an ``out=`` overlapping a
    segment is refused, whether both are views of one storage or of one numpy buffer through
    two ``torch.from_numpy`` calls (two storages)."""
    filler: list[Any] = [torch.zeros(1, 2) for _ in range(70 if many else 0)]
    buf = torch.arange(20.0)
    with pytest.raises(OutBufferError, match="shares memory"):
        _ours([buf[:4].reshape(2, 2), *filler], [0, 0], 0, False, out=buf[2:10].reshape(4, 2))
    # a strided segment whose last element lands inside out=
    with pytest.raises(OutBufferError, match="shares memory"):
        _ours([buf[0:9:4].reshape(3, 1), *filler], [0], 0, False, out=buf[8:11].reshape(3, 1))
    arena = np.arange(32, dtype=np.float32)
    seg = torch.from_numpy(arena[4:12]).reshape(4, 2)
    out = torch.from_numpy(arena[8:24]).reshape(8, 2)
    assert seg.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    with pytest.raises(OutBufferError, match="shares memory"):
        _ours([seg, *filler], [0, 0], 0, False, out=out)
    # the torch fallback (mixed dtypes promote to float64) checks the same way
    wide = torch.from_numpy(arena.view(np.float64)).reshape(8, 2)
    with pytest.raises(OutBufferError, match="shares memory"):
        _ours([seg, torch.ones(4, 2, dtype=torch.float64)], [0, 1], 0, False, out=wide)


def test_out_buffer_disjoint_from_inputs_in_one_arena() -> None:
    """``out=`` carved from the same buffer as the segments, but disjoint from them, is
    accepted and gets the right result (a staging arena holding inputs and output)."""
    arena = torch.arange(40.0)
    segs: list[Any] = [arena[:4].reshape(2, 2), arena[4:6].reshape(1, 2)]
    expected = torch.cat([segs[0], segs[1], segs[0]])
    out = arena[20:30].reshape(5, 2)
    assert _ours(segs, [0, 1, 0], 0, False, out=out) is out
    assert torch.equal(out, expected) and torch.equal(arena[:6], torch.arange(6.0))
    # adjacent byte ranges do not overlap either; and with two numpy views of one buffer
    np_arena = np.arange(24, dtype=np.float32)
    seg = torch.from_numpy(np_arena[:6]).reshape(3, 2)
    out2 = torch.from_numpy(np_arena[6:18]).reshape(6, 2)
    assert _ours([seg], [0, 0], 0, False, out=out2) is out2
    assert torch.equal(out2, torch.cat([seg, seg]))


def test_out_buffer_on_fallback_path() -> None:
    # mixed dtypes go through torch.cat (type promotion); out= still works and is checked
    segs: list[Any] = [torch.ones(2, 2, dtype=torch.int32), torch.ones(1, 2, dtype=torch.float32)]
    ref = _reference(segs, [0, 1], 0, False)
    assert ref is not None and ref.dtype == torch.float32
    out = torch.empty(3, 2)
    assert _ours(segs, [0, 1], 0, False, out=out) is out
    assert _same(out, ref)
    with pytest.raises(OutBufferError, match="dtype"):
        _ours(segs, [0, 1], 0, False, out=torch.empty(3, 2, dtype=torch.int32))


def test_pin_memory() -> None:
    segs: list[Any] = [torch.ones(3, 4)]
    if torch.cuda.is_available():
        got = _ours(segs, [0, 0], 0, False, pin_memory=True)
        assert got is not None and got.is_pinned()
    else:
        with pytest.raises(PinMemoryUnavailableError, match="pin_memory=True needs a CUDA"):
            _ours(segs, [0, 0], 0, False, pin_memory=True)


# -------------------------------------------------------------------------- errors and fallbacks


def test_errors_match_reference() -> None:
    mixed_rank: list[Any] = [torch.ones(2, 2), torch.ones(2)]
    with pytest.raises(ValueError, match=r"same rank, but received ranks \[1, 2\]"):
        _ours(mixed_rank, [0, 1], 0, True)
    with pytest.raises(IndexError, match="dim_to_pack=3 is invalid for tensors with rank 2"):
        _ours([torch.ones(2, 2)], [0], 3, True)
    with pytest.raises(IndexError, match="dim_to_pack=-3 is invalid"):
        _ours([torch.ones(2, 2)], [0], -3, True)
    with pytest.raises(SegmentMismatchError, match=r"shapes \(2, 2\) and \(2, 3\)"):
        _ours([torch.ones(2, 2), torch.ones(2, 3)], [0, 1], 0, False)
    with pytest.raises(IndexError, match="Dimension out of range"):
        _ours([torch.ones(2, 2)], [0], 2, False)
    with pytest.raises(SegmentMismatchError, match="rank-0 tensors cannot be concatenated"):
        _ours([torch.tensor(1.0)], [0, 0], 0, False)


def test_segments_on_different_devices_raise_segment_mismatch() -> None:
    segs: list[Any] = [torch.ones(1, 2), torch.ones(1, 2, device="meta")]
    with pytest.raises(SegmentMismatchError, match=r"different devices \['cpu', 'meta'\]") as info:
        _ours(segs, [0, 1], 0, False)
    assert isinstance(info.value, RuntimeError)  # what NeMo-RL's torch.cat raises there
    with pytest.raises(SegmentMismatchError, match="different devices"):
        _ours(segs, [0, 1], 0, True)  # with padding too
    # moving a meta segment to a real device: no data to move
    with pytest.raises(SegmentMismatchError, match="meta device has no data to move to cpu"):
        _ours(segs, [0, 1], 0, False, device="cpu")


def test_rank_mismatch_without_padding_raises_segment_mismatch() -> None:
    with pytest.raises(SegmentMismatchError, match=r"ranks \[1, 2\]"):
        _ours([torch.ones(1, 2), torch.ones(2)], [0, 1], 0, False)
    # torch.cat skips 1-D empty tensors (legacy rule); so does the check
    got = _ours([torch.ones(1, 2), torch.zeros(0)], [0, 1], 0, False)
    assert got is not None and torch.equal(got, torch.ones(1, 2))


def test_autograd_and_mixed_dtypes_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _native_calls(monkeypatch)
    w = torch.ones(2, 3, requires_grad=True)
    got = _ours([w], [0, 0], 0, False)
    assert got is not None and got.grad_fn is not None
    mixed: list[Any] = [torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2)]
    assert _same(_ours(mixed, [0, 1], 0, False), _reference(mixed, [0, 1], 0, False))
    assert calls == []


def test_device_argument_moves_tensors_in_place() -> None:
    a = torch.ones(2, 2)
    tensors: list[Any] = [a, None]
    identity = id(tensors)
    got = _gather.as_tensor(tensors, None, 0, False, "cpu")
    assert id(tensors) == identity and tensors[0] is a and tensors[1] is None
    assert _same(got, a)
    meta = _gather.as_tensor(tensors, np.array([0, 0]), 0, False, "meta")
    assert meta is not None and meta.device.type == "meta" and meta.shape == (4, 2)
    assert tensors[0] is not None and tensors[0].device.type == "meta"


def test_move_segments_cpu_and_counters() -> None:
    a = torch.ones(2)
    counters = _transfer.transfer_counters()
    before = counters.total_bytes
    moved = _transfer.move_segments([a, None, a], "cpu")
    assert moved[0] is a and moved[2] is a and moved[1] is None
    assert counters.total_bytes == before  # nothing crossed a bus
    meta = _transfer.move_segments([a, None, a], "meta")
    assert meta[0] is meta[2] and meta[0].device.type == "meta"
    assert counters.total_bytes == before + a.numel() * a.element_size()
    # like NeMo-RL, every non-None entry is moved with `.to`
    with pytest.raises(AttributeError):
        _transfer.move_segments([a, 3], "cpu")


def test_staging_buffer_views_equal_their_segments() -> None:
    # the CUDA feed's staging step, run host-to-host (pinning needs CUDA; the logic is the same)
    gen = torch.Generator().manual_seed(8)
    a = _rand((3, 4), torch.bfloat16, gen)
    b = _rand((4, 6), torch.bfloat16, gen)[:, ::2]  # non-contiguous
    c = _rand((), torch.bfloat16, gen)  # 0-d
    views = _transfer._stage([a, b, c], torch.device("cpu"), non_blocking=False, pin_memory=False)
    assert [v.shape for v in views] == [a.shape, b.shape, c.shape]
    assert all(_same(v, t) for v, t in zip(views, [a, b, c], strict=True))
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)  # one buffer, one copy
    assert (
        views[1].storage_offset() == a.numel()
        and views[2].storage_offset() == a.numel() + b.numel()
    )


# ---------------------------------------------------------------------------- the binding itself


def test_gather_into_binding_errors() -> None:
    out = np.zeros(4, dtype=np.uint8)
    src = np.arange(4, dtype=np.uint8)
    _native.gather_into(out, [src], np.array([0], dtype=np.int64))
    assert out.tolist() == [0, 1, 2, 3]
    with pytest.raises(PackedTensorError, match=r"order\[1\] = 5 is out of range for 1"):
        _native.gather_into(out, [src], np.array([0, 5], dtype=np.int64))
    with pytest.raises(PackedTensorError, match=r"-1 is out of range"):
        _native.gather_into(out, [src], np.array([-1], dtype=np.int64))
    with pytest.raises(PackedTensorError, match="segments need 8"):
        _native.gather_into(out, [src], np.array([0, 0], dtype=np.int64))
    with pytest.raises(PackedTensorError, match="equal blocks"):
        _native.gather_into(out, [src], np.array([0], dtype=np.int64), 3)
    readonly = np.zeros(4, dtype=np.uint8)
    readonly.setflags(write=False)
    with pytest.raises(TypeError):
        _native.gather_into(readonly, [src], np.array([0], dtype=np.int64))
    with pytest.raises(TypeError):
        _native.gather_into(out, [out], np.array([0], dtype=np.int64))
    with pytest.raises(TypeError):
        _native.gather_into(out, [src[::2]], np.array([0], dtype=np.int64))
    with pytest.raises(TypeError):
        _native.gather_into(out.astype(np.int32), [src], np.array([0], dtype=np.int64))
    with pytest.raises(OverflowError):
        _native.gather_into(out, [src], np.array([0], dtype=np.int64), -1)


def test_gather_bindings_refuse_overlapping_arrays() -> None:
    """Two arrays over one buffer that rust-numpy does not see as aliased (no common base
    object, as with two ``torch.from_numpy`` views) are refused when the output overlaps an
    input, before any copy; disjoint ones are fine."""
    buf = torch.arange(64, dtype=torch.uint8)
    out, src = buf[8:24].numpy(), buf[0:16].numpy()
    assert out.base is not src.base
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    with pytest.raises(PackedTensorError, match="overlaps input array 0"):
        _native.gather_into(out, [src], i64(0))
    with pytest.raises(PackedTensorError, match="overlaps input array 0"):
        _native.gather_ranges_into(out, src, i64(0), i64(16), i64(0))
    # an index array that is a view of the output buffer is an input too
    order_bytes = torch.zeros(24, dtype=torch.uint8)
    with pytest.raises(PackedTensorError, match="overlaps input array 1"):
        _native.gather_into(
            order_bytes[:8].numpy(), [buf[:8].numpy()], order_bytes[:8].view(torch.int64).numpy()
        )
    assert buf[:8].tolist() == list(range(8))
    _native.gather_into(buf[16:32].numpy(), [buf[0:16].numpy()], i64(0))
    assert buf[16:32].tolist() == list(range(16))


def test_gather_ranges_into_binding_errors() -> None:
    out = np.zeros(4, dtype=np.uint8)
    src = np.arange(6, dtype=np.uint8)
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    _native.gather_ranges_into(out, src, i64(0, 4), i64(2, 2), i64(1, 0))
    assert out.tolist() == [4, 5, 0, 1]
    _native.gather_ranges_into(out, src, i64(0, 2), i64(1, 1), i64(1, 0), 2, 3)
    assert out.tolist() == [2, 0, 5, 3]
    with pytest.raises(PackedTensorError, match="does not lie inside the 6-byte source"):
        _native.gather_ranges_into(out, src, i64(5), i64(2), i64(0, 0))
    with pytest.raises(PackedTensorError, match="start -1"):
        _native.gather_ranges_into(out, src, i64(-1), i64(2), i64(0, 0))
    with pytest.raises(PackedTensorError):
        _native.gather_ranges_into(out, src, i64(0), i64(2), i64(0, 1))
    with pytest.raises(PackedTensorError):
        _native.gather_ranges_into(out, src, i64(0), i64(2, 2), i64(0, 0))
    with pytest.raises(PackedTensorError, match="segments need 2"):
        _native.gather_ranges_into(out, src, i64(0), i64(2), i64(0))
    with pytest.raises(TypeError):
        _native.gather_ranges_into(out, out, i64(0), i64(2), i64(0, 0))


# -------------------------------------------------------------------------------- property test


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[Any], list[int] | None, int, bool, torch.dtype]:
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.integers(1, 3))
    dim = draw(st.integers(-rank, rank - 1))
    pad = draw(st.booleans())
    pack = dim % rank
    common = [draw(st.integers(0, 4)) for _ in range(rank)]
    n_phys = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    tensors: list[Any] = []
    for _ in range(n_phys):
        if draw(st.integers(0, 5)) == 0:
            tensors.append(None)
            continue
        shape = list(common)
        shape[pack] = draw(st.integers(0, 4))
        if pad:
            shape = [s if d == pack else draw(st.integers(0, 4)) for d, s in enumerate(shape)]
        t = _rand(tuple(shape), dtype, gen)
        if draw(st.booleans()) and rank >= 2:  # make it non-contiguous, same logical shape
            t = t.transpose(0, 1).contiguous().transpose(0, 1)
        tensors.append(t)
    legacy = draw(st.booleans())
    indices = None if legacy else draw(st.lists(st.integers(0, n_phys - 1), max_size=12))
    return tensors, indices, dim, pad, dtype


@pytest.mark.parametrize("compact", [False, True], ids=["per-segment", "compacted"])
@given(case=_cases(), use_out=st.booleans())
def test_native_equals_torch_reference(case: Any, use_out: bool, compact: bool) -> None:
    tensors, indices, dim, pad, _dtype = case
    threshold = 1 if compact else 10**9
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_gather, "COMPACT_MIN_SEGMENTS", threshold)
        _check_against_reference(tensors, indices, dim, pad, use_out)


def _check_against_reference(
    tensors: list[Any], indices: list[int] | None, dim: int, pad: bool, use_out: bool
) -> None:
    try:
        ref = _reference(tensors, indices, dim, pad)
    except (RuntimeError, IndexError, ValueError) as exc:
        with pytest.raises(type(exc)):
            _ours(tensors, indices, dim, pad)
        return
    got = _ours(tensors, indices, dim, pad)
    assert _same(got, ref)
    if use_out and ref is not None:
        out = torch.empty_like(ref)
        again = _ours(tensors, indices, dim, pad, out=out)
        assert again is out and _same(out, ref)


def test_small_outputs_are_one_torch_cat_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(3)
    segs: list[Any] = [_rand((3, 5), torch.float32, gen), None, _rand((2, 5), torch.float32, gen)]
    cases = [([0, 1, 2, 0, 2, 2, 1], 0), (None, 0), ([2, 0], -2)]
    for indices, dim in cases:
        monkeypatch.setattr(_gather, "SMALL_OUTPUT_BYTES", 0)
        native = _ours(segs, indices, dim, False)
        monkeypatch.setattr(_gather, "SMALL_OUTPUT_BYTES", 1 << 20)
        calls = _native_calls(monkeypatch)
        cat = _ours(segs, indices, dim, False)
        assert not calls, "a small output went to the native gather"
        assert cat.dtype == native.dtype and cat.shape == native.shape and cat.is_contiguous()
        assert torch.equal(cat, native)
    # What torch.cat refuses goes to the main path, which names the segments.
    bad = [torch.zeros(2, 3), torch.zeros(2, 4)]
    with pytest.raises(SegmentMismatchError):
        _ours(bad, None, 0, False)
    # Mixed dtypes keep the main path's behaviour too.
    mixed = [torch.zeros(2, 3), torch.zeros(1, 3, dtype=torch.float64)]
    monkeypatch.setattr(_gather, "SMALL_OUTPUT_BYTES", 0)
    expected = _ours(mixed, None, 0, False)
    monkeypatch.setattr(_gather, "SMALL_OUTPUT_BYTES", 1 << 20)
    got = _ours(mixed, None, 0, False)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_byte_views_leave_the_tensors_storage_resizable() -> None:
    # torch marks a storage unresizable for good once Tensor.numpy() has viewed it
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    view = _transfer.byte_view(t)
    assert bytes(view) == bytes(t.untyped_storage())
    view[:4] = 0  # a view, not a copy
    assert t[0, 0].item() == 0.0
    del view
    t.resize_(6, 4)
    t.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="contiguous"):
        _transfer.byte_view(torch.arange(12).view(3, 4).t())
