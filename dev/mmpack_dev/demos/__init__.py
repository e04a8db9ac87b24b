"""``make demo``: the main job. ``sft`` is the packed multimodal SFT pipeline on Energon,
``rl`` the GRPO-shaped media pipeline (G-expansion, DP sharding, pickling, re-concat).

``python -m mmpack_dev demo [PIPELINE] [OPTIONS]``: options go to the pipeline, so
``demo --samples 500`` and ``demo sft --samples 500`` are the same; ``demo rl -h`` lists the RL
options.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

_PIPELINES = {"sft": "mmpack_dev.demos.sft", "rl": "mmpack_dev.demos.rl"}
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
        "options",
        nargs=argparse.REMAINDER,
        help="options for the pipeline (see `demo PIPELINE -h`)",
    )


def main(argv: Sequence[str]) -> int:
    """Route ``argv`` (everything after ``demo``) to the chosen pipeline's ``main``."""
    argv = list(argv)
    pipeline = DEFAULT_PIPELINE
    if argv and argv[0] in _PIPELINES:
        pipeline = argv.pop(0)
    module = importlib.import_module(_PIPELINES[pipeline])
    return int(module.main(argv))


def run(args: argparse.Namespace) -> int:
    return main([args.pipeline, *args.options])
