"""The vision tower on unique media vs on every row's copy: Qwen2-VL built from configs, side by
side in one run.

For micro-batches that hold G rows of one prompt (and 2 prompts x G/2), the same model runs
twice on the same rows: the logical path (media from ``PackedTensor.as_tensor()``, what every
HF VLM reads today) and an ``mmpack.vision.encode_once`` copy fed
``PackedTensor.unique_segments()``. Per case and pass (forward under ``no_grad``; forward +
backward): the images the tower encodes (counted by a hook on the tower, and by
``encode_stats``), the tower's forward seconds (hooks; synchronized on CUDA), the whole call's
seconds (median of the repeats after a warm-up) and, on CUDA, the peak memory allocated. The
bench asserts that logits and loss agree between the paths before it reports any time.

Towers: ``tiny`` (width 32, depth 1, 8 x 8 patches of 2 pixels), ``small`` (width 256, depth
4, 16 x 16 patches of 14), ``realistic`` (Qwen2-VL-2B's width: 1280, 16 heads, MLP ratio 4,
``--depth`` blocks, 28 x 28 patches of 14; meant for a GPU). The LLM is small (width 128, one
layer) so that the tower's share shows.

Usage: ``python benches/bench_vision.py [--tower tiny --tower small] [--device cuda]
[--dtype bfloat16] [--quick] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

VOCAB, IMAGE, VIDEO, VISION_START, VISION_END = 1024, 1000, 1001, 1002, 1003
#: (width, depth, heads, patch size, patches per side of an image)
TOWERS = {
    "tiny": (32, 1, 2, 2, 8),
    "small": (256, 4, 4, 14, 16),
    "realistic": (1280, 8, 16, 14, 28),
}
TEXT_TOKENS = 48  # each row's completion


def build_model(tower: str, depth: int | None, device: str, dtype: torch.dtype) -> Any:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    width, default_depth, heads, patch, _ = TOWERS[tower]
    text = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]},
    }
    vision = {
        "depth": depth or default_depth,
        "embed_dim": width,
        "hidden_size": 128,
        "num_heads": heads,
        "mlp_ratio": 4,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).to(device=device, dtype=dtype).eval()


def make_batch(tower: str, prompts: int, group: int, dtype: torch.dtype) -> dict[str, Any]:
    """``prompts`` prompts of one image each, ``group`` rows per prompt, as NeMo-RL builds them:
    one dedup-enabled row per prompt, then ``repeat_interleave``."""
    from mmpack.packed import PackedTensor

    _, _, _, patch, side = TOWERS[tower]
    gen = torch.Generator().manual_seed(1)
    grid = torch.tensor([[1, side, side]])
    pixels = [
        torch.randn(side * side, 3 * 2 * patch * patch, generator=gen) for _ in range(prompts)
    ]
    tokens = side * side // 4
    ids = []
    for p in range(prompts):
        for g in range(group):
            completion = torch.randint(3, IMAGE, (TEXT_TOKENS,), generator=gen).tolist()
            ids.append([3 + p, VISION_START, *[IMAGE] * tokens, VISION_END, *completion, 4 + g])
    input_ids = torch.tensor(ids)
    return {
        "input_ids": input_ids,
        "pixel_values": PackedTensor([p.to(dtype) for p in pixels], dim_to_pack=0)
        .enable_deduplication()
        .repeat_interleave(group),
        "image_grid_thw": PackedTensor([grid] * prompts, dim_to_pack=0)
        .enable_deduplication()
        .repeat_interleave(group),
        "images": prompts * group,
        "unique_images": prompts,
    }


class TowerMeter:
    """Images and forward seconds of the model's vision tower, by hooks."""

    def __init__(self, model: Any, device: str) -> None:
        self.device = device
        self.images = 0
        self.seconds = 0.0
        self._start = 0.0
        visual = model.model.visual
        visual.register_forward_pre_hook(self._pre, with_kwargs=True)
        visual.register_forward_hook(self._post)

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.images += 0 if grid is None else int(grid.shape[0])
        self._sync()
        self._start = time.perf_counter()

    def _post(self, module: Any, args: Any, output: Any) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.images, self.seconds = 0, 0.0


def run_once(model: Any, batch: dict[str, Any], unique: bool, backward: bool, device: str) -> Any:
    ids = batch["input_ids"].to(device)
    if unique:
        media = {k: batch[k].unique_segments(device) for k in ("pixel_values", "image_grid_thw")}
    else:
        media = {k: batch[k].as_tensor(device) for k in ("pixel_values", "image_grid_thw")}
    kwargs = {"attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE).long()}
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        logits = model(input_ids=ids, use_cache=False, **kwargs, **media).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
        )
        if backward:
            loss.backward()
    return logits.detach().float(), loss.detach().float()


def tower_step(model: Any, batch: dict[str, Any], unique: bool, device: str) -> None:
    """The tower alone, forward + backward, as each path runs it: the logical path encodes every
    row's copy; the unique path encodes each image once and repeats the features by index (what
    ``encode_once`` does), so backward sums every occurrence's gradient into the one encode."""
    visual = model.model.visual
    if unique:
        pixels = batch["pixel_values"].unique_segments(device)
        grids = batch["image_grid_thw"].unique_segments(device)
        out = visual(pixels.values, grid_thw=grids.values).pooler_output
        per_image = out.reshape(grids.num_unique, -1, out.shape[-1])
        features = per_image.index_select(0, pixels.index)
    else:
        pixels_t = batch["pixel_values"].as_tensor(device)
        grids_t = batch["image_grid_thw"].as_tensor(device)
        features = visual(pixels_t, grid_thw=grids_t).pooler_output
    model.zero_grad(set_to_none=True)
    features.float().square().mean().backward()


def timed(fn: Any, repeats: int, device: str) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    model: Any, meter: TowerMeter, batch: dict[str, Any], unique: bool, backward: bool, args: Any
) -> dict[str, Any]:
    run_once(model, batch, unique, backward, args.device)  # warm-up
    totals, towers, images = [], [], 0
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        meter.reset()
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits, loss = run_once(model, batch, unique, backward, args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        totals.append(time.perf_counter() - start)
        towers.append(meter.seconds)
        images = meter.images
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None
    return {
        "seconds": statistics.median(totals),
        "tower_seconds": statistics.median(towers),
        "images": images,
        "peak_mib": peak,
        "logits": logits,
        "loss": loss,
    }


def bench_case(tower: str, prompts: int, group: int, args: Any) -> list[dict[str, Any]]:
    from mmpack.vision import encode_once, encode_stats

    dtype = getattr(torch, args.dtype)
    logical = build_model(tower, args.depth, args.device, dtype)
    adapted = encode_once(copy.deepcopy(logical))
    meters = (TowerMeter(logical, args.device), TowerMeter(adapted, args.device))
    batch = make_batch(tower, prompts, group, dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    rows = []
    tower_step_s = tuple(
        timed(lambda u=u: tower_step(logical, batch, u, args.device), args.repeats, args.device)
        for u in (False, True)
    )
    for backward in (False, True):
        before = encode_stats(adapted).encoded
        a = measure(logical, meters[0], batch, False, backward, args)
        b = measure(adapted, meters[1], batch, True, backward, args)
        scale = a["logits"].abs().max().item() + 1e-12
        diff = (a["logits"] - b["logits"]).abs().max().item() / scale
        assert diff <= tol, f"{tower} {prompts}x{group}: logits differ by {diff:.2e} (relative)"
        assert abs(a["loss"].item() - b["loss"].item()) <= tol * max(1.0, abs(a["loss"].item()))
        assert a["images"] == batch["images"] and b["images"] == batch["unique_images"]
        calls = (1 + args.repeats) * batch["unique_images"]
        assert encode_stats(adapted).encoded - before == calls
        rows.append(
            {
                "tower": tower,
                "rows": f"{prompts} x {group}",
                "pass": "forward + backward" if backward else "forward",
                "encodes": (a["images"], b["images"]),
                "tower_s": (a["tower_seconds"], b["tower_seconds"]),
                "tower_step_s": tower_step_s,
                "total_s": (a["seconds"], b["seconds"]),
                "peak_mib": (a["peak_mib"], b["peak_mib"]),
                "logit_diff": diff,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| tower | rows | pass | encodes logical / unique | tower s logical / unique | x | "
        "call s logical / unique | x | peak MiB logical / unique |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        # forward: the tower's forward in the model call; forward + backward: the tower alone
        tower = r["tower_step_s"] if r["pass"] == "forward + backward" else r["tower_s"]
        (el, eu), (tl, tu), (cl, cu), (pl, pu) = (
            r["encodes"],
            tower,
            r["total_s"],
            r["peak_mib"],
        )
        peak = "n/a (CPU)" if pl is None else f"{pl:,.0f} / {pu:,.0f}"
        out.append(
            f"| {r['tower']} | {r['rows']} | {r['pass']} | {el} / {eu} | {tl:.4f} / {tu:.4f} "
            f"| {tl / max(tu, 1e-9):.1f}x | {cl:.4f} / {cu:.4f} | {cl / max(cu, 1e-9):.1f}x "
            f"| {peak} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tower", action="append", choices=sorted(TOWERS))
    ap.add_argument("--depth", type=int, default=None, help="vision blocks (default per tower)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--groups", default="8,16", help="G values, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny tower, G = 4, one repeat")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    towers = args.tower or ["tiny", "small"]
    groups = [int(g) for g in args.groups.split(",")]
    if args.quick:
        towers, groups, args.repeats = ["tiny"], [4], 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    print(
        f"# vision bench: {device or platform.machine()}, {args.dtype}, torch {torch.__version__}"
    )
    rows = []
    for tower in towers:
        for group in groups:
            rows += bench_case(tower, 1, group, args)
            rows += bench_case(tower, 2, group // 2, args)
    print(table(rows))
    print(
        "tower s: forward rows time the tower inside the model call; forward + backward rows "
        "time the tower alone (its features' backward included), both paths the same way"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: v for k, v in r.items()} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
