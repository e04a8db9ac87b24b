"""``python -m mmpack_dev demo [train|sft|rl] [OPTIONS]``: the demos (see ``mmpack_dev.demos``)."""

from __future__ import annotations

import sys

from mmpack_dev.demos import main

USAGE = """usage: python -m mmpack_dev demo [train|sft|rl] [OPTIONS]

  demo train   a tiny Qwen2-VL trained on packed and on padded batches of the same samples
               from the real Energon loader (the default; `demo train -h`)
  demo --toy   the quick loader-only comparison: packing vs no packing, --compare-with
               another implementation (same as `demo sft`; `demo sft -h`)
  demo rl      the GRPO media path: G-expansion, DP sharding, pickling (`demo rl -h`)"""


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
