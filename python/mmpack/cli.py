"""The ``mmpack`` command: ``mmpack pack-stats`` (the demo is development code: ``make demo``).

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
    "pack-stats": (
        "mmpack.packing.stats_cli",
        "pack lengths from a file and report bins and efficiency",
    ),
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
    args = build_parser().parse_args(argv)
    module = importlib.import_module(_COMMANDS[args.command][0])
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
