"""``mmpack_dev demo`` (the main job): a tiny random-init Qwen2-VL trained on the CPU, once on
mmpack's packed THD micro-batches and once on padded rows of the same samples, in the same
order, from the same initial weights, with the same optimizer.

1. writes a synthetic multimodal SFT dataset in both source formats (generic ``messages[]``
   with inline images, MP4 clips and WAV clips; ``conversation[].fragments[]`` with a media
   store), with a few broken and a few skippable samples, and prepares it with Energon;
2. for each mask mode (from roles with Qwen2-VL's chat template; precomputed with the same
   template marking the replies ``{% generation %}``, and the fragments' ``trainable`` flags),
   runs one epoch of the real Energon loader (2 workers) with mmpack's `PackingTaskEncoder`
   and Qwen2-VL's real processor and tokenizer (audio is no Qwen2-VL modality: those samples
   are skipped and counted as such), and joins each batch's packs into one THD micro-batch
   (`mmpack.batch.micro_batch`, one fixed length per step);
3. trains the model for ``--steps`` steps on those micro-batches, then again from the same
   seed on the same samples as padded rows (`mmpack.batch.pad_samples`), and compares the
   per-step losses (float64; each loss is the sum over the trained predictions divided by
   their count);
4. runs one GRPO step on the same tiny Qwen2-VL (`mmpack_dev.demos.grpo_step`: prompts with
   an image each, G completions per prompt, NeMo-RL's media layout) twice from identical
   weights, logical media and `mmpack.vision.encode_once` with unique media, and compares
   loss, gradients, vision-tower encodes and seconds;
5. prints the report (loss agreement, training tokens/s and samples/s packed vs padded with
   the token fill that explains them, the loader's samples/s, mmpack's own time per sample,
   the sample accounting, media dedup, the GRPO step) and writes it as a PNG.

The loader-only comparison of earlier versions (packing vs no packing, and the plain-Python
reference with ``--compare-with``) is ``demo --toy``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmpack_dev.demos import grpo_step

DEFAULT_WORK = "mmpack-work"
MASK_MODES = {"roles": None, "precomputed": "precomputed"}
#: the largest |packed - padded| per-step loss (float64) the run accepts
DEFAULT_TOLERANCE = 1e-9


@dataclasses.dataclass
class Step:
    """One optimizer step: what it trained on and what it cost."""

    samples: int
    tokens: int  # real tokens (no padding)
    slots: int  # positions the model ran on
    trained: int  # predictions in the loss
    loss: float = float("nan")
    seconds: float = 0.0
    #: CPU seconds of the step (every thread): steadier than wall time on a shared machine
    cpu_seconds: float = 0.0


@dataclasses.dataclass
class Training:
    """One training run (packed or padded) of one mask mode."""

    layout: str
    steps: list[Step] = dataclasses.field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.steps) / self.seconds if self.seconds else 0.0

    @property
    def samples_per_s(self) -> float:
        return sum(s.samples for s in self.steps) / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        cpu = sum(s.cpu_seconds for s in self.steps)
        return sum(s.tokens for s in self.steps) / cpu if cpu else 0.0

    @property
    def fill(self) -> float:
        slots = sum(s.slots for s in self.steps)
        return sum(s.tokens for s in self.steps) / slots if slots else 0.0

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


@dataclasses.dataclass
class ModeRun:
    """The loader epoch and both trainings of one mask mode."""

    mode: str
    stats: dict[str, Any]
    expected: dict[str, int]
    delivered: list[str]
    loader_seconds: float
    batches: int
    micro_batch_ns: int
    pad_ns: int
    logical_media_bytes: int
    physical_media_bytes: int
    packed: Training
    padded: Training

    @property
    def loader_samples_per_s(self) -> float:
        return len(self.delivered) / self.loader_seconds if self.loader_seconds else 0.0

    @property
    def max_loss_diff(self) -> float:
        pairs = zip(self.packed.losses, self.padded.losses, strict=True)
        return max((abs(a - b) for a, b in pairs), default=float("nan"))

    @property
    def dedup_ratio(self) -> float:
        return (
            self.logical_media_bytes / self.physical_media_bytes
            if self.physical_media_bytes
            else 1.0
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmpack_dev demo", description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=160, help="conversations (default 160)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    p.add_argument("--capacity", type=int, default=320, help="tokens per pack (default 320)")
    p.add_argument("--packs-per-step", type=int, default=2, help="packs per micro-batch (2)")
    p.add_argument("--buffer", type=int, default=32, help="packing buffer size (default 32)")
    p.add_argument("--workers", type=int, default=2, help="Energon loader workers (default 2)")
    p.add_argument("--words", type=float, default=6, help="mean words per turn (default 6)")
    p.add_argument(
        "--exchanges", type=int, default=4, help="user/assistant exchanges: 1 to N (default 4)"
    )
    p.add_argument(
        "--mask-modes",
        default="roles,precomputed",
        help="comma-separated mask modes to run: roles, precomputed (default both)",
    )
    p.add_argument("--hidden", type=int, default=16, help="model width (default 16)")
    p.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    grpo_step.add_arguments(p)
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"largest accepted |packed - padded| loss per step (default {DEFAULT_TOLERANCE})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, help=f"work folder (default ./{DEFAULT_WORK}/train, else a temp dir)"
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    return p


def _work_dir(arg: str | None) -> Path:
    if arg:
        path = Path(arg)
    else:
        path = Path.cwd() / DEFAULT_WORK / "train"
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / ".write-test").write_text("ok")
            (path / ".write-test").unlink()
        except OSError:
            path = Path(tempfile.mkdtemp(prefix="mmpack-demo-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_dataset(root: Path, args: argparse.Namespace, log: Any) -> Any:
    """The synthetic dataset of the demo (short turns: packs hold several samples)."""
    import shutil

    from mmpack_dev.synthetic import write_synthetic_dataset

    if root.exists():
        shutil.rmtree(root)
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return write_synthetic_dataset(
            root,
            args.samples,
            seed=args.seed,
            capacity=args.capacity,
            shards_per_format=2,
            mean_words=args.words,
            image_fraction=0.4,
            broken_every=40,
            skip_every=30,
            video_every=25,
            audio_every=40,
            max_exchanges=args.exchanges,
            media_pool=4,  # store images shared by several samples: dedup within a pack
        )


def mode_dataset(ds: Any, mode: str) -> tuple[Path, dict[str, str]]:
    """The metadataset a mask mode reads and what the writer made each of its samples: from
    roles, the generic format alone (the fragments format marks trainable spans per fragment,
    which only the precomputed mode reads: mmpack refuses it in roles mode); precomputed, both
    formats."""
    from mmpack_dev.synthetic import write_metadataset

    if mode != "roles":
        return ds.metadataset, ds.expected
    path = write_metadataset(
        ds.root / "metadataset-generic.yaml",
        [{"path": "generic", "subflavors": {"mmpack_format": "generic"}}],
    )
    return path, {k: v for k, v in ds.expected.items() if k.startswith("gene")}


def expected_outcomes(ds: Any, mode: str) -> dict[str, str]:
    """Per sample of `mode`'s metadataset, what the run must do with it: ``"packed"``,
    ``"skip:<reason>"`` or ``"failed"``. Audio is no Qwen2-VL modality (skipped as
    undeclared)."""
    out: dict[str, str] = {}
    for key, fate in mode_dataset(ds, mode)[1].items():
        if fate.startswith("broken:"):
            out[key] = "failed"
        elif fate.startswith("skip:"):
            out[key] = fate
        elif "audio" in ds.media_kinds.get(key, ()):
            out[key] = "skip:undeclared_modality"
        else:
            out[key] = "packed"
    return out


def make_encoder(mode: str, args: argparse.Namespace) -> Any:
    """mmpack's task encoder with Qwen2-VL's processor and tokenizer for `mode`."""
    from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder

    from mmpack_dev.qwen_vocab import QWEN2_VL_CHAT_TEMPLATE, QWEN2_VL_GENERATION_TEMPLATE
    from mmpack_dev.tiny_qwen2_vl import build_processor

    template = QWEN2_VL_CHAT_TEMPLATE if mode == "roles" else QWEN2_VL_GENERATION_TEMPLATE
    processor = build_processor(template)
    config = PackingEncoderConfig(
        capacity=args.capacity,
        packing_buffer_size=args.buffer,
        # shuffled first fit: a pack (and so the padded rows of a step) mixes long and short
        # samples, as a shuffled loader's batches do
        algorithm="first_fit_shuffle",
        batch_size=args.packs_per_step,
        loss_mask_mode=MASK_MODES[mode],
        modalities=("image", "video"),
        on_undeclared_media="skip",  # the audio clips: counted, not trained on
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    return PackingTaskEncoder(config, processor=processor)


def _bar(args: argparse.Namespace, **kwargs: Any) -> Any:
    from tqdm import tqdm

    return tqdm(disable=args.no_progress, file=sys.stdout, dynamic_ncols=True, **kwargs)


def load_epoch(
    path: Path, samples: int, encoder: Any, args: argparse.Namespace, log: Any, label: str
) -> tuple[list[Any], float]:
    """One epoch of the Energon loader over the metadataset at `path` (`samples` samples):
    its batches and the seconds it took."""
    from megatron.energon import get_loader, get_train_dataset
    from mmpack.energon import make_worker_config

    dataset = get_train_dataset(
        str(path),
        worker_config=make_worker_config(encoder, num_workers=args.workers),
        **encoder.dataset_options(),
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    batches = []
    bar = _bar(args, total=samples, desc=f"loader  {label:<12}", unit="sample")
    start = time.perf_counter()
    # Energon prints per-sample errors and progress of its own (in every worker): to the log
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        for batch in get_loader(dataset, watchdog_timeout_seconds=None):
            batches.append(batch)
            bar.update(len(batch.sample_keys))
    seconds = time.perf_counter() - start
    bar.close()
    return batches, seconds


def padded_twin(micro: Any, options: Any) -> Any:
    """The samples of a THD micro-batch as padded rows (`mmpack.batch.pad_samples`), in the
    same order, each with the trained tokens the pack gave it."""
    from mmpack.batch import EncodedSample, pad_samples

    true = micro.cu_seqlens.tolist()
    start = micro.cu_seqlens_padded.tolist()
    samples = [
        EncodedSample(
            sid,
            micro.input_ids[s : s + (true[i + 1] - true[i])],
            loss_mask=micro.token_mask[s : s + (true[i + 1] - true[i])],
        )
        for i, (sid, s) in enumerate(zip(micro.sample_ids, start, strict=False))
    ]
    return pad_samples(samples, options.replace(loss_mask_mode="precomputed"))


def _media_bytes(media: dict[str, Any]) -> tuple[int, int]:
    logical = physical = 0
    for value in media.values():
        sizes = [0 if t is None else t.numel() * t.element_size() for t in value.tensors]
        physical += sum(sizes)
        indices = value._segment_indices
        logical += sum(sizes) if indices is None else sum(sizes[i] for i in indices)
    return logical, physical


def train(
    steps: list[tuple[Any, Any]],
    tokenizer: Any,
    args: argparse.Namespace,
    layout: str,
    label: str,
) -> Training:
    """`args.steps` AdamW steps of a fresh seeded model, on the packed micro-batches
    (``layout="packed"``) or their padded rows, with loss = summed loss / trained count."""
    import torch

    from mmpack_dev.tiny_qwen2_vl import build_model, packed_loss_sum, padded_loss_sum

    model = build_model(tokenizer, hidden=args.hidden, layers=args.layers, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run = Training(layout)
    bar = _bar(args, total=len(steps), desc=f"train   {label:<12}", unit="step")
    for micro, rows in steps:
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        if layout == "packed":
            loss_sum, count = packed_loss_sum(model, micro)
            slots = micro.input_ids.numel()
        else:
            loss_sum, count = padded_loss_sum(model, rows, micro.media)
            slots = rows.input_ids.numel()
        loss = loss_sum / count
        loss.backward()
        optimizer.step()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        run.steps.append(
            Step(
                samples=len(micro),
                tokens=int(micro.cu_seqlens[-1]),
                slots=slots,
                trained=count,
                loss=float(loss.detach()),
                seconds=seconds,
                cpu_seconds=cpu,
            )
        )
        bar.update(1)
        bar.set_postfix(loss=f"{run.steps[-1].loss:.4f}")
    bar.close()
    return run


def run_mode(ds: Any, mode: str, args: argparse.Namespace, log: Any) -> ModeRun:
    """Loader epoch, micro-batches and their padded twins, then both trainings, for `mode`."""
    from mmpack.batch import micro_batch

    encoder = make_encoder(mode, args)
    path, written = mode_dataset(ds, mode)
    batches, loader_seconds = load_epoch(path, len(written), encoder, args, log, mode)
    stats = encoder.stats.snapshot()
    delivered = [k for b in batches for k in b.sample_keys]
    options = encoder.batch_options
    steps = []
    micro_ns = pad_ns = logical = physical = 0
    for batch in batches[: args.steps]:
        t0 = time.perf_counter_ns()
        # one fixed shape per step, as a trainer with static shapes feeds it
        fixed = options.replace(pad_to_length=args.capacity * len(batch.packs))
        micro = micro_batch(batch.packs, fixed)
        t1 = time.perf_counter_ns()
        rows = padded_twin(micro, options)
        pad_ns += time.perf_counter_ns() - t1
        micro_ns += t1 - t0
        lg, ph = _media_bytes(micro.media)
        logical, physical = logical + lg, physical + ph
        steps.append((micro, rows))
    tokenizer = encoder.tokenizer
    packed = train(steps, tokenizer, args, "packed", f"{mode} packed")
    padded = train(steps, tokenizer, args, "padded", f"{mode} padded")
    expected: dict[str, int] = {}
    for outcome in expected_outcomes(ds, mode).values():
        expected[outcome] = expected.get(outcome, 0) + 1
    return ModeRun(
        mode=mode,
        stats=stats,
        expected=expected,
        delivered=delivered,
        loader_seconds=loader_seconds,
        batches=len(batches),
        micro_batch_ns=micro_ns,
        pad_ns=pad_ns,
        logical_media_bytes=logical,
        physical_media_bytes=physical,
        packed=packed,
        padded=padded,
    )


def accounting(ds: Any, run: ModeRun) -> tuple[bool, str]:
    """``samples in = packed + skipped by reason + failed by reason``, each count equal to what
    the dataset was written to provoke, and the delivered samples the expected ones, once."""
    st = run.stats
    n_in = sum(run.expected.values())
    skipped = {r: n for r, n in st["skipped"].items() if n}
    total = st["packed"] + st["skipped_total"] + st["failed"]
    want = run.expected
    by_reason_ok = all(
        skipped.get(outcome.removeprefix("skip:"), 0) == n
        for outcome, n in want.items()
        if outcome.startswith("skip:")
    ) and st["skipped_total"] == sum(n for o, n in want.items() if o.startswith("skip:"))
    expected_keys = {k for k, o in expected_outcomes(ds, run.mode).items() if o == "packed"}
    ok = (
        st["seen"] == n_in
        and total == n_in
        and st["packed"] == len(run.delivered) == want.get("packed", 0)
        and st["failed"] == want.get("failed", 0)
        and by_reason_ok
        and len(set(run.delivered)) == len(run.delivered)
        and set(run.delivered) == expected_keys
    )
    reasons = ", ".join(f"{r} {n}" for r, n in skipped.items()) or "none"
    failures = ", ".join(f"{r} {n}" for r, n in st["failed_by_reason"].items()) or "none"
    line = (
        f"{run.mode}: samples in {n_in} = packed {st['packed']} + skipped "
        f"{st['skipped_total']} ({reasons}) + failed {st['failed']} ({failures}) -> "
        f"{'balanced' if ok else 'MISMATCH'}"
    )
    return ok, line


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _us(ns: float, n: int) -> str:
    return f"{ns / 1e3 / n:.1f}" if n else "-"


def report_table(runs: list[ModeRun], args: argparse.Namespace) -> str:
    head = (
        "| mask mode | layout | steps | samples | token fill | train tokens/s | train samples/s "
        "| tokens/CPU-s | speed-up (CPU) | final loss | max |packed - padded| |"
    )
    out = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for t in (run.packed, run.padded):
            base = run.padded.tokens_per_cpu_s
            speedup = run.packed.tokens_per_cpu_s / base if t is run.packed and base else 1
            out.append(
                f"| {run.mode} | {t.layout} | {len(t.steps)} | {sum(s.samples for s in t.steps)}"
                f" | {100 * t.fill:.1f} % | {t.tokens_per_s:,.0f} | {t.samples_per_s:,.1f} | "
                f"{t.tokens_per_cpu_s:,.0f} | {speedup:.2f}x | {t.losses[-1]:.6f} | "
                f"{run.max_loss_diff:.1e} |"
            )
    return "\n".join(out)


def loader_table(runs: list[ModeRun], args: argparse.Namespace) -> str:
    head = (
        "| mask mode | loader samples/s | batches | packer µs/sample | builder µs/sample "
        "| micro-batch µs/sample | media decodes | dedup |"
    )
    out = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        st = run.stats
        n = st["packed"]
        trained = sum(s.samples for s in run.packed.steps)
        out.append(
            f"| {run.mode} | {run.loader_samples_per_s:,.0f} | {run.batches} | "
            f"{_us(st['select_ns'], n)} | {_us(st['build_ns'], n)} | "
            f"{_us(run.micro_batch_ns, trained)} | {st['decoded']} | {run.dedup_ratio:.2f}x |"
        )
    return "\n".join(out)


def plot(path: Path, runs: list[ModeRun], grpo: grpo_step.GrpoResult) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(15, 9))
    axes = grid.ravel()
    ax = axes[0]
    for run, color in zip(runs, ("#2a7", "#c84", "#58c"), strict=False):
        x = range(1, len(run.packed.steps) + 1)
        ax.plot(x, run.packed.losses, "-", color=color, lw=2, label=f"{run.mode} packed")
        ax.plot(x, run.padded.losses, "o", color=color, mfc="none", label=f"{run.mode} padded")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (sum over trained predictions / count)")
    worst = max(r.max_loss_diff for r in runs)
    ax.set_title(f"Loss, packed vs padded (max |diff| {worst:.1e})")
    ax.legend(fontsize=8)
    labels = [f"{r.mode}\n{t.layout}" for r in runs for t in (r.packed, r.padded)]
    colors = ["#2a7", "#58c"] * len(runs)
    rates = [t.tokens_per_s for r in runs for t in (r.packed, r.padded)]
    fills = [100 * t.fill for r in runs for t in (r.packed, r.padded)]
    axes[1].bar(labels, rates, color=colors)
    axes[1].tick_params(axis="x", labelsize=8)
    for i, (rate, fill) in enumerate(zip(rates, fills, strict=True)):
        axes[1].text(i, rate, f"{rate:,.0f}\nfill {fill:.0f} %", ha="center", va="bottom")
    axes[1].set_ylabel("training tokens / s (real tokens)")
    axes[1].set_title("Training throughput and token fill")
    axes[1].margins(y=0.2)
    run = runs[-1]
    st = run.stats
    parts = {"packed": st["packed"]}
    parts.update({f"skipped: {r}": n for r, n in st["skipped"].items() if n})
    parts.update({f"failed: {r}": n for r, n in st["failed_by_reason"].items()})
    axes[2].barh(list(parts), list(parts.values()), color="#888")
    axes[2].invert_yaxis()
    axes[2].set_xscale("log")
    axes[2].set_xlabel("samples (log scale)")
    axes[2].set_title(f"Accounting ({run.mode}): {sum(parts.values())} in")
    axes[2].tick_params(axis="y", labelsize=8)
    grpo_step.plot_panel(axes[3], grpo)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def _quiet_loader(log_path: Path) -> Iterator[Any]:
    """mmpack's per-sample log lines go to `log_path`; so does Energon's chatter."""
    logger = logging.getLogger("mmpack.energon")
    handler = logging.FileHandler(log_path, mode="w")
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        with open(log_path, "a") as log:
            yield log
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        handler.close()


def _describe(ds: Any, seconds: float) -> None:
    kinds = sorted({k for v in ds.media_kinds.values() for k in v})
    counts = {k: sum(k in v for v in ds.media_kinds.values()) for k in kinds}
    print(
        f"dataset: {ds.num_samples} conversations ({' + '.join(ds.formats)}); samples with "
        + ", ".join(f"{k} {n}" for k, n in counts.items())
        + f"; written and prepared with Energon in {seconds:.1f} s at {ds.root}",
        flush=True,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.mask_modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MASK_MODES]
    if bad or not modes:
        print(f"error: --mask-modes takes {', '.join(MASK_MODES)}; got {bad}", file=sys.stderr)
        return 2
    if args.samples < 20 or args.steps < 1 or args.capacity < 128 or args.workers < 0:
        print(
            "error: --samples >= 20, --steps >= 1, --capacity >= 128 and --workers >= 0 are "
            "required",
            file=sys.stderr,
        )
        return 2
    if args.grpo_prompts < 1 or args.grpo_group < 2:
        print("error: --grpo-prompts >= 1 and --grpo-group >= 2 are required", file=sys.stderr)
        return 2
    import torch

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    # one tokenizer call per sample is tiny, and forked workers must not inherit a used pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.use_deterministic_algorithms(True)
    work = _work_dir(args.out)
    started = time.perf_counter()
    log_path = work / "loader.log"
    with _quiet_loader(log_path) as log:
        t0 = time.perf_counter()
        ds = write_dataset(work / "dataset", args, log)
        dataset_s = time.perf_counter() - t0
        _describe(ds, dataset_s)
        runs = [run_mode(ds, mode, args, log) for mode in modes]
    from mmpack_dev.tiny_qwen2_vl import build_processor

    t0 = time.perf_counter()
    grpo = grpo_step.run_step(build_processor(), args)
    grpo_s = time.perf_counter() - t0

    print()
    print(
        f"Qwen2-VL (random init: {args.layers} layer(s), hidden {args.hidden}, vocabulary "
        f"151,936, float64) trained {args.steps} AdamW steps per run on the CPU; Energon "
        f"{args.workers} workers; capacity {args.capacity}, {args.packs_per_step} packs per "
        "micro-batch"
    )
    print(report_table(runs, args))
    print()
    print(loader_table(runs, args))
    print()
    print(grpo_step.table(grpo))
    print()
    ok = True
    for run in runs:
        agree = run.max_loss_diff <= args.tolerance
        ok = ok and agree
        print(
            f"{run.mode}: loss packed == padded on every step: {'yes' if agree else 'NO'} "
            f"(max |diff| {run.max_loss_diff:.2e}, tolerance {args.tolerance:.0e}); packed "
            f"{_ratio(run.packed.tokens_per_s, run.padded.tokens_per_s)} the padded tokens/s, "
            f"{_ratio(run.packed.tokens_per_cpu_s, run.padded.tokens_per_cpu_s)} per CPU-second, "
            f"at token fill {100 * run.packed.fill:.1f} % vs {100 * run.padded.fill:.1f} %"
        )
    for run in runs:
        balanced, line = accounting(ds, run)
        ok = ok and balanced
        print(line)
    run = runs[-1]
    print(
        f"media: {run.stats['decoded']} decodes for {run.stats['packed']} packed samples; in "
        f"the trained micro-batches {run.logical_media_bytes / 1e6:.2f} MB logical / "
        f"{run.physical_media_bytes / 1e6:.2f} MB physical (dedup {run.dedup_ratio:.2f}x)"
    )
    print(grpo_step.verdict(grpo))
    ok = ok and grpo.ok
    if not args.no_plot:
        png = work / "train-demo.png"
        plot(png, runs, grpo)
        print(f"plot: {png}")
    print(f"loader log (per-sample errors): {log_path}")
    loader_s = sum(r.loader_seconds for r in runs)
    train_s = sum(r.packed.seconds + r.padded.seconds for r in runs)
    print(
        f"wall time: dataset {dataset_s:.0f} s, loader {loader_s:.0f} s, training steps "
        f"{train_s:.0f} s, GRPO step {grpo_s:.0f} s; whole run "
        f"{time.perf_counter() - started:.0f} s"
    )
    if args.json:
        summary = {
            "ok": ok,
            "settings": vars(args),
            "modes": {
                r.mode: {
                    "max_loss_diff": r.max_loss_diff,
                    "accounting_balanced": accounting(ds, r)[0],
                    "stats": r.stats,
                    "loader_samples_per_s": r.loader_samples_per_s,
                    "dedup_ratio": r.dedup_ratio,
                    **{
                        t.layout: {
                            "losses": t.losses,
                            "tokens_per_s": t.tokens_per_s,
                            "samples_per_s": t.samples_per_s,
                            "token_fill": t.fill,
                            "tokens_per_cpu_s": t.tokens_per_cpu_s,
                        }
                        for t in (r.packed, r.padded)
                    },
                }
                for r in runs
            },
            "grpo": grpo_step.summary(grpo),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not grpo.ok:
        print(
            "error: the GRPO step, logical vs unique media (tolerances: loss "
            f"{grpo_step.LOSS_TOLERANCE:.0e}, gradients {grpo_step.GRAD_TOLERANCE:.0e} of their "
            f"scale): {'; '.join(grpo.problems)}",
            file=sys.stderr,
        )
    return 0 if ok else 1
