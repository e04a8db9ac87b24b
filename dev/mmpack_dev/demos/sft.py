"""``mmpack_dev demo sft``: packed multimodal SFT on the real Megatron-Energon loader.

1. writes a synthetic multimodal SFT dataset in both source formats (generic ``messages[]`` with
   inline media, and ``conversation[].fragments[]`` with a separate media store; images on some
   samples, a few broken and a few skippable samples) and prepares it with Energon;
2. runs one epoch through the real Energon loader with mmpack packing (progress bar), then, with
   ``--compare-with MODULE:ATTR``, the same loader with that Energon task encoder (for example
   the plain-Python reference task encoder of the test suite, which imports nothing from
   mmpack: ``reference.energon:ReferencePackingTaskEncoder`` with ``PYTHONPATH=tests``, as ``make
   demo`` runs it), then the same loader without packing;
3. prints a report (samples/s, tokens/s, token fill, samples in = packed + skipped by reason +
   failed by reason, media dedup ratio, the compared pipeline and no packing side by side),
   checks that mmpack's packs equal the compared pipeline's, and writes a PNG (fill histogram and
   throughput).
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
from pathlib import Path
from typing import Any

import numpy as np

from mmpack_dev.demos.comparison import OPTION, import_comparison

DEFAULT_WORK = "mmpack-work"


@dataclasses.dataclass
class RunResult:
    name: str
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    slots: int = 0
    seconds: float = 0.0
    #: CPU seconds of this process and its (joined) loader workers: robust on a shared machine
    cpu_seconds: float = 0.0
    first_batch_s: float = 0.0
    fills: list[float] = dataclasses.field(default_factory=list)
    logical_media_bytes: int = 0
    physical_media_bytes: int = 0
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    keys: list[str] = dataclasses.field(default_factory=list)
    digest: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def samples_per_cpu_s(self) -> float:
        return self.samples / self.cpu_seconds if self.cpu_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def fill(self) -> float:
        return self.tokens / self.slots if self.slots else 0.0

    @property
    def dedup_ratio(self) -> float:
        return (
            self.logical_media_bytes / self.physical_media_bytes
            if self.physical_media_bytes
            else 1.0
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmpack_dev demo sft", description=__doc__.splitlines()[0])
    p.add_argument(
        "--samples", type=int, default=3000, help="conversations in the dataset (default 3000)"
    )
    p.add_argument("--capacity", type=int, default=2048, help="tokens per pack (default 2048)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="Energon loader workers (default: 2 with more than 4 CPU cores, else 0: on a small "
        "machine the workers only compete with the main process)",
    )
    p.add_argument("--buffer", type=int, default=64, help="packing buffer size (default 64)")
    p.add_argument(
        "--algorithm",
        default="first_fit_decreasing",
        help="packing algorithm (default first_fit_decreasing: NeMo-RL's, so a --compare-with "
        "run of NeMo-RL's packer must give identical packs)",
    )
    p.add_argument("--batch-size", type=int, default=1, help="packs per batch (default 1)")
    p.add_argument(
        "--unpacked-batch-size",
        type=int,
        default=8,
        help="samples per batch without packing (default 8)",
    )
    p.add_argument(
        "--out",
        type=str,
        default=None,
        help=f"work folder (default ./{DEFAULT_WORK}/sft, else a temp dir)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=2, help="interleaved rounds; each pipeline reports its best"
    )
    p.add_argument(
        OPTION,
        dest="compare_with",
        metavar="MODULE:ATTR",
        default=None,
        help="an Energon TaskEncoder subclass (importable path; built as CLS(config, "
        "tokenizer=..., processor=...), with stats.snapshot() and batches of packs) to run as "
        "the 'reference packing' pipeline and compare with mmpack's pack for pack, e.g. "
        "reference.energon:ReferencePackingTaskEncoder with PYTHONPATH=tests (make demo passes "
        "it); without it no comparison runs",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the run without packing")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--json", type=str, default=None, help="also write the results as JSON here")
    return p


def _work_dir(arg: str | None) -> Path:
    if arg:
        path = Path(arg)
    else:
        path = Path.cwd() / DEFAULT_WORK / "sft"
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError:
            path = Path(tempfile.mkdtemp(prefix="mmpack-demo-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _dataset(work: Path, args: argparse.Namespace) -> Any:
    from mmpack_dev.synthetic import SyntheticDataset, write_synthetic_dataset

    root = work / "dataset"
    params = {"samples": args.samples, "seed": args.seed, "capacity": args.capacity, "version": 2}
    stamp = root / "params.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("params") == params:
        saved = json.loads(stamp.read_text())
        return SyntheticDataset(
            root,
            root / "metadataset.yaml",
            saved["expected"],
            tuple(saved["formats"]),
            saved["media"],
        )
    if root.exists():
        import shutil

        shutil.rmtree(root)
    with contextlib.redirect_stdout(sys.stderr):
        ds = write_synthetic_dataset(root, args.samples, seed=args.seed, capacity=args.capacity)
    stamp.write_text(
        json.dumps(
            {
                "params": params,
                "expected": ds.expected,
                "formats": ds.formats,
                "media": ds.media_store_items,
            }
        )
    )
    return ds


def _media_bytes(media: dict[str, Any]) -> tuple[int, int]:
    logical = physical = 0
    for value in media.values():
        tensors = list(value.tensors)
        sizes = [0 if t is None else t.numel() * t.element_size() for t in tensors]
        physical += sum(sizes)
        indices = value._segment_indices
        if indices is None:
            logical += sum(sizes)
        else:
            logical += sum(sizes[i] for i in indices)
    return logical, physical


def _media_digest(media: dict[str, Any]) -> tuple[Any, ...]:
    """Per key, the shape and sum of the materialized media (what the model reads)."""
    out = []
    for key in sorted(media):
        whole = media[key].as_tensor()
        out.append((key, None if whole is None else (tuple(whole.shape), float(whole.sum()))))
    return tuple(out)


def make_encoder(encoder_cls: Any, args: argparse.Namespace) -> Any:
    """An `encoder_cls` (`PackingTaskEncoder`, or a compared task encoder class that takes the
    same arguments) with the demo's settings."""
    from mmpack.energon import PackingEncoderConfig

    from mmpack_dev.synthetic import PATCH_SIZE, build_tokenizer

    config = PackingEncoderConfig(
        capacity=args.capacity,
        packing_buffer_size=args.buffer,
        algorithm=args.algorithm,
        loss_mask_mode="precomputed",
        batch_size=args.batch_size,
    )
    return encoder_cls(config, tokenizer=build_tokenizer(), processor={"patch_size": PATCH_SIZE})


def run_pipeline(
    name: str,
    ds: Any,
    *,
    args: argparse.Namespace,
    encoder_cls: Any,
    packing: bool,
    log: Any,
    progress: bool = True,
) -> RunResult:
    from megatron.energon import get_loader, get_train_dataset
    from mmpack.energon import make_worker_config
    from tqdm import tqdm

    encoder = make_encoder(encoder_cls, args)
    worker_config = make_worker_config(encoder, num_workers=args.workers)
    dataset = get_train_dataset(
        str(ds.metadataset),
        worker_config=worker_config,
        batch_size=args.batch_size if packing else args.unpacked_batch_size,
        packing_buffer_size=args.buffer if packing else None,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    result = RunResult(name)
    bar = tqdm(
        total=ds.num_samples,
        desc=f"{name:<18}",
        unit="sample",
        disable=not progress,
        file=sys.stdout,
    )
    cpu_start = _cpu_seconds()
    start = time.perf_counter()
    # Energon prints per-sample errors and its own progress bars (in every worker): to the log.
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        for batch in get_loader(dataset, watchdog_timeout_seconds=None):
            if result.batches == 0:
                result.first_batch_s = time.perf_counter() - start
            result.batches += 1
            result.samples += len(batch.sample_keys)
            result.tokens += batch.num_tokens
            result.slots += batch.token_slots
            result.keys.extend(batch.sample_keys)
            if batch.packs is not None:
                for pack in batch.packs:
                    n_real = int(pack.cu_seqlens[-1])
                    result.fills.append(n_real / args.capacity)
                    lg, ph = _media_bytes(pack.media)
                    result.logical_media_bytes += lg
                    result.physical_media_bytes += ph
                    result.digest.append(
                        (
                            tuple(pack.sample_ids),
                            int(pack.input_ids.sum()),
                            int(pack.labels.sum()),
                            int(pack.loss_mask.sum()),
                            int(pack.token_mask.sum()),
                            tuple(pack.cu_seqlens.tolist()),
                            _media_digest(pack.media),
                        )
                    )
            else:
                width = batch.padded.input_ids.shape[1]
                for row in batch.padded.attention_mask:
                    result.fills.append(int(row.sum()) / width)
            bar.update(len(batch.sample_keys))
    result.seconds = time.perf_counter() - start
    # the exhausted loader has joined its workers, so their CPU time is in RUSAGE_CHILDREN
    result.cpu_seconds = _cpu_seconds() - cpu_start
    bar.close()
    result.stats = encoder.stats.snapshot()
    return result


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def _cpu_seconds() -> float:
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _accounting(ds: Any, r: RunResult) -> tuple[bool, str]:
    st = r.stats
    skipped = st["skipped_total"]
    failed = st["failed"]
    ok = (st["seen"] == ds.num_samples) and (r.samples + skipped + failed == ds.num_samples)
    dupes = len(r.keys) - len(set(r.keys))
    ok = ok and dupes == 0 and set(r.keys) == ds.keys_with("ok")
    reasons = ", ".join(f"{k} {v}" for k, v in st["skipped"].items() if v)
    failures = ", ".join(f"{k} {v}" for k, v in st["failed_by_reason"].items())
    line = (
        f"samples in {ds.num_samples} = packed {r.samples} + skipped {skipped} "
        f"({reasons or 'none'}) + failed {failed} ({failures or 'none'})  "
        f"-> {'balanced' if ok else 'MISMATCH'} "
        f"(duplicates: {dupes}; delivered == the expected-good set: "
        f"{set(r.keys) == ds.keys_with('ok')})"
    )
    return ok, line


def _per_sample_us(r: RunResult, field: str) -> str:
    ns = r.stats.get(field, 0)
    if not ns or not r.samples:
        return "-"
    return f"{ns / 1e3 / r.samples:.1f}"


def _table(rows: list[RunResult], base: RunResult) -> str:
    head = (
        "| pipeline | batches | samples/s | tokens/s | samples/CPU-s | token fill | first batch "
        "| packer µs/sample | builder µs/sample | mmpack speed-up |"
    )
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    out = [head, sep]
    for r in rows:
        ratio = base.samples_per_s / r.samples_per_s if r.samples_per_s else float("nan")
        out.append(
            f"| {r.name} | {r.batches} | {r.samples_per_s:,.0f} | {r.tokens_per_s:,.0f} | "
            f"{r.samples_per_cpu_s:,.0f} | "
            f"{100 * r.fill:.1f} % | {r.first_batch_s:.2f} s | "
            f"{_per_sample_us(r, 'select_ns')} | {_per_sample_us(r, 'build_ns')} | "
            f"{'1.00x' if r is base else f'{ratio:.2f}x'} |"
        )
    return "\n".join(out)


def _plot(path: Path, rows: list[RunResult], capacity: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bins = np.linspace(0, 1, 41)
    for r in rows:
        if r.fills:
            label = f"{r.name} (mean {100 * np.mean(r.fills):.1f} %)"
            if r.name == "no packing":
                ax1.hist(r.fills, bins=bins, alpha=0.45, label=label, color="#58c")
            else:
                ax1.hist(r.fills, bins=bins, histtype="step", linewidth=2, label=label)
    ax1.set_xlabel(f"fill of a row (real tokens / row length; packs: capacity {capacity})")
    ax1.set_ylabel("rows")
    ax1.set_title("Token fill per packed sequence / padded row")
    ax1.legend(fontsize=8)
    names = [r.name for r in rows]
    ax2.bar(names, [r.samples_per_s for r in rows], color=["#2a7", "#c84", "#58c"][: len(rows)])
    for i, r in enumerate(rows):
        ax2.text(
            i,
            r.samples_per_s,
            f"{r.samples_per_s:,.0f}/s\n{r.tokens_per_s / 1e3:,.0f}k tok/s",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax2.set_ylabel("samples / s (whole epoch, incl. start-up)")
    ax2.set_title("Loader throughput")
    ax2.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.workers is None:
        args.workers = 2 if (os.cpu_count() or 1) > 4 else 0
    if args.samples < 10 or args.capacity < 64 or args.workers < 0:
        print(
            "error: --samples >= 10, --capacity >= 64 and --workers >= 0 are required",
            file=sys.stderr,
        )
        return 2
    from megatron.energon import TaskEncoder
    from mmpack.energon import PackingTaskEncoder
    from mmpack.errors import PackingArgumentError
    from mmpack.packing import algorithm_name

    try:
        algorithm_name(args.algorithm)
    except PackingArgumentError as err:
        print(f"error: --algorithm: {err}", file=sys.stderr)
        return 2
    compared = None
    if args.compare_with is not None:
        try:
            compared = import_comparison(args.compare_with)
        except (ImportError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if not (isinstance(compared, type) and issubclass(compared, TaskEncoder)):
            print(
                f"error: {OPTION} {args.compare_with}: expected an Energon TaskEncoder "
                f"subclass, got {compared!r}",
                file=sys.stderr,
            )
            return 2
        try:
            # built once before any run: settings it refuses would otherwise fail it after
            # the mmpack run
            make_encoder(compared, args)
        except ValueError as err:  # mmpack's EnergonConfigError, or the compared one's own
            print(
                f"error: {OPTION} {args.compare_with} refuses these settings: {err}",
                file=sys.stderr,
            )
            return 2
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    # One tokenizer call per sample is tiny: Rust thread-pool hand-offs cost more than they
    # save, and forked loader workers must not inherit a used pool anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = _work_dir(args.out)
    log_path = work / "loader.log"
    logger = logging.getLogger("mmpack.energon")
    handler = logging.FileHandler(log_path, mode="w")
    logger.addHandler(handler)
    propagate = logger.propagate
    logger.propagate = False
    try:
        t0 = time.perf_counter()
        ds = _dataset(work, args)
        print(
            f"dataset: {ds.num_samples} conversations ({' + '.join(ds.formats)}), "
            f"{ds.media_store_items} images in the fragments media store, at {ds.root} "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        plan: list[tuple[str, Any, bool]] = [("mmpack packing", PackingTaskEncoder, True)]
        if compared is not None:
            plan.append(("reference packing", compared, True))
        if not args.no_baseline:
            plan.append(("no packing", PackingTaskEncoder, False))
        runs: dict[str, list[RunResult]] = {name: [] for name, _, _ in plan}
        with open(log_path, "a") as log:
            # Interleaved rounds (A B C A B C): the box is shared and the first epoch also
            # warms caches, so each pipeline reports its best round.
            for round_ in range(args.repeats):
                for name, encoder_cls, packing in plan:
                    label = name if args.repeats == 1 else f"{name} ({round_ + 1}/{args.repeats})"
                    result = run_pipeline(
                        label, ds, args=args, encoder_cls=encoder_cls, packing=packing, log=log
                    )
                    result.name = name
                    runs[name].append(result)
        rows = [max(runs[name], key=lambda r: r.samples_per_s) for name, _, _ in plan]
        first = {name: results[0] for name, results in runs.items()}
        mm = rows[0]
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        handler.close()

    print()
    print(
        f"Energon {args.workers} worker(s), {args.algorithm}, capacity {args.capacity}, "
        f"packing buffer {args.buffer}, "
        f"{args.batch_size} pack(s) per batch "
        f"({args.unpacked_batch_size} samples per batch without packing)"
    )
    print(_table(rows, mm))
    print()
    ok = True
    for results in runs.values():
        for result in results:
            good, line = _accounting(ds, result)
            ok = ok and good
    _, line = _accounting(ds, first["mmpack packing"])
    print(line)
    print(
        f"media: {mm.stats['decoded']} decodes for {mm.samples} packed samples; dedup ratio "
        f"{mm.dedup_ratio:.2f}x (logical {mm.logical_media_bytes / 1e6:.1f} MB / physical "
        f"{mm.physical_media_bytes / 1e6:.1f} MB in the packs)"
    )
    identical: bool | None = None  # no comparison ran
    if compared is not None:
        identical = all(
            r.digest == first["mmpack packing"].digest
            for name in ("mmpack packing", "reference packing")
            for r in runs[name]
        )
        print(
            f"mmpack packs == reference packs, sample for sample: {identical} "
            f"({len(mm.digest)} packs, every round)"
        )
    if not args.no_baseline:
        base = rows[-1]
        print(
            f"packing vs no packing: {mm.samples_per_s / base.samples_per_s:.2f}x samples/s, "
            f"{_ratio(mm.samples_per_cpu_s, base.samples_per_cpu_s)} samples per CPU-second, "
            f"token fill {100 * mm.fill:.1f} % vs {100 * base.fill:.1f} %"
        )
    if compared is not None:
        ref = rows[1]
        print(
            f"mmpack vs reference packer+builder: {mm.samples_per_s / ref.samples_per_s:.2f}x "
            f"samples/s, {_ratio(mm.samples_per_cpu_s, ref.samples_per_cpu_s)} samples per "
            f"CPU-second, {_ratio(ref.stats.get('build_ns', 0), mm.stats.get('build_ns', 0))} "
            "less time in the batch builder"
        )
    if not args.no_plot:
        png = work / "sft-demo.png"
        _plot(png, rows, args.capacity)
        print(f"plot: {png}")
    print(f"loader log (per-sample errors): {log_path}")
    if args.json:
        summary = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            # null when no --compare-with pipeline ran
            "identical_to_compared": identical,
            "accounting_balanced": ok,
            "stats": mm.stats,
            "dedup_ratio": mm.dedup_ratio,
            "pipelines": {
                r.name: {
                    "samples_per_s": r.samples_per_s,
                    "samples_per_cpu_s": r.samples_per_cpu_s,
                    "rounds_samples_per_cpu_s": [x.samples_per_cpu_s for x in runs[r.name]],
                    "tokens_per_s": r.tokens_per_s,
                    "token_fill": r.fill,
                    "batches": r.batches,
                    "first_batch_s": r.first_batch_s,
                    "packer_us_per_sample": r.stats.get("select_ns", 0) / 1e3 / max(r.samples, 1),
                    "builder_us_per_sample": r.stats.get("build_ns", 0) / 1e3 / max(r.samples, 1),
                    "rounds_samples_per_s": [x.samples_per_s for x in runs[r.name]],
                }
                for r in rows
            },
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if ok and identical is not False else 1
