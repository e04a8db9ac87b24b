"""The GRPO step of ``mmpack_dev demo`` (``train``): one policy-gradient loss and backward on the
demo's tiny Qwen2-VL, once on logical media and once with the vision tower run once per unique
image (`mmpack.vision.encode_once`), from identical weights.

* the batch: ``--grpo-prompts`` prompts, each a user turn with its own image (of its own size,
  processed once by Qwen2-VL's real processor; the real Qwen2 tokenizer), and ``--grpo-group``
  (G) rows per prompt: the prompt followed by a different completion per row (seeded words, the
  stand-ins for G sampled rollouts, ending with ``<|im_end|>``), right-padded; one rank, and the
  whole batch is one micro-batch;
* the media, as NeMo-RL builds it: one dedup-enabled `PackedTensor` row per prompt (pixels
  and grids), ``concat``, then ``repeat_interleave(G)``;
* the loss: GRPO's clipped surrogate on policy (the ratio is 1, so its gradient is
  ``-A * grad log p``), written as ``-sum(A_row * log p(token)) / completion tokens``, with each
  row's advantage its seeded reward normalized within its group;
* logical: the model as built, fed ``as_tensor()`` (every row's own copy of its image: the
  vision tower encodes it G times); unique: an `encode_once` copy fed ``unique_segments()``
  (each image encoded once, its features repeated to the placeholders of the G rows).

The step reports both losses, the largest gradient difference over every parameter (vision
tower included), the images and patches the vision tower ran on, and the seconds each path took
(media materialization, forward, loss and backward); the demo fails when the losses differ by
more than `LOSS_TOLERANCE` or a parameter's gradients by more than `GRAD_TOLERANCE` of its scale.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import time
from typing import Any

#: the largest |logical - unique| loss the step accepts: the forward is the same float64
#: arithmetic both ways (each image's features are computed alike, then copied), so the losses
#: agree to float64 rounding (bit for bit on this model)
LOSS_TOLERANCE = 1e-10
#: the largest |logical - unique| gradient entry the step accepts, relative to the scale of its
#: parameter's gradient (its largest |entry|). Looser than float64 rounding: Qwen2-VL's vision
#: attention applies its rotary embedding in float32 even in a float64 model (q and k are cast
#: down and back). Logical media backpropagate each row's copy through that float32 island on its
#: own and sum the results in float64; unique media sum the G rows' feature gradients first and
#: cast the sum. The two round differently at float32 precision, diluted by the float64 sums
#: around them: a few 1e-11 of the scale on the vision tower's attention and first norm (float64
#: rounding elsewhere), so 1e-8 leaves a wide margin and still catches a wrong gradient (a missed
#: or doubled row is off by a whole row's share, orders of magnitude more). Relative, because the
#: absolute differences scale with the gradients (about 1e-5 on the tiny vision tower here)
GRAD_TOLERANCE = 1e-8
#: (width, height) of the prompts' images, in turn: each prompt's image has its own grid
IMAGE_SIZES = ((84, 56), (112, 84), (56, 112), (112, 112), (84, 84), (56, 84))
#: words per completion (inclusive range)
COMPLETION_WORDS = (2, 8)
#: runs of each path, alternating; the seconds are the best run's (the first pays warm-ups)
RUNS = 2


@dataclasses.dataclass
class GrpoPath:
    """One way of running the step."""

    name: str
    media: str  # what the model was fed
    loss: float
    encodes: int  # images the vision tower encoded, as the path reports them
    tower_images: int  # images the vision tower's forward ran on (counted by a hook)
    tower_patches: int  # patches it ran on
    seconds: float  # the best of `RUNS`


@dataclasses.dataclass
class GrpoResult:
    """The step, both ways, and their comparison."""

    prompts: int
    group: int
    rows: int
    completion_tokens: int
    grids: list[list[int]]
    logical: GrpoPath
    unique: GrpoPath
    max_grad_diff: float  # the largest |logical - unique| gradient entry
    #: the largest such difference relative to its parameter's gradient scale (largest |entry|)
    max_grad_rel_diff: float
    worst_parameter: str  # the parameter with that relative difference
    parameters: int  # parameter tensors compared (each got a gradient both ways)
    vision_parameters: int
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def loss_diff(self) -> float:
        return abs(self.logical.loss - self.unique.loss)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def paths(self) -> tuple[GrpoPath, GrpoPath]:
        return self.logical, self.unique


@dataclasses.dataclass
class GrpoBatch:
    """The micro-batch: rows, the completion tokens each predicts, and the media."""

    input_ids: Any  # [rows, length]
    attention_mask: Any
    targets: Any  # bool [rows, length]: the positions that predict a completion token
    advantages: Any  # [rows]
    pixel_values: Any  # PackedTensor, one row per batch row
    image_grid_thw: Any  # PackedTensor
    grids: list[list[int]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grpo-prompts", type=int, default=4, help="GRPO step: prompts, one image each (4)"
    )
    parser.add_argument(
        "--grpo-group", type=int, default=8, help="GRPO step: rows (completions) per prompt (8)"
    )


def build_batch(processor: Any, prompts: int, group: int, seed: int, dtype: Any) -> GrpoBatch:
    """`prompts` prompts with an image each and `group` completions per prompt (seeded), the
    media in NeMo-RL's layout, pixels in `dtype`."""
    import numpy as np
    import torch
    from mmpack import PackedTensor
    from PIL import Image

    from mmpack_dev.demos.rl import expand_mmpack, per_prompt_values
    from mmpack_dev.synthetic import WORDS, png_bytes

    tokenizer = processor.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = np.random.default_rng(seed)
    pixels, grids, rows, spans = [], [], [], []
    for p in range(prompts):
        width, height = IMAGE_SIZES[p % len(IMAGE_SIZES)]
        image = Image.open(io.BytesIO(png_bytes(width, height, seed=seed + p))).convert("RGB")
        turn = [{"type": "image"}, {"type": "text", "text": f"Name picture {p + 1} in words."}]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
        )
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        prompt = inputs["input_ids"][0].tolist()
        pixels.append([inputs["pixel_values"].to(dtype)])
        grids.append([inputs["image_grid_thw"]])
        for _ in range(group):
            words = rng.integers(0, len(WORDS), rng.integers(*COMPLETION_WORDS, endpoint=True))
            reply = " ".join(WORDS[int(i)] for i in words)
            completion = [*tokenizer(reply, add_special_tokens=False)["input_ids"], end]
            spans.append((len(prompt), len(completion)))
            rows.append(prompt + completion)
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    targets = torch.zeros(ids.shape, dtype=torch.bool)
    for r, (row, (start, count)) in enumerate(zip(rows, spans, strict=True)):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
        targets[r, start - 1 : start + count - 1] = True  # predicting each completion token
    rewards = torch.from_numpy(rng.random((prompts, group)))  # a verifier's stand-in
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    advantages = ((rewards - mean) / (std + 1e-6)).reshape(-1)
    return GrpoBatch(
        input_ids=ids,
        attention_mask=mask,
        targets=targets,
        advantages=advantages,
        pixel_values=expand_mmpack(PackedTensor, per_prompt_values(PackedTensor, pixels), group),
        image_grid_thw=expand_mmpack(PackedTensor, per_prompt_values(PackedTensor, grids), group),
        grids=[g[0][0].tolist() for g in grids],
    )


def grpo_loss(model: Any, batch: GrpoBatch, media: dict[str, Any]) -> Any:
    """``-sum(A_row * log p(completion token)) / completion tokens`` of `batch` fed `media`
    (the fused loss head over the completion positions alone)."""
    import torch

    from mmpack_dev.tiny_qwen2_vl import LinearCrossEntropy

    captured: dict[str, Any] = {}

    def keep(module: Any, args: Any, output: Any) -> None:
        captured["hidden"] = output.last_hidden_state  # after the final norm

    ids = batch.input_ids
    hook = model.model.language_model.register_forward_hook(keep)
    try:
        model(
            input_ids=ids,
            attention_mask=batch.attention_mask,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            use_cache=False,
            logits_to_keep=1,  # the loss head below computes the logits it needs
            **media,
        )
    finally:
        hook.remove()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    targets = batch.targets
    scale = batch.advantages[:, None].expand_as(ids)[targets] / int(targets.sum())
    hidden = captured["hidden"][targets]
    return LinearCrossEntropy.apply(hidden, model.lm_head.weight, labels[targets], -100, scale)


def _count_tower(model: Any) -> tuple[dict[str, int], Any]:
    """Counters of the images and patches the vision tower's forward runs on, and its hook."""
    counts = {"images": 0, "patches": 0}

    def count(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        grid = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        counts["images"] += int(grid.shape[0])
        counts["patches"] += int(args[0].shape[0])

    return counts, model.model.visual.register_forward_pre_hook(count, with_kwargs=True)


def _run_path(model: Any, batch: GrpoBatch, unique: bool) -> tuple[GrpoPath, dict[str, Any]]:
    """One run of the step on `model`: logical or unique media; its gradients."""
    from mmpack.vision import encode_stats

    encoded = encode_stats(model).encoded if unique else 0
    counts, hook = _count_tower(model)
    model.zero_grad(set_to_none=True)
    try:
        start = time.perf_counter()
        if unique:
            media = {
                "pixel_values": batch.pixel_values.unique_segments(),
                "image_grid_thw": batch.image_grid_thw.unique_segments(),
            }
        else:
            media = {
                "pixel_values": batch.pixel_values.as_tensor(),
                "image_grid_thw": batch.image_grid_thw.as_tensor(),
            }
        loss = grpo_loss(model, batch, media)
        loss.backward()
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    path = GrpoPath(
        name="unique" if unique else "logical",
        media="unique_segments()" if unique else "as_tensor()",
        loss=float(loss.detach()),
        # logical: every occurrence is encoded; unique: what encode_once counted
        encodes=encode_stats(model).encoded - encoded if unique else len(media["image_grid_thw"]),
        tower_images=counts["images"],
        tower_patches=counts["patches"],
        seconds=seconds,
    )
    return path, grads


def compare_gradients(
    grads_a: dict[str, Any], grads_b: dict[str, Any], names: list[str]
) -> tuple[float, float, str]:
    """The largest |a - b| gradient entry over the parameters `names`, the largest such
    difference relative to its parameter's gradient scale (the largest |entry| of either
    gradient: a gradient that one path has and the other lacks is off by 1), and the parameter
    with that relative difference."""
    grad_diff, rel_diff, worst = 0.0, 0.0, ""
    for n in names:
        diff = (grads_a[n] - grads_b[n]).abs().max().item()
        scale = max(grads_a[n].abs().max().item(), grads_b[n].abs().max().item())
        rel = diff / scale if scale else 0.0  # both all zero
        grad_diff = max(grad_diff, diff)
        if rel > rel_diff or not worst:
            rel_diff, worst = rel, n
    return grad_diff, rel_diff, worst


def run_step(processor: Any, args: argparse.Namespace) -> GrpoResult:
    """Build the batch and the model (`args.hidden`, `args.layers`, `args.seed`), run the step
    logical and unique on identical copies, and compare them."""
    from mmpack.vision import encode_once

    from mmpack_dev.tiny_qwen2_vl import build_model

    model = build_model(processor.tokenizer, hidden=args.hidden, layers=args.layers, seed=args.seed)
    adapted = encode_once(copy.deepcopy(model))
    batch = build_batch(processor, args.grpo_prompts, args.grpo_group, args.seed, model.dtype)
    times = []
    for _ in range(RUNS):
        logical, grads_a = _run_path(model, batch, unique=False)
        unique, grads_b = _run_path(adapted, batch, unique=True)
        times.append((logical.seconds, unique.seconds))
    logical.seconds = min(t[0] for t in times)
    unique.seconds = min(t[1] for t in times)
    names = [n for n, _ in model.named_parameters()]
    problems = []
    missing = sorted(set(names) - (grads_a.keys() & grads_b.keys()))
    if missing:
        problems.append(f"parameters without a gradient both ways: {', '.join(missing[:4])}")
    common = [n for n in names if n in grads_a and n in grads_b]
    grad_diff, rel_diff, worst = compare_gradients(grads_a, grads_b, common)
    result = GrpoResult(
        prompts=args.grpo_prompts,
        group=args.grpo_group,
        rows=int(batch.input_ids.shape[0]),
        completion_tokens=int(batch.targets.sum()),
        grids=batch.grids,
        logical=logical,
        unique=unique,
        max_grad_diff=grad_diff,
        max_grad_rel_diff=rel_diff,
        worst_parameter=worst,
        parameters=len(common),
        vision_parameters=sum(".visual." in n for n in common),
        problems=problems,
    )
    if not result.loss_diff <= LOSS_TOLERANCE:
        problems.append(f"loss differs by {result.loss_diff:.2e} > {LOSS_TOLERANCE:.0e}")
    if not rel_diff <= GRAD_TOLERANCE:
        problems.append(
            f"gradients differ by up to {rel_diff:.2e} of their scale > {GRAD_TOLERANCE:.0e} "
            f"({worst}: up to {grad_diff:.2e})"
        )
    for path in result.paths:
        if path.tower_images != path.encodes:
            problems.append(
                f"{path.name}: the vision tower ran on {path.tower_images} images, the path "
                f"reports {path.encodes} encodes"
            )
    if unique.encodes != args.grpo_prompts:
        problems.append(f"unique: {unique.encodes} encodes for {args.grpo_prompts} images")
    return result


def table(result: GrpoResult) -> str:
    head = (
        f"| GRPO step ({result.prompts} prompts x G={result.group}) | media | loss "
        "| loss diff | max grad diff | max grad diff / scale | vision encodes | vision patches "
        "| seconds |"
    )
    out = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for path in result.paths:
        out.append(
            f"| {path.name} | {path.media} | {path.loss:.12f} | {result.loss_diff:.1e} | "
            f"{result.max_grad_diff:.1e} | {result.max_grad_rel_diff:.1e} | {path.encodes} | "
            f"{path.tower_patches:,} | {path.seconds:.2f} |"
        )
    return "\n".join(out)


def verdict(result: GrpoResult) -> str:
    """The step's one-line conclusion (what failed, when it did)."""
    shape = (
        f"{result.rows} rows, {result.completion_tokens} completion tokens, image grids "
        f"{', '.join('x'.join(map(str, g)) for g in result.grids)}"
    )
    if not result.ok:
        return f"GRPO step: logical and unique FAIL ({shape}): {'; '.join(result.problems)}"
    logical, unique = result.paths
    return (
        f"GRPO step: loss and gradients logical == unique: yes (|loss diff| "
        f"{result.loss_diff:.2e}, tolerance {LOSS_TOLERANCE:.0e}; max |grad diff| "
        f"{result.max_grad_diff:.2e}, relative to the gradient's scale at most "
        f"{result.max_grad_rel_diff:.2e} "
        f"({result.worst_parameter}), tolerance {GRAD_TOLERANCE:.0e}, over {result.parameters} "
        f"parameter tensors, {result.vision_parameters} of the vision tower); vision tower "
        f"{logical.encodes} -> {unique.encodes} encodes, {logical.seconds:.2f} s -> "
        f"{unique.seconds:.2f} s ({shape})"
    )


def summary(result: GrpoResult) -> dict[str, Any]:
    """The step for the demo's JSON."""
    return {
        "ok": result.ok,
        "problems": result.problems,
        "prompts": result.prompts,
        "group": result.group,
        "rows": result.rows,
        "completion_tokens": result.completion_tokens,
        "loss_diff": result.loss_diff,
        "max_grad_diff": result.max_grad_diff,
        "max_grad_rel_diff": result.max_grad_rel_diff,
        "worst_parameter": result.worst_parameter,
        "loss_tolerance": LOSS_TOLERANCE,
        "grad_tolerance": GRAD_TOLERANCE,
        "parameters": result.parameters,
        "vision_parameters": result.vision_parameters,
        **{p.name: dataclasses.asdict(p) for p in result.paths},
    }


def plot_panel(ax: Any, result: GrpoResult) -> None:
    """Vision-tower encodes logical vs unique as bars, each with its patches and seconds; the
    agreement in the title."""
    paths = result.paths
    labels = [f"{p.name}\n{p.media}" for p in paths]
    ax.bar(labels, [p.encodes for p in paths], color=["#58c", "#2a7"])
    for i, p in enumerate(paths):
        text = f"{p.encodes} encodes\n{p.tower_patches:,} patches\n{p.seconds:.2f} s"
        ax.text(i, p.encodes, text, ha="center", va="bottom")
    ax.set_ylabel("vision tower encodes (images)")
    ax.set_title(
        f"GRPO step, {result.prompts} prompts x G={result.group}, logical vs unique"
        f"{'' if result.ok else ': FAIL'}\n|loss diff| {result.loss_diff:.1e} (tolerance "
        f"{LOSS_TOLERANCE:.0e}), max |grad diff| {result.max_grad_diff:.1e}\n"
        f"/ gradient scale {result.max_grad_rel_diff:.1e} (tolerance {GRAD_TOLERANCE:.0e}), "
        f"{result.parameters} parameter tensors"
    )
    ax.margins(y=0.35)
