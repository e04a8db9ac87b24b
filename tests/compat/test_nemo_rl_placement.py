"""``install(accelerate=True)``'s group-aware placement in NeMo-RL's ``shard_by_batch_size``:
the rows that share media land on one rank where balance allows, and nothing a trainer reads
changes but where each row is.

NeMo-RL needs a newer Python than this suite runs on: the tests run on the stand-in modules of
``support.nemo_rl_standins`` (NeMo-RL's sharding rules as plain Python). NeMo-RL's own loss
functions are the oracle of ``tests/nemo_rl_fidelity/placement_losses.py``, run beside NeMo-RL.
"""

from __future__ import annotations

import itertools
from typing import Any

import mmpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mmpack.compat import nemo_rl as compat
from mmpack.errors import PackingArgumentError
from mmpack.packing import PlacementCost
from reference import placement as ref
from support.nemo_rl_reference import ReferenceBatchedDataDict
from support.nemo_rl_standins import installed_standins

PATCH = 1176  # elements of one flattened patch: a segment's patch count is its size over this


def grpo_batch(
    prompts: int, group: int, width: int, seed: int, *, patches: tuple[int, int] = (4, 40)
) -> ReferenceBatchedDataDict:
    """A GRPO train batch: ``prompts`` prompts, each with 1-2 deduplicated images, expanded to
    ``group`` rows that share them; per-row token fields and a row id."""
    gen = torch.Generator().manual_seed(seed)
    per_prompt = []
    for _ in range(prompts):
        images = int(torch.randint(1, 3, (1,), generator=gen))
        parts = [
            mmpack.PackedTensor(
                torch.randn(int(torch.randint(*patches, (1,), generator=gen)), 8, generator=gen),
                0,
            ).enable_deduplication()
            for _ in range(images)
        ]
        per_prompt.append(mmpack.PackedTensor.merge_segments(parts))
    pixels = mmpack.PackedTensor.concat(per_prompt).repeat_interleave(group)
    grids = mmpack.PackedTensor.concat(
        [
            mmpack.PackedTensor(torch.tensor([[1, 2, 2]]), 0).enable_deduplication()
            for _ in range(prompts)
        ]
    ).repeat_interleave(group)
    n = prompts * group
    return ReferenceBatchedDataDict(
        {
            "input_ids": torch.randint(0, 1000, (n, width), generator=gen),
            "input_lengths": torch.randint(1, width + 1, (n,), generator=gen),
            "token_mask": torch.rand(n, width, generator=gen) > 0.3,
            "sample_mask": torch.ones(n),
            "advantages": torch.randn(n, generator=gen),
            "row": torch.arange(n),
            "pixel_values": pixels,
            "image_grid_thw": grids,
        }
    )


def packing_args(capacity: int, multiple: int = 1, order: str | None = None) -> dict[str, Any]:
    return {
        "max_tokens_per_microbatch": capacity,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": "modified_first_fit_decreasing",
        "sequence_length_pad_multiple": multiple,
        "microbatch_order": order,
    }


def dynamic_args(capacity: int, round_to: int) -> dict[str, Any]:
    return {
        "max_tokens_per_microbatch": capacity,
        "sequence_length_round": round_to,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }


def logical_rows(value: mmpack.PackedTensor) -> list[list[Any]]:
    """Every row's segments as (values, provenance) pairs."""
    out = []
    counts = value.logical_segment_counts_by_row()
    segments = iter(value.iter_logical_segments())
    for row in range(len(value)):
        out.append([next(segments).tolist() for _ in range(counts[row])])
    return out


def check_shards(
    batch: ReferenceBatchedDataDict,
    shards: list[Any],
    order: list[int],
    batch_size: int,
    *,
    packing: dict[str, Any] | None = None,
) -> None:
    """What a trainer relies on: every row once, in its own global batch, with its own data;
    equal work units per shard; micro-batch metadata by NeMo-RL's rules; ``order`` right."""
    total = len(batch["row"])
    chunks = total // batch_size
    seen: list[int] = []
    source_pixels = logical_rows(batch["pixel_values"])
    for shard in shards:
        rows = shard["row"].tolist()
        seen.extend(rows)
        index = torch.tensor(rows, dtype=torch.int64)
        for key in ("input_ids", "input_lengths", "token_mask", "advantages"):
            assert torch.equal(shard[key], batch[key].index_select(0, index)), key
        assert logical_rows(shard["pixel_values"]) == [source_pixels[r] for r in rows]
        if packing is not None:
            counts = shard.elem_counts_per_gb
            assert len(counts) == chunks and sum(counts) == len(rows)
            multiple = packing["sequence_length_pad_multiple"]
            start = 0
            for c in range(chunks):
                chunk_rows = rows[start : start + counts[c]]
                assert all(c * batch_size <= r < (c + 1) * batch_size for r in chunk_rows)
                spans = shard.micro_batch_indices[c]
                assert spans[0][0] == 0 and spans[-1][1] == counts[c]
                assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(spans))
                padded = [
                    -(-int(batch["input_lengths"][r]) // multiple) * multiple for r in chunk_rows
                ]
                sums = [sum(padded[a:b]) for a, b in spans]
                assert shard.micro_batch_lengths[c] == sums
                assert max(sums) <= packing["max_tokens_per_microbatch"]
                start += counts[c]
            # every shard runs the same number of micro-batches per global batch
            assert [len(s) for s in shard.micro_batch_indices] == [
                len(s) for s in shards[0].micro_batch_indices
            ]
        else:
            per = batch_size // len(shards)
            assert len(rows) == per * chunks
            for c in range(chunks):
                own = rows[c * per : (c + 1) * per]
                assert all(c * batch_size <= r < (c + 1) * batch_size for r in own)
                lengths = shard["input_lengths"][c * per : (c + 1) * per].tolist()
                assert lengths == sorted(lengths)
    assert sorted(seen) == list(range(total))
    if packing is not None:
        assert order == seen  # the shards' rows one shard after another
    else:
        # NeMo-RL's dynamic order: per global batch, each shard's rows
        per = batch_size // len(shards)
        rows_of = [s["row"].tolist() for s in shards]
        assert order == [
            r for c in range(chunks) for rows in rows_of for r in rows[c * per : (c + 1) * per]
        ]
        seen = order
    # NeMo-RL's reorder_data (the inverse permutation of ``order``) puts the rows back
    merged = torch.tensor(seen)
    assert merged[torch.argsort(torch.tensor(order))].tolist() == list(range(total))


@settings(max_examples=25, deadline=None)
@given(
    shards=st.sampled_from([1, 2, 4]),
    prompts_per_shard=st.integers(1, 4),
    group=st.sampled_from([1, 2, 4, 8]),
    chunks=st.integers(1, 3),
    width=st.integers(1, 48),
    multiple=st.sampled_from([1, 8]),
    capacity=st.integers(64, 400),
    order=st.sampled_from([None, "packer", "largest_first"]),
    seed=st.integers(0, 2**16),
)
def test_sequence_packing_moves_rows_only_between_ranks_of_their_global_batch(
    shards: int,
    prompts_per_shard: int,
    group: int,
    chunks: int,
    width: int,
    multiple: int,
    capacity: int,
    order: str | None,
    seed: int,
) -> None:
    with installed_standins():
        compat.install(accelerate=True)
        batch_size = shards * prompts_per_shard * group
        batch = grpo_batch(batch_size * chunks // group, group, width, seed)
        args = packing_args(max(capacity, width + multiple), multiple, order)
        out, order_out = batch.shard_by_batch_size(
            shards, batch_size=batch_size, sequence_packing_args=args
        )
        check_shards(batch, out, order_out, batch_size, packing=args)


@settings(max_examples=25, deadline=None)
@given(
    shards=st.sampled_from([1, 2, 4]),
    prompts_per_shard=st.integers(1, 4),
    group=st.sampled_from([1, 2, 4, 8]),
    chunks=st.integers(1, 3),
    width=st.integers(1, 48),
    round_to=st.sampled_from([1, 8]),
    seed=st.integers(0, 2**16),
)
def test_dynamic_batching_moves_rows_only_between_ranks_of_their_global_batch(
    shards: int,
    prompts_per_shard: int,
    group: int,
    chunks: int,
    width: int,
    round_to: int,
    seed: int,
) -> None:
    with installed_standins():
        compat.install(accelerate=True)
        batch_size = shards * prompts_per_shard * group
        batch = grpo_batch(batch_size * chunks // group, group, width, seed)
        args = dynamic_args(max(64, width + round_to), round_to)
        out, order_out = batch.shard_by_batch_size(
            shards, batch_size=batch_size, dynamic_batching_args=args
        )
        check_shards(batch, out, order_out, batch_size)
        # NeMo-RL's micro-batches: per position, the longest row over the shards
        per = batch_size // shards
        for c in range(chunks):
            longest = [max(int(s["input_lengths"][c * per + r]) for s in out) for r in range(per)]
            longest = [min(-(-x // round_to) * round_to, width) for x in longest]
            spans = out[0].micro_batch_indices[c]
            for a, b in spans:
                assert (b - a) * max(longest[a:b]) <= args["max_tokens_per_microbatch"]
        assert all(s.micro_batch_indices == out[0].micro_batch_indices for s in out)


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_a_prompts_rows_share_one_rank(mode: str) -> None:
    """G = 8 rows of 16 prompts over 4 ranks: each prompt's images land on one rank, so each
    rank holds a quarter of the unique images (NeMo-RL's placement: nearly all of them)."""
    with installed_standins():
        batch = grpo_batch(16, 8, 64, 7, patches=(400, 800))
        kwargs: dict[str, Any] = (
            {"sequence_packing_args": packing_args(512)}
            if mode == "packing"
            else {"dynamic_batching_args": dynamic_args(512, 8)}
        )
        unique = {}
        for placement in ("groups", "nemo_rl"):
            compat.install(accelerate=True, placement=placement)
            out, _ = batch.shard_by_batch_size(4, batch_size=128, **kwargs)
            unique[placement] = [len(set(s["pixel_values"]._segment_provenance)) for s in out]
            compat.uninstall()
        prompts_per_rank = [16 / 4 * 1.5] * 4  # 1-2 images per prompt
        assert sum(unique["groups"]) == len(set(batch["pixel_values"]._segment_provenance))
        assert max(unique["groups"]) <= 1.6 * max(prompts_per_rank)
        assert min(unique["nemo_rl"]) > max(unique["groups"])


def test_batches_without_shared_media_are_sharded_as_nemo_rl_shards_them() -> None:
    with installed_standins():
        batch = grpo_batch(16, 1, 32, 3)
        args = packing_args(128)
        theirs = ReferenceBatchedDataDict.shard_by_batch_size(
            batch, 4, batch_size=8, sequence_packing_args=args
        )
        compat.install(accelerate=True)
        ours = batch.shard_by_batch_size(4, batch_size=8, sequence_packing_args=args)
        assert ours[1] == theirs[1]
        for a, b in zip(ours[0], theirs[0], strict=True):
            assert a["row"].tolist() == b["row"].tolist()
            assert a.micro_batch_lengths == b.micro_batch_lengths


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(1000, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1000)
    ).double()


def step_gradients(
    model: torch.nn.Module, shards: list[Any], batch_size: int, dp: int, packing: bool
) -> list[torch.Tensor]:
    """A train step as NeMo-RL's policy worker runs it on every rank: per global batch (the
    shard's rows of it, as ``get_batch`` cuts them), the valid tokens over all ranks normalise
    a token-mean policy-gradient loss summed over each rank's micro-batches; gradients summed
    over ranks (the all-reduce)."""
    model.zero_grad()
    chunks = len(shards[0].micro_batch_indices)
    keys = ("input_ids", "token_mask", "sample_mask", "advantages")
    for c in range(chunks):
        parts = []
        for shard in shards:
            if packing:
                start = sum(shard.elem_counts_per_gb[:c])
                end = start + shard.elem_counts_per_gb[c]
            else:
                start, end = c * batch_size // dp, (c + 1) * batch_size // dp
            parts.append(({k: shard[k][start:end] for k in keys}, shard.micro_batch_indices[c]))
        valid = sum(
            float((p["token_mask"][:, 1:] * p["sample_mask"][:, None]).sum()) for p, _ in parts
        )
        for part, spans in parts:
            for a, b in spans:
                ids = part["input_ids"][a:b]
                logits = model(ids[:, :-1])
                logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
                mask = part["token_mask"][a:b, 1:] * part["sample_mask"][a:b, None]
                weight = part["advantages"][a:b, None].double()
                loss = -(logp * weight * mask).sum() / valid
                loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_a_train_steps_gradients_do_not_depend_on_the_placement(mode: str) -> None:
    with installed_standins():
        batch = grpo_batch(8, 4, 24, 11, patches=(200, 400))
        kwargs: dict[str, Any] = (
            {"sequence_packing_args": packing_args(96)}
            if mode == "packing"
            else {"dynamic_batching_args": dynamic_args(96, 1)}
        )
        grads = {}
        rows = {}
        for placement in ("nemo_rl", "groups"):
            compat.install(accelerate=True, placement=placement)
            out, _ = batch.shard_by_batch_size(4, batch_size=16, **kwargs)
            rows[placement] = [s["row"].tolist() for s in out]
            grads[placement] = step_gradients(tiny_model(0), out, 16, 4, mode == "packing")
            compat.uninstall()
        assert rows["nemo_rl"] != rows["groups"]  # the placements differ
        for a, b in zip(grads["nemo_rl"], grads["groups"], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_bad_placement_arguments_are_refused_before_anything_changes() -> None:
    with installed_standins():
        with pytest.raises(PackingArgumentError, match="placement"):
            compat.install(accelerate=True, placement="spread")
        assert compat.installed() is None
        with pytest.raises(PackingArgumentError, match="placement_cost"):
            compat.install(accelerate=True, placement_cost={"patch": 1.0})  # type: ignore[arg-type]
        assert compat.installed() is None
        compat.install(accelerate=True, placement_cost=PlacementCost(patch=0.5))
        assert compat.accelerated()


def rank_compute(batch: ReferenceBatchedDataDict, shards: list[Any], dynamic: bool) -> float:
    """The worst rank's compute, priced independently (``tests/reference/placement.py``): its
    rows' tokens, linear and quadratic (under dynamic batching, the micro-batches every rank
    runs, padded to their lengths), plus the patches of its unique images, once a rank."""
    cost = PlacementCost()
    provenance = {}
    segments_of_row = []
    for key in ("pixel_values", "image_grid_thw"):
        value = batch[key]
        counts = value.logical_segment_counts_by_row()
        ids = value._segment_provenance
        offsets, indices = value.csr()
        for row in range(len(value)):
            if key == "pixel_values":
                segments_of_row.append([])
            for k in indices[offsets[row] : offsets[row + 1]].tolist():
                numel = value.tensors[k].numel()
                sid = provenance.setdefault(ids[k], len(provenance))
                segments_of_row[row].append((sid, -(-numel // PATCH)))
        assert len(counts) == len(value)
    patches = {sid: p for row in segments_of_row for sid, p in row}
    segment_costs = ref.segment_costs_of(
        [patches[s] for s in range(len(patches))], cost.patch, cost.patch_attention
    )
    ranks = [0] * len(batch["row"])
    for r, shard in enumerate(shards):
        for row in shard["row"].tolist():
            ranks[row] = r
    item_segments = [[sid for sid, _ in row] for row in segments_of_row]
    zero = [0.0] * len(ranks)
    vision = ref.rank_costs(ranks, zero, item_segments, segment_costs, len(shards))[0]
    if not dynamic:
        tokens = ref.row_costs(batch["input_lengths"].tolist(), cost.token, cost.attention)
        return max(ref.rank_costs(ranks, tokens, item_segments, segment_costs, len(shards))[0])
    padded = 0.0
    for spans, lengths in zip(
        shards[0].micro_batch_indices, shards[0].micro_batch_lengths, strict=True
    ):
        for (a, b), length in zip(spans, lengths, strict=True):
            padded += (b - a) * ref.row_costs([length], cost.token, cost.attention)[0]
    return padded + max(vision)


@settings(max_examples=20, deadline=None)
@given(
    mode=st.sampled_from(["packing", "dynamic"]),
    shards=st.sampled_from([2, 4]),
    group=st.sampled_from([2, 4, 8]),
    width=st.integers(16, 96),
    seed=st.integers(0, 2**16),
)
def test_the_worst_rank_never_computes_more_than_the_tolerance_over_nemo_rls(
    mode: str, shards: int, group: int, width: int, seed: int
) -> None:
    """mmpack's placement is used only where its worst rank costs at most 5 % more than NeMo-RL's
    (and it encodes fewer images); otherwise NeMo-RL's placement stays."""
    with installed_standins():
        batch = grpo_batch(4 * shards, group, width, seed, patches=(100, 600))
        batch_size = 4 * shards * group
        kwargs: dict[str, Any] = (
            {"sequence_packing_args": packing_args(max(2 * width, 128))}
            if mode == "packing"
            else {"dynamic_batching_args": dynamic_args(max(2 * width, 128), 8)}
        )
        theirs, _ = ReferenceBatchedDataDict.shard_by_batch_size(
            batch, shards, batch_size=batch_size, **kwargs
        )
        compat.install(accelerate=True)
        ours, _ = batch.shard_by_batch_size(shards, batch_size=batch_size, **kwargs)
        dynamic = mode == "dynamic"
        assert rank_compute(batch, ours, dynamic) <= rank_compute(batch, theirs, dynamic) * (
            1 + 0.05 + 1e-9
        )


def test_a_row_longer_than_a_micro_batch_gets_nemo_rls_error() -> None:
    with installed_standins():
        batch = grpo_batch(8, 4, 40, 5)
        batch["input_lengths"][3] = 40
        args = packing_args(32)
        with pytest.raises(Exception) as theirs:
            ReferenceBatchedDataDict.shard_by_batch_size(
                batch, 4, batch_size=16, sequence_packing_args=args
            )
        compat.install(accelerate=True)
        with pytest.raises(Exception) as ours:
            batch.shard_by_batch_size(4, batch_size=16, sequence_packing_args=args)
        assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


def test_a_zero_length_row_nemo_rl_packs_is_packed_as_nemo_rl_packs_it() -> None:
    """First-fit decreasing packs a row of length 0; mmpack's packer refuses one, so the
    grouped path leaves such a global batch to NeMo-RL's placement."""
    with installed_standins():
        batch = grpo_batch(8, 4, 40, 6)
        args = packing_args(96)
        args["algorithm"] = "first_fit_decreasing"
        batch["input_lengths"][2] = 0
        theirs = ReferenceBatchedDataDict.shard_by_batch_size(
            batch, 4, batch_size=32, sequence_packing_args=args
        )
        compat.install(accelerate=True)
        ours = batch.shard_by_batch_size(4, batch_size=32, sequence_packing_args=args)
        assert ours[1] == theirs[1]
