"""Every size-like argument of the public API, driven with sizes near the int32 and int64 limits
and 2**40, and with negatives, zero, bools, floats and numpy integers. Each call either works,
with the result the size implies, or raises ``TypeError`` or an ``MmpackError`` whose message
names the argument. None may abort the process.

A size in range can be legitimately huge (a pack of 2**31 - 1 positions needs 56 GB), so whether
it works depends on the machine. The properties therefore run in full in a process forked from
this one with its address space capped at 1 GiB above what it already maps: every such size is
refused there by the allocator, on any machine, and a crash (an abort, a segfault, the OOM
killer) fails this test instead of the test run. This process checks the boundary values that
cannot allocate much: out of range, of the wrong type, or small.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import resource
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mmpack import PackedTensor, safe_load
from mmpack.batch import BatchOptions, EncodedSample, masks, micro_batch, pack_samples, pad_samples
from mmpack.compat.nemo_rl.packing import get_packer
from mmpack.errors import MmpackError
from mmpack.packing import assign_to_ranks, pack

I32_MAX = 2**31 - 1
I64_MAX = 2**63 - 1
#: A result up to this many bytes must be built; a larger one may be refused for memory.
SMALL = 64 << 20
#: The child's address-space headroom over what its imports hold.
HEADROOM = 1 << 30

LIMITS = [
    *(
        sign * 2**k + d
        for k in (31, 32, 40, 42, 62, 63, 64)
        for d in (-1, 0, 1)
        for sign in (1, -1)
    ),
    *range(-2, 9),
    10**30,
]
_INTS = st.one_of(
    st.sampled_from(LIMITS),
    st.integers(-3, 48),
    # (a result near the child's cap: some of its buffers fit, the rest must be refused)
    st.integers(2**26, 2**27),
    *(st.integers(2**k - 3, 2**k + 3) for k in (31, 32, 40, 42, 63)),
    st.integers(-(2**63) - 3, -(2**63) + 3),
)


def _numpy_int(v: int) -> Any:
    for dtype in (np.int32, np.int64, np.uint64):
        info = np.iinfo(dtype)
        if info.min <= v <= info.max:
            return dtype(v)
    return v


_ODD = [True, False, 4.0, 2.0**40, math.inf, math.nan, "8", b"8", [4]]
#: The boundary values, each as an int and as a numpy integer, and values of other types.
VALUES = [*LIMITS, *map(_numpy_int, LIMITS), *_ODD]
SIZES = st.one_of(_INTS, _INTS.map(_numpy_int), st.sampled_from(_ODD))


# ----------------------------------------------------------------------------- the arguments


@dataclass(frozen=True)
class Arg:
    """One size argument of one public function."""

    id: str
    #: The function called with the size.
    call: Callable[[Any], Any]
    #: How its error messages may name it (the argument's name first).
    names: tuple[str, ...]
    #: The smallest and largest int that may work (a hard limit: int32 offsets, int64).
    minimum: int
    maximum: int
    #: Checks a result against the size that gave it.
    check: Callable[[Any, int], None]
    #: Bytes the result needs per unit of the size: above ``SMALL`` in all, it may be refused.
    cost: int = 0
    #: Whether numpy integers are accepted (else they must be refused, naming the argument).
    numpy: bool = True
    #: Any other rule the size must meet to work (a divisor of the rows, a bin count).
    valid: Callable[[int], bool] = lambda v: True


def _exact(value: Any, numpy: bool) -> int | None:
    """The size as an int where an int is expected (a numpy integer where accepted)."""
    if type(value) is int or (numpy and isinstance(value, np.integer)):
        return int(value)
    return None


def _in_range(arg: Arg, v: int) -> bool:
    return arg.minimum <= v <= arg.maximum and arg.valid(v)


def _big(arg: Arg, value: Any) -> bool:
    """A size in range whose result may be too big to build here."""
    v = _exact(value, arg.numpy)
    return v is not None and _in_range(arg, v) and v * arg.cost > SMALL


def drive(arg: Arg, value: Any) -> None:
    """Call ``arg`` with ``value``: a correct result, or a typed error naming it."""
    v = _exact(value, arg.numpy)
    shown = f"{arg.id}={value!r} ({type(value).__name__})"
    try:
        result = arg.call(value)
    except (TypeError, MmpackError) as exc:
        assert any(name in str(exc) for name in arg.names), (
            f"{shown}: {type(exc).__name__} does not name the argument: {exc}"
        )
        assert v is None or not _in_range(arg, v) or _big(arg, value), (
            f"{shown} is a valid size but was refused: {type(exc).__name__}: {exc}"
        )
        return
    assert v is not None, f"{shown} was accepted: a size must be an int"
    assert _in_range(arg, v), f"{shown} was accepted, out of [{arg.minimum}, {arg.maximum}]"
    arg.check(result, v)


# ----------------------------------------------------------------------------- batch

SAMPLE = EncodedSample("s", [5, 6, 7, 8], loss_mask=[1, 1, 1, 1])
PRE = {"loss_mask_mode": "precomputed"}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _thd_width(expected: Callable[[int], int]) -> Callable[[Any, int], None]:
    def check(batch: Any, v: int) -> None:
        assert batch.input_ids.shape == (expected(v),)
        assert int(batch.cu_seqlens_padded[-1]) == expected(v)
        assert batch.token_mask.numpy().sum() == 4

    return check


def _rows_width(expected: Callable[[int], int]) -> Callable[[Any, int], None]:
    def check(batch: Any, v: int) -> None:
        assert tuple(batch.input_ids.shape) == (1, expected(v))
        assert batch.attention_mask.numpy().sum() == 4  # numpy: torch's pool stays unused

    return check


def _cp_multiple(v: int) -> int:
    return 2 * v if v > 1 else 1


def _micro(v: Any) -> Any:
    return micro_batch([pack_samples([SAMPLE], **PRE)], pad_to_length=v)


def _option_check(name: str) -> Callable[[Any, int], None]:
    def check(options: Any, v: int) -> None:
        assert getattr(options, name) == v

    return check


BATCH = [
    Arg(
        "pack_samples.pad_to_length",
        lambda v: pack_samples([SAMPLE], pad_to_length=v, **PRE),
        ("pad_to_length",),
        4,
        I32_MAX,
        _thd_width(lambda v: v),
        cost=26,
    ),
    Arg(
        "pack_samples.pad_to_multiple_of",
        lambda v: pack_samples([SAMPLE], pad_to_multiple_of=v, **PRE),
        ("pad_to_multiple_of",),
        1,
        I32_MAX,
        _thd_width(lambda v: _round_up(4, v)),
        cost=26,
    ),
    Arg(
        "pack_samples.cp_size",
        lambda v: pack_samples([SAMPLE], cp_size=v, **PRE),
        ("cp_size",),
        1,
        I32_MAX // 2,
        _thd_width(lambda v: _round_up(4, _cp_multiple(v))),
        cost=52,
    ),
    Arg(
        "pad_samples.pad_to_length",
        lambda v: pad_samples([SAMPLE], pad_to_length=v, **PRE),
        ("pad_to_length",),
        4,
        I64_MAX,
        _rows_width(lambda v: v),
        cost=27,
    ),
    Arg(
        "pad_samples.pad_to_multiple_of",
        lambda v: pad_samples([SAMPLE], pad_to_multiple_of=v, **PRE),
        ("pad_to_multiple_of",),
        1,
        I64_MAX,
        _rows_width(lambda v: _round_up(4, v)),
        cost=27,
    ),
    Arg(
        "pad_samples.cp_size",
        lambda v: pad_samples([SAMPLE], cp_size=v, **PRE),
        ("cp_size",),
        1,
        I64_MAX,
        _rows_width(lambda v: _round_up(4, _cp_multiple(v))),
        cost=54,
    ),
    Arg(
        "micro_batch.pad_to_length",
        _micro,
        ("pad_to_length",),
        4,
        I32_MAX,
        _thd_width(lambda v: v),
        cost=26,
    ),
    *(
        Arg(
            f"BatchOptions.{name}",
            lambda v, name=name: BatchOptions(**{name: v}),
            (name,),
            1,
            I64_MAX,
            _option_check(name),
        )
        for name in ("pad_to_length", "pad_to_multiple_of", "cp_size")
    ),
]

# ----------------------------------------------------------------------------- masks


def _mask_of_four(mask: Any, v: int) -> None:
    assert mask.tolist() == [0, 0, 1, 1]


MASKS = [
    Arg(
        "masks.validate.num_tokens",
        lambda v: masks.validate([0, 1, 1, 1], v),
        ("num_tokens", "tokens"),
        4,
        4,
        lambda result, v: None,
    ),
    Arg(
        "masks.from_roles.num_tokens",
        lambda v: masks.from_roles([2, 2], ["user", "assistant"], num_tokens=v),
        ("num_tokens", "tokens"),
        4,
        4,
        _mask_of_four,
    ),
    Arg(
        "masks.from_fragments.num_tokens",
        lambda v: masks.from_fragments([2, 2], [False, True], num_tokens=v),
        ("num_tokens", "tokens"),
        4,
        4,
        _mask_of_four,
    ),
]

# ----------------------------------------------------------------------------- packing

LENGTHS = [3, 5, 2]


def _all_packed(packing: Any) -> list[list[int]]:
    bins = packing.bins()
    assert sorted(i for b in bins for i in b) == [0, 1, 2]
    return bins


def _packs_into(capacity: Callable[[int], int]) -> Callable[[Any, int], None]:
    def check(packing: Any, v: int) -> None:
        for b in _all_packed(packing):
            assert sum(LENGTHS[i] for i in b) <= capacity(v)

    return check


def _at_most_items(packing: Any, v: int) -> None:
    assert all(len(b) <= v for b in _all_packed(packing))


def _at_least_bins(packing: Any, v: int) -> None:
    assert len(_all_packed(packing)) >= v


def _bins_multiple(packing: Any, v: int) -> None:
    assert len(_all_packed(packing)) % v == 0


def _media_within(packing: Any, v: int) -> None:
    _all_packed(packing)
    assert all(m <= v for m in packing.bin_media.tolist())


def _ranks(assignment: Any, v: int) -> None:
    assert len(assignment.rank_offsets) == v + 1
    assert sorted(assignment.bin_indices.tolist()) == [0, 1]


def _nemo_rl_bins(expected: Callable[[int], Callable[[list[list[int]]], bool]]) -> Any:
    def check(bins: list[list[int]], v: int) -> None:
        assert sorted(i for b in bins for i in b) == [0, 1, 2]
        assert expected(v)(bins)

    return check


PACKING = [
    Arg(
        "pack.capacity",
        lambda v: pack(LENGTHS, v),
        ("capacity",),
        5,
        I64_MAX,
        _packs_into(lambda v: v),
    ),
    Arg(
        "pack.max_items_per_bin",
        lambda v: pack(LENGTHS, 10, max_items_per_bin=v),
        ("max_items_per_bin",),
        1,
        I64_MAX,
        _at_most_items,
    ),
    Arg(
        "pack.min_bins",
        lambda v: pack(LENGTHS, 10, min_bins=v),
        ("min_bins",),
        0,
        len(LENGTHS),
        _at_least_bins,
    ),
    Arg(
        "pack.bins_multiple_of",
        lambda v: pack(LENGTHS, 10, bins_multiple_of=v),
        ("bins_multiple_of",),
        1,
        len(LENGTHS),
        _bins_multiple,
    ),
    Arg(
        "pack.media_capacity",
        lambda v: pack(LENGTHS, 10, media=[1, 2, 1], media_capacity=v),
        ("media_capacity", "media capacity"),
        2,
        I64_MAX,
        _media_within,
    ),
    Arg(
        "pack.search_budget",
        lambda v: pack(LENGTHS, 10, algorithm="minimum_bin_slack", search_budget=v),
        ("search_budget",),
        0,
        I64_MAX,
        lambda packing, v: _packs_into(lambda v: 10)(packing, v),
    ),
    Arg(
        "assign_to_ranks.num_ranks",
        lambda v: assign_to_ranks(pack(LENGTHS, 5), v),
        ("num_ranks",),
        1,
        I64_MAX,
        _ranks,
        cost=16,
    ),
    Arg(
        "get_packer.bin_capacity",
        lambda v: get_packer("first_fit_decreasing", v).pack(LENGTHS),
        ("bin_capacity", "bin capacity"),
        5,
        I64_MAX,
        _nemo_rl_bins(lambda v: lambda bins: all(sum(LENGTHS[i] for i in b) <= v for b in bins)),
    ),
    Arg(
        "get_packer.min_bin_count",
        lambda v: get_packer("first_fit_decreasing", 10, min_bin_count=v).pack(LENGTHS),
        ("min_bin_count",),
        0,
        len(LENGTHS),
        _nemo_rl_bins(lambda v: lambda bins: len(bins) >= v),
    ),
    Arg(
        "get_packer.bin_count_multiple",
        lambda v: get_packer("first_fit_decreasing", 10, bin_count_multiple=v).pack(LENGTHS),
        ("bin_count_multiple",),
        1,
        len(LENGTHS),
        _nemo_rl_bins(lambda v: lambda bins: len(bins) % v == 0),
    ),
]

# ----------------------------------------------------------------------------- PackedTensor


def _value(rows: int) -> PackedTensor:
    return PackedTensor([torch.full((1, 2), float(r)) for r in range(rows)], 0)


def _rows(n: Callable[[int], int]) -> Callable[[Any, int], None]:
    def check(value: Any, v: int) -> None:
        assert len(value) == n(v)

    return check


def _shards_of(rows: int) -> Callable[[Any, int], None]:
    def check(shards: Any, v: int) -> None:
        assert len(shards) == v
        assert all(len(s) == rows // v for s in shards)

    return check


PACKED = [
    Arg(
        "PackedTensor.repeat_interleave.repeats",
        lambda v: _value(2).enable_deduplication().repeat_interleave(v),
        ("repeats",),
        0,
        I64_MAX // 2,
        _rows(lambda v: 2 * v),
        cost=32,
    ),
    Arg(
        "PackedTensor.shard.num_shards",
        lambda v: _value(4).enable_deduplication().shard(v),
        ("num_shards",),
        1,
        4,
        _shards_of(4),
        valid=lambda v: 4 % v == 0,
    ),
    Arg(
        "PackedTensor.shard.num_shards (legacy)",
        lambda v: _value(4).shard(v),
        ("num_shards",),
        1,
        4,
        _shards_of(4),
        valid=lambda v: 4 % v == 0,
    ),
    Arg(
        # an empty value splits into any number of shards, each a Python value (~50 us)
        "PackedTensor.shard.num_shards (empty)",
        lambda v: PackedTensor.empty_rows_like(_value(1).enable_deduplication(), 0).shard(v),
        ("num_shards",),
        1,
        I64_MAX,
        _shards_of(0),
        cost=SMALL >> 10,
    ),
    Arg(
        "PackedTensor.empty_rows_like.num_rows",
        lambda v: PackedTensor.empty_rows_like(_value(1).enable_deduplication(), v),
        ("num_rows",),
        0,
        I64_MAX,
        _rows(lambda v: v),
        cost=8,
    ),
    Arg(
        "PackedTensor.empty_rows_like.num_rows (legacy)",
        lambda v: PackedTensor.empty_rows_like(_value(1), v),
        ("num_rows",),
        0,
        I64_MAX,
        _rows(lambda v: v),
        cost=8,
    ),
]

# ----------------------------------------------------------------------------- safe_load

PAYLOAD = pickle.dumps([1, 2, 3])


def _loaded(value: Any, v: int) -> None:
    assert value == [1, 2, 3]


SAFE_LOAD = [
    Arg(
        "safe_load.loads.max_bytes",
        lambda v: safe_load.loads(PAYLOAD, max_bytes=v),
        ("max_bytes",),
        0,
        2**200,
        _loaded,
        numpy=False,
        # a bound too small for the payload is refused (PickleTooLargeError naming max_bytes)
        valid=lambda v: v >= 1 << 20,
    ),
    Arg(
        "safe_load.load.max_bytes",
        lambda v: safe_load.load(io.BytesIO(PAYLOAD), max_bytes=v),
        ("max_bytes",),
        0,
        2**200,
        _loaded,
        numpy=False,
        valid=lambda v: v >= 1 << 20,
    ),
]

# ----------------------------------------------------------------------------- energon


def _encoder_config(**fields: Any) -> Any:
    from mmpack.energon import PackingEncoderConfig  # Energon loads on first use

    return PackingEncoderConfig(**fields)


ENERGON = [
    Arg(
        f"PackingEncoderConfig.{name}",
        lambda v, name=name: _encoder_config(**{name: v}),
        (name,),
        1,
        I64_MAX,
        _option_check(name),
        numpy=False,
    )
    for name in (
        "capacity",
        "packing_buffer_size",
        "batch_size",
        "max_items_per_bin",
        "media_capacity",
        "failure_tolerance",
        "max_consecutive_skips",
        "pad_to_multiple_of",
        "cp_size",
    )
]

ARGS = [*BATCH, *MASKS, *PACKING, *PACKED, *SAFE_LOAD, *ENERGON]


# ----------------------------------------------------------------------------- this process


@pytest.mark.parametrize("arg", ARGS, ids=[a.id for a in ARGS])
def test_boundary_sizes_that_cannot_allocate_much(arg: Arg) -> None:
    """Every boundary value that is out of range, of the wrong type, or small: a typed error
    naming the argument, or the result the size implies. (In range and large: the child.)"""
    for value in VALUES:
        if not _big(arg, value):
            drive(arg, value)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: pack_samples([SAMPLE], pad_to_length=2**31, **PRE), "pad_to_length"),
        (lambda: pack_samples([SAMPLE], pad_to_multiple_of=2**42, **PRE), "pad_to_multiple_of"),
        (lambda: pack_samples([SAMPLE], cp_size=2**40, **PRE), "cp_size"),
        (lambda: _micro(2**42), "pad_to_length"),
        (lambda: pad_samples([SAMPLE], pad_to_multiple_of=2**61, **PRE), "pad_to_multiple_of"),
        (lambda: pad_samples([SAMPLE], cp_size=2**62, **PRE), "cp_size"),
        (lambda: pad_samples([SAMPLE], pad_to_length=I64_MAX, **PRE), "pad_to_length"),
    ],
)
def test_sizes_past_int32_offsets_or_memory_are_refused_by_arithmetic(
    call: Callable[[], Any], name: str
) -> None:
    """No allocator is asked: past int32 THD offsets, or bytes past ``usize``."""
    with pytest.raises(MmpackError, match=f"invalid {name}: "):
        call()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_size_in_a_forked_child_with_capped_memory() -> None:
    """The properties for every value, large sizes in range included, in a process forked from
    this one with its address space capped: each large size is refused by the allocator as a
    typed error (or built, when small enough), and the child survives all of them."""
    _encoder_config()  # every import before the cap
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        os.close(read)
        code = 1
        with os.fdopen(write, "w", buffering=1) as out:
            try:
                _child(out)
                code = 0
            except BaseException:
                out.write(traceback.format_exc())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as report:
        text = report.read()
    _, status = os.waitpid(pid, 0)
    lines = text.strip().splitlines() or ["(nothing)"]
    ended = (
        f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        if os.WIFSIGNALED(status)
        else f"exited with {os.WEXITSTATUS(status)}"
    )
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the child {ended} after:\n" + "\n".join(lines[-40:])
    )
    assert lines[-1] == f"checked {len(ARGS)} arguments and the issue's three calls"


def _cap_address_space() -> None:
    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = vm_kib * 1024 + HEADROOM
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _property(arg: Arg) -> Callable[[], None]:
    @given(value=SIZES)
    def prop(value: Any) -> None:
        drive(arg, value)

    return prop


def _child(out: Any) -> None:
    _cap_address_space()
    # an eighth of the profile's examples per argument: there are many arguments, and the
    # boundary values run in full (the small ones in the parent, the large ones here)
    examples = max(settings.default.max_examples // 8, 10)
    for arg in ARGS:
        out.write(f"driving {arg.id}\n")
        for value in VALUES:
            if _big(arg, value):
                drive(arg, value)
        settings(database=None, max_examples=examples, deadline=None)(_property(arg))()
    out.write("driving the issue's three calls\n")
    for call, name in (
        (lambda: pad_samples([SAMPLE], pad_to_length=2**42, **PRE), "pad_to_length"),
        (lambda: pad_samples([SAMPLE], pad_to_multiple_of=2**42, **PRE), "pad_to_multiple_of"),
        (lambda: _micro(2**42), "pad_to_length"),
    ):
        with pytest.raises(MmpackError, match=f"invalid {name}: "):
            call()
    out.write(f"checked {len(ARGS)} arguments and the issue's three calls\n")
