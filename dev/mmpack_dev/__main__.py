"""``python -m mmpack_dev demo [sft|rl] [OPTIONS]``: the main job (see ``mmpack_dev.demos``)."""

from __future__ import annotations

import sys

from mmpack_dev.demos import main


def run(argv: list[str]) -> int:
    if argv[:1] != ["demo"]:
        print("usage: python -m mmpack_dev demo [sft|rl] [OPTIONS]", file=sys.stderr)
        return 2
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
