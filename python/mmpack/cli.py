"""The ``mmpack`` command: ``mmpack demo [sft|rl]``, ``mmpack pack-stats``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only routes, so importing it stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mmpack.demos", "run the main job (packed multimodal SFT; `demo rl` for GRPO media)"),
    "pack-stats": ("mmpack.pack_stats", "pack lengths from a file and report bins and efficiency"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmpack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"] and not (set(argv[1:2]) & {"-h", "--help"}):
        # The demo's options belong to the pipeline; argparse would reject them here.
        from mmpack.demos import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    module = importlib.import_module(_COMMANDS[args.command][0])
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
