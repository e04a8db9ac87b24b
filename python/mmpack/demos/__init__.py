"""``mmpack demo``: the main job. ``sft`` is the packed multimodal SFT pipeline on Energon,
``rl`` the GRPO-shaped media pipeline (G-expansion, DP sharding, pickling, re-concat)."""

from __future__ import annotations

import argparse
import importlib

_PIPELINES = {"sft": "mmpack.demos.sft", "rl": "mmpack.demos.rl"}
DEFAULT_PIPELINE = "sft"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pipeline",
        nargs="?",
        choices=sorted(_PIPELINES),
        default=DEFAULT_PIPELINE,
        help=f"which pipeline to run (default: {DEFAULT_PIPELINE})",
    )
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, help="options for the pipeline (see `demo PIPELINE -h`)"
    )


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(_PIPELINES[args.pipeline])
    return int(module.main(list(args.rest)))
