"""``install(accelerate=True)``: mmpack's versions of NeMo-RL's ``BatchedDataDict`` methods
(``repeat_interleave``, ``shard_by_batch_size``, ``from_batches``) and of
``batched_message_log_to_flat_message``.

NeMo-RL needs a newer Python than this suite runs on, so each test registers small stand-ins
for ``nemo_rl.data.multimodal_utils``, ``nemo_rl.distributed.batched_data_dict`` and
``nemo_rl.data.llm_message_utils`` holding the plain versions of ``support.nemo_rl_reference``,
and compares the accelerated ones with them. NeMo-RL's own tests run against the real modules
with ``tests/nemo_rl_fidelity/run_fidelity.py --accelerate``.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import mmpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mmpack.compat import nemo_rl as compat
from support.nemo_rl_reference import (
    ReferenceBatchedDataDict,
    reference_flatten,
)
from support.nemo_rl_standins import installed_standins

BatchedDataDict = ReferenceBatchedDataDict


@pytest.fixture
def nemo() -> Iterator[types.ModuleType]:
    with installed_standins() as batched:
        yield batched


def grpo_batch() -> BatchedDataDict:
    image = object()
    rows = []
    for i in range(3):
        base = torch.arange(10 + i)
        pixels = mmpack.PackedTensor(torch.randn(4 + i, 3), dim_to_pack=0)
        rows.append(
            [
                {"role": "system", "token_ids": base[:4]},  # a view: shares storage with the next
                {"role": "user", "token_ids": base, "pixel_values": pixels, "meta": ("t", i)},
            ]
        )
    return BatchedDataDict(
        {
            "message_log": rows,
            "loss_multiplier": torch.ones(3),
            "vllm_images": [[image, torch.zeros(2)] for _ in range(3)],
            "extra_env_info": [{"answer": str(i), "tags": ["a"]} for i in range(3)],
        }
    )


def describe(batch: Any) -> Any:
    """Values, types and identity classes (objects and tensor storages) of a batch."""
    ids: dict[int, int] = {}
    storages: dict[int, int] = {}

    def walk(v: Any) -> Any:
        ref = ids.setdefault(id(v), len(ids))
        if isinstance(v, torch.Tensor):
            return (
                "T",
                ref,
                storages.setdefault(v.untyped_storage().data_ptr(), len(storages)),
                v.tolist(),
            )
        if isinstance(v, mmpack.PackedTensor):
            return ("P", ref, [walk(t) for t in v.tensors], v._segment_provenance, len(v))
        if isinstance(v, dict):
            return ("D", ref, [(k, walk(x)) for k, x in v.items()])
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, ref, [walk(x) for x in v])
        return ("A", ref if type(v) is object else None, v if type(v) is not object else None)

    return (
        type(batch).__name__,
        [(k, walk(v)) for k, v in batch.data.items()],
        batch.micro_batch_indices,
    )


@pytest.mark.parametrize("share", [True, False])
def test_accelerated_repeat_interleave_equals_deepcopy_version(
    nemo: types.ModuleType, share: bool
) -> None:
    reference_method = nemo.BatchedDataDict.repeat_interleave
    assert compat.install(accelerate=True, placement="nemo_rl") == "patched"
    assert compat.accelerated()
    assert nemo.BatchedDataDict.repeat_interleave is not reference_method
    batch = grpo_batch()
    ours = batch.repeat_interleave(4, share_immutable_media=share)
    theirs = reference_method(batch, 4, share_immutable_media=share)
    # Described with the source batch, so that what is shared with it shows too.
    assert describe(BatchedDataDict({"src": batch.data, "out": ours.data})) == describe(
        BatchedDataDict({"src": batch.data, "out": theirs.data})
    )
    rows = ours["message_log"]
    assert len(rows) == 12
    assert rows[0][1]["token_ids"] is not rows[1][1]["token_ids"]
    rows[0][1]["token_ids"][0] = -1  # copies are independent
    assert rows[1][1]["token_ids"][0] == 0 and batch["message_log"][0][1]["token_ids"][0] == 0
    # The system turn is a view of the user turn's ids in the source, and still is in each copy.
    assert (
        rows[0][0]["token_ids"].untyped_storage().data_ptr()
        == rows[0][1]["token_ids"].untyped_storage().data_ptr()
    )
    shared_media = rows[0][1]["pixel_values"].tensors[0] is rows[1][1]["pixel_values"].tensors[0]
    assert shared_media is share
    assert (ours["vllm_images"][0][0] is batch["vllm_images"][0][0]) is share


def test_packed_tensor_values_are_refused_like_nemo_rl(nemo: types.ModuleType) -> None:
    compat.install(accelerate=True, placement="nemo_rl")
    batch = BatchedDataDict({"pixel_values": mmpack.PackedTensor(torch.ones(2, 3), dim_to_pack=0)})
    with pytest.raises(NotImplementedError, match="PackedTensor does not currently support"):
        batch.repeat_interleave(2)


def test_uninstall_restores_nemo_rl_methods(nemo: types.ModuleType) -> None:
    original = nemo.BatchedDataDict.__dict__["repeat_interleave"]
    compat.install()
    assert not compat.accelerated()
    assert nemo.BatchedDataDict.__dict__["repeat_interleave"] is original
    compat.install(accelerate=True, placement="nemo_rl")  # a second call adds the methods
    assert nemo.BatchedDataDict.__dict__["repeat_interleave"] is not original
    compat.uninstall()
    assert nemo.BatchedDataDict.__dict__["repeat_interleave"] is original
    assert not compat.accelerated() and compat.installed() is None


def test_accelerate_without_nemo_rl_changes_nothing() -> None:
    saved = {
        name: module for name, module in sys.modules.items() if name.split(".")[0] == "nemo_rl"
    }
    for name in saved:
        del sys.modules[name]
    compat.uninstall()
    try:
        with pytest.raises(ImportError, match=r"nemo_rl\.distributed\.batched_data_dict"):
            compat.install(accelerate=True, placement="nemo_rl")
        assert compat.installed() is None and not compat.accelerated()
        assert "nemo_rl.data.multimodal_utils" not in sys.modules
        assert compat.install() == "shim"
        with pytest.raises(ImportError, match="shim"):
            compat.install(accelerate=True, placement="nemo_rl")
    finally:
        compat.uninstall()
        sys.modules.update(saved)


# ------------------------------------------------------------------ sharding, stacking, flatten


def summary(value: Any, labels: dict[int, int]) -> Any:
    """Values, dtypes and shapes; which objects are the same object (labels in first-seen
    order); a PackedTensor's physical layout (segments by identity, offsets, indices,
    provenance) and its logical rows."""

    def label(v: Any) -> int:
        return labels.setdefault(id(v), len(labels))

    if isinstance(value, torch.Tensor):
        return ("T", value.dtype, tuple(value.shape), value.tolist())
    if isinstance(value, mmpack.PackedTensor):
        return (
            "P",
            len(value),
            [label(t) for t in value.tensors],
            value._row_offsets,
            value._segment_indices,
            value._segment_provenance,
            value.logical_segment_counts_by_row(),
            [t.tolist() for t in value.iter_logical_segments()],
        )
    if isinstance(value, list):
        return ("L", [label(v) for v in value])
    if isinstance(value, ReferenceBatchedDataDict):
        return (
            type(value).__name__,
            [(k, summary(v, labels)) for k, v in value.data.items()],
            value.micro_batch_indices,
            value.micro_batch_lengths,
            value.elem_counts_per_gb,
        )
    if isinstance(value, tuple):
        return ("tuple", [summary(v, labels) for v in value])
    raise TypeError(type(value))


def same(ours: Any, theirs: Any, source: Any = None) -> None:
    """``ours`` and ``theirs`` agree in everything ``summary`` shows, objects labelled by
    identity against a shared ``source`` first."""
    labels_a: dict[int, int] = {}
    labels_b: dict[int, int] = {}
    if source is not None:
        summary(source, labels_a)
        summary(source, labels_b)
    assert summary(ours, labels_a) == summary(theirs, labels_b)


def as_list(result: Any) -> Any:
    shards, order = result
    return tuple([*shards, ReferenceBatchedDataDict({"order": list(order)})])


def train_batch(rows: int, width: int, seed: int) -> ReferenceBatchedDataDict:
    """A train batch as the GRPO path shards it: token tensors, lengths, a 3-D per-token field,
    a list, and deduplicated images that several rows share."""
    gen = torch.Generator().manual_seed(seed)
    prompts = max(1, rows // 4)
    images = [torch.randn(2 + i % 3, 3, generator=gen) for i in range(prompts + 1)]
    per_prompt = [
        mmpack.PackedTensor.merge_segments(
            [
                mmpack.PackedTensor(images[(p + k) % len(images)], 0).enable_deduplication()
                for k in range(p % 3)
            ]
        )
        if p % 3
        else mmpack.PackedTensor.empty_rows_like(
            mmpack.PackedTensor(images[0], 0).enable_deduplication(), 1
        )
        for p in range(prompts)
    ]
    pixels = mmpack.PackedTensor.flattened_concat([per_prompt[r % prompts] for r in range(rows)])
    return ReferenceBatchedDataDict(
        {
            "input_ids": torch.randint(0, 1000, (rows, width), generator=gen),
            "input_lengths": torch.randint(1, width + 1, (rows,), generator=gen, dtype=torch.int32),
            "token_mask": torch.rand(rows, width, generator=gen) > 0.5,
            "teacher_topk": torch.randn(rows, width, 2, generator=gen),
            "sample_mask": torch.rand(rows, generator=gen),
            "idx": [object() for _ in range(rows)],
            "pixel_values": pixels,
        }
    )


def packing_args(capacity: int) -> dict[str, Any]:
    """NeMo-RL's sequence-packing arguments for ``train_batch``'s keys."""
    return {
        "max_tokens_per_microbatch": capacity,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": "modified_first_fit_decreasing",
        "sequence_length_pad_multiple": 1,
    }


@settings(max_examples=30, deadline=None)
@given(
    shards=st.sampled_from([1, 2, 4]),
    chunks=st.integers(1, 3),
    per_shard=st.integers(1, 6),
    width=st.integers(1, 40),
    multiple=st.sampled_from([1, 8]),
    capacity=st.integers(48, 160),
    algorithm=st.sampled_from(["modified_first_fit_decreasing", "first_fit_decreasing"]),
    microbatch_order=st.sampled_from([None, "packer", "largest_first"]),
    seed=st.integers(0, 2**16),
)
def test_accelerated_sequence_packing_shards_equal_the_plain_version(
    shards: int,
    chunks: int,
    per_shard: int,
    width: int,
    multiple: int,
    capacity: int,
    algorithm: str,
    microbatch_order: str | None,
    seed: int,
) -> None:
    with installed_standins() as batched:
        batch_size = shards * per_shard
        batch = train_batch(batch_size * chunks, width, seed)
        args = {
            "max_tokens_per_microbatch": capacity,
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "algorithm": algorithm,
            "sequence_length_pad_multiple": multiple,
            "microbatch_order": microbatch_order,
        }
        calls = ReferenceBatchedDataDict.reference_calls
        theirs = ReferenceBatchedDataDict.shard_by_batch_size(
            batch, shards, batch_size=batch_size, sequence_packing_args=args
        )
        compat.install(accelerate=True, placement="nemo_rl")
        fast_calls = ReferenceBatchedDataDict.reference_calls
        ours = batch.shard_by_batch_size(shards, batch_size=batch_size, sequence_packing_args=args)
        # the fast path ran (the plain method was not called again)
        assert ReferenceBatchedDataDict.reference_calls == fast_calls == calls + 1
        assert all(type(s) is batched.SlicedDataDict for s in ours[0])
        same(as_list(ours), as_list(theirs), batch)


@settings(max_examples=30, deadline=None)
@given(
    shards=st.sampled_from([1, 2, 4]),
    chunks=st.integers(1, 3),
    per_shard=st.integers(1, 6),
    width=st.integers(1, 40),
    round_to=st.sampled_from([1, 8, 64]),
    seed=st.integers(0, 2**16),
)
def test_accelerated_dynamic_batching_shards_equal_the_plain_version(
    shards: int, chunks: int, per_shard: int, width: int, round_to: int, seed: int
) -> None:
    with installed_standins():
        batch_size = shards * per_shard
        batch = train_batch(batch_size * chunks, width, seed)
        # ties in the lengths: the sort must keep NeMo-RL's stable order
        batch["input_lengths"] = batch["input_lengths"] // 4 + 1
        args = {
            "max_tokens_per_microbatch": max(64, width),
            "sequence_length_round": round_to,
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
        }
        theirs = ReferenceBatchedDataDict.shard_by_batch_size(
            batch, shards, batch_size=batch_size, dynamic_batching_args=args
        )
        compat.install(accelerate=True, placement="nemo_rl")
        calls = ReferenceBatchedDataDict.reference_calls
        ours = batch.shard_by_batch_size(shards, batch_size=batch_size, dynamic_batching_args=args)
        assert ReferenceBatchedDataDict.reference_calls == calls
        same(as_list(ours), as_list(theirs), batch)
        # every shard shares NeMo-RL's one micro-batch list, as NeMo-RL's shards do
        assert len({id(s.micro_batch_indices) for s in ours[0]}) == 1


def test_sharding_outside_the_fast_path_runs_nemo_rls_method() -> None:
    with installed_standins():
        compat.install(accelerate=True, placement="nemo_rl")
        batch = train_batch(8, 5, 0)
        args = {
            "max_tokens_per_microbatch": 64,
            "sequence_length_round": 8,
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
        }
        for kwargs in (
            {"allow_uneven_shards": True},  # the plain path of NeMo-RL's method
            {"dynamic_batching_args": args, "sequence_packing_args": args},
            {"dynamic_batching_args": {**args, "input_key": "missing"}},
        ):
            calls = ReferenceBatchedDataDict.reference_calls
            with pytest.raises((NotImplementedError, KeyError)):
                batch.shard_by_batch_size(2, **kwargs)
            assert ReferenceBatchedDataDict.reference_calls == calls + 1
        # lengths over the micro-batch capacity: NeMo-RL's own refusal, not ours
        calls = ReferenceBatchedDataDict.reference_calls
        with pytest.raises(AssertionError, match="padded length"):
            batch.shard_by_batch_size(
                2, dynamic_batching_args={**args, "max_tokens_per_microbatch": 1}
            )
        assert ReferenceBatchedDataDict.reference_calls == calls + 1


@settings(max_examples=40, deadline=None)
@given(
    widths=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    rows=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    dtype=st.sampled_from([torch.int64, torch.bool, torch.float32, torch.int32]),
    pad=st.sampled_from([None, 0, 1, -100]),
)
def test_accelerated_from_batches_equals_the_plain_version(
    widths: list[int], rows: list[int], dtype: torch.dtype, pad: int | None
) -> None:
    with installed_standins():
        gen = torch.Generator().manual_seed(sum(widths) + sum(rows))
        batches = []
        for w, n in zip(widths, rows, strict=False):
            if not n and len(batches) == len(widths) - 1 and not batches:
                n = 1
            values = torch.randint(0, 2, (n, w), generator=gen).to(dtype)
            batches.append(
                {
                    "input_ids": values,
                    "lengths": torch.arange(n),
                    "extra": torch.ones(n, w, 2),
                    "names": [f"r{i}" for i in range(n)],
                }
            )
        pads = None if pad is None else {"input_ids": pad}
        if sum(b["input_ids"].shape[0] for b in batches) == 0:
            batches[0] = {k: v for k, v in batches[0].items()}
        theirs_error = ours_error = None
        try:
            theirs = ReferenceBatchedDataDict.from_batches(batches, pads)
        except RuntimeError as exc:  # pad_sequence of no rows at all
            theirs_error = type(exc)
        compat.install(accelerate=True, placement="nemo_rl")
        try:
            ours = ReferenceBatchedDataDict.from_batches(batches, pads)
        except RuntimeError as exc:
            ours_error = type(exc)
        assert ours_error == theirs_error
        if theirs_error is None:
            same(ours, theirs)
            assert type(ours) is ReferenceBatchedDataDict


def test_from_batches_width_comes_from_rows_only() -> None:
    # a batch without rows but a wider tensor does not widen pad_sequence's output
    with installed_standins():
        batches = [
            {"input_ids": torch.ones(2, 3, dtype=torch.int64)},
            {"input_ids": torch.ones(0, 9, dtype=torch.int64)},
        ]
        theirs = ReferenceBatchedDataDict.from_batches(batches)
        compat.install(accelerate=True, placement="nemo_rl")
        ours = ReferenceBatchedDataDict.from_batches(batches)
        assert ours["input_ids"].shape == theirs["input_ids"].shape == (2, 3)


def message_logs(seed: int, rows: int, experts: bool, missing: bool) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    image = mmpack.PackedTensor(torch.randn(4, 3, generator=gen), 0).enable_deduplication()
    logs = []
    for r in range(rows):
        log = []
        for turn, role in enumerate(("system", "user", "assistant")):
            n = int(torch.randint(0, 9, (1,), generator=gen))
            message: dict[str, Any] = {
                "role": role,
                "content": f"{role} {r}",
                "token_ids": torch.randint(0, 99, (n,), generator=gen),
                "token_loss_mask": torch.full((n,), role == "assistant", dtype=torch.bool),
            }
            if role == "assistant" and not (missing and r % 2):
                message["generation_logprobs"] = torch.randn(n, generator=gen)
            if role == "user" and r % 3 != 1:
                message["pixel_values"] = image
            if experts:
                message["routed_experts"] = torch.randint(0, 8, (n, 2), generator=gen)
            log.append(message)
            del turn
        logs.append(log)
    return logs


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 7),
    experts=st.booleans(),
    missing=st.booleans(),
    divisible=st.sampled_from([1, 8]),
    pads=st.sampled_from([None, {"token_ids": 7}, {"token_ids": 0, "generation_logprobs": -1}]),
)
def test_accelerated_flatten_equals_the_plain_version(
    seed: int,
    rows: int,
    experts: bool,
    missing: bool,
    divisible: int,
    pads: dict[str, int] | None,
) -> None:
    with installed_standins() as batched:
        messages = sys.modules["nemo_rl.data.llm_message_utils"]
        logs = message_logs(seed, rows, experts, missing and not experts)
        plain = messages.batched_message_log_to_flat_message
        theirs, their_lengths = plain(logs, pads, divisible)
        # (install rebinds every module's copy of the function, this module's included)
        compat.install(accelerate=True, placement="nemo_rl")
        flatten = messages.batched_message_log_to_flat_message
        assert flatten is not plain
        ours, our_lengths = flatten(logs, pads, divisible)
        assert torch.equal(our_lengths, their_lengths) and our_lengths.dtype == torch.int32
        assert list(ours.data) == list(theirs.data)  # NeMo-RL's key order
        same(ours, theirs, ReferenceBatchedDataDict({"logs": logs}))
        assert type(ours) is batched.BatchedDataDict


def test_flatten_outside_the_fast_path_runs_nemo_rls_function() -> None:
    with installed_standins():
        messages = sys.modules["nemo_rl.data.llm_message_utils"]
        logs = message_logs(0, 3, False, False)
        # NeMo-RL's per-row torch.cat promotes a row's mixed dtypes: the fast path must not
        logs[0][2]["token_ids"] = logs[0][2]["token_ids"].to(torch.int32)
        theirs, _ = reference_flatten(logs, None, 1)
        compat.install(accelerate=True, placement="nemo_rl")
        ours, _ = messages.batched_message_log_to_flat_message(logs, None, 1)
        same(ours, theirs, ReferenceBatchedDataDict({"logs": logs}))
        assert ours["token_ids"].dtype == torch.int64
        # rows of different dtypes: NeMo-RL's error (the stand-in's), not a promoted result
        logs = message_logs(0, 3, False, False)
        for message in logs[1]:
            message["token_ids"] = message["token_ids"].to(torch.int32)
        with pytest.raises(AssertionError, match="inconsistent types"):
            messages.batched_message_log_to_flat_message(logs, None, 1)


def test_uninstall_restores_the_flatten_everywhere() -> None:
    with installed_standins():
        messages = sys.modules["nemo_rl.data.llm_message_utils"]
        importer = types.ModuleType("nemo_rl_importer")
        plain = messages.batched_message_log_to_flat_message
        importer.batched_message_log_to_flat_message = plain  # type: ignore[attr-defined]
        sys.modules["nemo_rl_importer"] = importer
        try:
            compat.install(accelerate=True, placement="nemo_rl")
            fast = messages.batched_message_log_to_flat_message
            assert importer.batched_message_log_to_flat_message is fast is not plain
            compat.uninstall()
            assert messages.batched_message_log_to_flat_message is plain
            assert importer.batched_message_log_to_flat_message is plain
        finally:
            del sys.modules["nemo_rl_importer"]


def test_fast_paths_leave_nemo_rls_edge_cases_to_nemo_rl() -> None:
    with installed_standins():
        messages = sys.modules["nemo_rl.data.llm_message_utils"]
        plain_flatten = messages.batched_message_log_to_flat_message
        # pad_sequence converts the pad value through a double: 2**53 + 1 pads as 2**53
        batches = [
            {"input_ids": torch.ones(1, 2, dtype=torch.int64)},
            {"input_ids": torch.ones(1, 4, dtype=torch.int64)},
        ]
        pads = {"input_ids": 2**53 + 1}
        theirs = ReferenceBatchedDataDict.from_batches(batches, pads)
        # lengths compared as NeMo-RL compares them: a NaN capacity is refused, never passed
        batch = train_batch(8, 5, 0)
        nan_cap = {
            "max_tokens_per_microbatch": float("nan"),
            "sequence_length_round": 8,
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
        }
        logs = message_logs(1, 3, False, False)
        for log in logs:
            for message in log:
                message["token_ids"] = message["token_ids"].to(torch.uint16)
        their_flat, _ = plain_flatten(logs, None, 1)
        empty = ReferenceBatchedDataDict(
            {"input_ids": torch.zeros(0, 3), "input_lengths": torch.zeros(0)}
        )
        pack = packing_args(8)
        compat.install(accelerate=True, placement="nemo_rl")
        ours = ReferenceBatchedDataDict.from_batches(batches, pads)
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert int(ours["input_ids"][0, 3]) == 2**53
        calls = ReferenceBatchedDataDict.reference_calls
        with pytest.raises(AssertionError):
            batch.shard_by_batch_size(2, dynamic_batching_args=nan_cap)
        assert ReferenceBatchedDataDict.reference_calls == calls + 1
        # masked_scatter_ has no uint16 kernel: NeMo-RL's own path flattens it
        our_flat, _ = messages.batched_message_log_to_flat_message(logs, None, 1)
        assert torch.equal(our_flat["token_ids"].long(), their_flat["token_ids"].long())
        assert our_flat["token_ids"].dtype == torch.uint16
        # a batch without rows goes to NeMo-RL's method
        calls = ReferenceBatchedDataDict.reference_calls
        with pytest.raises((NotImplementedError, AssertionError, ZeroDivisionError, ValueError)):
            empty.shard_by_batch_size(2, batch_size=0, sequence_packing_args=pack)
        assert ReferenceBatchedDataDict.reference_calls == calls + 1


def test_rarer_inputs_get_nemo_rls_layout_and_errors() -> None:
    with installed_standins():
        messages = sys.modules["nemo_rl.data.llm_message_utils"]
        plain_flatten = messages.batched_message_log_to_flat_message
        # 4-D message tensors in channels_last: NeMo-RL's own cat and stack lay them out
        logs = [
            [
                {
                    "role": "user",
                    "frames": torch.randn(2 + r, 3, 4, 5).to(memory_format=torch.channels_last),
                }
            ]
            for r in range(2)
        ]
        their_flat, _ = plain_flatten(logs, None, 1)
        batch = train_batch(8, 5, 0)
        batch["frames"] = torch.randn(8, 3, 2, 2).to(memory_format=torch.channels_last)
        packing = packing_args(64)
        their_shards, _ = batch.shard_by_batch_size(2, sequence_packing_args=packing)
        no_cap = {
            "max_tokens_per_microbatch": None,
            "sequence_length_round": 8,
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
        }
        with pytest.raises(TypeError) as theirs:
            train_batch(8, 5, 0).shard_by_batch_size(2, dynamic_batching_args=no_cap)
        compat.install(accelerate=True, placement="nemo_rl")
        our_flat, _ = messages.batched_message_log_to_flat_message(logs, None, 1)
        assert our_flat["frames"].stride() == their_flat["frames"].stride()
        assert torch.equal(our_flat["frames"], their_flat["frames"])
        our_shards, _ = batch.shard_by_batch_size(2, sequence_packing_args=packing)
        for ours, want in zip(our_shards, their_shards, strict=True):
            assert ours["frames"].stride() == want["frames"].stride()
            assert torch.equal(ours["frames"], want["frames"])
        calls = ReferenceBatchedDataDict.reference_calls
        with pytest.raises(TypeError) as mine:
            train_batch(8, 5, 0).shard_by_batch_size(2, dynamic_batching_args=no_cap)
        assert str(mine.value) == str(theirs.value)
        assert ReferenceBatchedDataDict.reference_calls == calls + 1
        meta = train_batch(8, 5, 0)
        meta["input_lengths"] = meta["input_lengths"].to("meta")
        calls = ReferenceBatchedDataDict.reference_calls
        with pytest.raises((RuntimeError, NotImplementedError)):
            meta.shard_by_batch_size(2, sequence_packing_args=packing)
        assert ReferenceBatchedDataDict.reference_calls == calls + 1


def test_a_module_importing_the_flatten_after_install_gets_nemo_rls_back() -> None:
    with installed_standins():
        messages = sys.modules["nemo_rl.data.llm_message_utils"]
        plain = messages.batched_message_log_to_flat_message
        compat.install(accelerate=True, placement="nemo_rl")
        late = types.ModuleType("nemo_rl_late_importer")
        late.batched_message_log_to_flat_message = messages.batched_message_log_to_flat_message  # type: ignore[attr-defined]
        sys.modules["nemo_rl_late_importer"] = late
        try:
            compat.uninstall()
            assert late.batched_message_log_to_flat_message is plain  # type: ignore[attr-defined]
        finally:
            del sys.modules["nemo_rl_late_importer"]


def outcome(call: Any) -> Any:
    """What a call gives, comparable across the plain and the accelerated versions: its error's
    type and message, or every tensor of its result (repr, dtype, strides)."""
    try:
        result = call()
    except Exception as exc:
        return ("raised", type(exc), str(exc))
    shards = result[0] if isinstance(result, tuple) else [result]
    return [
        [(key, repr(v), v.dtype, v.stride()) for key, v in shard.items() if torch.is_tensor(v)]
        for shard in shards
    ]


@pytest.mark.parametrize(
    ("dtype", "pad"),
    [
        (torch.uint8, -1),
        (torch.int8, 1000),
        (torch.int64, float("nan")),
        (torch.int64, 1e30),
        (torch.int32, None),
        (torch.float32, "a"),
    ],
)
def test_stacking_with_nothing_to_pad_still_refuses_a_pad_the_dtype_cannot_hold(
    dtype: torch.dtype, pad: Any
) -> None:
    batches = [{"x": torch.ones(2, 3, dtype=dtype)}, {"x": torch.ones(1, 3, dtype=dtype)}]
    with installed_standins():
        theirs = outcome(lambda: ReferenceBatchedDataDict.from_batches(batches, {"x": pad}))
        compat.install(accelerate=True, placement="nemo_rl")
        ours = outcome(lambda: ReferenceBatchedDataDict.from_batches(batches, {"x": pad}))
    assert theirs[0] == "raised"
    assert ours == theirs


ODD_KINDS = ["quantized", "sparse", "bits8", "uint16", "float8_e8m0fnu", "float8_e4m3fn"]


def odd_tensors(rows: int) -> dict[str, torch.Tensor]:
    """Values NeMo-RL's indexing and pad_sequence meet in their own ways (most refuse them)."""
    plain = torch.arange(rows * 3, dtype=torch.uint8).view(rows, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized dtypes are deprecated, and still accepted
        quantized = torch.quantize_per_tensor(plain.float(), 0.5, 0, torch.quint8)
    odd = {
        "quantized": quantized,
        "sparse": plain.float().to_sparse(),
        "bits8": plain.view(torch.bits8),
        "uint16": plain.to(torch.uint16),
    }
    for name in ("float8_e8m0fnu", "float8_e4m3fn"):
        odd[name] = plain.view(getattr(torch, name))
    return odd


@pytest.mark.parametrize("kind", ODD_KINDS)
def test_odd_dtypes_and_layouts_go_to_nemo_rls_own_code(kind: str) -> None:
    packing = packing_args(64)
    dynamic = {
        "max_tokens_per_microbatch": 64,
        "sequence_length_round": 8,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }
    with installed_standins():
        batch = train_batch(8, 5, 0)
        batch[kind] = odd_tensors(8)[kind]
        value = odd_tensors(3)[kind]
        if kind == "sparse":
            parts = [{"v": value}, {"v": value}]
        else:
            parts = [{"v": value[:2]}, {"v": value[2:]}]

        def calls() -> list[Any]:
            return [
                lambda: batch.shard_by_batch_size(2, sequence_packing_args=packing),
                lambda: batch.shard_by_batch_size(2, dynamic_batching_args=dynamic),
                lambda: ReferenceBatchedDataDict.from_batches(parts),
            ]

        theirs = [outcome(call) for call in calls()]
        compat.install(accelerate=True, placement="nemo_rl")
        before = ReferenceBatchedDataDict.reference_calls
        ours = [outcome(call) for call in calls()]
    assert ReferenceBatchedDataDict.reference_calls == before + 2  # both shardings fell back
    assert ours == theirs


def test_uninstall_gives_nemo_rls_class_back_to_nemo_rl_modules_imported_meanwhile() -> None:
    with installed_standins():
        original = sys.modules["nemo_rl.data.multimodal_utils"].PackedTensor
        compat.install()
        late = types.ModuleType("nemo_rl.utils.late_metrics")
        late.PackedTensor = sys.modules["nemo_rl.data.multimodal_utils"].PackedTensor  # type: ignore[attr-defined]
        user = types.ModuleType("training_script")
        user.PackedTensor = mmpack.PackedTensor  # type: ignore[attr-defined]
        sys.modules.update({late.__name__: late, user.__name__: user})
        try:
            assert late.PackedTensor is mmpack.PackedTensor  # type: ignore[attr-defined]
            compat.uninstall()
            assert late.PackedTensor is original  # type: ignore[attr-defined]
            # a module outside NeMo-RL that imported mmpack's class keeps it
            assert user.PackedTensor is mmpack.PackedTensor  # type: ignore[attr-defined]
        finally:
            del sys.modules[late.__name__], sys.modules[user.__name__]


def test_installs_and_uninstalls_from_many_threads_leave_nothing_behind() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    with installed_standins():
        batched = sys.modules["nemo_rl.distributed.batched_data_dict"]
        plain = dict(vars(batched.BatchedDataDict))
        torchs = torch.Tensor.__dict__["__reduce_ex__"]
        start = threading.Barrier(8)

        def churn() -> int:
            start.wait(timeout=30)
            for _ in range(20):
                compat.install(accelerate=True, placement="nemo_rl")
                compat.uninstall()
            return 20

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(churn) for _ in range(8)]
        # every thread ran to the end: an error in one is raised here, not lost
        assert [f.result() for f in futures] == [20] * 8
        assert compat.installed() is None
        assert dict(vars(batched.BatchedDataDict)) == plain
        assert torch.Tensor.__dict__["__reduce_ex__"] is torchs
