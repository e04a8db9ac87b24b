"""PackedTensor benchmark: mmpack vs the plain-Python reference (NeMo-RL's algorithms), one run.

Workload: B prompts with 1-3 small images each (fp32 ``[patches * k, dim]``, k in 1..2; small, so
metadata cost dominates), each prompt one dedup-enabled row; G=16 rollouts per prompt; 8 DP shards.

Rows (median wall time over the repeats; ratio = reference / mmpack):

* (a) the whole pipeline at B=1024: G-expansion (reference: ``deepcopy`` per copy + ``concat``,
  as NeMo-RL; mmpack: ``concat`` + ``repeat_interleave``), ``shard(8)``, protocol-5 pickle round
  trip of each shard, re-``concat``, ``logical_segment_counts_by_row``. Target >= 20x.
* (b) single operations on a value of B=8192 prompts x G=16 = 131,072 logical rows (~16k physical
  segments): ``concat`` of its 8 shards, ``shard(8)``, ``slice`` of a random half of the rows,
  ``logical_segment_counts_by_row``, pickle round trip (dumps + loads, protocol 5). Target >= 10x.
* (c) NeMo-RL's drop-in path: ``deepcopy`` of 16,384 single-row dedup values (B=1024 x G=16),
  then one ``concat``. Target >= 3x.

Usage: ``python benches/bench_packed.py [--quick] [--repeats N] [--json PATH] [--check]``.
Prints a markdown table and machine info, and writes ``bench-results/bench_packed.json``. Build
the extension with ``make build-release`` first (``make bench`` does).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import pickle
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The plain-Python references live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # the development package

import mmpack
import numpy as np
import torch
from mmpack_dev.demos.rl import expand_by_deepcopy, expand_mmpack, make_images, per_prompt_values
from reference.packed_tensor import PackedTensor as Ref

MM: Any = mmpack.PackedTensor
G = 16
DP = 8


@dataclass
class Row:
    section: str
    operation: str
    reference_ms: float
    mmpack_ms: float
    target: float | None

    @property
    def ratio(self) -> float:
        return self.reference_ms / self.mmpack_ms if self.mmpack_ms > 0 else float("inf")

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.ratio >= self.target


def median_ms(fn: Callable[[], Any], repeats: int, warmup: bool) -> float:
    if warmup:
        fn()
    times = []
    for _ in range(max(1, repeats)):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def pipeline(cls: Any, prompts: list[Any], expand: Callable[..., Any]) -> tuple[int, list[int]]:
    expanded = expand(cls, prompts, G)
    shards = expanded.shard(DP)
    loaded = [pickle.loads(pickle.dumps(s, protocol=5)) for s in shards]
    back = cls.concat(loaded)
    counts = back.logical_segment_counts_by_row()
    return len(back.tensors), list(counts)


def drop_in(cls: Any, prompts: list[Any]) -> Any:
    return cls.concat([copy.deepcopy(p) for p in prompts for _ in range(G)])


def same_structure(ref: Any, mm: Any) -> bool:
    return (
        len(ref) == len(mm)
        and len(ref.tensors) == len(mm.tensors)
        and ref.logical_segment_counts_by_row() == list(mm.logical_segment_counts_by_row())
        and ref._segment_indices == list(mm._segment_indices or [])
    )


def run(args: argparse.Namespace) -> list[Row]:
    reps, warm = args.repeats, not args.quick
    rows: list[Row] = []

    # (a) + (c): B prompts
    images = make_images(args.prompts, patches=args.patches, dim=args.dim, seed=1)
    ref_prompts = per_prompt_values(Ref, images)
    mm_prompts = per_prompt_values(MM, images)
    r_out = pipeline(Ref, ref_prompts, expand_by_deepcopy)
    m_out = pipeline(MM, mm_prompts, expand_mmpack)
    assert r_out == m_out, "pipeline outputs differ between reference and mmpack"
    rows.append(
        Row(
            "a",
            f"whole pipeline, B={args.prompts} (expand G={G}, shard {DP}, pickle, concat, counts)",
            median_ms(lambda: pipeline(Ref, ref_prompts, expand_by_deepcopy), reps, warm),
            median_ms(lambda: pipeline(MM, mm_prompts, expand_mmpack), reps, warm),
            20.0,
        )
    )
    rows.append(
        Row(
            "a",
            f"  of which G-expansion (deepcopy+concat vs repeat_interleave), B={args.prompts}",
            median_ms(lambda: expand_by_deepcopy(Ref, ref_prompts, G), reps, warm),
            median_ms(lambda: expand_mmpack(MM, mm_prompts, G), reps, warm),
            None,
        )
    )
    assert same_structure(drop_in(Ref, ref_prompts), drop_in(MM, mm_prompts))
    rows.append(
        Row(
            "c",
            f"drop-in: deepcopy {args.prompts * G:,} one-row dedup values + concat",
            median_ms(lambda: drop_in(Ref, ref_prompts), reps, warm),
            median_ms(lambda: drop_in(MM, mm_prompts), reps, warm),
            3.0,
        )
    )

    # (b): one big value, built identically for both sides from the same CSR lists
    big_images = make_images(args.big_prompts, patches=args.patches, dim=args.dim, seed=2)
    mm_big = expand_mmpack(MM, per_prompt_values(MM, big_images), G)
    ref_big = Ref(
        list(mm_big.tensors),
        0,
        _row_offsets=list(mm_big._row_offsets),
        _segment_indices=list(mm_big._segment_indices),
        _segment_provenance=list(mm_big._segment_provenance),
    )
    n_rows = len(mm_big)
    label = f"{n_rows:,} rows / {len(mm_big.tensors):,} physical"
    ref_shards, mm_shards = ref_big.shard(DP), mm_big.shard(DP)
    half = sorted(random.Random(3).sample(range(n_rows), n_rows // 2))
    half_np = np.asarray(half, dtype=np.int64)
    assert same_structure(Ref.concat(ref_shards), MM.concat(mm_shards))
    assert same_structure(ref_big.slice(half), mm_big.slice(half_np))
    roundtrip_ref = pickle.loads(pickle.dumps(ref_big, protocol=5))
    roundtrip_mm = pickle.loads(pickle.dumps(mm_big, protocol=5))
    assert same_structure(roundtrip_ref, roundtrip_mm)
    assert all(
        torch.equal(a, b) for a, b in zip(roundtrip_ref.tensors, roundtrip_mm.tensors, strict=True)
    )
    ops: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        (f"concat of {DP} shards, {label}", lambda: Ref.concat(ref_shards),
         lambda: MM.concat(mm_shards)),
        (f"shard({DP}), {label}", lambda: ref_big.shard(DP), lambda: mm_big.shard(DP)),
        (f"slice (random half of the rows), {label}", lambda: ref_big.slice(half),
         lambda: mm_big.slice(half_np)),
        (f"logical_segment_counts_by_row, {label}", ref_big.logical_segment_counts_by_row,
         mm_big.logical_segment_counts_by_row),
        (f"pickle round trip (protocol 5), {label}",
         lambda: pickle.loads(pickle.dumps(ref_big, protocol=5)),
         lambda: pickle.loads(pickle.dumps(mm_big, protocol=5))),
    ]  # fmt: skip
    for name, ref_fn, mm_fn in ops:
        rows.append(
            Row("b", name, median_ms(ref_fn, reps, warm), median_ms(mm_fn, reps, warm), 10.0)
        )
    return rows


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "mmpack": mmpack.__version__,
    }


def render(rows: list[Row], info: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"PackedTensor: mmpack vs plain-Python reference, medians of {args.repeats} run(s)"
        f"{' (quick smoke run: sizes too small for the targets)' if args.quick else ''}",
        "",
        "| | operation | reference ms | mmpack ms | ratio | target | met? |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        target = "" if r.target is None else f">= {r.target:g}x"
        met = "" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(
            f"| {r.section} | {r.operation} | {r.reference_ms:,.1f} | {r.mmpack_ms:,.2f} "
            f"| {r.ratio:,.1f}x | {target} | {met} |"
        )
    lines.append("")
    lines.append("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (no warm-up)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per row (5; quick: 1)")
    parser.add_argument("--prompts", type=int, default=None, help="B for (a)/(c) (1024)")
    parser.add_argument("--big-prompts", type=int, default=None, help="B for (b) (8192)")
    parser.add_argument("--patches", type=int, default=2, help="patch rows per image unit (2)")
    parser.add_argument("--dim", type=int, default=64, help="features per patch (64)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/bench_packed.json"))
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.prompts is None:
        args.prompts = 32 if args.quick else 1024
    if args.big_prompts is None:
        args.big_prompts = 64 if args.quick else 8192

    rows = run(args)
    info = machine_info()
    print(render(rows, info, args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "machine": info,
                "rows": [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in rows],
            },
            indent=2,
        )
    )
    if args.check and not args.quick and any(r.met is False for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
