"""The vision tower on unique media vs on every row's copy: Qwen2-VL built from configs, side by
side in one run.

For micro-batches that hold G rows of one prompt (and 2 prompts x G/2 rows), the same model runs
on the same rows twice: the logical path (media from ``PackedTensor.as_tensor()``, what every HF
VLM reads today) and an ``mmpack.vision.encode_once`` deep copy fed
``PackedTensor.unique_segments()``. Each path runs first forward only (under ``no_grad``), then
forward + backward (cross-entropy over the logits). Per case and pass:

* encodes: the images the vision tower encodes per call (a hook on ``model.model.visual``; on
  the unique path also ``encode_stats``, which must agree);
* tower s: the tower's own seconds per call: its forward (forward hooks) plus, in the backward
  pass, its backward (from the gradient of its output to the last gradient accumulated into its
  parameters); on CUDA every clock reading synchronizes;
* call s: the whole call (model forward, loss, backward), median of the repeats after a warm-up;
  media are materialized before the clock starts;
* peak MiB: on CUDA, ``max_memory_allocated`` (reset per pass) minus the memory allocated after
  setup (model and batch built). On the CPU each path of each case runs in its own forked process
  (which starts its own high-water mark) and the figure is its peak resident memory (``VmHWM``)
  minus its resident memory after setup, read after each pass; the forward-only pass runs first,
  so the second figure is the high-water mark of both, which the backward pass sets.

Before any figure is reported the bench asserts that logits and loss agree between the paths in
both passes (relative 1e-4 in float32, 5e-2 in bfloat16), and that every parameter's gradient
norm agrees after the backward.

Towers: ``tiny`` (width 32, depth 1, 8 x 8 patches of 2 pixels), ``small`` (width 256, depth 4,
4 heads, 16 x 16 patches of 14 pixels: a 224 x 224 image), ``realistic`` (Qwen2-VL-2B's tower
width 1280, 16 heads, MLP ratio 4, ``--depth`` blocks (8), 28 x 28 patches of 14: a 392 x 392
image; meant for a GPU). ``--side`` sets the patches per image side of every tower. The LLM is
small (width 128, one layer, 1,024-token vocabulary) so that the tower's share shows.

    python benches/bench_vision.py            # tiny and small towers, G = 8 and 16, CPU
    python benches/bench_vision.py --quick    # tiny tower, G = 4, one repeat (seconds)
    python benches/bench_vision.py --tower realistic --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
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
PASSES = ("forward", "forward + backward")


# ------------------------------------------------------------------------------ model and rows


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
    with torch.device(device):  # initialized where it runs (the same weights for both paths)
        model = Qwen2VLForConditionalGeneration(config)
    return model.to(dtype=dtype).eval()


def make_batch(
    tower: str, side: int | None, prompts: int, group: int, dtype: torch.dtype
) -> dict[str, Any]:
    """``prompts`` prompts of one image each (``side`` x ``side`` patches), ``group`` rows per
    prompt, as NeMo-RL builds them: one dedup-enabled row per prompt, then
    ``repeat_interleave``."""
    from mmpack.packed import PackedTensor

    _, _, _, patch, default_side = TOWERS[tower]
    side = side or default_side
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
    return {
        "input_ids": torch.tensor(ids),
        "pixel_values": PackedTensor([p.to(dtype) for p in pixels], dim_to_pack=0)
        .enable_deduplication()
        .repeat_interleave(group),
        "image_grid_thw": PackedTensor([grid] * prompts, dim_to_pack=0)
        .enable_deduplication()
        .repeat_interleave(group),
    }


# ------------------------------------------------------------------------------ measuring


class TowerMeter:
    """Images and seconds of the model's vision tower per call, by hooks: forward hooks on the
    tower; for its backward, a hook on the gradient of its output (the tower's backward starts)
    and hooks on the gradients accumulated into its parameters (the last one ends it)."""

    def __init__(self, model: Any, device: str) -> None:
        self.device = device
        visual = model.model.visual
        visual.register_forward_pre_hook(self._pre, with_kwargs=True)
        visual.register_forward_hook(self._post)
        for p in visual.parameters():
            p.register_post_accumulate_grad_hook(self._accumulated)
        self.reset()

    def reset(self) -> None:
        self.images, self.forward_s = 0, 0.0
        self._start = self._backward_start = self._backward_end = None

    @property
    def seconds(self) -> float:
        backward = 0.0
        if self._backward_start is not None and self._backward_end is not None:
            backward = self._backward_end - self._backward_start
        return self.forward_s + backward

    def _now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.images += 0 if grid is None else int(grid.shape[0])
        self._start = self._now()

    def _post(self, module: Any, args: Any, output: Any) -> None:
        assert self._start is not None
        self.forward_s += self._now() - self._start
        merged = getattr(output, "pooler_output", output)
        if isinstance(merged, torch.Tensor) and merged.requires_grad:
            merged.register_hook(self._gradient_out)

    def _gradient_out(self, grad: torch.Tensor) -> None:
        self._backward_start = self._now()

    def _accumulated(self, param: torch.Tensor) -> None:
        self._backward_end = self._now()


def _status_mib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process in MiB (Linux), or ``ru_maxrss`` elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_mib(device: str, peak: bool) -> float:
    if device == "cuda":
        return (
            torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
        ) / 2**20
    return _status_mib("VmHWM" if peak else "VmRSS")


def call(model: Any, ids: torch.Tensor, media: dict[str, Any], backward: bool) -> Any:
    """One model call on the rows: forward, cross-entropy over the logits, backward."""
    model.zero_grad(set_to_none=True)
    kwargs = {"attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE).long()}
    with torch.set_grad_enabled(backward):
        logits = model(input_ids=ids, use_cache=False, **kwargs, **media).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
        )
        if backward:
            loss.backward()
    return logits.detach().float(), loss.detach().float()


def run_path(spec: dict[str, Any]) -> dict[str, Any]:
    """One path of one case: both passes; saves logits, loss and gradient norms to
    ``spec["tensors"]`` for the comparison."""
    import copy

    from mmpack.vision import encode_once, encode_stats

    device, dtype, unique = spec["device"], getattr(torch, spec["dtype"]), spec["unique"]
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    built = build_model(spec["tower"], spec["depth"], device, dtype)
    # both paths run a deep copy of the model built from the seed; the unique path adapts its own
    model = copy.deepcopy(built)
    del built
    if unique:
        encode_once(model)
    meter = TowerMeter(model, device)
    batch = make_batch(spec["tower"], spec["side"], spec["prompts"], spec["group"], dtype)
    ids = batch["input_ids"].to(device)
    keys = ("pixel_values", "image_grid_thw")
    if device == "cuda":
        torch.cuda.synchronize()
    base = _memory_mib(device, peak=False)
    result: dict[str, Any] = {"setup_mib": base}
    saved: dict[str, Any] = {}
    for backward, name in zip((False, True), PASSES, strict=True):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        encoded = encode_stats(model).encoded if unique else 0
        totals, towers, images = [], [], set()
        for i in range(1 + spec["repeats"]):  # the first is a warm-up
            if unique:
                media = {k: batch[k].unique_segments(device) for k in keys}
            else:
                media = {k: batch[k].as_tensor(device) for k in keys}
            meter.reset()
            start = meter._now()
            logits, loss = call(model, ids, media, backward)
            seconds = meter._now() - start
            if i:
                totals.append(seconds)
                towers.append(meter.seconds)
            images.add(meter.images)
            del media
        assert len(images) == 1, images
        result[name] = {
            "call_s": statistics.median(totals),
            "tower_s": statistics.median(towers),
            "encodes": images.pop(),
            "encode_stats": (encode_stats(model).encoded - encoded) / (1 + spec["repeats"])
            if unique
            else None,
            "peak_mib": _memory_mib(device, peak=True) - base,
        }
        saved[name] = {"logits": logits.cpu(), "loss": loss.cpu()}
        if backward:
            saved[name]["grads"] = {
                n: p.grad.double().norm().item()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
    torch.save(saved, spec["tensors"])
    del model, meter
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _forked(spec: dict[str, Any], queue: Any) -> None:
    try:
        queue.put(("ok", run_path(spec)))
    except BaseException as error:  # reported by the parent
        import traceback

        queue.put(("error", f"{error!r}\n{traceback.format_exc()}"))


def run_forked(spec: dict[str, Any]) -> dict[str, Any]:
    """``run_path(spec)`` in a forked process: its own peak resident memory, and no import cost
    (the parent imported transformers and ran no torch op before)."""
    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()
    proc = context.Process(target=_forked, args=(spec, queue))
    proc.start()
    proc.join()
    if queue.empty():
        raise RuntimeError(f"{spec} died with exit code {proc.exitcode}")
    status, value = queue.get()
    if status != "ok":
        raise RuntimeError(f"{spec} failed:\n{value}")
    return value


def check_agree(a: dict[str, Any], b: dict[str, Any], tol: float, label: str) -> float:
    """Assert that the two paths' logits, loss and gradient norms agree; the logits' largest
    difference relative to their largest magnitude."""
    scale = a["logits"].abs().max().item() + 1e-12
    diff = (a["logits"] - b["logits"]).abs().max().item() / scale
    assert diff <= tol, f"{label}: logits differ by {diff:.2e} (relative)"
    la, lb = a["loss"].item(), b["loss"].item()
    assert abs(la - lb) <= tol * max(1.0, abs(la)), f"{label}: loss {la} vs {lb}"
    if "grads" in a:
        assert a["grads"].keys() == b["grads"].keys(), f"{label}: different parameters got grads"
        for n, ga in a["grads"].items():
            gb = b["grads"][n]
            assert abs(ga - gb) <= 10 * tol * max(ga, 1e-6), f"{label}: grad of {n}: {ga} vs {gb}"
    return diff


def case_specs(tower: str, prompts: int, group: int, args: Any, tmp: str) -> list[dict[str, Any]]:
    """The two paths of a case, logical then unique, as child specs."""
    return [
        {
            "tower": tower,
            "depth": args.depth,
            "side": args.side,
            "prompts": prompts,
            "group": group,
            "unique": unique,
            "repeats": args.repeats,
            "device": args.device,
            "dtype": args.dtype,
            "threads": args.threads,
            "tensors": f"{tmp}/{tower}-{prompts}x{group}-{'unique' if unique else 'logical'}.pt",
        }
        for unique in (False, True)
    ]


def rows_of(specs: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check the two paths of a case against each other; one table row per pass."""
    spec = specs[0]
    label = f"{spec['tower']} {spec['prompts']} x {spec['group']}"
    tol = 1e-4 if spec["dtype"] == "float32" else 5e-2
    tensors = [torch.load(s["tensors"]) for s in specs]
    logical, unique = results
    rows = []
    for name in PASSES:
        diff = check_agree(tensors[0][name], tensors[1][name], tol, f"{label}, {name}")
        a, b = logical[name], unique[name]
        images, unique_images = spec["prompts"] * spec["group"], spec["prompts"]
        assert a["encodes"] == images, f"{label}: logical path encoded {a['encodes']}"
        assert b["encodes"] == unique_images, f"{label}: unique path encoded {b['encodes']}"
        assert b["encode_stats"] == unique_images, f"{label}: encode_stats {b['encode_stats']}"
        rows.append(
            {
                "tower": spec["tower"],
                "rows": f"{spec['prompts']} x {spec['group']}",
                "pass": name,
                "encodes": (a["encodes"], b["encodes"]),
                "tower_s": (a["tower_s"], b["tower_s"]),
                "call_s": (a["call_s"], b["call_s"]),
                "peak_mib": (a["peak_mib"], b["peak_mib"]),
                "setup_mib": (logical["setup_mib"], unique["setup_mib"]),
                "logit_diff": diff,
            }
        )
    return rows


# ------------------------------------------------------------------------------ report


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "n/a"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| tower | rows | pass | encodes logical / unique | tower s logical / unique | x | "
        "call s logical / unique | x | peak MiB logical / unique | x |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        (el, eu), (tl, tu), (cl, cu), (pl, pu) = (
            r["encodes"],
            r["tower_s"],
            r["call_s"],
            r["peak_mib"],
        )
        out.append(
            f"| {r['tower']} | {r['rows']} | {r['pass']} | {el} / {eu} | {tl:.4f} / {tu:.4f} "
            f"| **{_ratio(tl, tu)}** | {cl:.4f} / {cu:.4f} | {_ratio(cl, cu)} "
            f"| {pl:,.1f} / {pu:,.1f} | {_ratio(pl, pu)} |"
        )
    return "\n".join(out)


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The goal, per tower and G: the tower's forward + backward at least 0.8 x G faster on
    unique media when a micro-batch holds G rows of one prompt."""
    lines = []
    for r in rows:
        if r["pass"] != PASSES[1] or not r["rows"].startswith("1 x "):
            continue
        group = int(r["rows"].split(" x ")[1])
        speedup = r["tower_s"][0] / r["tower_s"][1]
        r["goal"] = {"target": 0.8 * group, "speedup": speedup, "met": speedup >= 0.8 * group}
        verdict = "met" if r["goal"]["met"] else "NOT met"
        lines.append(
            f"goal, {r['tower']} tower, G = {group}: tower forward + backward {speedup:.1f}x "
            f"faster, target 0.8 x G = {0.8 * group:.1f}x: {verdict}"
        )
    return lines


def machine_line(args: Any, memory: str) -> str:
    name = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    threads = args.threads or torch.get_num_threads()
    return (
        f"# bench_vision: {name}, {args.device}, {threads} CPU threads, {args.dtype}, "
        f"torch {torch.__version__}, {platform.platform()}; memory: {memory}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tower", action="append", choices=sorted(TOWERS), help="repeatable")
    ap.add_argument("--depth", type=int, default=None, help="vision blocks (default per tower)")
    ap.add_argument("--side", type=int, default=None, help="patches per image side (even)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--groups", default="8,16", help="G values, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per pass (median)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="tiny tower, G = 4, one repeat")
    ap.add_argument("--out", default="bench-results/bench_vision.json")
    args = ap.parse_args(argv)
    towers = args.tower or ["tiny", "small"]
    groups = [int(g) for g in args.groups.split(",")]
    if args.quick:
        towers, groups, args.repeats = ["tiny"], [4], 1
        args.threads = args.threads or 1
    if args.side is not None and (args.side < 2 or args.side % 2):
        ap.error("--side must be even (Qwen2-VL merges 2 x 2 patches)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device")
    if args.device == "cuda":
        memory = "CUDA max_memory_allocated above setup, reset per pass; one process"
    else:
        memory = "peak RSS (VmHWM) above RSS after setup, each path of each case in its own fork"
    # import what the paths need before any fork (and before any torch op)
    import mmpack.vision  # noqa: F401
    import transformers  # noqa: F401
    from transformers import Qwen2VLForConditionalGeneration  # noqa: F401

    print(machine_line(args, memory) + "\n", flush=True)
    cases = [
        (tower, prompts, group // prompts)
        for tower in dict.fromkeys(towers)
        for group in groups
        for prompts in (1, 2)
        if group % prompts == 0
    ]
    # CUDA runs in this process (a fork would inherit its CUDA context); CPU paths in forks. The
    # comparisons come after the last fork: the parent runs no torch op before forking.
    runner = run_path if args.device == "cuda" else run_forked
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        specs = [case_specs(*case, args, tmp) for case in cases]
        results = [[runner(spec) for spec in pair] for pair in specs]
        rows = [row for pair, res in zip(specs, results, strict=True) for row in rows_of(pair, res)]
    seconds = time.perf_counter() - start
    print(table(rows))
    print(
        "\ntower s: the tower's forward, plus its backward in the backward pass; call s: the "
        f"whole call; x: logical / unique. {len(cases)} cases in {seconds:.0f} s."
    )
    for line in goal_lines(rows):
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {
        "quick": args.quick,
        "machine": machine_line(args, memory),
        "device": args.device,
        "dtype": args.dtype,
        "towers": towers,
        "depth": args.depth,
        "side": args.side,
        "repeats": args.repeats,
        "memory": memory,
        "seconds": seconds,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
