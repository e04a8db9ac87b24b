"""The Energon SFT pipeline benchmark: the `mmpack_dev demo sft` job, side by side in one run.

Rows: the real Megatron-Energon loader over a synthetic multimodal SFT dataset (both source
formats) with (1) mmpack packing + the native batch builder, (2) the plain-Python reference task
encoder on the same loader (``tests/reference/energon.py``: NeMo-RL's packer, the torch batch
builder, no mmpack code; passed to the demo with ``--compare-with``), (3) the same loader without
packing. Columns:
samples/s, tokens/s, token fill, time to first batch, and the time spent inside the packer and
the batch builder per sample (measured in the loader workers). Each pipeline runs
``--repeats`` interleaved rounds and reports its best.

Usage: ``python benches/bench_energon.py [--quick] [--workers N] [--samples N]``. Prints a
markdown table and writes ``bench-results/bench_energon.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # the development package

from mmpack_dev.demos import sft

REFERENCE = "reference.energon:ReferencePackingTaskEncoder"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=str, default="bench-results/bench_energon.json")
    args = parser.parse_args(argv)
    samples = args.samples or (240 if args.quick else 3000)
    workers = args.workers if args.workers is not None else (0 if args.quick else 2)
    repeats = args.repeats or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="mmpack-bench-energon-") as work:
        demo_args = [
            "--samples", str(samples),
            "--workers", str(workers),
            "--repeats", str(repeats),
            "--out", str(Path(work) / "sft"),
            "--json", str(Path(args.out).resolve()),
            "--no-plot",
            "--compare-with", REFERENCE,
        ]  # fmt: skip
        if args.quick:
            demo_args += ["--capacity", "1024", "--buffer", "32"]
        return sft.main(demo_args)


if __name__ == "__main__":
    sys.exit(main())
