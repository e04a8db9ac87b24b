"""What the model-family examples share: a tiny tokenizer built in code, a small real
WebDataset, the Energon loader, and the next-token loss over a pack's labels.

Nothing is downloaded: tokenizers are word-level over a small vocabulary (the family's special
tokens, the words of the family's chat template and the synthetic words of the samples),
processors are built from their classes' defaults, models from configs with random weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from mmpack.energon import PackingTaskEncoder, make_worker_config
from mmpack_dev.synthetic import WORDS, write_webdataset

__all__ = [
    "WORDS",
    "generic_sample",
    "load_packs",
    "next_token_loss",
    "word_tokenizer",
    "write_dataset",
]


def word_tokenizer(
    special_tokens: Sequence[str],
    chat_template: str,
    *,
    extra_words: Sequence[str] = (),
    **special: str,
) -> Any:
    """A word-level `PreTrainedTokenizerFast`: `special_tokens` are added tokens (never
    split), words and punctuation of the template and the samples are the vocabulary.
    `special` names roles of tokens (``eos_token="<|im_end|>"``, ``pad_token=...``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", *special_tokens, *extra_words, *WORDS, ".", ",", ":", "?", "!"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        additional_special_tokens=list(special_tokens),
        **special,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def generic_sample(
    key: str,
    messages: list[dict[str, str]],
    media: Sequence[tuple[str, str, bytes, dict[str, Any]]] = (),
) -> tuple[str, list[tuple[str, bytes]]]:
    """One sample of mmpack's generic format: ``messages`` (``<image>`` / ``<video>`` /
    ``<audio>`` placeholders in the content) and ``media`` items ``(name, kind, bytes, meta)``
    in placeholder order."""
    manifest = [{"name": name, "kind": kind, **meta} for name, kind, _, meta in media]
    body = json.dumps({"messages": messages, "media": manifest}).encode()
    parts = [("json", body)]
    seen = set()
    for name, _, data, _ in media:
        if name not in seen:
            parts.append((name, data))
            seen.add(name)
    return key, parts


def write_dataset(root: Path, samples: list[tuple[str, list[tuple[str, bytes]]]]) -> Path:
    """Write `samples` as a prepared Energon WebDataset under `root`."""
    return write_webdataset(root, samples)


def load_packs(path: Path, encoder: PackingTaskEncoder, *, workers: int = 0) -> list[Any]:
    """Every pack of one pass over the dataset at `path`, through the Energon loader."""
    from megatron.energon import get_loader, get_train_dataset

    dataset = get_train_dataset(
        str(path),
        worker_config=make_worker_config(encoder, num_workers=workers),
        **encoder.dataset_options(),
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    return [
        pack for batch in get_loader(dataset, watchdog_timeout_seconds=None) for pack in batch.packs
    ]


def next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of `logits` ``[T, V]`` against a pack's `labels` ``[T]`` (already
    the next-token targets, `ignore_index` where nothing is trained), and the trained count."""
    loss = torch.nn.functional.cross_entropy(
        logits.float(), labels, ignore_index=ignore_index, reduction="sum"
    )
    return loss, int((labels != ignore_index).sum())


def summarize(
    packs: list[Any], losses: list[tuple[float, float, int]], encoder: PackingTaskEncoder
) -> dict[str, Any]:
    """What every example returns: packed vs unpacked loss per pack, and the loader's counts."""
    return {
        "packs": len(packs),
        "samples": sum(len(p) for p in packs),
        "losses": losses,
        "max_abs_diff": max(abs(p - u) for p, u, _ in losses),
        "stats": encoder.stats.snapshot(),
        "packs_data": packs,
        "encoder": encoder,
    }


def report(family: str, result: dict[str, Any]) -> None:
    """Print an example's result: one line per pack, then the largest difference."""
    print(f"{family}: {result['samples']} samples in {result['packs']} packs")
    for i, (packed, unpacked, count) in enumerate(result["losses"]):
        print(
            f"  pack {i}: loss packed {packed:.6f}  unpacked {unpacked:.6f}  "
            f"|diff| {abs(packed - unpacked):.2e}  ({count} trained tokens)"
        )
    print(f"max |packed - unpacked| = {result['max_abs_diff']:.2e}")
