"""Pickling state belongs to one pickling operation (``mmpack.packed.pickling.format``).

Values of one pickle share the tensors they have in common (written once, one object each
after loading). What a pickle contains never depends on other pickles: concurrent ones in other
threads, or long-lived ``pickle.Pickler`` objects that still hold earlier values. Every payload
is byte-identical to pickling its value alone, and none carries another value's tensors.
"""

from __future__ import annotations

import io
import pickle
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from mmpack.packed import PackedTensor as P

N_THREADS = 8
ROUNDS = 40


def _marker(n: int, byte: int) -> torch.Tensor:
    """A uint8 tensor of ``n`` bytes all equal to ``byte``: its bytes are easy to find."""
    return torch.full((n,), byte, dtype=torch.uint8)


def _has_run(payload: bytes, byte: int, length: int = 64) -> bool:
    return bytes([byte]) * length in payload


def _shared_family() -> tuple[list[P], list[torch.Tensor]]:
    """A many-segment value of several dtypes and small values sharing some of its tensors,
    plus values with tensors of their own."""
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.int64, torch.float16, torch.uint8, torch.bool]
    segs: list[torch.Tensor] = []
    for i in range(3000):
        dtype = dtypes[i % len(dtypes)]
        shape = (1 + i % 3, 2)
        if dtype == torch.bool:
            segs.append(torch.randint(0, 2, shape, generator=gen).bool())
        elif dtype == torch.uint8:
            segs.append(torch.randint(0, 200, shape, generator=gen).to(dtype))
        else:
            segs.append((torch.randn(shape, generator=gen) * 100).to(dtype))
    big = P(list(segs), 0).enable_deduplication()
    values = [big, big.slice(list(range(0, 3000, 7)))]
    for k in range(12):
        picks = [segs[(k * 131 + j * 17) % 3000] for j in range(1 + k % 4)]
        own = torch.full((2, 2), float(k))
        values.append(P([*picks, own, None], 0))
    values.append(
        P([segs[0], segs[0], segs[1]], 0, _row_offsets=[0, 3], _segment_indices=[2, 0, 1])
    )
    return values, segs


def _check_same(got: P, want: P) -> None:
    assert len(got.tensors) == len(want.tensors)
    for x, y in zip(got.tensors, want.tensors, strict=True):
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))
    assert got._row_offsets == want._row_offsets
    assert got._segment_indices == want._segment_indices
    assert got._segment_provenance == want._segment_provenance


@pytest.mark.parametrize("protocol", [2, 5])
def test_threads_pickle_byte_identical_payloads(protocol: int) -> None:
    """8 threads pickle values that share tensors, all at once; every payload equals the one
    the value gives alone, and loads back to it."""
    values, _ = _shared_family()
    alone = [pickle.dumps(v, protocol=protocol) for v in values]
    assert [pickle.dumps(v, protocol=protocol) for v in values] == alone  # deterministic
    errors: list[str] = []
    barrier = threading.Barrier(N_THREADS, timeout=60)

    def work(seed: int) -> int:
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(ROUNDS):
            i = rng.randrange(len(values))
            try:
                data = pickle.dumps(values[i], protocol=protocol)
            except Exception as exc:  # the failure under test: report, do not kill the thread
                errors.append(f"value {i}: {type(exc).__name__}: {exc}")
                continue
            if data != alone[i]:
                errors.append(f"value {i}: {len(data)} bytes, {len(alone[i])} alone")
        return ROUNDS

    with ThreadPoolExecutor(N_THREADS) as pool:
        done = [f.result() for f in [pool.submit(work, s) for s in range(N_THREADS)]]
    assert done == [ROUNDS] * N_THREADS  # every thread ran to its end (errors re-raised)
    assert not errors, f"{len(errors)} payloads differ: {errors[:5]}"
    for data, value in zip(alone, values, strict=True):
        _check_same(pickle.loads(data), value)


def test_threads_pickle_lists_that_share_within_themselves() -> None:
    """One pickle of several values still writes each shared tensor once, also while other
    threads pickle overlapping values."""
    values, _ = _shared_family()
    batch = values[1:]
    alone = pickle.dumps(batch, protocol=5)

    def work() -> list[bytes]:
        return [pickle.dumps(batch, protocol=5) for _ in range(10)]

    with ThreadPoolExecutor(N_THREADS) as pool:
        results = [d for f in [pool.submit(work) for _ in range(N_THREADS)] for d in f.result()]
    assert len(results) == N_THREADS * 10 and set(results) == {alone}
    got = pickle.loads(alone)
    seen: dict[int, int] = {}
    for g, w in zip(got, batch, strict=True):
        _check_same(g, w)
        for x, y in zip(g.tensors, w.tensors, strict=True):
            if y is not None:
                assert seen.setdefault(id(y), id(x)) == id(x)  # one object per shared tensor


def test_a_long_lived_pickler_does_not_leak_into_other_pickles() -> None:
    """While a long-lived ``Pickler`` still holds value ``a`` (a 1 MiB tensor and a small one),
    pickling ``b``, which shares the small tensor, gives exactly ``b``'s bytes alone."""
    small = _marker(3, 0x11)
    a = P([_marker(1 << 20, 0xA5), small], 0)
    b = P([small], 0)
    b_alone = pickle.dumps(b, protocol=5)
    stream = io.BytesIO()
    keeper = pickle.Pickler(stream, protocol=5)
    keeper.dump(a)
    for protocol in (5, 2):
        data = pickle.dumps(b, protocol=protocol)
        assert not _has_run(data, 0xA5)
        assert data == pickle.dumps(P([small], 0), protocol=protocol)
    assert pickle.dumps(b, protocol=5) == b_alone and len(b_alone) < 1000
    # the keeper goes on: a later dump into it can share with what it wrote
    c = P([small, _marker(5, 0x22)], 0)
    keeper.dump(c)
    stream.seek(0)
    reader = pickle.Unpickler(stream)
    got_a, got_c = reader.load(), reader.load()
    _check_same(got_a, a)
    _check_same(got_c, c)


def test_interleaved_long_lived_picklers_carry_only_their_own_tensors() -> None:
    """Two picklers alive at once in one thread, used in turns: each stream loads back to what
    went in and never holds the other stream's tensors, even where a value shares a tensor
    with a value only the other stream wrote."""
    small, other, extra = _marker(3, 0x31), _marker(70, 0x32), _marker(70, 0x33)
    a = P([_marker(4096, 0x41), small], 0)
    b = P([small, other], 0)  # written to Q only
    c = P([small, extra], 0)  # written to P, shares `small` with b
    d = P([small], 0)
    buf_p, buf_q = io.BytesIO(), io.BytesIO()
    p, q = pickle.Pickler(buf_p, protocol=5), pickle.Pickler(buf_q, protocol=5)
    p.dump(a)
    q.dump(b)
    mark = buf_p.tell()
    p.dump(c)
    p.dump(d)
    q.dump(d)
    tail = buf_p.getvalue()[mark:]
    assert not _has_run(tail, 0x32, 32)  # b's own tensor stays in Q's stream
    assert not _has_run(buf_q.getvalue(), 0x41, 32) and not _has_run(buf_q.getvalue(), 0x33, 32)
    buf_p.seek(0)
    buf_q.seek(0)
    rp, rq = pickle.Unpickler(buf_p), pickle.Unpickler(buf_q)
    for want in (a, c, d):
        _check_same(rp.load(), want)
    for want in (b, d):
        _check_same(rq.load(), want)


def test_pickling_keeps_no_media_alive() -> None:
    """After a pickle is written, mmpack's bookkeeping holds no reference to its tensors (only
    the pickler's memo does, while it lives)."""
    import gc
    import weakref

    big = torch.ones(1 << 16)
    ref = weakref.ref(big)
    value = P([big], 0).enable_deduplication()
    copies = [value, *(P([big], 0) for _ in range(3))]
    data = pickle.dumps(copies, protocol=5)
    del big, value, copies
    gc.collect()
    assert ref() is None
    assert len(pickle.loads(data)) == 4


def test_the_class_lookup_is_seen_once_per_pickler() -> None:
    """The signal the format relies on: a pickler looks ``mmpack.packed.PackedTensor`` up
    once, for its first value, and the module stays what it was for everyone else."""
    import sys

    import mmpack
    import mmpack.packed.pickling.operation as operation

    module = sys.modules["mmpack.packed"]
    assert module.PackedTensor is P is mmpack.PackedTensor
    calls: list[int] = []
    operation.THREADS.pickler_started = lambda: calls.append(1)  # type: ignore[method-assign]
    try:
        pickle.dumps([P([torch.ones(2)], 0) for _ in range(5)], protocol=5)
        assert len(calls) == 1
        pickle.dumps([P([torch.ones(2)], 0) for _ in range(5)], protocol=2)
        assert len(calls) == 2
    finally:
        del operation.THREADS.pickler_started  # the class's method again, not a bound copy
    assert "PackedTensor" in dir(module) and type(module) is type(sys)  # a plain module
    assert "PackedTensor" not in vars(module)  # served by __getattr__, the lookup the signal is


def test_pickling_state_is_per_thread_not_per_process() -> None:
    """A value pickled in one thread while another thread's pickle of a sharing value is in
    progress (held open by a live Pickler) is not affected by it."""
    shared = _marker(8, 0x51)
    a = P([_marker(2048, 0x52), shared], 0)
    b = P([shared], 0)
    alone = pickle.dumps(b, protocol=5)
    started, done = threading.Event(), threading.Event()
    keeper: list[Any] = []

    def hold() -> None:
        try:
            pk = pickle.Pickler(io.BytesIO(), protocol=5)
            pk.dump(a)
            keeper.append(pk)
        finally:
            started.set()  # also when the dump failed: the result below re-raises it
        done.wait(10)

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(hold)
        assert started.wait(10)
        try:
            assert keeper, held.exception(timeout=10)
            assert pickle.dumps(b, protocol=5) == alone
        finally:
            done.set()
            held.result(timeout=10)
