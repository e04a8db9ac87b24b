"""GPU check for the device feed: correctness against the CPU path, host-to-device bytes and time.

One short script (well under 5 minutes on one GPU). Without a CUDA device it prints a message
and exits 0.

Checks, for a deduplicated G=16 GRPO batch and its expanded legacy twin:

* ``PackedTensor.as_tensor("cuda")`` equals the CPU materialization byte for byte (fp32, bf16,
  int64 media; ``pad_to_max_shape``; a negative ``dim_to_pack``; ``out=`` on the device);
* the deduplicated batch moves exactly ``physical_nbytes()`` host-to-device (each unique segment
  once, through pinned staging), the legacy twin its logical bytes;
* the asynchronous copy survives reuse of pinned memory and writes to the sources right after
  ``as_tensor`` returns;
* ``PackedBatch``-style media moves (``move_segments``) keep sharing on the device;
* a THD micro-batch (``mmpack.batch.micro_batch``, every field: ``labels``, ``loss_mask``,
  ``token_mask``, positions, offsets) and padded rows (``mmpack.batch.padded.pad_samples``)
  arrive on the device equal to the host ones, and their fields still pass the checks there.

Prints a markdown table (H2D bytes, median ms) and exits non-zero on any mismatch.
Usage: ``python benches/gpu_check.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

G = 16


def _batch(prompts: int, dtype: torch.dtype, seed: int = 0) -> Any:
    from mmpack.packed import PackedTensor

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in range(prompts):
        images = [
            torch.randn(64 * (1 + (p + i) % 3), 1176, generator=gen).to(dtype)
            for i in range(1 + p % 2)
        ]
        rows.append(
            PackedTensor.merge_segments([PackedTensor(t, 0).enable_deduplication() for t in images])
        )
    return PackedTensor.flattened_concat(rows).repeat_interleave(G)


def _legacy(value: Any) -> Any:
    from mmpack.packed import PackedTensor

    return PackedTensor(
        [value.slice([r]).as_tensor().clone() for r in range(len(value))], value.dim_to_pack
    )


def _fresh(value: Any) -> Any:
    """A copy whose ``tensors`` list can be moved in place without touching ``value``."""
    from mmpack.packed import PackedTensor

    offsets, indices = value.csr()
    return PackedTensor(
        list(value.tensors),
        value.dim_to_pack,
        pad_to_max_shape=value.pad_to_max_shape,
        _row_offsets=offsets.tolist(),
        _segment_indices=indices.tolist(),
    )


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    result = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a = a.detach().cpu().contiguous()
    b = b.detach().cpu().contiguous()
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


def _referenced_nbytes(value: Any) -> int:
    """Bytes of the distinct physical segments that ``value``'s rows reference."""
    _, indices = value.csr()
    tensors = value.tensors
    return sum(tensors[i].nbytes for i in sorted(set(indices.tolist())) if tensors[i] is not None)


def _store_shards(
    device: torch.device, prompts: int, counters: Any
) -> tuple[list[tuple[str, int, int, float, bool]], list[str]]:
    """The worker side end to end: the 8 DP shards of a G-expanded batch through Ray's object
    store with put-once media, each read in place on receipt and materialized on the device.
    Each shard's unique segments cross host-to-device once; the result equals the driver's CPU
    materialization of the shard it sent."""
    import ray
    from mmpack.packed import ray_store

    rows: list[tuple[str, int, int, float, bool]] = []
    failures: list[str] = []
    was_on = ray_store.enabled()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20)  # fmt: skip
    try:
        ray_store.enable(True)
        batch = _batch(prompts, torch.bfloat16, seed=5)
        shards = batch.shard(8)
        expected = [s.as_tensor() for s in shards]
        needed = [_referenced_nbytes(s) for s in shards]
        received = ray.get([ray.put(s) for s in shards])
        h2d = 0
        ok = True
        t0 = time.perf_counter()
        for shard, want, need in zip(received, expected, needed, strict=True):
            counters.reset()
            got = shard.as_tensor(device)
            torch.cuda.synchronize()
            moved = counters.total_bytes
            h2d += moved
            if not _same(got, want) or moved != need:
                ok = False
                failures.append(
                    f"store shard: equal={_same(got, want)} h2d={moved} expected={need}"
                )
        seconds = time.perf_counter() - t0
        logical = sum(s.logical_nbytes() for s in shards)
        rows.append(("as_tensor(cuda) of 8 shards read from the store", h2d, logical,
                     seconds * 1e3, ok))  # fmt: skip
        print(
            f"store shards: {h2d:,} B host-to-device for {logical:,} logical bytes "
            f"({logical / max(h2d, 1):.1f}x fewer)"
        )
    finally:
        ray_store.enable(was_on)
        ray.shutdown()
    return rows, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
            "nothing to check."
        )
        return 0

    from mmpack.packed import PackedTensor
    from mmpack.packed import transfer as _transfer

    device = torch.device("cuda", torch.cuda.current_device())
    print(f"gpu_check on {torch.cuda.get_device_name(device)}, torch {torch.__version__}\n")
    counters = _transfer.transfer_counters()
    failures: list[str] = []
    rows: list[tuple[str, int, int, float, bool]] = []

    for dtype in (torch.float32, torch.bfloat16):
        dedup = _batch(args.prompts, dtype)
        legacy = _legacy(dedup)
        cpu = dedup.as_tensor()
        for label, value in (("dedup", dedup), ("legacy", legacy)):
            expected_h2d = value.physical_nbytes()

            def run(value: Any = value) -> Any:
                counters.reset()
                return _fresh(value).as_tensor(device)

            ms, got = _timed(run, args.repeats)
            h2d = counters.total_bytes
            ok = _same(got, cpu) and h2d == expected_h2d
            if not ok:
                failures.append(
                    f"{label} {dtype}: equal={_same(got, cpu)} h2d={h2d} expected={expected_h2d}"
                )
            rows.append(
                (f"as_tensor(cuda) {label} {dtype}", h2d, value.logical_nbytes(), ms * 1e3, ok)
            )
        # the legacy path moves the logical bytes, the dedup one the physical bytes
        ratio = legacy.physical_nbytes() / max(dedup.physical_nbytes(), 1)
        print(f"{dtype}: legacy/dedup host-to-device bytes = {ratio:.1f}x")

    rows_store, failed_store = _store_shards(device, args.prompts, counters)
    rows += rows_store
    failures += failed_store

    # shapes: padding, negative dim, out= on the device, int64 metadata
    gen = torch.Generator().manual_seed(1)
    segs = [torch.randn(2, 3, 5, generator=gen), torch.randn(4, 1, 2, generator=gen), None]
    for dim, pad in ((0, True), (-1, True), (-2, False), (1, False)):
        base_segs = (
            segs if pad else [torch.randn(2, 3, 5, generator=gen) for _ in range(2)] + [None]
        )
        value = PackedTensor(
            list(base_segs), dim, pad_to_max_shape=pad,
            _row_offsets=[0, 2, 3, 5], _segment_indices=[0, 1, 2, 1, 0],
        ).enable_deduplication()  # fmt: skip
        cpu = _fresh(value).as_tensor()
        got = _fresh(value).as_tensor(device)
        ok = _same(got, cpu)
        if ok and cpu is not None:
            out = torch.empty_like(cpu, device=device)
            again = _fresh(value).as_tensor(device, out=out)
            ok = again is out and _same(out, cpu)
        if not ok:
            failures.append(f"shape case dim={dim} pad={pad}")
        rows.append((f"as_tensor(cuda) dim={dim} pad={pad}", 0, 0, 0.0, ok))

    ints = PackedTensor(
        [torch.tensor([[1, 4, 6]]), torch.tensor([[1, 2, 2]])], 0
    ).enable_deduplication()
    ints = ints.repeat_interleave(G)
    ok = _same(_fresh(ints).as_tensor(device), ints.as_tensor())
    rows.append(("as_tensor(cuda) int64 grid", 0, 0, 0.0, ok))
    if not ok:
        failures.append("int64 grid")

    # The copy from the pinned staging buffer is asynchronous: hold the stream with a sleep
    # kernel so it is still queued when as_tensor returns, then reuse pinned memory and
    # overwrite the sources. The result must not change (the staging block stays reserved
    # until the copy ran; the sources were copied into it before the call returned).
    value = _batch(args.prompts, torch.float32, seed=3)
    expected = value.as_tensor()
    sources = list(value.tensors)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the copy
    got = _fresh(value).as_tensor(device)
    for _ in range(4):
        torch.empty(expected.numel(), pin_memory=True).fill_(float("nan"))
    for seg in sources:
        seg.fill_(float("nan"))
    torch.cuda.synchronize()
    ok = _same(got, expected)
    rows.append(("as_tensor(cuda) survives staging reuse", 0, 0, 0.0, ok))
    if not ok:
        failures.append("staging buffer reused or sources read after as_tensor returned")

    # a device move keeps sharing: one unique segment, many slots
    a = torch.randn(128, 1176)
    counters.reset()
    moved = _transfer.move_segments([a, None, a, a], device)
    ok = moved[0] is moved[2] is moved[3] and moved[1] is None and counters.total_bytes == a.nbytes
    ok = ok and _same(moved[0], a)
    rows.append(("move_segments shares", counters.total_bytes, 3 * a.nbytes, 0.0, ok))
    if not ok:
        failures.append("move_segments sharing")

    # trainer batches: every field crosses unchanged and still agrees with the others
    import dataclasses

    from mmpack.batch import EncodedSample, PackedBatch, micro_batch, pack_samples
    from mmpack.batch.padded import PaddedBatch, pad_samples

    samples = [
        EncodedSample(f"s{i}", torch.arange(3, 3 + n), message_lengths=[2, n - 2],
                      message_roles=["user", "assistant"])
        for i, n in enumerate((5, 9, 4, 12))
    ]  # fmt: skip
    packs = [pack_samples(samples[:2], cp_size=2), pack_samples(samples[2:], cp_size=2)]
    for name, host, cls in (
        ("micro_batch(...).to(cuda)", micro_batch(packs, cp_size=2, pad_to_length=64), PackedBatch),
        ("pad_samples(...).to(cuda)", pad_samples(samples, pad_to_multiple_of=8), PaddedBatch),
    ):
        fields = cls._TENSOR_FIELDS
        before = {f: getattr(host, f).clone() for f in fields}
        moved = host.to(device)
        ok = all(
            getattr(moved, f).device.type == "cuda" and _same(getattr(moved, f).cpu(), before[f])
            for f in fields
        )
        try:
            dataclasses.replace(moved)  # the checks read a host copy of device tensors
        except Exception as exc:  # reported as a failure below
            ok = False
            print(f"{name}: {exc}")
        rows.append((name, 0, 0, 0.0, ok))
        if not ok:
            failures.append(name)

    print("| case | H2D bytes | logical bytes | median ms | ok |")
    print("|---|---:|---:|---:|---|")
    for name, h2d, logical, ms, ok in rows:
        print(f"| {name} | {h2d:,} | {logical:,} | {ms:.2f} | {'yes' if ok else 'NO'} |")
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        return 1
    print("\nall GPU checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
