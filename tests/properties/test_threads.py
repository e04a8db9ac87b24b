"""Threads: mmpack used from 8 threads at once on shared inputs gives what one
thread gives, and long native calls release the GIL, two of them at once too.

No timing assertion: the GIL tests check *when* things happened (timestamps), not how fast, and
no sleep stands in for synchronization (events and barriers do).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from mmpack import PackedTensor, packing
from mmpack.batch import EncodedSample, masks, pack_samples
from mmpack.compat.nemo_rl import packing as nemo_rl_packing
from mmpack.errors import LossMaskError

N_THREADS = 8
ROUNDS = 6


def _shared_inputs() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 900, 20_000).astype(np.int64)
    segments = [torch.full((int(rng.integers(1, 4)), 3), float(i)) for i in range(64)]
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 3, 200))]).astype(np.int64)
    indices = rng.integers(0, len(segments), int(offsets[-1])).astype(np.int64)
    value = PackedTensor(
        segments,
        0,
        _row_offsets=offsets.tolist(),
        _segment_indices=indices.tolist(),
        _segment_provenance=[i.to_bytes(16, "little") for i in range(len(segments))],
    )
    samples = []
    for i in range(40):
        n = int(rng.integers(2, 50))
        samples.append(
            EncodedSample(
                f"s{i}",
                rng.integers(0, 1000, n).astype(np.int64),
                loss_mask=rng.integers(0, 2, n).astype(np.int8),
            )
        )
    mask = rng.integers(0, 2, 100_000).astype(np.int8)
    bad_mask = mask.copy()
    bad_mask[77_777] = 2
    return {
        "lengths": lengths,
        "value": value,
        "rows": rng.permutation(len(value)).astype(np.int64),
        "samples": samples,
        "mask": mask,
        "bad_mask": bad_mask,
    }


def _digest_value(v: PackedTensor) -> tuple[Any, ...]:
    t = v.as_tensor()
    return (
        len(v),
        tuple(v._row_offsets or ()),
        tuple(v._segment_indices or ()),
        tuple(v._segment_provenance or ()),
        None if t is None else tuple(t.flatten().tolist()),
    )


def _work(inp: dict[str, Any]) -> dict[str, Any]:
    """Every operation under test on the shared inputs, reduced to plain values."""
    out: dict[str, Any] = {}
    for alg in ("best_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle"):
        p = packing.pack(inp["lengths"], 1024, algorithm=alg, seed=3)
        out[f"pack:{alg}"] = (p.bin_offsets.tobytes(), p.item_indices.tobytes())
    ffd = nemo_rl_packing.get_packer("FIRST_FIT_DECREASING", 1024).pack(
        inp["lengths"][:2000].tolist()
    )
    out["get_packer"] = ffd
    value: PackedTensor = inp["value"]
    sliced = value.slice(inp["rows"])
    rep = value.repeat_interleave(3)
    joined = PackedTensor.concat([sliced, value, rep.slice(list(range(0, len(rep), 5)))])
    out["slice"] = _digest_value(sliced)
    out["concat"] = _digest_value(joined)
    out["shard"] = [_digest_value(s) for s in rep.shard(4)]
    out["counts"] = joined.logical_segment_counts_by_row()
    masks.validate(inp["mask"], len(inp["mask"]))
    try:
        masks.validate(inp["bad_mask"], len(inp["bad_mask"]), sample_id="bad")
    except LossMaskError as exc:
        out["bad_mask"] = str(exc)
    batch = pack_samples(inp["samples"], loss_mask_mode="precomputed", pad_to_multiple_of=8)
    out["pack_samples"] = (
        batch.input_ids.tolist(),
        batch.labels.tolist(),
        batch.loss_mask.tolist(),
        batch.position_ids.tolist(),
        batch.cu_seqlens.tolist(),
        batch.cu_seqlens_padded.tolist(),
    )
    return out


def test_eight_threads_on_shared_inputs_match_one_thread() -> None:
    inp = _shared_inputs()
    want = _work(inp)
    assert "bad_mask" in want and "77777" in want["bad_mask"]
    barrier = threading.Barrier(N_THREADS)

    def run(_: int) -> list[dict[str, Any]]:
        barrier.wait()
        return [_work(inp) for _ in range(ROUNDS)]

    with ThreadPoolExecutor(N_THREADS) as pool:
        results = [r for rs in pool.map(run, range(N_THREADS)) for r in rs]
    assert len(results) == N_THREADS * ROUNDS
    for got in results:
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == want[key], key
    # the shared inputs were not modified
    again = _shared_inputs()
    assert np.array_equal(inp["lengths"], again["lengths"])
    assert _digest_value(inp["value"]) == _digest_value(again["value"])


def test_concurrent_materialization_of_one_value() -> None:
    """``as_tensor`` on one shared value from many threads at once (it moves segments in place
    when asked for a device: here the CPU, so the list must stay unchanged)."""
    inp = _shared_inputs()
    value: PackedTensor = inp["value"]
    want = value.as_tensor()
    ids = [id(t) for t in value.tensors]
    barrier = threading.Barrier(N_THREADS)

    def run(_: int) -> bool:
        barrier.wait()
        return all(torch.equal(value.as_tensor(device="cpu"), want) for _ in range(20))

    with ThreadPoolExecutor(N_THREADS) as pool:
        assert all(pool.map(run, range(N_THREADS)))
    assert [id(t) for t in value.tensors] == ids


# --------------------------------------------------------------------------- GIL release


class _Ticker(threading.Thread):
    """A pure-Python thread that counts and timestamps its turns without ever sleeping, so it
    always wants the GIL: turns taken in the middle of a native call prove that call released
    it (a call that held it would leave none there). Scheduling decides how many turns it gets,
    never whether a held GIL lets it in, so a test retries a run that got none, and a call that
    holds the GIL fails every try."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ticks: list[float] = []
        self.running = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.ticks.append(time.perf_counter())
            self.running.set()

    def __enter__(self) -> _Ticker:
        self.start()
        assert self.running.wait(timeout=30), "the ticker never ran"
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(timeout=30)
        assert not self.is_alive()


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    start = time.perf_counter()
    fn()
    return start, time.perf_counter()


def _ticks_in_middle(ticks: list[float], span: tuple[float, float]) -> int:
    a, b = span
    third = (b - a) / 3
    return sum(1 for t in ticks if a + third < t < b - third)


#: runs of a GIL test before it fails: a run whose ticker was never scheduled in the middle of
#: the call says nothing; a call that holds the GIL leaves no tick there in any run
TRIES = 3
LONG_N = 3_000_000


@pytest.fixture(scope="module")
def long_lengths() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 4096, LONG_N).astype(np.int64)


def _long_pack(lengths: np.ndarray) -> None:
    packing.pack(lengths, 8192, algorithm="first_fit_decreasing")


def test_two_long_native_calls_both_release_the_gil(long_lengths: np.ndarray) -> None:
    """Two threads each run one long ``pack`` at once; a third, pure-Python thread keeps
    ticking, and ticks in the middle third of both calls (so both released the GIL while the
    other thread was running too). The workers' results are collected, so an error in either
    fails the test."""
    for _ in range(TRIES):
        barrier = threading.Barrier(2)

        def worker(barrier: threading.Barrier) -> tuple[float, float]:
            barrier.wait(timeout=30)
            return _timed(lambda: _long_pack(long_lengths))

        with _Ticker() as ticker, ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(worker, barrier) for _ in range(2)]
            a, b = (f.result(timeout=120) for f in futures)
        counts = [_ticks_in_middle(ticker.ticks, span) for span in (a, b)]
        if all(counts):
            break
    assert counts[0] > 0, f"the GIL was held during call a {a} in {TRIES} tries"
    assert counts[1] > 0, f"the GIL was held during call b {b} in {TRIES} tries"


@pytest.mark.parametrize(
    "name",
    ["pack", "slice", "repeat_interleave", "concat", "pack_samples"],
)
def test_long_native_calls_let_python_threads_run(name: str, long_lengths: np.ndarray) -> None:
    """Each long native call (one call of 0.3 s or more): a pure-Python thread ticks in its
    middle third. (``masks.validate`` is too fast to measure this way: 12M values take about
    a millisecond.)"""
    n = LONG_N
    seg = [torch.zeros(1, 1)]
    big = PackedTensor(
        seg, 0, _row_offsets=np.arange(n + 1), _segment_indices=np.zeros(n, np.int64)
    )
    rows = np.random.default_rng(1).permutation(n).astype(np.int64)
    shards = big.shard(8) if name == "concat" else []
    mask = np.ones(4 * n, dtype=np.int8)
    tokens = np.ones(4 * n, dtype=np.int64)
    calls: dict[str, Callable[[], Any]] = {
        "pack": lambda: _long_pack(long_lengths),
        "slice": lambda: big.slice(rows),
        "repeat_interleave": lambda: big.repeat_interleave(8),
        "concat": lambda: PackedTensor.concat(shards),
        "pack_samples": lambda: pack_samples(
            [EncodedSample("s", tokens, loss_mask=mask)], loss_mask_mode="precomputed"
        ),
    }
    for _ in range(TRIES):
        with _Ticker() as ticker:
            span = _timed(calls[name])
        if _ticks_in_middle(ticker.ticks, span):
            break
    assert _ticks_in_middle(ticker.ticks, span) > 0, f"{name} held the GIL for {span}"
