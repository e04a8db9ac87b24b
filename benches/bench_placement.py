"""Where GRPO rows land: NeMo-RL's data-parallel sharding against mmpack's group-aware placement,
side by side on the same batches. Prints markdown tables and writes JSON to
``bench-results/bench_placement.json``.

Batches are shaped as in ``bench_nemo_rl_grpo.py``: ``B`` prompts with 1-3 Qwen2-VL images each
(grid ``1 x 2a x 2b`` patches, ``a, b`` uniform in ``[2, 8]``; ``patches x 1176`` values, bf16
once cast), a prompt of ``8-24 + 20-120 + patches / 4`` tokens and a response of 32-1023
tokens, expanded to ``G`` rows, sharded over 8 ranks in global batches of 512 rows. A second set
has long-tailed lengths and image sizes (lognormal). For both of NeMo-RL's modes:

* sequence packing: NeMo-RL's bins (``modified_first_fit_decreasing``, 8192 tokens, at least one
  bin per rank and a multiple of the ranks) dealt round robin, against
  ``mmpack.compat.nemo_rl.placement.packing_shards`` (``pack_groups`` + ``place``);
* dynamic batching: NeMo-RL's rows sorted by length and dealt strided, against
  ``dynamic_order`` (``place`` over rows, each rank's rows by length).

Figures per global batch, then averaged over the batch's global batches: the worst rank's
compute against NeMo-RL's (its rows' tokens, linear and quadratic, plus its unique images'
patches; under dynamic batching the tokens of the micro-batches every rank runs, padded to
their longest rows), worst / mean rank cost
(the placement objective: tokens, attention, each unique image's patches once per rank), the
same for tokens alone beside a placement that ignores media (``place`` without segments: the
balance goal is within 1.05 of it), unique images per rank (max) over the batch's unique images
per rank, encodes over all ranks over the unique images; then over the whole batch, the unique
media bytes each rank receives (what it pulls from the object store: max over ranks), and the
placement's own time. Last, ``place`` on a million rows through Python.

    python benches/bench_placement.py            # B = 256, 1024, 4096; G = 8, 16
    python benches/bench_placement.py --quick    # B = 64, G = 8
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from mmpack.compat.nemo_rl.micro_batches import dynamic_micro_batches
from mmpack.compat.nemo_rl.placement import RowMedia, dynamic_order, packing_shards
from mmpack.packing import PlacementCost, pack, place, placement_of

RANKS = 8
GLOBAL_BATCH = 512
CAPACITY = 8192
ROUND = 64  # dynamic batching's sequence_length_round in the GRPO bench
PATCH_BYTES = 1176 * 2  # one patch of bf16 pixel values
ALGORITHM = "modified_first_fit_decreasing"


def grpo_batch(prompts: int, group: int, seed: int, long_tail: bool) -> dict[str, Any]:
    """Row lengths, each row's image ids (CSR) and each image's patches."""
    rng = np.random.default_rng(seed)
    images = rng.integers(1, 4, prompts)
    if long_tail:
        patches = np.clip(rng.lognormal(np.log(120), 1.0, images.sum()), 16, 4096)
        response = np.clip(rng.lognormal(np.log(400), 1.0, prompts * group), 16, 6000)
    else:
        patches = 4 * rng.integers(2, 9, images.sum()) * rng.integers(2, 9, images.sum())
        response = rng.integers(32, 1024, prompts * group)
    patches = patches.astype(np.int64)
    first = np.concatenate(([0], np.cumsum(images)))
    image_tokens = np.add.reduceat(patches, first[:-1]) // 4
    prompt = rng.integers(8, 25, prompts) + rng.integers(20, 121, prompts) + image_tokens
    lengths = np.repeat(prompt, group) + response.astype(np.int64)
    lengths = np.minimum(lengths, CAPACITY)
    rows_images = np.repeat(images, group)
    offsets = np.concatenate(([0], np.cumsum(rows_images))).astype(np.int64)
    ids = np.concatenate(
        [np.arange(first[p], first[p + 1]) for p in np.repeat(np.arange(prompts), group)]
    )
    return {"lengths": lengths, "offsets": offsets, "ids": ids.astype(np.int64), "patches": patches}


def nemo_packing(lengths: list[int]) -> list[list[list[int]]]:
    bins = pack(
        lengths, CAPACITY, algorithm=ALGORITHM, min_bins=RANKS, bins_multiple_of=RANKS
    ).bins()
    return [bins[s::RANKS] for s in range(RANKS)]


def nemo_dynamic(lengths: list[int]) -> list[int]:
    ranked = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [i for s in range(RANKS) for i in ranked[s::RANKS]]


def rank_of_rows(shards: list[list[int]], n: int) -> np.ndarray:
    ranks = np.empty(n, dtype=np.int64)
    for r, rows in enumerate(shards):
        ranks[rows] = r
    return ranks


def measure(batch: dict[str, Any], mode: str) -> dict[str, dict[str, float]]:
    media = RowMedia(batch["offsets"], batch["ids"], batch["patches"])
    cost = PlacementCost()
    lengths = batch["lengths"]
    n = len(lengths)
    chunks = n // GLOBAL_BATCH
    stats: dict[str, dict[str, list[float]]] = {"nemo_rl": {}, "mmpack": {}}
    ranks_all = {k: np.empty(n, dtype=np.int64) for k in stats}
    args = {"max_tokens_per_microbatch": CAPACITY, "algorithm": ALGORITHM}
    for c in range(chunks):
        start = c * GLOBAL_BATCH
        chunk = lengths[start : start + GLOBAL_BATCH].tolist()
        offsets, ids = media.chunk(start, start + GLOBAL_BATCH)
        shards: dict[str, list[list[int]]] = {}
        t0 = time.perf_counter()
        if mode == "packing":
            shards["nemo_rl"] = [[r for b in bins for r in b] for bins in nemo_packing(chunk)]
        else:
            order = nemo_dynamic(chunk)
            per = GLOBAL_BATCH // RANKS
            shards["nemo_rl"] = [order[s * per : (s + 1) * per] for s in range(RANKS)]
        t1 = time.perf_counter()
        if mode == "packing":
            placed = packing_shards(media, start, chunk, RANKS, args, nemo_packing(chunk))
            shards["mmpack"] = [[r for b in bins for r in b] for bins in placed]
        else:
            micro = (CAPACITY, ROUND, int(lengths.max()))
            order = dynamic_order(media, start, chunk, RANKS, nemo_dynamic(chunk), micro)
            per = GLOBAL_BATCH // RANKS
            shards["mmpack"] = [order[s * per : (s + 1) * per] for s in range(RANKS)]
        t2 = time.perf_counter()
        times = {"nemo_rl": t1 - t0, "mmpack": t2 - t1}
        blind = place(chunk, RANKS, cost=cost)  # balanced on tokens, media ignored
        blind_tokens = placement_of(blind.item_ranks, chunk, RANKS, cost=cost)
        unique = len(np.unique(ids))
        for name, per_rank in shards.items():
            ranks = rank_of_rows(per_rank, GLOBAL_BATCH)
            ranks_all[name][start : start + GLOBAL_BATCH] = ranks
            full = placement_of(
                ranks,
                chunk,
                RANKS,
                segments=ids,
                segment_offsets=offsets,
                patches=batch["patches"],
                cost=cost,
            )
            tokens = placement_of(ranks, chunk, RANKS, cost=cost)
            compute = full.worst
            if mode == "dynamic":
                # every rank runs the same micro-batches, padded to their longest rows
                spans, padded = dynamic_micro_batches(
                    [[chunk[i] for i in rows] for rows in per_rank],
                    CAPACITY,
                    ROUND,
                    int(lengths.max()),
                )
                padded_tokens = sum(
                    cost.rows(np.array([p]))[0] * (b - a)
                    for (a, b), p in zip(spans, padded, strict=True)
                )
                vision = placement_of(
                    ranks,
                    np.zeros(GLOBAL_BATCH, dtype=np.int64),
                    RANKS,
                    segments=ids,
                    segment_offsets=offsets,
                    patches=batch["patches"],
                    cost=cost,
                )
                compute = padded_tokens + vision.worst
            row = stats[name]
            for key, value in (
                ("imbalance", full.imbalance),
                ("token_imbalance_vs_blind", tokens.imbalance / blind_tokens.imbalance),
                ("unique_per_rank_ratio", full.rank_segments.max() / (unique / RANKS)),
                ("encodes_ratio", full.encodes / unique),
                ("seconds", times[name]),
                ("compute", compute),
            ):
                row.setdefault(key, []).append(float(value))
    out: dict[str, dict[str, float]] = {}
    for name, row in stats.items():
        out[name] = {k: (sum(v) if k == "seconds" else float(np.mean(v))) for k, v in row.items()}
    for name in stats:
        out[name]["compute_vs_nemo_rl"] = float(
            np.mean(np.array(stats[name]["compute"]) / np.array(stats["nemo_rl"]["compute"]))
        )
    for name in stats:
        # what each rank receives over the whole batch: its shard's unique images
        worst = 0
        for r in range(RANKS):
            rows = np.flatnonzero(ranks_all[name][: chunks * GLOBAL_BATCH] == r)
            seg = np.unique(
                np.concatenate([media.ids[media.offsets[i] : media.offsets[i + 1]] for i in rows])
            )
            worst = max(worst, int(batch["patches"][seg].sum()) * PATCH_BYTES)
        out[name]["max_rank_media_mib"] = worst / 2**20
    return out


def table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> str:
    head = (
        "| batch | placement | worst rank compute (x NeMo-RL) | worst/mean cost | tokens vs "
        "media-blind | unique images per rank (x fair share) | encodes (x unique) | max rank "
        "media MiB | placement s |"
    )
    lines = [f"### {title}", "", head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, result in rows:
        for name in ("nemo_rl", "mmpack"):
            r = result[name]
            lines.append(
                f"| {label} | {name} | {r['compute_vs_nemo_rl']:.3f} | {r['imbalance']:.3f} "
                f"| {r['token_imbalance_vs_blind']:.3f} "
                f"| {r['unique_per_rank_ratio']:.2f} | {r['encodes_ratio']:.2f} "
                f"| {r['max_rank_media_mib']:.1f} | {r['seconds']:.3f} |"
            )
    return "\n".join(lines)


def million_rows() -> dict[str, float]:
    rng = np.random.default_rng(7)
    n, group = 1_000_000, 16
    lengths = rng.integers(100, 4000, n)
    offsets = np.arange(n + 1, dtype=np.int64)
    ids = np.arange(n, dtype=np.int64) // group
    patches = rng.integers(64, 2048, n // group)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        p = place(lengths, RANKS, segments=ids, segment_offsets=offsets, patches=patches)
        best = min(best, time.perf_counter() - t)
    return {"seconds": best, "imbalance": p.imbalance, "encodes_ratio": p.encodes / (n // group)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--prompts", type=lambda v: [int(x) for x in v.split(",")], default=[256, 1024, 4096]
    )
    ap.add_argument("--out", default="bench-results/bench_placement.json")
    args = ap.parse_args()
    sizes = [(64, 8)] if args.quick else [(b, g) for b in args.prompts for g in (8, 16)]
    report: dict[str, Any] = {"machine": platform.platform(), "ranks": RANKS}
    for long_tail in (False, True):
        for mode in ("packing", "dynamic"):
            rows = []
            for b, g in sizes:
                result = measure(grpo_batch(b, g, seed=b + g, long_tail=long_tail), mode)
                rows.append((f"B={b} G={g}", result))
                report[f"{'long_tail' if long_tail else 'grpo'}/{mode}/B{b}G{g}"] = result
            title = f"{'long-tailed lengths' if long_tail else 'GRPO bench batches'}, {mode}"
            print(table(title, rows), "\n", flush=True)
    if not args.quick:
        report["million_rows"] = million_rows()
        m = report["million_rows"]
        print(
            f"place(), 1M rows in groups of 16, 8 ranks: {m['seconds']:.3f} s, worst/mean "
            f"{m['imbalance']:.4f}, encodes {m['encodes_ratio']:.4f}x unique"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
