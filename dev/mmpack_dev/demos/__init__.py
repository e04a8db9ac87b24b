"""``make demo``: the main job. ``train`` (the default) trains a tiny Qwen2-VL on packed and on
padded batches of the same samples from the real Energon loader; ``sft`` (``--toy``) is the
quick loader-only comparison (packing vs no packing, and ``--compare-with`` another
implementation); ``rl`` the GRPO-shaped media pipeline (G-expansion, DP sharding, pickling,
re-concat).

``python -m mmpack_dev demo [PIPELINE] [OPTIONS]``: options go to the pipeline, so
``demo --steps 4`` and ``demo train --steps 4`` are the same, and ``demo --toy ...`` is
``demo sft ...``; ``demo rl -h`` lists the RL options.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

_PIPELINES = {
    "train": "mmpack_dev.demos.train",
    "sft": "mmpack_dev.demos.sft",
    "rl": "mmpack_dev.demos.rl",
}
DEFAULT_PIPELINE = "train"
#: the option that picks the loader-only comparison
TOY_OPTION = "--toy"
TOY_PIPELINE = "sft"


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
    if TOY_OPTION in argv:
        argv.remove(TOY_OPTION)
        pipeline = TOY_PIPELINE
    elif argv and argv[0] in _PIPELINES:
        pipeline = argv.pop(0)
    module = importlib.import_module(_PIPELINES[pipeline])
    return int(module.main(argv))


def run(args: argparse.Namespace) -> int:
    return main([args.pipeline, *args.options])
