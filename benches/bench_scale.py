"""Scale and memory benchmark: mmpack at 10M rows / 10M lengths, and 1M repeated
small operations with resident memory sampled to show it stays flat.

Cases, each in a fresh subprocess so its peak resident memory (``VmHWM``) is its own:

* ``packed``: a ``PackedTensor`` with N logical rows over few physical segments (N/16 prompt rows
  over 4,096 image segments, then ``repeat_interleave(16)``), then ``slice`` of a random half of
  the rows, ``shard(8)``, ``concat`` of the shards, ``logical_segment_counts_by_row`` and a
  protocol-5 pickle round trip.
* ``packing``: ``mmpack.packing.pack`` of N random lengths (best-fit and first-fit decreasing)
  and ``assign_to_ranks`` over 64 ranks.
* ``repeat``: M small operations, cycling through: construct a 4-row ``PackedTensor``,
  ``slice``, ``concat``, ``pack`` of 16 lengths, ``masks.validate``; RSS is sampled every M/10.
* ``reference``: the plain-Python reference (NeMo-RL's algorithms, ``tests/reference``) on the
  ``packed`` and ``packing`` workloads at a size it finishes in (``--reference-n``, default N/100):
  the baseline for memory per row.

Prints a markdown table (wall time, baseline RSS after imports, peak RSS, peak minus baseline,
and bytes per row / length) and writes ``bench-results/bench_scale.json``. ``--quick`` runs a
tiny size for the smoke test. Usage: ``python benches/bench_scale.py [--quick] [--n N]
[--ops M] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The plain-Python references live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

FULL_N = 10_000_000
FULL_OPS = 1_000_000
G = 16
N_SEGMENTS = 4096


def _status_kib(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in KiB (Linux), or ``ru_maxrss`` elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def peak_mib() -> float:
    return _status_kib("VmHWM") / 1024


# ------------------------------------------------------------------------------------ cases


def case_packed(n: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from mmpack import PackedTensor

    base_rss = rss_mib()
    rng = np.random.default_rng(0)
    prompts = max(1, n // G)
    segments = [torch.randn(int(rng.integers(1, 3)) * 4, 8) for _ in range(N_SEGMENTS)]
    counts = rng.integers(1, 4, prompts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    indices = rng.integers(0, N_SEGMENTS, int(offsets[-1])).astype(np.int64)
    provenance = [i.to_bytes(16, "little") for i in range(N_SEGMENTS)]
    times: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        start = time.perf_counter()
        out = fn()
        times[name] = time.perf_counter() - start
        return out

    base = timed(
        "construct",
        lambda: PackedTensor(
            segments,
            0,
            _row_offsets=offsets,
            _segment_indices=indices,
            _segment_provenance=provenance,
        ),
    )
    value = timed("repeat_interleave", lambda: base.repeat_interleave(G))
    rows = len(value)
    half = rng.permutation(rows)[: rows // 2].astype(np.int64)
    sliced = timed("slice half", lambda: value.slice(half))
    shards = timed("shard 8", lambda: value.shard(8))
    joined = timed("concat 8 shards", lambda: PackedTensor.concat(shards))
    counts_out = timed("counts", joined.logical_segment_counts_by_row)
    blob = timed("pickle dumps", lambda: pickle.dumps(joined, protocol=5))
    back = timed("pickle loads", lambda: pickle.loads(blob))
    assert len(back) == rows == len(joined) and len(counts_out) == rows
    assert len(sliced) == rows // 2
    return {
        "rows": rows,
        "physical_segments": len(value.tensors),
        "pickle_bytes": len(blob),
        "times_s": times,
        "baseline_rss_mib": base_rss,
        "peak_rss_mib": peak_mib(),
        "items": rows,
    }


def case_packing(n: int) -> dict[str, Any]:
    import numpy as np
    from mmpack import packing

    base_rss = rss_mib()
    lengths = np.random.default_rng(0).integers(1, 4096, n).astype(np.int64)
    times: dict[str, float] = {}
    bins = {}
    for alg in ("best_fit_decreasing", "first_fit_decreasing"):
        start = time.perf_counter()
        p = packing.pack(lengths, 8192, algorithm=alg)
        times[alg] = time.perf_counter() - start
        bins[alg] = p.num_bins
        assert len(p.item_indices) == n
    start = time.perf_counter()
    ranks = packing.assign_to_ranks(p, 64)
    times["assign_to_ranks 64"] = time.perf_counter() - start
    assert ranks.num_ranks == 64
    return {
        "lengths": n,
        "bins": bins,
        "times_s": times,
        "baseline_rss_mib": base_rss,
        "peak_rss_mib": peak_mib(),
        "items": n,
    }


def case_repeat(ops: int) -> dict[str, Any]:
    import gc

    import numpy as np
    import torch
    from mmpack import PackedTensor, packing
    from mmpack.batch import masks

    segs = [torch.ones(2, 4), torch.zeros(1, 4)]
    prov = [b"a" * 16, b"b" * 16]
    lengths = np.arange(1, 17, dtype=np.int64)
    mask = np.ones(64, dtype=np.int8)
    rows = [1, 0, 3]
    samples: list[tuple[int, float]] = []
    step = max(5, ops // 10)
    v = s = None
    start = time.perf_counter()
    for i in range(ops):
        kind = i % 5
        if kind == 0:
            v = PackedTensor(
                segs, 0, _row_offsets=[0, 1, 2, 3, 3], _segment_indices=[0, 1, 0],
                _segment_provenance=prov,
            )  # fmt: skip
        elif kind == 1:
            s = v.slice(rows)  # type: ignore[union-attr]
        elif kind == 2:
            PackedTensor.concat([v, s])
        elif kind == 3:
            packing.pack(lengths, 32)
        else:
            masks.validate(mask, 64)
        if i % step == 0 or i == ops - 1:
            gc.collect()
            samples.append((i + 1, rss_mib()))
    elapsed = time.perf_counter() - start
    # the first sample is taken after one operation: allocator pools and caches warm up
    # during the first tenth, so growth is measured from the second sample on
    warm = samples[min(1, len(samples) - 1)][1]
    return {
        "ops": ops,
        "seconds": elapsed,
        "rss_samples_mib": samples,
        "rss_after_warmup_mib": warm,
        "rss_end_mib": samples[-1][1],
        "growth_after_warmup_mib": samples[-1][1] - warm,
        "peak_rss_mib": peak_mib(),
    }


def case_reference(n: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from reference import packing as ref_packing
    from reference.packed_tensor import PackedTensor as Ref

    base_rss = rss_mib()
    rng = np.random.default_rng(0)
    prompts = max(1, n // G)
    segments = [torch.randn(int(rng.integers(1, 3)) * 4, 8) for _ in range(N_SEGMENTS)]
    times: dict[str, float] = {}
    start = time.perf_counter()
    counts = rng.integers(1, 4, prompts)
    offsets = [0, *np.cumsum(counts).tolist()]
    indices = rng.integers(0, N_SEGMENTS, offsets[-1]).tolist()
    value = Ref(
        segments,
        0,
        _row_offsets=offsets,
        _segment_indices=indices,
        _segment_provenance=[i.to_bytes(16, "little") for i in range(N_SEGMENTS)],
    )
    # NeMo-RL expands rollouts by slicing each prompt row G times and concatenating
    expanded = Ref.concat([value.slice([r]) for r in range(prompts) for _ in range(G)])
    times["expand x16"] = time.perf_counter() - start
    start = time.perf_counter()
    shards = [expanded.slice(list(range(k, len(expanded), 8))) for k in range(8)]
    Ref.concat(shards).logical_segment_counts_by_row()
    times["shard + concat + counts"] = time.perf_counter() - start
    packed_peak = peak_mib()
    # NeMo-RL's first-fit is O(items x bins) in Python: a smaller input keeps it finite
    n_pack = min(n, 20_000)
    lengths = rng.integers(1, 4096, n_pack).tolist()
    start = time.perf_counter()
    ref_packing.get_packer(ref_packing.PackingAlgorithm.FIRST_FIT_DECREASING, 8192).pack(lengths)
    times[f"first_fit_decreasing ({n_pack:,} lengths)"] = time.perf_counter() - start
    return {
        "rows": len(expanded),
        "lengths": n,
        "times_s": times,
        "baseline_rss_mib": base_rss,
        "packed_peak_rss_mib": packed_peak,
        "peak_rss_mib": peak_mib(),
        "items": len(expanded),
    }


CASES = {
    "packed": case_packed,
    "packing": case_packing,
    "repeat": case_repeat,
    "reference": case_reference,
}


def run_case(name: str, size: int, timeout: float = 1800) -> dict[str, Any]:
    """Run one case in a fresh interpreter; its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--case", name, "--size", str(size)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| case | size | operation | seconds |",
        "|---|---:|---|---:|",
    ]
    for name in ("packed", "packing", "reference"):
        r = results.get(name)
        if not r:
            continue
        size = r.get("rows", r.get("lengths"))
        for op, secs in r["times_s"].items():
            lines.append(f"| {name} | {size:,} | {op} | {secs:.3f} |")
    lines += [
        "",
        "| case | size | baseline RSS MiB | peak RSS MiB | peak - baseline MiB | bytes per item |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("packed", "packing", "reference"):
        r = results.get(name)
        if not r:
            continue
        delta = r["peak_rss_mib"] - r["baseline_rss_mib"]
        per = delta * 2**20 / max(1, r["items"])
        lines.append(
            f"| {name} | {r['items']:,} | {r['baseline_rss_mib']:.0f} | {r['peak_rss_mib']:.0f} "
            f"| {delta:.0f} | {per:.1f} |"
        )
    rep = results.get("repeat")
    if rep:
        lines += [
            "",
            f"Repeated small operations: {rep['ops']:,} operations (construct, slice, concat, "
            f"pack, validate in turn) in {rep['seconds']:.1f} s.",
            "",
            "| after operation | RSS MiB |",
            "|---:|---:|",
        ]
        lines += [f"| {i:,} | {m:.1f} |" for i, m in rep["rss_samples_mib"]]
        lines.append(
            f"\nRSS growth after warm-up: {rep['growth_after_warmup_mib']:+.1f} MiB "
            f"({rep['rss_after_warmup_mib']:.1f} -> {rep['rss_end_mib']:.1f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--n", type=int, default=None, help=f"rows / lengths (default {FULL_N:,})")
    parser.add_argument("--ops", type=int, default=None, help=f"operations (default {FULL_OPS:,})")
    parser.add_argument("--reference-n", type=int, default=None, help="reference size (N/100)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/bench_scale.json"))
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # child process: one case, JSON on stdout
        print(json.dumps(CASES[args.case](args.size)))
        return 0
    n = args.n or (20_000 if args.quick else FULL_N)
    ops = args.ops or (2_000 if args.quick else FULL_OPS)
    ref_n = args.reference_n or max(G, n // 100)
    results = {
        "packed": run_case("packed", n),
        "packing": run_case("packing", n),
        "reference": run_case("reference", ref_n),
        "repeat": run_case("repeat", ops),
    }
    import mmpack

    report = {
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mmpack": mmpack.__version__,
        },
        "n": n,
        "ops": ops,
        "reference_n": ref_n,
        "results": results,
    }
    print(_table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
