"""Materialization and payload measurement: mmpack vs the plain torch / pickle paths, one run.

Workload: a GRPO batch of prompts with dynamic-resolution images (fp32 ``pixel_values`` of
``[patches, 1176]``), expanded G=16 times with ``repeat_interleave`` so every physical segment
appears 16 times in the materialized output (>= 64 MiB of it).

Rows (median wall time over the repeats):

* ``as_tensor`` on the CPU: the plain-Python reference (NeMo-RL's algorithm: logical list +
  ``torch.cat``) vs mmpack's native gather into a new buffer, and into a reused ``out=`` buffer.
* ``payload.measure``: from shapes (mmpack) vs measuring by protocol-5 pickling of the same
  payload (what NeMo-RL's ``protocol5_serialized_nbytes`` does).

Usage: ``python benches/bench_materialize.py [--quick] [--repeats N]``. Prints a markdown table
and writes ``bench-results/bench_materialize.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# The plain-Python references live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mmpack.packed import PackedTensor, payload
from reference.packed_tensor import PackedTensor as RefPT

G = 16


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (allocator, page cache, rayon pool)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _workload(prompts: int, patches: int) -> tuple[Any, RefPT]:
    gen = torch.Generator().manual_seed(0)
    images: list[torch.Tensor] = []
    counts: list[int] = []
    for p in range(prompts):
        n = 1 + p % 2
        counts.append(n)
        images.extend(
            torch.randn(patches * (1 + (p + i) % 3), 1176, generator=gen) for i in range(n)
        )
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    indices = list(range(len(images)))
    # G-expanded layout: each prompt row repeated G times, sharing the physical segments
    exp_offsets = [0]
    exp_indices: list[int] = []
    for r in range(prompts):
        row = indices[offsets[r] : offsets[r + 1]]
        for _ in range(G):
            exp_indices.extend(row)
            exp_offsets.append(len(exp_indices))
    ref = RefPT(
        list(images),
        0,
        _row_offsets=exp_offsets,
        _segment_indices=exp_indices,
        _segment_provenance=[bytes(16) for _ in images],
    )
    base = PackedTensor(
        list(images),
        0,
        _row_offsets=offsets,
        _segment_indices=indices,
    ).enable_deduplication()
    return base.repeat_interleave(G), ref


def _workload_small(prompts: int) -> tuple[Any, RefPT]:
    """``image_grid_thw``-like metadata: one tiny int64 segment per prompt, G-expanded."""
    grids = [torch.tensor([[1, 2 * (1 + p % 7), 2 * (1 + p % 5)]]) for p in range(prompts)]
    indices = [p for p in range(prompts) for _ in range(G)]
    offsets = list(range(len(indices) + 1))
    ref = RefPT(list(grids), 0, _row_offsets=offsets, _segment_indices=indices)
    base = PackedTensor(list(grids), 0).enable_deduplication()
    return base.repeat_interleave(G), ref


def _mm_as_tensor(value: PackedTensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    return value.as_tensor(out=out)


def _payloads(prompts: int, patches: int) -> list[tuple[str, Any]]:
    """A rollout-to-policy payload (media, token ids, per-sample message logs of small token
    tensors, as NeMo-RL hands to Ray), deduplicated and as its expanded legacy twin."""
    pixels, _ = _workload(prompts, patches)
    n = len(pixels)
    grid = PackedTensor(
        [torch.tensor([[1, 4, 4]]) for _ in pixels.tensors],
        0,
        _row_offsets=pixels.csr()[0].tolist(),
        _segment_indices=pixels.csr()[1].tolist(),
    ).enable_deduplication()
    common = {
        "input_ids": torch.zeros(n, 512, dtype=torch.int64),
        "message_log": [
            [
                {"role": "user", "token_ids": torch.arange(100)},
                {"role": "assistant", "token_ids": torch.arange(50)},
            ]
            for _ in range(n)
        ],
    }
    dedup = {"pixel_values": pixels, "image_grid_thw": grid, **common}
    legacy = {
        key: PackedTensor([v.slice([r]).as_tensor().clone() for r in range(n)], 0)
        for key, v in (("pixel_values", pixels), ("image_grid_thw", grid))
    }
    media = {"pixel_values": pixels, "image_grid_thw": grid, "input_ids": common["input_ids"]}

    def as_reference(value: PackedTensor) -> RefPT:
        offsets, indices = value.csr()
        return RefPT(
            list(value.tensors),
            value.dim_to_pack,
            _row_offsets=offsets.tolist(),
            _segment_indices=indices.tolist(),
            _segment_provenance=value._segment_provenance,
        )

    media_ref = {
        "pixel_values": as_reference(pixels),
        "image_grid_thw": as_reference(grid),
        "input_ids": common["input_ids"],
    }
    return [
        (f"media batch, {n} rows, dedup, NeMo-RL-style class", media_ref),
        (f"media batch, {n} rows, dedup", media),
        (f"media batch, {n} rows, legacy twin", {**legacy, "input_ids": common["input_ids"]}),
        (f"rollout batch + message logs, {n} rows, dedup", dedup),
        (f"rollout batch + message logs, {n} rows, legacy twin", {**legacy, **common}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    prompts, patches = (4, 8) if args.quick else (8, 48)
    repeats = args.repeats or (1 if args.quick else 7)

    mm, ref = _workload(prompts, patches)
    expected = ref.as_tensor()
    got = _mm_as_tensor(mm)
    assert expected is not None and got is not None and torch.equal(got, expected)
    out = torch.empty_like(expected)
    out_mb = expected.numel() * expected.element_size() / 2**20
    physical_mb = sum(t.numel() * t.element_size() for t in ref.tensors) / 2**20

    t_ref = _median(lambda: ref.as_tensor(), repeats)
    t_new = _median(lambda: _mm_as_tensor(mm), repeats)
    t_out = _median(lambda: _mm_as_tensor(mm, out), repeats)
    assert torch.equal(out, expected)
    logical = list(ref.iter_logical_segments())
    t_cat_out = _median(lambda: torch.cat(logical, out=out), repeats)

    rows = []

    def row(name: str, baseline: float, ours: float, note: str) -> None:
        rows.append(
            {
                "case": name,
                "reference_ms": baseline * 1e3,
                "mmpack_ms": ours * 1e3,
                "speedup": baseline / ours if ours > 0 else float("inf"),
                "note": note,
            }
        )

    row("as_tensor, new buffer", t_ref, t_new, f"{out_mb:.1f} MiB out of {physical_mb:.1f} MiB")
    row("as_tensor, reused out=", t_ref, t_out, f"{out_mb / t_out / 1024:.1f} GiB/s")
    row(
        "(info) torch.cat(out=) of a prebuilt list vs mmpack out=",
        t_cat_out,
        t_out,
        "not NeMo-RL's path: no list building, reused buffer",
    )
    many, many_ref = _workload_small(64 if args.quick else 4096)
    t_ref_s = _median(lambda: many_ref.as_tensor(), repeats)
    t_new_s = _median(lambda: _mm_as_tensor(many), repeats)
    row(
        "as_tensor, many small segments",
        t_ref_s,
        t_new_s,
        f"{len(many_ref.tensors)} physical int64 [1, 3] grids x {G}",
    )
    for label, obj in _payloads(8 if args.quick else 64, 4 if args.quick else 16):
        t_pickle = _median(lambda obj=obj: payload.serialized_nbytes(obj), repeats)
        t_measure = _median(lambda obj=obj: payload.measure(obj), max(repeats, 5))
        stats = payload.measure(obj, serialized=True)
        row(
            f"payload.measure ({label})",
            t_pickle,
            t_measure,
            f"physical {stats.physical_bytes / 2**20:.1f} MiB, "
            f"serialized {(stats.serialized_bytes or 0) / 2**20:.1f} MiB",
        )

    print(
        f"## bench_materialize (G={G}, {len(ref.tensors)} physical segments, "
        f"{len(ref._segment_indices or [])} logical, torch threads {torch.get_num_threads()})\n"
    )
    print("| case | reference (torch.cat / pickle) ms | mmpack ms | speedup | note |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['reference_ms']:.2f} | {r['mmpack_ms']:.3f} | "
            f"{r['speedup']:.1f}x | {r['note']} |"
        )
    results = Path("bench-results")
    results.mkdir(exist_ok=True)
    (results / "bench_materialize.json").write_text(
        json.dumps({"quick": args.quick, "repeats": repeats, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
