"""``mmpack_dev demo rl``: the GRPO media path, mmpack next to another PackedTensor implementation.

1. builds synthetic prompts with 1-3 small images each, each prompt's media one dedup-enabled
   PackedTensor row (what NeMo-RL's processor + ``merge_segments`` give);
2. expands every prompt G times (the compared side: NeMo-RL's ``deepcopy`` per copy, then
   ``concat``; mmpack: ``concat`` then ``repeat_interleave``);
3. shards the batch to the DP ranks, pickles each shard (protocol 5, as a Ray hop would),
   unpickles and re-concatenates them, counts segments per row, and materializes rank 0's shard
   (what that rank feeds its model);
4. prints time and bytes, and with ``--compare-with MODULE:ATTR`` (a PackedTensor class, for
   example the plain-Python reference of the test suite, ``reference.packed_tensor:PackedTensor``
   with ``PYTHONPATH=tests``) runs that class too, side by side, and checks that both give the
   same rows, segment counts, physical segment count and materialized tensor.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import pickle
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmpack_dev.demos.comparison import OPTION, import_comparison

__all__ = [
    "StepTimes",
    "expand_by_deepcopy",
    "expand_mmpack",
    "main",
    "make_images",
    "per_prompt_values",
    "run_pipeline",
]


def make_images(
    num_prompts: int, *, max_images: int = 3, patches: int = 4, dim: int = 1176, seed: int = 0
) -> list[list[Any]]:
    """``num_prompts`` lists of 1..``max_images`` float32 tensors of ``[patches * k, dim]``
    (k in 1..2: dynamic resolution), seeded."""
    import torch

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts: list[list[Any]] = []
    for _ in range(num_prompts):
        n = rng.randint(1, max_images)
        prompts.append(
            [torch.randn(patches * rng.randint(1, 2), dim, generator=gen) for _ in range(n)]
        )
    return prompts


def per_prompt_values(cls: Any, images: Sequence[Sequence[Any]]) -> list[Any]:
    """One dedup-enabled single-row value per prompt, built as NeMo-RL does: a PackedTensor per
    image, ``enable_deduplication`` (``_prepare_multimodal_sharing``), ``merge_segments``."""
    return [
        cls.merge_segments([cls([img], 0).enable_deduplication() for img in imgs])
        for imgs in images
    ]


def expand_by_deepcopy(cls: Any, prompts: Sequence[Any], group: int) -> Any:
    """NeMo-RL's G-expansion: every prompt deep-copied ``group`` times, then one ``concat``
    (which re-interns the copies by provenance)."""
    return cls.concat([copy.deepcopy(p) for p in prompts for _ in range(group)])


def expand_mmpack(cls: Any, prompts: Sequence[Any], group: int) -> Any:
    """mmpack's G-expansion: one ``concat`` of the prompts, then ``repeat_interleave``."""
    return cls.concat(list(prompts)).repeat_interleave(group)


@dataclass
class StepTimes:
    """Median seconds per pipeline step, plus what the run produced."""

    seconds: dict[str, float] = field(default_factory=dict)
    pickled_bytes: int = 0
    physical_bytes: int = 0
    logical_bytes: int = 0
    rows: int = 0
    physical_segments: int = 0
    counts: list[int] = field(default_factory=list)
    materialized: Any = None


STEPS = (
    "expand",
    "shard",
    "pickle",
    "unpickle",
    "re-concat",
    "segment counts",
    "materialize rank 0",
)


def run_pipeline(
    cls: Any,
    prompts: Sequence[Any],
    expand: Callable[[Any, Sequence[Any], int], Any],
    *,
    group: int,
    dp: int,
    repeats: int,
) -> StepTimes:
    """Run the pipeline once to warm up, then ``repeats`` times; record the median time of
    every step."""
    samples: dict[str, list[float]] = {step: [] for step in STEPS}
    out = StepTimes()
    for attempt in range(max(1, repeats) + 1):  # attempt 0 warms up and is not counted
        gc.collect()
        clock = time.perf_counter
        t0 = clock()
        expanded = expand(cls, prompts, group)
        t1 = clock()
        shards = expanded.shard(dp)
        t2 = clock()
        blobs = [pickle.dumps(s, protocol=5) for s in shards]
        t3 = clock()
        loaded = [pickle.loads(b) for b in blobs]
        t4 = clock()
        back = cls.concat(loaded)
        t5 = clock()
        counts = back.logical_segment_counts_by_row()
        t6 = clock()
        materialized = loaded[0].as_tensor()  # what DP rank 0 feeds its model
        t7 = clock()
        if attempt == 0:
            continue
        for step, dt in zip(
            STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6), strict=True
        ):
            samples[step].append(dt)
        out.pickled_bytes = sum(len(b) for b in blobs)
        out.physical_bytes = back.physical_nbytes()
        out.logical_bytes = back.logical_nbytes()
        out.rows = len(back)
        out.physical_segments = len(back.tensors)
        out.counts = list(counts)
        out.materialized = materialized
    out.seconds = {step: statistics.median(v) for step, v in samples.items()}
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _ratio(ref: float, fast: float) -> str:
    return f"{ref / fast:,.1f}x" if fast > 0 else "-"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmpack_dev demo rl", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--prompts", type=int, default=1024, help="prompts in the batch (1024)")
    p.add_argument("--group", type=int, default=16, help="G: rollouts per prompt (16)")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks to shard to (8)")
    p.add_argument("--max-images", type=int, default=3, help="images per prompt: 1..N (3)")
    p.add_argument("--patches", type=int, default=4, help="patch rows per image unit (4)")
    p.add_argument("--dim", type=int, default=1176, help="pixel features per patch (1176)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side; medians shown (3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        OPTION,
        dest="compare_with",
        metavar="MODULE:ATTR",
        default=None,
        help="a PackedTensor class (importable path) to run as the 'reference' side, with "
        "NeMo-RL's deepcopy G-expansion, e.g. reference.packed_tensor:PackedTensor with "
        "PYTHONPATH=tests; without it only mmpack's side runs",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--plot", type=Path, default=None, help="also write a PNG bar chart here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("prompts", "group", "dp", "max_images", "patches", "dim", "repeats"):
        if getattr(args, name) < 1:
            print(f"mmpack_dev demo rl: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    rows = args.prompts * args.group
    if rows % args.dp:
        print(
            f"mmpack_dev demo rl: prompts x group = {rows} rows do not split over --dp {args.dp}",
            file=sys.stderr,
        )
        return 2
    compared = None
    if args.compare_with is not None:
        try:
            compared = import_comparison(args.compare_with)
        except (ImportError, ValueError) as err:
            print(f"mmpack_dev demo rl: {err}", file=sys.stderr)
            return 2
        if not (isinstance(compared, type) and hasattr(compared, "concat")):
            print(
                f"mmpack_dev demo rl: {OPTION} {args.compare_with}: expected a PackedTensor class, "
                f"got {compared!r}",
                file=sys.stderr,
            )
            return 2

    import mmpack
    import torch

    images = make_images(
        args.prompts, max_images=args.max_images, patches=args.patches, dim=args.dim,
        seed=args.seed,
    )  # fmt: skip
    sides: dict[str, tuple[Any, Callable[[Any, Sequence[Any], int], Any]]] = {}
    if compared is not None:
        sides["reference"] = (compared, expand_by_deepcopy)
    sides["mmpack"] = (mmpack.PackedTensor, expand_mmpack)
    results: dict[str, StepTimes] = {}
    for name, (cls, expand) in sides.items():
        prompts = per_prompt_values(cls, images)
        results[name] = run_pipeline(
            cls, prompts, expand, group=args.group, dp=args.dp, repeats=args.repeats
        )
    ref, mm = results.get("reference"), results["mmpack"]
    agree: bool | None = None  # no comparison ran
    if ref is not None:
        agree = (
            ref.rows == mm.rows
            and ref.counts == mm.counts
            and ref.physical_segments == mm.physical_segments
            and ref.materialized is not None
            and mm.materialized is not None
            and torch.equal(ref.materialized, mm.materialized)
        )

    n_images = sum(len(x) for x in images)
    print(
        f"GRPO media pipeline: {args.prompts} prompts, {n_images} images "
        f"(1-{args.max_images} per prompt), G={args.group} -> {rows} rows, "
        f"{args.dp} DP shards; medians of {args.repeats} runs\n"
    )
    _print_tables(ref, mm, args.dp)
    compared_line = "" if ref is None else f" (reference {ref.physical_segments})"
    agree_line = "" if agree is None else f"; outputs agree: {'yes' if agree else 'NO'}"
    print(f"\nrows {mm.rows}, physical segments {mm.physical_segments}{compared_line}{agree_line}")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} python "
        f"{platform.python_version()} torch {torch.__version__} mmpack {mmpack.__version__}"
    )

    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "agree": agree,
        **{
            name: {
                "seconds": r.seconds,
                "pickled_bytes": r.pickled_bytes,
                "physical_bytes": r.physical_bytes,
                "logical_bytes": r.logical_bytes,
                "rows": r.rows,
                "physical_segments": r.physical_segments,
            }
            for name, r in results.items()
        },
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot is not None:
        _plot(args.plot, ref, mm)
    return 0 if agree is not False else 1


def _print_tables(ref: StepTimes | None, mm: StepTimes, dp: int) -> None:
    """Time per step and bytes, the compared side (when there is one) next to mmpack's."""
    if ref is None:
        print("| step | mmpack ms |")
        print("|---|---:|")
        for step in (*STEPS, "total"):
            m = sum(mm.seconds.values()) if step == "total" else mm.seconds[step]
            print(f"| {'**total**' if step == 'total' else step} | {m * 1e3:,.1f} |")
        print()
        print("| bytes | mmpack |")
        print("|---|---:|")
        print(f"| physical (unique media) | {_mib(mm.physical_bytes)} |")
        print(
            f"| logical (materialized; a no-dedup pipeline ships this) | {_mib(mm.logical_bytes)} |"
        )
        print(f"| pickled, all {dp} shards | {_mib(mm.pickled_bytes)} |")
        return
    print("| step | reference ms | mmpack ms | speedup |")
    print("|---|---:|---:|---:|")
    for step in (*STEPS, "total"):
        if step == "total":
            r, m = sum(ref.seconds.values()), sum(mm.seconds.values())
            label = "**total**"
        else:
            r, m = ref.seconds[step], mm.seconds[step]
            label = step
        print(f"| {label} | {r * 1e3:,.1f} | {m * 1e3:,.1f} | {_ratio(r, m)} |")
    print()
    print("| bytes | reference | mmpack |")
    print("|---|---:|---:|")
    print(f"| physical (unique media) | {_mib(ref.physical_bytes)} | {_mib(mm.physical_bytes)} |")
    print(
        f"| logical (materialized; a no-dedup pipeline ships this) | {_mib(ref.logical_bytes)} "
        f"| {_mib(mm.logical_bytes)} |"
    )
    print(f"| pickled, all {dp} shards | {_mib(ref.pickled_bytes)} | {_mib(mm.pickled_bytes)} |")


def _plot(path: Path, ref: StepTimes | None, mm: StepTimes) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install 'mmpack[cli]' for matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(STEPS))
    if ref is not None:
        ax.bar([x - 0.2 for x in xs], [ref.seconds[s] * 1e3 for s in STEPS], 0.4, label="reference")
    offset = 0.2 if ref is not None else 0.0
    ax.bar([x + offset for x in xs], [mm.seconds[s] * 1e3 for s in STEPS], 0.4, label="mmpack")
    ax.set_xticks(list(xs), STEPS, rotation=20)
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("GRPO media pipeline")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
