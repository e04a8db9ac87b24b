"""``python -m mmpack_dev demo [sft|rl] [OPTIONS]``: the main job (see ``mmpack_dev.demos``)."""

from __future__ import annotations

import sys

from mmpack_dev.demos import main

USAGE = """usage: python -m mmpack_dev demo [sft|rl] [OPTIONS]

  demo sft   packed multimodal SFT on the real Energon loader (the default; `demo sft -h`)
  demo rl    the GRPO media path: G-expansion, DP sharding, pickling (`demo rl -h`)"""


def run(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv[:1] != ["demo"]:
        print(USAGE, file=sys.stderr)
        return 2
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
