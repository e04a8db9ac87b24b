"""NeMo-RL's own multimodal GRPO data path, with NeMo-RL's classes and with mmpack installed.

Runs NeMo-RL's real code (a checkout given with ``--nemo-rl``, never part of this repo) in child
processes on the same generated batch, one a mode: ``nemo_rl`` (NeMo-RL's classes as they are),
``mmpack`` (after ``mmpack.compat.nemo_rl.install()``), ``mmpack_accelerated``
(``install(accelerate=True, placement="nemo_rl")``: mmpack's opt-in versions of
``BatchedDataDict``'s hot methods, NeMo-RL's placement of rows exactly) and ``mmpack_groups``
(``install(accelerate=True)``: the same, with the default ``placement="groups"``, under which
``shard_by_batch_size`` places the rows that share media on one rank). Each child times the
stages GRPO runs on the batch, then fingerprints every stage's output; the parent checks that the
fingerprints are identical and prints the per-stage table, the totals, the PackedTensor share,
the payload bytes per shard, the unique images per shard, the memory high-water mark by the end
of each stage, the unique bytes of the batch (each image once, and the token tensors) with the
path's memcpy floor (those bytes over this machine's memcpy bandwidth, measured in the same
run), and the object-store bytes written, read and sent between nodes where a store meter is set
(``STORE_METER``; "n/a" otherwise).

Under ``placement="groups"`` rows move between shards and micro-batches, so only the stages
before the sharding can be identical to NeMo-RL's. For every mode the fingerprint pass also
checks what any placement must keep (``RowChecks``): the returned indices name every row once;
each shard row is the train row its index names, with its own data (a per-row fingerprint: its
tokens up to its length, its scalars, its media by content, its list items) and in its own
global batch; each shard's micro-batch metadata follows NeMo-RL's rules (packing: spans
contiguous over the global batch's rows, lengths the sums of the padded lengths, within the
cap; dynamic batching: one span list for all shards, lengths the rounded longest row at those
positions on any shard, within the cap); a shard is the same value after the Ray hop; every
micro-batch's ``as_tensors=True`` media is its own rows' media in row order; and
``from_batches`` gives the train rows in the returned order. The multiset of per-row
fingerprints of every global batch (after each sharding, over the micro-batches of each, after
``from_batches``) must be the same in every mode, and sequence packing must give each shard
NeMo-RL's number of micro-batches per global batch.

The batch is shaped like a multimodal GRPO batch: ``B`` prompts, each a message log whose user
message holds token ids and Qwen2-VL-like ``pixel_values`` (patches x 1176, float32) and
``image_grid_thw`` PackedTensors for 1-3 images, plus the vLLM prompt fields. The stages:

1. ``repeat_interleave(G, share_immutable_media=True)``;
2. the rollout appends an assistant message to every row (not timed: it stands for generation);
3. ``batched_message_log_to_flat_message`` and the train batch with
   ``get_multimodal_dict(as_tensors=False, pixel_dtype=torch.bfloat16)``;
4. ``shard_by_batch_size(8, batch_size=gbs, ...)`` with sequence packing, and again with
   dynamic batching;
5. every shard sent through Ray's object store (``ray.put``, then ``ray.get``);
6. on each unpickled shard, per global batch and micro-batch, what the policy worker does:
   ``get_batch``, the micro-batch iterator, ``get_multimodal_dict(as_tensors=True)``;
7. ``BatchedDataDict.from_batches`` of the shards back into one batch.

Run with the side environment that can import NeMo-RL (Python >= 3.12, torch, transformers,
ray, and mmpack installed or on ``PYTHONPATH``)::

    python benches/bench_nemo_rl_grpo.py --nemo-rl PATH/TO/NeMo-RL --prompts 256,1024

Image sizes are set by ``--patches`` (the image side range in 14-pixel patches). With the
default, B = 1024 peaks at about 11 GiB per process; B = 4096 needs a smaller range (``2:8``) on
a 24 GiB machine. The "PackedTensor share" row is the time in the installed class's methods plus
a Ray hop of each shard's PackedTensor values alone (their part of the hop), from a separate
timed pass; the rest of the total is NeMo-RL's own code and plain tensors.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MODES = ("nemo_rl", "mmpack", "mmpack_accelerated", "mmpack_groups", "mmpack_unique")
#: ``install`` arguments per mode (``nemo_rl`` installs nothing).
INSTALL_ARGS: dict[str, dict[str, Any]] = {
    "mmpack": {},
    "mmpack_accelerated": {"accelerate": True, "placement": "nemo_rl"},
    "mmpack_groups": {"accelerate": True},  # placement="groups", the default
    # the workers' get_multimodal_dict(as_tensors=True) gives each unique segment once
    "mmpack_unique": {"accelerate": True, "unique_media": True},
}
#: Modes that place rows as NeMo-RL does: every stage's output is identical to NeMo-RL's.
KEEPS_PLACEMENT = ("nemo_rl", "mmpack", "mmpack_accelerated")
#: Stages that are identical whatever the placement (they come before the sharding).
BEFORE_SHARDING = ("repeat_interleave", "flatten_and_cast")
STAGES = (
    "repeat_interleave",
    "flatten_and_cast",
    "shard_packing",
    "shard_dynamic",
    "pickle",
    "unpickle",
    "worker_microbatches",
    "from_batches",
)
PATCH_DIM = 1176  # Qwen2-VL: 3 channels x 2 frames x 14 x 14
SHARDS = 8
GLOBAL_BATCH = 512
MAX_TOKENS_PER_MICROBATCH = 8192
# Enough for the largest shard; pages of the store the driver touches count in its memory.
OBJECT_STORE_BYTES = 3 << 30
# The share of the store touched at start (Ray keeps a little for itself).
STORE_WARM_FRACTION = 0.9


# ------------------------------------------------------------------------------- the batch


def make_prompt_batch(num_prompts: int, patches: tuple[int, int], seed: int) -> Any:
    """A GRPO prompt batch as NeMo-RL's VLM data processor builds it (deterministic)."""
    import torch
    from nemo_rl.data.multimodal_utils import PackedTensor
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    message_logs, lengths = [], []
    for _ in range(num_prompts):
        grids = [
            (
                1,
                2 * randint(patches[0] // 2, patches[1] // 2),
                2 * randint(patches[0] // 2, patches[1] // 2),
            )
            for _ in range(randint(1, 3))
        ]
        n_patches = sum(t * h * w for t, h, w in grids)
        image_tokens = n_patches // 4
        system = {
            "role": "system",
            "content": "You are a helpful assistant.",
            "token_ids": torch.randint(0, 150_000, (randint(8, 24),), generator=gen),
        }
        user = {
            "role": "user",
            "content": "<image>" * len(grids) + " What is shown?",
            "token_ids": torch.randint(
                0, 150_000, (randint(20, 120) + image_tokens,), generator=gen
            ),
            "pixel_values": PackedTensor(
                torch.randn(n_patches, PATCH_DIM, generator=gen), dim_to_pack=0
            ),
            "image_grid_thw": PackedTensor(torch.tensor(grids, dtype=torch.int64), dim_to_pack=0),
        }
        message_logs.append([system, user])
        lengths.append(len(system["token_ids"]) + len(user["token_ids"]))
    return BatchedDataDict(
        {
            "message_log": message_logs,
            "length": torch.tensor(lengths),
            "extra_env_info": [{"answer": str(i)} for i in range(num_prompts)],
            "loss_multiplier": torch.ones(num_prompts),
            "idx": list(range(num_prompts)),
            "task_name": ["clevr"] * num_prompts,
            "vllm_content": ["<image> What is shown?"] * num_prompts,
            "vllm_images": [[f"image-{i}-{j}" for j in range(2)] for i in range(num_prompts)],
        }
    )


def append_responses(repeated: Any, seed: int) -> None:
    """What generation leaves in each row: an assistant turn, the loss masks and logprobs."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    for log in repeated["message_log"]:
        n = int(torch.randint(32, 1024, (1,), generator=gen))
        log.append(
            {
                "role": "assistant",
                "content": "",
                "token_ids": torch.randint(0, 150_000, (n,), generator=gen),
                "generation_logprobs": torch.randn(n, generator=gen),
            }
        )
        for message in log:
            k = len(message["token_ids"])
            trainable = message["role"] == "assistant"
            message["token_loss_mask"] = torch.full((k,), int(trainable), dtype=torch.bool)
            message.setdefault("generation_logprobs", torch.zeros(k))


# ------------------------------------------------------------------------------- the path


def _peak_rss() -> int:
    """The process's resident-memory high-water mark, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Timer:
    """Seconds per stage (summed over its calls) and the memory high-water mark of the process
    when the stage last ended (the peak reached by then: the mark only rises)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.peak_rss: dict[str, int] = {}

    def run(self, stage: str, fn: Callable[[], Any]) -> Any:
        gc.collect()
        start = time.perf_counter()
        out = fn()
        self.seconds[stage] += time.perf_counter() - start
        self.peak_rss[stage] = _peak_rss()
        return out


def unique_bytes(batch: Any, train: Any) -> dict[str, int]:
    """What the batch holds once: the prompts' media (each image once, however many rows and
    shards reference it; float32 as made and in the train batch's bfloat16) and the train
    batch's token-level tensors (one copy of each)."""
    import torch

    media_f32 = media_bf16 = 0
    seen: set[int] = set()
    for log in batch["message_log"]:
        for message in log:
            for key in ("pixel_values", "image_grid_thw"):
                value = message.get(key)
                if value is None:
                    continue
                for t in value.tensors:
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    media_f32 += t.nbytes
                    cast = t.is_floating_point() and key == "pixel_values"
                    media_bf16 += t.numel() * 2 if cast else t.nbytes
    tokens = sum(v.nbytes for v in train.values() if isinstance(v, torch.Tensor))
    rows_per_prompt = len(train["input_ids"]) // max(1, len(batch["message_log"]))
    return {
        "media_f32": media_f32,
        "media_bf16": media_bf16,
        "tokens": tokens,
        # every row carrying its own media, as without any deduplication
        "media_bf16_logical": media_bf16 * rows_per_prompt,
    }


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """This machine's memcpy bandwidth (bytes/s, one thread as the path runs): the best of
    ``repeats`` copies of ``nbytes`` between two preallocated buffers."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def microbatches(shard: Any, packing: bool, global_batch: int) -> Iterator[Any]:
    """The policy worker's walk over its shard: global batches, then micro-batches."""
    if packing:
        for gb in range(len(shard.elem_counts_per_gb)):
            yield from shard.get_batch(
                batch_idx=gb
            ).make_microbatch_iterator_for_packable_sequences()
    else:
        per_rank = global_batch // SHARDS
        for gb in range(shard.size // per_rank):
            yield from shard.get_batch(
                batch_idx=gb, batch_size=per_rank
            ).make_microbatch_iterator_with_dynamic_shapes()


def run_path(
    num_prompts: int,
    generations: int,
    patches: tuple[int, int],
    seed: int,
    fingerprint: bool,
    packed_hop: bool = False,
) -> dict[str, Any]:
    """One pass over the path; with ``packed_hop``, also the Ray hop of each shard's
    PackedTensor values alone (``seconds["packed_hop"]``, not a stage of the path)."""
    import torch
    from nemo_rl.data.llm_message_utils import batched_message_log_to_flat_message
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    timer = Timer()
    digests: dict[str, str] = {}
    prints = Fingerprint() if fingerprint else None

    def note(stage: str, value: Any) -> None:
        if prints is not None:
            digests[stage] = prints.of(value)
            # Per key too, so that a difference names where it is.
            first = value[0] if isinstance(value, tuple) else value
            for i, part in enumerate(first if isinstance(first, list) else [first]):
                if isinstance(part, collections.abc.Mapping):
                    for key in part:
                        digests[f"{stage}[{i}].{key}"] = prints.of(part[key])

    batch = make_prompt_batch(num_prompts, patches, seed)
    repeated = timer.run(
        "repeat_interleave",
        lambda: batch.repeat_interleave(generations, share_immutable_media=True),
    )
    note("repeat_interleave", repeated)
    append_responses(repeated, seed)

    def flatten_and_cast() -> Any:
        flat, input_lengths = batched_message_log_to_flat_message(
            repeated["message_log"],
            pad_value_dict={"token_ids": 0},
            make_sequence_length_divisible_by=8,
        )
        train = BatchedDataDict(
            {
                "input_ids": flat["token_ids"],
                "input_lengths": input_lengths,
                "generation_logprobs": flat["generation_logprobs"],
                "token_mask": flat["token_loss_mask"],
                "sample_mask": repeated["loss_multiplier"],
            }
        )
        train.update(flat.get_multimodal_dict(as_tensors=False, pixel_dtype=torch.bfloat16))
        return train

    train = timer.run("flatten_and_cast", flatten_and_cast)
    gbs = min(GLOBAL_BATCH, train.size)
    note("flatten_and_cast", train)
    checks = RowChecks(prints, train, gbs) if prints is not None else None
    packing_args = {
        "max_tokens_per_microbatch": MAX_TOKENS_PER_MICROBATCH,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": "modified_first_fit_decreasing",
        "sequence_length_pad_multiple": 8,
    }
    dynamic_args = {
        "max_tokens_per_microbatch": MAX_TOKENS_PER_MICROBATCH,
        "sequence_length_round": 64,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }
    packed_shards, packed_order = timer.run(
        "shard_packing",
        lambda: train.shard_by_batch_size(
            SHARDS, batch_size=gbs, sequence_packing_args=packing_args
        ),
    )
    note("shard_packing", (packed_shards, packed_order, [_micro_state(s) for s in packed_shards]))
    if checks is not None:
        checks.sharding("shard_packing", packed_shards, packed_order, True, packing_args)
    dynamic_shards, dynamic_order = timer.run(
        "shard_dynamic",
        lambda: train.shard_by_batch_size(
            SHARDS, batch_size=gbs, dynamic_batching_args=dynamic_args
        ),
    )
    note(
        "shard_dynamic", (dynamic_shards, dynamic_order, [_micro_state(s) for s in dynamic_shards])
    )
    if checks is not None:
        checks.sharding("shard_dynamic", dynamic_shards, dynamic_order, False, dynamic_args)

    payload_bytes: list[int] = []
    worker_prints: list[str] = []
    materialized = 0  # bytes of the micro-batches' as_tensors=True outputs (fingerprint pass)
    for shards, packing in ((packed_shards, True), (dynamic_shards, False)):
        name = "worker_packing" if packing else "worker_dynamic"
        for shard in shards:
            if packed_hop:
                media = {k: v for k, v in shard.items() if type(v).__name__ == "PackedTensor"}
                timer.run("packed_hop", lambda m=media: RAY.get(RAY.put(m)))
            sent = timer.run("pickle", lambda s=shard: RAY.put(s))
            received = timer.run("unpickle", lambda r=sent: RAY.get(r))
            del sent
            if prints is not None and checks is not None:
                payload_bytes.append(RAY.payload_bytes(shard))
                worker_prints.append(prints.of((received, _micro_state(received))))
                checks.received(name, shard, received)
            timer.run(
                "worker_microbatches", lambda s=received, p=packing: _drain(microbatches(s, p, gbs))
            )
            if prints is not None and checks is not None:
                # Fingerprinting the materialized tensors is not timed: a second walk.
                for gb, mb in _microbatches_by_gb(received, packing, gbs):
                    tensors = mb.get_multimodal_dict(as_tensors=True)
                    materialized += sum(_materialized_bytes(v) for v in tensors.values())
                    # unique media is checked by what it stands for: every row's own media
                    tensors = {k: _logical(v) for k, v in tensors.items()}
                    worker_prints.append(prints.of(tensors))
                    checks.microbatch(name, gb, mb, tensors)
            del received
        if checks is not None:
            checks.microbatches_done(name)
    if prints is not None:
        digests["worker"] = hashlib.blake2b("".join(worker_prints).encode()).hexdigest()
    back = timer.run("from_batches", lambda: BatchedDataDict.from_batches(packed_shards))
    note("from_batches", back)
    if checks is not None:
        checks.from_batches(back, packed_order)
    return {
        "seconds": dict(timer.seconds),
        "peak_rss_by_stage": timer.peak_rss,
        "digests": digests,
        "payload_bytes": payload_bytes,
        "store": RAY.store_counters(),
        "unique_bytes": {**unique_bytes(batch, train), "materialized": materialized},
        "rows": len(repeated["message_log"]),
        "row_checks": None
        if checks is None
        else {
            "failed": checks.failed,
            "digests": checks.digests,
            "media": checks.media,
            "micro_counts": checks.micro_counts,
        },
    }


def _microbatches_by_gb(shard: Any, packing: bool, global_batch: int) -> Iterator[Any]:
    """``microbatches``, each with the index of its global batch."""
    per_rank = global_batch // SHARDS
    count = len(shard.elem_counts_per_gb) if packing else shard.size // per_rank
    for gb in range(count):
        if packing:
            mbs = shard.get_batch(batch_idx=gb).make_microbatch_iterator_for_packable_sequences()
        else:
            mbs = shard.get_batch(
                batch_idx=gb, batch_size=per_rank
            ).make_microbatch_iterator_with_dynamic_shapes()
        for mb in mbs:
            yield gb, mb


def _materialized_bytes(value: Any) -> int:
    """Bytes a worker's ``as_tensors=True`` output wrote: a tensor's, or unique media's values."""
    import torch

    if type(value).__name__ == "UniqueSegments":
        return int(value.values.nbytes)
    return int(value.nbytes) if isinstance(value, torch.Tensor) else 0


def _logical(value: Any) -> Any:
    return value.logical() if type(value).__name__ == "UniqueSegments" else value


def _drain(it: Iterator[Any]) -> None:
    for mb in it:
        mb.get_multimodal_dict(as_tensors=True)


def _micro_state(shard: Any) -> Any:
    return (shard.micro_batch_indices, shard.micro_batch_lengths, shard.elem_counts_per_gb)


# ------------------------------------------------------------------------------- Ray


class _Ray:
    """The hop to a policy worker through Ray's object store: ``ray.put`` serializes (pickle
    protocol 5 with out-of-band buffers) into shared memory, ``ray.get`` deserializes from it."""

    def start(self) -> None:
        """Start Ray and touch every page of its object store once, as a training job's store
        is after its first steps: the first write into a fresh store page costs a page fault
        (measured here at about 0.5 GB/s against 9 GB/s into touched pages), which would
        otherwise charge whichever stage writes first."""
        import numpy as np

        ray = self._ray()
        warm = np.ones(int(OBJECT_STORE_BYTES * STORE_WARM_FRACTION), dtype=np.uint8)
        ref = ray.put(warm)
        del ref, warm

    def _ray(self) -> Any:
        import ray

        if not ray.is_initialized():
            ray.init(
                num_cpus=1,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=OBJECT_STORE_BYTES,
            )
        return ray

    def put(self, value: Any) -> Any:
        return self._ray().put(value)

    def get(self, ref: Any) -> Any:
        return self._ray().get(ref)

    def store_counters(self) -> dict[str, int] | None:
        """Bytes written into and read out of the object store, and bytes between nodes, for
        the pass just run, where a store meter provides them (``STORE_METER``: a callable
        returning a dict with ``written``, ``read`` and ``between_nodes``); ``None`` without
        one, and the table shows "n/a"."""
        return STORE_METER() if STORE_METER is not None else None

    def put_bandwidth(self, nbytes: int, repeats: int = 3) -> float:
        """Bytes/s of ``ray.put`` of one fresh ``nbytes`` buffer into the object store (the best
        of ``repeats``; each buffer freed before the next)."""
        import numpy as np

        ray = self._ray()
        best = float("inf")
        for _ in range(repeats):
            buffer = np.ones(max(1, nbytes), dtype=np.uint8)
            start = time.perf_counter()
            ref = ray.put(buffer)
            best = min(best, time.perf_counter() - start)
            del ref, buffer
        return max(1, nbytes) / best

    def store_in_use(self) -> float:
        """Bytes in use in the object store, as the raylet reports them (on its heartbeat, so
        after a pause), once every value the driver dropped is collected. The meter of
        ``mmpack.packed.ray_store.store_used_bytes``, here because the NeMo-RL process does not
        import mmpack."""
        ray = self._ray()
        gc.collect()
        time.sleep(1.5)
        total = ray.cluster_resources().get("object_store_memory", 0.0)
        return float(total - ray.available_resources().get("object_store_memory", 0.0))

    def store_in_use_with(self, nbytes: int) -> float:
        """``store_in_use`` while one object of ``nbytes`` lives: shows that the meter sees
        what the store holds (so a reading of zero after the path means an empty store)."""
        import numpy as np

        ref = self._ray().put(np.ones(nbytes, dtype=np.uint8))
        try:
            return self.store_in_use()
        finally:
            del ref

    def payload_bytes(self, value: Any) -> int:
        """In-band plus out-of-band bytes Ray's serializer writes for ``value``."""
        from ray._private.worker import global_worker

        self._ray()
        return int(global_worker.get_serialization_context().serialize(value).total_bytes)


RAY = _Ray()
STORE_PROBE_BYTES = 64 * 2**20
#: The hook for an object-store meter (see ``_Ray.store_counters``); the multi-node bench sets it.
STORE_METER: Callable[[], dict[str, int]] | None = None


# ------------------------------------------------------------------------------- fingerprints


class Fingerprint:
    """A digest of a value that two implementations must agree on: tensors by dtype, shape and
    bytes; PackedTensors by their logical rows (each row's segments, by content), the
    provenance groups (which logical references share provenance, labelled in first-reference
    order) and their flags; containers recursively."""

    def __init__(self) -> None:
        self._tensor_cache: dict[int, tuple[Any, str]] = {}

    def of(self, value: Any) -> str:
        h = hashlib.blake2b(digest_size=16)
        self._feed(h, value)
        return h.hexdigest()

    def _tensor(self, t: Any, cache: bool = False) -> str:
        """``cache``: a physical segment, fingerprinted once however many rows reference it
        (the cache keeps it alive; materialized tensors are not cached, so they can be freed)."""
        import torch

        hit = self._tensor_cache.get(id(t)) if cache else None
        if hit is not None and hit[0] is t:
            return hit[1]
        flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest = hashlib.blake2b(memoryview(flat.numpy()), digest_size=16).hexdigest()
        out = f"T{t.dtype}{tuple(t.shape)}{digest}"
        if cache:
            self._tensor_cache[id(t)] = (t, out)
        return out

    def _feed(self, h: Any, value: Any) -> None:
        import torch

        if isinstance(value, torch.Tensor):
            h.update(self._tensor(value).encode())
        elif type(value).__name__ == "PackedTensor":
            h.update(self._packed(value).encode())
        elif isinstance(value, collections.abc.Mapping):
            h.update(f"M{type(value).__name__}{len(value)}".encode())
            for key in sorted(value, key=repr):
                h.update(repr(key).encode())
                self._feed(h, value[key])
        elif isinstance(value, (list, tuple)):
            h.update(f"L{len(value)}".encode())
            for item in value:
                self._feed(h, item)
        else:
            h.update(repr(value).encode())

    def _packed(self, p: Any) -> str:
        tensors = p.tensors
        offsets = p._row_offsets
        indices = p._segment_indices
        provenance = p._segment_provenance
        if offsets is None:
            offsets, indices = list(range(len(tensors) + 1)), list(range(len(tensors)))
        groups: dict[Any, int] = {}
        rows = []
        for r in range(len(offsets) - 1):
            row = []
            for i in indices[offsets[r] : offsets[r + 1]]:
                seg = tensors[i]
                label = groups.setdefault(
                    provenance[i] if provenance is not None else ("no", i), len(groups)
                )
                row.append((None if seg is None else self._tensor(seg, cache=True), label))
            rows.append(row)
        h = hashlib.blake2b(
            repr((p.dim_to_pack, p.pad_to_max_shape, provenance is not None, rows)).encode(),
            digest_size=16,
        )
        return "P" + h.hexdigest()


def _row_segments(p: Any) -> list[list[Any]]:
    """A PackedTensor's segments (``None`` kept) per logical row."""
    tensors = p.tensors
    offsets = p._row_offsets
    indices = p._segment_indices
    if offsets is None:
        return [[t] for t in tensors]
    return [[tensors[i] for i in indices[offsets[r] : offsets[r + 1]]] for r in range(len(p))]


class RowChecks:
    """What every placement must keep, checked row by row (the fingerprint pass; see the module
    docstring): ``failed`` lists what did not hold; ``digests`` the per-global-batch multisets of
    per-row fingerprints, which must agree across modes; ``media`` the unique images (segments
    of ``pixel_values``, by content) and their bytes per shard; ``micro_counts`` each shard's
    micro-batches per global batch."""

    def __init__(self, prints: Fingerprint, train: Any, gbs: int) -> None:
        self.prints = prints
        self.gbs = gbs
        self.failed: list[str] = []
        self.digests: dict[str, str] = {}
        self.media: dict[str, list[list[int]]] = {}
        self.micro_counts: dict[str, list[list[int]]] = {}
        self._by_gb: dict[str, dict[int, list[str]]] = collections.defaultdict(
            lambda: collections.defaultdict(list)
        )
        self.train_rows = self.rows(train)

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)

    def rows(self, batch: Any) -> list[str]:
        """One fingerprint a row: each key's part of the row (a token-level tensor up to the
        row's length, so a micro-batch's truncation to a width that holds it changes
        nothing; a PackedTensor's segments by content; a list's item)."""
        import torch

        lengths = batch["input_lengths"].tolist()
        n = len(lengths)
        hashes = [hashlib.blake2b(digest_size=16) for _ in range(n)]
        for key in sorted(batch):
            value = batch[key]
            if isinstance(value, torch.Tensor):
                t = value.detach().cpu().contiguous()
                head = f"{key}{t.dtype}{tuple(t.shape[2:])}".encode()
                raw = t.reshape(n, -1).view(torch.uint8).numpy()
                per_position = raw.shape[1] // t.shape[1] if t.ndim >= 2 and t.shape[1] else 0
                for r, h in enumerate(hashes):
                    h.update(head)
                    h.update(raw[r, : lengths[r] * per_position] if t.ndim >= 2 else raw[r])
            elif type(value).__name__ == "PackedTensor":
                head = f"{key}{value.dim_to_pack}{value.pad_to_max_shape}"
                for h, segments in zip(hashes, _row_segments(value), strict=True):
                    h.update(head.encode())
                    for seg in segments:
                        h.update(b"-" if seg is None else self.prints._tensor(seg, True).encode())
            else:
                for r, h in enumerate(hashes):
                    h.update(f"{key}{value[r]!r}".encode())
        return [h.hexdigest() for h in hashes]

    def _multiset(self, name: str) -> None:
        by_gb = self._by_gb.pop(name)
        h = hashlib.blake2b(digest_size=16)
        for gb in sorted(by_gb):
            h.update(f"gb{gb}:{','.join(sorted(by_gb[gb]))};".encode())
        self.digests[name] = h.hexdigest()

    def sharding(
        self, name: str, shards: list[Any], order: list[int], packing: bool, args: dict[str, Any]
    ) -> None:
        """The shards and returned indices of one ``shard_by_batch_size``."""
        total = len(self.train_rows)
        self.expect(sorted(order) == list(range(total)), f"{name}: indices name every row once")
        per_rank = self.gbs // len(shards)
        offset = 0  # packing: shard s's rows are order[offset : offset + its size]
        media, counts = [], []
        for s, shard in enumerate(shards):
            rows = self.rows(shard)
            if packing:
                gb_of = [gb for gb, n in enumerate(shard.elem_counts_per_gb) for _ in range(n)]
                positions = range(offset, offset + len(rows))
                offset += len(rows)
            else:
                gb_of = [j // per_rank for j in range(len(rows))]
                positions = [
                    gb * self.gbs + s * per_rank + j % per_rank for j, gb in enumerate(gb_of)
                ]
            self.expect(len(gb_of) == len(rows), f"{name}: shard {s}'s rows per global batch")
            for j, (fp, gb, pos) in enumerate(zip(rows, gb_of, positions, strict=False)):
                self._by_gb[name][gb].append(fp)
                if pos >= len(order) or fp != self.train_rows[order[pos]]:
                    self.failed.append(f"{name}: shard {s} row {j} is the row its index names")
                    break
                if order[pos] // self.gbs != gb:
                    self.failed.append(f"{name}: shard {s} row {j} in its own global batch")
                    break
            self._metadata(name, s, shard, packing, args, shards)
            counts.append([len(spans) for spans in shard.micro_batch_indices])
            unique = {}
            for segments in _row_segments(shard["pixel_values"]):
                for seg in segments:
                    if seg is not None:
                        unique[self.prints._tensor(seg, True)] = seg.nbytes
            media.append([len(unique), sum(unique.values())])
        self._multiset(name)
        self.media[name] = media
        self.micro_counts[name] = counts

    def _metadata(
        self,
        name: str,
        s: int,
        shard: Any,
        packing: bool,
        args: dict[str, Any],
        shards: list[Any],
    ) -> None:
        """NeMo-RL's rules for the micro-batch metadata of shard ``s``."""
        cap = args["max_tokens_per_microbatch"]
        lengths = shard["input_lengths"].tolist()
        spans_by_gb, lengths_by_gb = shard.micro_batch_indices, shard.micro_batch_lengths
        what = f"{name}: shard {s}'s micro-batch metadata"
        if packing:
            pad = args["sequence_length_pad_multiple"]
            counts = shard.elem_counts_per_gb
            ok = len(spans_by_gb) == len(lengths_by_gb) == len(counts)
            ok = ok and sum(counts) == len(lengths)
            first = 0
            for spans, spans_lengths, n in zip(spans_by_gb, lengths_by_gb, counts, strict=False):
                ok = ok and len(spans) == len(spans_lengths) and spans[-1][1] == n
                end = 0
                for (lo, hi), total in zip(spans, spans_lengths, strict=False):
                    padded = sum(-(-x // pad) * pad for x in lengths[first + lo : first + hi])
                    ok = ok and lo == end and hi > lo and total == padded and total <= cap
                    end = hi
                first += n
        else:
            round_to = args["sequence_length_round"]
            width = shard["input_ids"].shape[1]
            per_rank = self.gbs // len(shards)
            every = [other["input_lengths"].tolist() for other in shards]
            ok = all(
                other.micro_batch_indices == spans_by_gb
                and other.micro_batch_lengths == lengths_by_gb
                for other in shards
            )
            ok = ok and len(spans_by_gb) == len(lengths) // per_rank
            for gb, (spans, spans_lengths) in enumerate(
                zip(spans_by_gb, lengths_by_gb, strict=False)
            ):
                end = 0
                for (lo, hi), longest in zip(spans, spans_lengths, strict=False):
                    need = max(
                        min(-(-x[gb * per_rank + r] // round_to) * round_to, width)
                        for x in every
                        for r in range(lo, hi)
                    )
                    ok = ok and lo == end and hi > lo and longest == need
                    ok = ok and (hi - lo) * longest <= cap
                    end = hi
                ok = ok and end == per_rank
        self.expect(bool(ok), what)

    def received(self, name: str, sent: Any, received: Any) -> None:
        state = (_micro_state(sent), _micro_state(received))
        self.expect(
            self.prints.of((sent, state[0])) == self.prints.of((received, state[1])),
            f"{name}: a shard is the same value after the Ray hop",
        )

    def microbatch(self, name: str, gb: int, mb: Any, tensors: dict[str, Any]) -> None:
        """One micro-batch of global batch ``gb`` and its ``as_tensors=True`` media."""
        import torch

        self._by_gb[name][gb].extend(self.rows(mb))
        for key, value in mb.items():
            if type(value).__name__ != "PackedTensor":
                continue
            segments = [seg for row in _row_segments(value) for seg in row if seg is not None]
            got = tensors.get(key)
            if not segments or value.pad_to_max_shape or value.dim_to_pack != 0:
                ok = got is None if not segments else True  # the bench's media pack on dim 0
            else:
                h = hashlib.blake2b(digest_size=16)  # the digest of their torch.cat on dim 0
                for seg in segments:
                    flat = seg.detach().cpu().contiguous().reshape(-1)
                    h.update(memoryview(flat.view(torch.uint8).numpy()))
                shape = (sum(seg.shape[0] for seg in segments), *segments[0].shape[1:])
                ok = got is not None and self.prints._tensor(got) == (
                    f"T{segments[0].dtype}{shape}{h.hexdigest()}"
                )
            self.expect(ok, f"{name}: micro-batch media of global batch {gb} ({key}) is its rows'")

    def microbatches_done(self, name: str) -> None:
        self._multiset(name)

    def from_batches(self, back: Any, order: list[int]) -> None:
        rows = self.rows(back)
        self.expect(
            rows == [self.train_rows[i] for i in order],
            "from_batches: the train rows in the returned order",
        )
        self._by_gb["from_batches"] = {
            gb: [fp for fp, i in zip(rows, order, strict=True) if i // self.gbs == gb]
            for gb in range(len(rows) // self.gbs)
        }
        self._multiset("from_batches")


# ------------------------------------------------------------------------------- PackedTensor share


_PICKLING_HOOKS = ("__reduce_ex__", "__reduce__", "__getstate__", "__setstate__")


def packed_tensor_seconds(run: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``run`` with every method of the installed PackedTensor class timed (outermost calls
    only), and pickling's calls into it too; returns its result and the seconds spent there."""
    from nemo_rl.data import multimodal_utils

    cls = multimodal_utils.PackedTensor
    spent = [0.0]
    depth = [0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
                depth[0] -= 1

        return wrapper

    saved = {}
    for name, attr in list(vars(cls).items()):
        # Pickling hooks are timed by the hop of the PackedTensor values (see run_path), the
        # same way for a class that has them and one that does not.
        if name in (
            "__dict__",
            "__weakref__",
            "__module__",
            "__doc__",
            "__class__",
            *_PICKLING_HOOKS,
        ):
            continue
        if isinstance(attr, (classmethod, staticmethod)):
            saved[name] = attr
            setattr(cls, name, type(attr)(timed(attr.__func__)))
        elif callable(attr):
            saved[name] = attr
            setattr(cls, name, timed(attr))
    try:
        out = run()
    finally:
        for name, attr in saved.items():
            setattr(cls, name, attr)
    return out, spent[0] + out["seconds"]["packed_hop"]


# ------------------------------------------------------------------------------- processes


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.nemo_rl)
    if args.mode != "nemo_rl":
        import mmpack.compat.nemo_rl as mmpack_nemo_rl

        mode = mmpack_nemo_rl.install(**INSTALL_ARGS[args.mode])
        assert mode == "patched", mode
        from mmpack.packed import ray_store

        counters = ray_store.store_counters()
        global STORE_METER
        # put-once media chunks; the shards' own (in-band) bytes are the payload column
        STORE_METER = lambda: {  # noqa: E731
            "written": counters.put_bytes,
            "read": counters.get_bytes,
            "between_nodes": 0,
        }
    import torch

    torch.set_num_threads(args.threads)
    RAY.start()
    store_before = RAY.store_in_use()
    patches = (int(args.patches.split(":")[0]), int(args.patches.split(":")[1]))

    def one_pass(fingerprint: bool = False) -> dict[str, Any]:
        return run_path(args.prompts_one, args.generations, patches, args.seed, fingerprint)

    passes = [one_pass() for _ in range(args.repeats)]
    result = passes[0]
    # The fastest of the passes, stage by stage: the machine's noise only ever adds time.
    result["seconds"] = {
        stage: min(p["seconds"][stage] for p in passes) for stage in result["seconds"]
    }
    _, result["packed_tensor_seconds"] = packed_tensor_seconds(
        lambda: run_path(
            args.prompts_one, args.generations, patches, args.seed, False, packed_hop=True
        )
    )
    if args.verify:
        if STORE_METER is not None:
            from mmpack.packed import ray_store

            ray_store.store_counters().reset()
        checked = one_pass(fingerprint=True)
        result["digests"], result["payload_bytes"] = checked["digests"], checked["payload_bytes"]
        result["store"] = checked["store"]
        result["row_checks"] = checked["row_checks"]
        result["unique_bytes"]["materialized"] = checked["unique_bytes"]["materialized"]
    # every batch, shard and received value of the passes died with its pass
    result["store_in_use"] = {
        "before": store_before,
        "after": RAY.store_in_use(),
        "probe": RAY.store_in_use_with(STORE_PROBE_BYTES),
    }
    result["peak_rss_bytes"] = _peak_rss()
    result["memcpy_bytes_per_s"] = memcpy_bandwidth()
    result["put_bytes_per_s"] = RAY.put_bandwidth(result["unique_bytes"]["media_bf16"])
    Path(args.result).write_text(json.dumps(result))


def parent(args: argparse.Namespace) -> int:
    here = Path(__file__).resolve()
    failures = 0
    report = []
    for prompts in [int(x) for x in args.prompts.split(",")]:
        results = {}
        for mode in args.modes.split(","):
            out = Path(args.out) / f"grpo-{prompts}-{mode}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                str(here),
                "--child",
                "--mode",
                mode,
                "--nemo-rl",
                args.nemo_rl,
                "--prompts-one",
                str(prompts),
                "--generations",
                str(args.generations),
                "--patches",
                args.patches,
                "--seed",
                str(args.seed),
                "--result",
                str(out),
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
            ] + (["--verify"] if args.verify else [])
            start = time.perf_counter()
            # NeMo-RL orders some keys by iterating a set of strings: fix the hash seed so the
            # processes build their dicts in the same order.
            threads = str(args.threads)
            env = {
                **os.environ,
                "PYTHONHASHSEED": "0",
                "OMP_NUM_THREADS": threads,
                "RAYON_NUM_THREADS": threads,
            }
            subprocess.run(cmd, check=True, env=env)
            print(f"# B={prompts} {mode}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
            results[mode] = json.loads(out.read_text())
        base = results.get("nemo_rl")
        print(
            f"\n## B = {prompts} prompts, G = {args.generations}: "
            f"{base and base['rows']} rows, {SHARDS} shards"
        )
        modes = list(results)
        print(
            "| stage | "
            + " | ".join(f"{m} (s)" for m in modes)
            + " | "
            + " | ".join(f"{m} speed-up" for m in modes[1:])
            + " |"
        )
        print("|---" * (1 + 2 * len(modes) - 1) + "|")
        for stage in (*STAGES, "total", "PackedTensor share"):
            if stage == "total":
                secs = {
                    m: sum(v for k, v in r["seconds"].items() if k in STAGES)
                    for m, r in results.items()
                }
            elif stage == "PackedTensor share":
                secs = {m: r["packed_tensor_seconds"] for m, r in results.items()}
            else:
                secs = {m: r["seconds"].get(stage, 0.0) for m, r in results.items()}
            ratios = [secs[modes[0]] / max(secs[m], 1e-9) for m in modes[1:]]
            print(
                f"| {stage} | "
                + " | ".join(f"{secs[m]:.3f}" for m in modes)
                + " | "
                + " | ".join(f"{x:.1f}x" for x in ratios)
                + " |"
            )
        _print_memory_and_floor(results, modes)
        for m in modes:
            pb = results[m]["payload_bytes"]
            print(
                f"payload bytes per shard, {m}: packing {pb[:SHARDS]}, "
                f"dynamic {pb[SHARDS:]} (total {sum(pb):,})"
            )
        if args.verify:
            _print_media(results, modes)
            _print_materialized(results, modes)
            failures += _check_rows(results, modes)
            for m in modes[1:]:
                base = results[modes[0]]["digests"]
                keys = [
                    k
                    for k in base
                    if (m in KEEPS_PLACEMENT and modes[0] in KEEPS_PLACEMENT)
                    or k.split("[")[0] in BEFORE_SHARDING
                ]
                differing = [k for k in keys if results[m]["digests"].get(k) != base[k]]
                same = not differing
                stages = sorted({k.split("[")[0] for k in keys}, key=list(base).index)
                print(
                    f"outputs identical, {m} vs {modes[0]}: {same} ({', '.join(stages)})"
                    + (f" (differ: {differing})" if differing else "")
                )
                failures += not same
                if results[m]["payload_bytes"] and sum(results[m]["payload_bytes"]) > sum(
                    results[modes[0]]["payload_bytes"]
                ):
                    print(f"payload larger with {m}")
                    failures += 1
        report.append({"prompts": prompts, "results": results})
    (Path(args.out) / "grpo-report.json").write_text(json.dumps(report, indent=1))
    return 1 if failures else 0


def _print_media(results: dict[str, Any], modes: list[str]) -> None:
    """The unique images (``pixel_values`` segments, by content) each shard carries and their
    bytes: what a rank pulls, materializes and encodes at least."""
    unique = results[modes[0]]["unique_bytes"]["media_bf16"]
    for m in modes:
        media = results[m]["row_checks"]["media"]
        for stage in ("shard_packing", "shard_dynamic"):
            segments = [n for n, _ in media[stage]]
            mb = [b / 1e6 for _, b in media[stage]]
            print(
                f"unique images per shard, {m}, {stage.removeprefix('shard_')}: "
                f"{segments} segments, MB {[round(x) for x in mb]} (max {max(mb):.0f} MB, "
                f"sum {sum(mb) / 1e3:.3f} GB = {sum(mb) * 1e6 / max(unique, 1):.2f}x the "
                "batch's unique images)"
            )


def _print_materialized(results: dict[str, Any], modes: list[str]) -> None:
    """Bytes the workers' ``get_multimodal_dict(as_tensors=True)`` wrote over every
    micro-batch, against the unique media of the shards they walked (both shardings)."""
    for m in modes:
        written = results[m]["unique_bytes"]["materialized"]
        media = results[m]["row_checks"]["media"]
        unique = sum(b for stage in ("shard_packing", "shard_dynamic") for _, b in media[stage])
        print(
            f"worker materialized, {m}: {written / 1e9:.3f} GB = "
            f"{written / max(unique, 1):.2f}x the shards' unique media ({unique / 1e9:.3f} GB)"
        )


def _check_rows(results: dict[str, Any], modes: list[str]) -> int:
    """Every mode's row checks, and the per-global-batch row multisets and (sequence packing)
    micro-batch counts against the first mode's; returns the number of failures."""
    failures = 0
    base = results[modes[0]]["row_checks"]
    for m in modes:
        rc = results[m]["row_checks"]
        failed = rc["failed"]
        differing = [k for k in base["digests"] if rc["digests"].get(k) != base["digests"][k]]
        counts_same = rc["micro_counts"]["shard_packing"] == base["micro_counts"]["shard_packing"]
        totals = {k: sum(map(sum, v)) for k, v in rc["micro_counts"].items()}
        print(
            f"row checks, {m}: {'all hold' if not failed else f'FAILED {failed[:5]}'}; rows per "
            f"global batch as {modes[0]}'s (after each sharding, over the micro-batches, after "
            f"from_batches): {not differing}"
            + (f" (differ: {differing})" if differing else "")
            + f"; packing micro-batches per shard and global batch as {modes[0]}'s: "
            f"{counts_same}; micro-batches packing {totals['shard_packing']}, dynamic "
            f"{totals['shard_dynamic']}"
        )
        failures += bool(failed) + bool(differing) + (not counts_same)
    return failures


def _print_memory_and_floor(results: dict[str, Any], modes: list[str]) -> None:
    """Peak memory by stage, the unique bytes of the batch, the memcpy floor of the path beside
    the totals, and the object-store bytes where a meter provides them."""
    print("\n| peak RSS by the end of (GiB) | " + " | ".join(modes) + " |")
    print("|---" * (1 + len(modes)) + "|")
    for stage in STAGES:
        cells = [
            f"{r['peak_rss_by_stage'][stage] / 2**30:.2f}"
            if stage in r.get("peak_rss_by_stage", {})
            else "n/a"
            for r in (results[m] for m in modes)
        ]
        print(f"| {stage} | " + " | ".join(cells) + " |")
    print("| whole process | " + " | ".join(
        f"{results[m]['peak_rss_bytes'] / 2**30:.2f}" for m in modes) + " |")  # fmt: skip
    first = results[modes[0]]
    unique = first.get("unique_bytes")
    if unique:
        bandwidth = min(r["memcpy_bytes_per_s"] for r in results.values())
        floor_bytes = unique["media_bf16"] + unique["tokens"]
        print(
            f"\nunique bytes of the batch: media {unique['media_f32'] / 1e9:.3f} GB as float32, "
            f"{unique['media_bf16'] / 1e9:.3f} GB in the train batch's bfloat16; token tensors "
            f"{unique['tokens'] / 1e9:.3f} GB"
        )
        totals = {
            m: sum(v for k, v in r["seconds"].items() if k in STAGES) for m, r in results.items()
        }
        print(
            f"memcpy bandwidth {bandwidth / 1e9:.2f} GB/s (one thread, this run); floor of the "
            f"path (media bf16 + tokens, copied once) {floor_bytes / bandwidth:.3f} s; totals: "
            + ", ".join(
                f"{m} {t:.3f} s ({t * bandwidth / floor_bytes:.0f}x the floor)"
                for m, t in totals.items()
            )
        )
        _print_share_floor(results, modes, bandwidth)
        _print_store_ratio(results, modes, unique)
    for m in modes:
        store = results[m].get("store")
        if store is None:
            print(f"object store, {m}: n/a (no store meter; bytes between nodes: n/a)")
        else:
            print(
                f"object store, {m}: media chunks written {store['written']:,} B, read in place "
                f"{store['read']:,} B (each shard maps its chunks; nothing is copied out), "
                f"between nodes {store.get('between_nodes', 0):,} B"
            )
    for m in modes:
        in_use = results[m].get("store_in_use")
        if in_use is not None:
            print(
                f"object store in use, {m}: {in_use['before'] / 2**20:.2f} MiB before the "
                f"path, {in_use['after'] / 2**20:.2f} MiB after it (every value dropped); "
                f"the meter reads a live {STORE_PROBE_BYTES / 2**20:.0f} MiB object as "
                f"{in_use['probe'] / 2**20:.2f} MiB"
            )


def _print_share_floor(results: dict[str, Any], modes: list[str], bandwidth: float) -> None:
    """What the PackedTensor share cannot go below with any class: the micro-batches'
    materialized tensors written once at memcpy bandwidth, and the unique media written into
    the object store once at Ray's put rate (both measured in this run)."""
    unique = results[modes[0]]["unique_bytes"]
    materialized = unique.get("materialized", 0)
    put_rate = min(r.get("put_bytes_per_s", float("inf")) for r in results.values())
    floor = materialized / bandwidth + unique["media_bf16"] / put_rate
    base = results[modes[0]]["packed_tensor_seconds"]
    print(
        f"PackedTensor share floor {floor:.3f} s: as_tensors=True outputs "
        f"{materialized / 1e9:.3f} GB at {bandwidth / 1e9:.2f} GB/s, plus the unique media "
        f"{unique['media_bf16'] / 1e9:.3f} GB into the store at Ray's put rate "
        f"{put_rate / 1e9:.2f} GB/s; {modes[0]}'s share is {base / floor:.1f}x it; "
        + ", ".join(
            f"{m} {results[m]['packed_tensor_seconds'] / floor:.2f}x the floor" for m in modes
        )
    )


def _print_store_ratio(results: dict[str, Any], modes: list[str], unique: dict[str, int]) -> None:
    """Bytes written into the object store (the shards' own bytes plus the put-once media
    chunks) against what the two shardings must carry at least: the unique media once and the
    token tensors once per sharding; and against every row carrying its own media."""
    shardings = 2
    floor = unique["media_bf16"] + shardings * unique["tokens"]
    no_dedup = shardings * (unique["media_bf16_logical"] + unique["tokens"])
    for m in modes:
        store = results[m].get("store") or {}
        written = sum(results[m]["payload_bytes"]) + store.get("written", 0)
        print(
            f"into the object store, {m}: {written:,} B = {written / floor:.2f}x the unique "
            f"media plus each sharding's token tensors ({floor:,} B); without deduplication "
            f"{no_dedup:,} B, {no_dedup / written:.1f}x more"
        )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nemo-rl", required=True, help="path of a NeMo-RL checkout")
    ap.add_argument("--prompts", default="256,1024,4096", help="comma-separated prompt counts B")
    ap.add_argument("--generations", type=int, default=16, help="G")
    ap.add_argument("--patches", default="4:16", help="image side range in patches, MIN:MAX")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed passes per process (fastest kept)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch / OpenMP / mmpack threads per process "
        "(1: ratios about the code, not about core contention)",
    )
    ap.add_argument("--out", default="target/bench-nemo-rl")
    ap.add_argument(
        "--no-verify", dest="verify", action="store_false", help="skip the output check"
    )
    ap.add_argument(
        "--verify", dest="verify", action="store_true", default=True, help=argparse.SUPPRESS
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.nemo_rl = str(Path(args.nemo_rl).resolve())
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
