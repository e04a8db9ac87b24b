"""Chat-template encoding time against the number of turns: mmpack vs transformers, one run.

Each row is one conversation of ``turns`` user/assistant pairs (short texts, so the template's
work dominates), encoded with the real Qwen2 vocabulary and the generation-marked templates of
Qwen2-VL and Qwen3 (reasoning kept after the last user query):

* ``hf``: ``tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
  return_assistant_tokens_mask=True)``, what the field uses for masks today.
* ``masks``: ``mmpack.batch.masks.from_chat_template`` (tokens and mask, one render).
* ``energon``: the Energon encoder's ``encode_conversation`` (tokens, mask, message spans and
  the checks it makes per sample), in precomputed mode.

Before timing, tokens and mask of ``masks`` and ``energon`` are checked equal to ``hf``'s.
Reported: median seconds (the three interleaved in each repeat; short conversations are
repeated more) and the ratio mmpack / hf (<= 1.0 is the goal at every length).

Usage: ``python benches/bench_chat_template.py [--quick] [--repeats N]``. Prints a markdown
table and writes ``bench-results/bench_chat_template.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mmpack.batch import masks
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack_dev.chat_conversations import turns as conversation_of
from mmpack_dev.chat_templates import family_tokenizer

FAMILIES = ("qwen2_vl", "qwen3", "llama3_1")


def _medians(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions interleaved in every repeat (so a
    change in the machine's load hits all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up (compiles the template on both sides)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _cooked(messages: list[dict[str, Any]]) -> Conversation:
    turns = []
    for m in messages:
        fields = {k: v for k, v in m.items() if k not in ("role", "content")}
        turns.append(Turn(m["role"], (Part(text=m["content"]),), fields=fields))
    return Conversation(
        __key__="bench",
        __restore_key__=(),
        __subflavors__=None,
        __sources__=(),
        source_format="bench",
        turns=turns,
    )


def _row(family: str, n: int, repeats: int) -> dict[str, Any]:
    tok = family_tokenizer(family, generation=True)
    messages = conversation_of(family, n)
    enc = PackingTaskEncoder(
        PackingEncoderConfig(modalities=[], loss_mask_mode="precomputed"), tokenizer=tok
    )
    conv = _cooked(messages)

    def hf() -> Any:
        return tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )

    theirs = hf()
    ids, mask = masks.from_chat_template(tok, messages)
    encoded = enc.encode_conversation(conv)
    if ids.tolist() != list(theirs["input_ids"]) or mask.astype(int).tolist() != list(
        theirs["assistant_masks"]
    ):
        raise SystemExit(f"{family} {n} turns: masks.from_chat_template differs from hf")
    if (
        encoded.token_ids.tolist() != ids.tolist()
        or np.asarray(encoded.loss_mask, dtype=bool).tolist() != mask.tolist()
    ):
        raise SystemExit(f"{family} {n} turns: the Energon encoder differs from hf")
    row: dict[str, Any] = {"family": family, "turns": n, "tokens": len(ids)}
    row.update(
        _medians(
            {
                "hf": hf,
                "masks": lambda: masks.from_chat_template(tok, messages),
                "energon": lambda: enc.encode_conversation(conv),
            },
            max(repeats, 1000 // max(n, 1)),
        )
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1 to 200 turns, 5 repeats")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    lengths = [1, 10, 50, 200] if args.quick else [1, 10, 50, 200, 500, 1000, 2000]
    repeats = 5 if args.quick else args.repeats
    rows = [_row(f, n, repeats) for f in FAMILIES for n in lengths]
    print(
        "| template | turns | tokens | hf (s) | masks (s) | energon (s) | masks / hf "
        "| energon / hf |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['family']} | {r['turns']} | {r['tokens']} | {r['hf']:.4f} | {r['masks']:.4f} "
            f"| {r['energon']:.4f} | {r['masks'] / r['hf']:.2f} | {r['energon'] / r['hf']:.2f} |"
        )
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "bench_chat_template.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
