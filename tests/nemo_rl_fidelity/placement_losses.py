#!/usr/bin/env python3
"""Check that mmpack's row placement in ``shard_by_batch_size`` changes no training result.

``install(accelerate=True)`` replaces NeMo-RL's ``BatchedDataDict.shard_by_batch_size``, and a
placement other than NeMo-RL's own may put a row on another data-parallel rank, in another
micro-batch, at another position. None of that may change the training step: each row must stay
in its global batch (the chunk of ``batch_size`` rows an optimizer step sees), NeMo-RL's loss
functions normalise by counts over the whole global batch on all ranks, and the gradients of
the ranks are summed. This script trains a tiny model for a few global batches both ways and
compares the loss of every global batch and every gradient.

It uses NeMo-RL's own code wherever the GPU allows: the batch is built as GRPO builds it
(``BatchedDataDict.repeat_interleave(G, share_immutable_media=True)`` of the prompts' message
logs, ``batched_message_log_to_flat_message``, ``get_multimodal_dict``), so the G rows of a
prompt share their prompt's image segments (same provenance) in a top-level ``pixel_values``
PackedTensor; sharding, ``get_batch`` and the micro-batch iterators are ``BatchedDataDict``'s;
the loss is NeMo-RL's loss function called through ``prepare_loss_input`` and, with sequence
packing, ``SequencePackingLossWrapper``, with the per-global-batch ``global_valid_seqs`` /
``global_valid_toks`` that ``process_global_batch`` sums over the data-parallel ranks. What the
policy worker does on a GPU is done here by hand, the same way: the DP ranks are simulated in one
process (their gradients summed, which is what FSDP's average of ``loss * dp_size`` gives); with
sequence packing each row runs its own forward and the logits are laid out as the packed sequence
NeMo-RL's ``pack_sequences`` / ``get_flash_attention_kwargs`` describe (what varlen flash
attention computes); logprobs are taken in float64 on the CPU (NeMo-RL's
``get_next_token_logprobs_from_logits`` casts to float32 and moves ids to CUDA, which would
hide nothing but would blur the comparison to 1e-7). The model is a random-init two-layer GPT-2
in float64 whose input embeddings get a projection of the row's image, so that a row given
another row's image changes the result; an SGD step follows each global batch.

Two loss functions (``ClippedPGLossFn`` with the default GRPO config, ``NLLLossFn``) times two
batching modes (sequence packing, dynamic batching, with the argument dicts NeMo-RL's policy
builds). Each side runs in its own child process: ``nemo_rl`` is plain NeMo-RL (no mmpack),
``mmpack`` calls ``mmpack.compat.nemo_rl.install(accelerate=True, placement=P)`` first
(``--placement none``: the call without ``placement=``, mmpack's default, which also works with
an mmpack older than the option). Besides the results, each side checks the placement itself:
every row lands exactly once, in its own global batch, with its own prompt's image, and the
returned ``batch_sorted_indices`` say where each row went (with sequence packing, the shards'
rows in order; with dynamic batching, NeMo-RL's order: each chunk sorted, then cut into shards).

The table shows, per global batch, the loss both ways, the largest loss and gradient
differences, and on which rank the G rows of each prompt landed (one digit a row, one group a
prompt). Exit status 1 when a difference is above ``--tolerance`` (default 1e-10) or a check
fails, 2 when a side does not run.

Usage, with the side venv NeMo-RL needs (Python >= 3.12, see ``run_fidelity.py``)::

    PYTHONPATH=nemo-rl .venv-nemo-rl/bin/python tests/nemo_rl_fidelity/placement_losses.py \\
        --placement groups

(or ``--nemo-rl nemo-rl`` instead of PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

SIDES = ("nemo_rl", "mmpack")
LOSSES = ("clipped_pg", "nll")
MODES = ("sequence_packing", "dynamic_batching")

# A GRPO step in miniature: P prompts, G generations each, global batches of GBS rows, DP ranks.
PROMPTS, GENERATIONS, GBS, DP = 8, 4, 16, 4
VOCAB, HIDDEN, PAD = 256, 32, 0
# Images as a Qwen2-VL processor flattens them: patches of 3 x 2 x 14 x 14 values. Big next to
# the rows' tokens, as in a VLM, so that a group-aware placement has a reason to move rows.
IMAGE_DIM, PATCHES = 1176, (256, 513)
MAKE_SEQUENCE_LENGTH_DIVISIBLE_BY = 4  # the policy's make_sequence_length_divisible_by
TRAIN_MB_TOKENS = 64
SEQUENCE_LENGTH_ROUND = 8
LEARNING_RATE = 0.5
SEED = 1234


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--placement",
        choices=("none", "groups", "nemo_rl"),
        default="none",
        help="mmpack side: install(accelerate=True, placement=PLACEMENT); none: without it",
    )
    parser.add_argument("--nemo-rl", help="a NeMo-RL checkout (else NeMo-RL from PYTHONPATH)")
    parser.add_argument("--tolerance", type=float, default=1e-10)
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        torch.save(_side(args.child, args.placement), args.out)
        return 0

    env = dict(os.environ)
    if args.nemo_rl:
        checkout = str(Path(args.nemo_rl).resolve())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [checkout, env.get("PYTHONPATH")]))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="placement-losses") as tmp:
        for side in SIDES:
            out = Path(tmp) / f"{side}.pt"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side]
            cmd += ["--placement", args.placement, "--out", str(out)]
            done = subprocess.run(cmd, env=env, check=False)
            if done.returncode != 0 or not out.exists():
                print(f"error: the {side} side failed (exit {done.returncode})", file=sys.stderr)
                return 2
            results[side] = torch.load(out, weights_only=False)
    return _compare(results, args.placement, args.tolerance)


# --- one side, in its own process --------------------------------------------------------------


def _side(side: str, placement: str) -> dict[str, Any]:
    if side == "mmpack":
        from mmpack.compat import nemo_rl as compat

        if placement == "none":
            compat.install(accelerate=True)
        else:
            compat.install(accelerate=True, placement=placement)
        assert compat.accelerated()
    torch.use_deterministic_algorithms(True)
    _float64_logprobs()
    out: dict[str, Any] = {"runs": {}}
    for loss_name in LOSSES:
        for mode in MODES:
            out["runs"][loss_name, mode] = _train(_loss_fn(loss_name), mode)
    import nemo_rl.data.multimodal_utils as mm

    out["packed_tensor"] = f"{mm.PackedTensor.__module__}.{mm.PackedTensor.__qualname__}"
    return out


def _float64_logprobs() -> None:
    """NeMo-RL's non-parallel logprob path without its float32 cast and ``.cuda()``."""
    from nemo_rl.algorithms.loss import utils

    def logprobs(
        input_ids: torch.Tensor,
        next_token_logits: torch.Tensor,
        seq_index: torch.Tensor | None = None,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: Any = None,
        context_parallel_group: Any = None,
        sampling_params: Any = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        assert vocab_parallel_group is None and sampling_params is None
        logprobs = torch.nn.functional.log_softmax(next_token_logits[:, :-1], dim=-1)
        return logprobs.gather(dim=-1, index=input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    utils.get_next_token_logprobs_from_logits = logprobs


def _loss_fn(name: str) -> Any:
    from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn, NLLLossFn

    return ClippedPGLossFn(ClippedPGLossConfig()) if name == "clipped_pg" else NLLLossFn()


def _grpo_batch() -> tuple[Any, list[torch.Tensor]]:
    """The train data of one GRPO step, built as ``grpo.py`` builds it; and the images."""
    from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message
    from nemo_rl.data.multimodal_utils import PackedTensor
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(SEED)
    images = []
    message_logs = []
    for _ in range(PROMPTS):
        patches = int(torch.randint(*PATCHES, (1,), generator=gen))
        image = torch.randn(patches, IMAGE_DIM, generator=gen, dtype=torch.float64)
        images.append(image)
        prompt_len = int(torch.randint(3, 9, (1,), generator=gen))
        user = {
            "role": "user",
            "content": "<image> question",
            "token_ids": torch.randint(1, VOCAB, (prompt_len,), generator=gen),
            "pixel_values": PackedTensor(image, dim_to_pack=0),
        }
        message_logs.append([user])
    loss_multiplier = torch.ones(PROMPTS, dtype=torch.float64)
    prompts = BatchedDataDict({"message_log": message_logs, "loss_multiplier": loss_multiplier})
    batch = prompts.repeat_interleave(GENERATIONS, share_immutable_media=True)

    rows = batch.size
    for message_log in batch["message_log"]:
        response_len = int(torch.randint(1, 25, (1,), generator=gen))
        message_log.append(
            {
                "role": "assistant",
                "content": "answer",
                "token_ids": torch.randint(1, VOCAB, (response_len,), generator=gen),
                "generation_logprobs": -5.5
                + 0.3 * torch.randn(response_len, generator=gen, dtype=torch.float64),
            }
        )
        # add_grpo_token_loss_masks_and_generation_logprobs: generated tokens only
        for message in message_log:
            generated = message["role"] == "assistant" and "generation_logprobs" in message
            mask = torch.ones_like if generated else torch.zeros_like
            message["token_loss_mask"] = mask(message["token_ids"])
            if "generation_logprobs" not in message:
                message["generation_logprobs"] = torch.zeros(
                    len(message["token_ids"]), dtype=torch.float64
                )
    batch["loss_multiplier"][5] = 0.0  # one row the loss must ignore

    flat, input_lengths = batched_message_log_to_flat_message(
        batch["message_log"],
        pad_value_dict={"token_ids": PAD},
        make_sequence_length_divisible_by=MAKE_SEQUENCE_LENGTH_DIVISIBLE_BY,
    )
    data = BatchedDataDict(
        {
            "input_ids": flat["token_ids"],
            "input_lengths": input_lengths,
            "generation_logprobs": flat["generation_logprobs"],
            "token_mask": flat["token_loss_mask"],
            "sample_mask": batch["loss_multiplier"],
        }
    )
    data.update(flat.get_multimodal_dict(as_tensors=False, pixel_dtype=torch.float64))
    width = data["input_ids"].shape[1]
    advantages = torch.randn(rows, 1, generator=gen, dtype=torch.float64)
    data["advantages"] = advantages.expand(rows, width).clone()
    for key in ("prev_logprobs", "reference_policy_logprobs"):
        noise = torch.randn(rows, width, generator=gen, dtype=torch.float64)
        data[key] = (-5.5 + 0.3 * noise) * data["token_mask"]
    data["row_id"] = torch.arange(rows)  # where each row went, read back from the shards

    pixel_values = data["pixel_values"]
    assert len(pixel_values) == rows and len(pixel_values.tensors) == PROMPTS, (
        "the G rows of a prompt do not share its image segments"
    )
    return data, images


class TinyVLM(torch.nn.Module):
    """A random-init causal LM whose input embeddings get a projection of the row's image."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        # GPT-2 rather than Llama or Qwen2: their RMSNorm computes in float32, whose rounding
        # would differ with the shape of a micro-batch and blur the comparison to ~1e-9.
        eager: dict[str, Any] = {"attn_implementation": "eager"}
        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **eager,
        )
        self.lm = GPT2LMHeadModel(config)
        self.image_proj = torch.nn.Linear(IMAGE_DIM, HIDDEN)

    def forward(self, input_ids: torch.Tensor, images: list[torch.Tensor]) -> torch.Tensor:
        """Logits [B, T, V] of right-padded rows (causal: padding changes no valid position)."""
        features = torch.stack([image.mean(dim=0) for image in images])
        embeds = self.lm.get_input_embeddings()(input_ids) + self.image_proj(features)[:, None]
        batch, seq_len = input_ids.shape
        out = self.lm(
            inputs_embeds=embeds,
            attention_mask=torch.ones(batch, seq_len, dtype=torch.bool),
            position_ids=torch.arange(seq_len).repeat(batch, 1),
        )
        return out.logits


def _row_images(mb: Any) -> list[torch.Tensor]:
    """Each row's image, read through the micro-batch's PackedTensor."""
    pixel_values = mb["pixel_values"]
    images = [pixel_values.slice([i]).as_tensor() for i in range(len(pixel_values))]
    # what the policy worker hands the model: get_multimodal_dict(as_tensors=True)
    whole = mb.get_multimodal_dict(as_tensors=True)["pixel_values"]
    assert torch.equal(whole, torch.cat(images)), "row slices disagree with the whole"
    return images


def _train(loss_fn: Any, mode: str) -> dict[str, Any]:
    data, images = _grpo_batch()
    torch.manual_seed(SEED)
    model = TinyVLM().to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    # lm_policy.py builds these (train: train_mb_tokens, batch_size=gbs)
    if mode == "sequence_packing":
        kwargs = {
            "sequence_packing_args": {
                "algorithm": "modified_first_fit_decreasing",
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "sequence_length_pad_multiple": MAKE_SEQUENCE_LENGTH_DIVISIBLE_BY,
                "microbatch_order": "packer",
                "max_tokens_per_microbatch": TRAIN_MB_TOKENS,
            }
        }
    else:
        kwargs = {
            "dynamic_batching_args": {
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "sequence_length_round": SEQUENCE_LENGTH_ROUND,
                "max_tokens_per_microbatch": TRAIN_MB_TOKENS,
            }
        }
    shards, sorted_indices = data.shard_by_batch_size(DP, batch_size=GBS, **kwargs)
    problems = _check_shards(data, shards, list(sorted_indices), mode)

    local_gbs = GBS // DP
    num_global_batches = data.size // GBS
    losses, grads, where = [], [], {}
    for gb in range(num_global_batches):
        # process_global_batch: counts over the global batch, summed over the DP ranks
        batches = [shard.get_batch(batch_idx=gb, batch_size=local_gbs) for shard in shards]
        global_valid_seqs = torch.stack([torch.sum(b["sample_mask"]) for b in batches]).sum()
        global_valid_toks = torch.stack(
            [torch.sum(b["token_mask"][:, 1:] * b["sample_mask"].unsqueeze(-1)) for b in batches]
        ).sum()
        optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for rank, batch in enumerate(batches):
            if mode == "sequence_packing":
                microbatches = batch.make_microbatch_iterator_for_packable_sequences()
            else:
                microbatches = batch.make_microbatch_iterator_with_dynamic_shapes()
            for mb_index, mb in enumerate(microbatches):
                row_images = _row_images(mb)
                for position, row in enumerate(mb["row_id"].tolist()):
                    if row in where:
                        problems.append(f"{mode}: row {row} trained twice")
                    where[row] = (gb, rank, mb_index, position)
                    if not torch.equal(row_images[position], images[row // GENERATIONS]):
                        problems.append(f"{mode}: row {row} does not have its prompt's image")
                step = _packed_loss if mode == "sequence_packing" else _padded_loss
                loss = step(model, mb, row_images, loss_fn, global_valid_seqs, global_valid_toks)
                # automodel_forward_backward: (loss * dp_size).backward(), averaged over DP
                loss.backward()
                total = total + loss.detach()
        losses.append(float(total))
        grads.append({n: _grad(p) for n, p in model.named_parameters()})
        optimizer.step()

    for row in range(data.size):
        if row not in where:
            problems.append(f"{mode}: row {row} never trained")
        elif where[row][0] != row // GBS:
            problems.append(f"{mode}: row {row} trained in global batch {where[row][0]}")
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "where": where,
        "problems": problems,
    }


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    assert param.grad is not None
    return param.grad.detach().clone()


def _padded_loss(
    model: TinyVLM,
    mb: Any,
    row_images: list[torch.Tensor],
    loss_fn: Any,
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
) -> torch.Tensor:
    """process_microbatch + LossPostProcessor without sequence packing: one padded forward."""
    from nemo_rl.algorithms.loss import prepare_loss_input

    logits = model(mb["input_ids"], row_images)
    loss_input, mb = prepare_loss_input(logits, mb, loss_fn, sampling_params=None)
    loss, _ = loss_fn(
        data=mb,
        global_valid_seqs=global_valid_seqs,
        global_valid_toks=global_valid_toks,
        **loss_input,
    )
    return loss


def _packed_loss(
    model: TinyVLM,
    mb: Any,
    row_images: list[torch.Tensor],
    loss_fn: Any,
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
) -> torch.Tensor:
    """process_microbatch + LossPostProcessor with sequence packing, on a CPU: the packed
    sequence and its cu_seqlens are NeMo-RL's; its logits are each row's own forward, laid out
    where varlen flash attention puts them."""
    from nemo_rl.algorithms.loss import SequencePackingLossWrapper, prepare_loss_input
    from nemo_rl.models.huggingface.common import get_flash_attention_kwargs, pack_sequences

    lengths = mb["input_lengths"]
    packed_ids, _, _ = pack_sequences(
        input_ids=mb["input_ids"],
        input_lengths=lengths,
        packed_sequence_size=[len(lengths)],
        padding_value=PAD,
        return_attention_mask=False,
        min_seq_len=TRAIN_MB_TOKENS,
    )
    cu_seqlens = get_flash_attention_kwargs(input_lengths=lengths).cu_seqlens_q
    pieces = []
    for i, length in enumerate(lengths.tolist()):
        ids = mb["input_ids"][i : i + 1, :length]
        start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        assert torch.equal(packed_ids[:, start:end], ids), "packed layout differs"
        pieces.append(model(ids, [row_images[i]]))
    used = int(cu_seqlens[-1])
    tail = pieces[0].new_zeros(1, packed_ids.shape[1] - used, VOCAB)
    logits = torch.cat([*pieces, tail], dim=1)

    def prepare(**kwargs: Any) -> Any:
        return prepare_loss_input(sampling_params=None, **kwargs)

    packed = SequencePackingLossWrapper(
        loss_fn=loss_fn, prepare_fn=prepare, cu_seqlens_q=cu_seqlens, cu_seqlens_q_padded=cu_seqlens
    )
    loss, _ = packed(logits, mb, global_valid_seqs, global_valid_toks)
    return loss


def _check_shards(data: Any, shards: list[Any], sorted_indices: list[int], mode: str) -> list[str]:
    """The returned indices must say where each row went (NeMo-RL's meaning, per mode)."""
    rows = [shard["row_id"].tolist() for shard in shards]
    if sorted(sorted_indices) != list(range(data.size)):
        return [f"{mode}: batch_sorted_indices is not a permutation of the rows"]
    if mode == "sequence_packing":
        expected = [row for shard_rows in rows for row in shard_rows]
    else:
        # each chunk sorted, then cut into DP runs of GBS // DP rows; shard s takes run s
        per_shard = GBS // DP
        expected = []
        for chunk in range(data.size // GBS):
            for shard_rows in rows:
                expected.extend(shard_rows[chunk * per_shard : (chunk + 1) * per_shard])
    if expected != sorted_indices:
        return [f"{mode}: batch_sorted_indices do not say where the rows went"]
    return []


# --- comparing ------------------------------------------------------------------------------


def _compare(results: dict[str, Any], placement: str, tolerance: float) -> int:
    call = "install(accelerate=True" + ("" if placement == "none" else f", placement={placement!r}")
    print(f"nemo_rl: no mmpack ({results['nemo_rl']['packed_tensor']})")
    print(f"mmpack:  {call}) ({results['mmpack']['packed_tensor']})")
    print(
        f"{PROMPTS} prompts x {GENERATIONS} rows, global batch {GBS}, DP {DP}, float64; "
        "ranks: the rank of each row of each prompt in the global batch (nemo_rl | mmpack)"
    )
    header = (
        f"{'loss':<10} {'mode':<16} {'gb':>2} {'loss nemo_rl':>20} {'loss mmpack':>20} "
        f"{'|d loss|':>9} {'max|d grad|':>11}  ranks"
    )
    print(header)
    print("-" * len(header))
    failed: list[str] = []
    for key in results["nemo_rl"]["runs"]:
        a, b = results["nemo_rl"]["runs"][key], results["mmpack"]["runs"][key]
        failed.extend(f"nemo_rl side: {p}" for p in a["problems"])
        failed.extend(f"mmpack side: {p}" for p in b["problems"])
        for gb, (loss_a, loss_b) in enumerate(zip(a["losses"], b["losses"], strict=True)):
            d_loss = abs(loss_a - loss_b)
            d_grad = max(
                float((a["grads"][gb][n] - b["grads"][gb][n]).abs().max()) for n in a["grads"][gb]
            )
            ranks = f"{_ranks(a['where'], gb)} | {_ranks(b['where'], gb)}"
            print(
                f"{key[0]:<10} {key[1]:<16} {gb:>2} {loss_a:>20.15f} {loss_b:>20.15f} "
                f"{d_loss:>9.2e} {d_grad:>11.2e}  {ranks}"
            )
            if not (d_loss <= tolerance and d_grad <= tolerance):
                failed.append(f"{key[0]} {key[1]} global batch {gb}: differs")
        d_param = max(float((a["params"][n] - b["params"][n]).abs().max()) for n in a["params"])
        if not d_param <= tolerance:
            failed.append(f"{key[0]} {key[1]}: parameters after the steps differ by {d_param:.2e}")
    # The two batching modes are two placements of the same rows: if they disagree on a side,
    # this simulation of the worker is off, and its verdict on placements means nothing.
    for side in SIDES:
        for loss_name in LOSSES:
            packed, dynamic = (results[side]["runs"][loss_name, mode] for mode in MODES)
            d_mode = max(
                max(abs(x - y) for x, y in zip(packed["losses"], dynamic["losses"], strict=True)),
                *(
                    float((g[n] - h[n]).abs().max())
                    for g, h in zip(packed["grads"], dynamic["grads"], strict=True)
                    for n in g
                ),
            )
            print(f"{side} {loss_name}: sequence packing vs dynamic batching: {d_mode:.2e}")
            if not d_mode <= tolerance:
                failed.append(f"{side} {loss_name}: the batching modes disagree ({d_mode:.2e})")
    if failed:
        print(f"\nFAIL (tolerance {tolerance:g}):")
        for line in failed:
            print(f"  {line}")
        return 1
    print(f"\nOK: every loss and gradient within {tolerance:g}")
    return 0


def _ranks(where: dict[int, tuple[int, int, int, int]], gb: int) -> str:
    groups = []
    for prompt in range(gb * GBS // GENERATIONS, (gb + 1) * GBS // GENERATIONS):
        rows = range(prompt * GENERATIONS, (prompt + 1) * GENERATIONS)
        groups.append("".join(str(where[r][1]) if r in where else "-" for r in rows))
    return " ".join(groups)


if __name__ == "__main__":
    sys.exit(main())
