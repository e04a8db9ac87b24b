"""Plain versions of the NeMo-RL ``BatchedDataDict`` methods and the message-log flatten that
``install(accelerate=True)`` replaces, written from their documented behaviour the slow, obvious
way (every bin selected into its own batch and stacked row by row with ``pad_sequence``, every
conversation concatenated and padded on its own). NeMo-RL needs a newer Python than this suite
runs on, so the tests register these as stand-in NeMo-RL modules and compare the accelerated
versions with them; NeMo-RL's own tests run against the real modules with
``tests/nemo_rl_fidelity/run_fidelity.py --accelerate``.
"""

from __future__ import annotations

import copy
from collections import UserDict
from typing import Any

import mmpack
import torch
from mmpack.compat.nemo_rl.packing import get_packer

PackedTensor = mmpack.PackedTensor

MEDIA_KEYS = frozenset({"vllm_content", "vllm_images"})

#: media keys and their metadata keys, whose per-row segment counts must agree
COUPLED_MULTIMODAL_KEYS = (
    ("pixel_values", "image_grid_thw"),
    ("pixel_values_videos", "video_grid_thw"),
)


def prepare_sharing(item: Any, *, media_context: bool = False) -> dict[int, Any]:
    """NeMo-RL's rule: PackedTensors get provenance, leaves under media keys are shared."""
    shared: dict[int, Any] = {}

    def visit(value: Any, in_media: bool) -> None:
        if isinstance(value, mmpack.PackedTensor):
            value.enable_deduplication()
        elif isinstance(value, dict):
            for key, child in value.items():
                visit(child, in_media or key in MEDIA_KEYS)
        elif isinstance(value, (list, tuple)):
            for child in value:
                visit(child, in_media)
        elif in_media:
            shared[id(value)] = value

    visit(item, media_context)
    return shared


class ReferenceBatchedDataDict(UserDict):  # type: ignore[type-arg]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: Any = None
        self.micro_batch_lengths: Any = None
        self.elem_counts_per_gb: Any = None

    def repeat_interleave(self, num_repeats: int, *, share_immutable_media: bool = False) -> Any:
        """The reference: every row deep-copied with ``copy.deepcopy``."""
        out = type(self)()
        for key, value in self.data.items():
            if torch.is_tensor(value):
                out[key] = value.repeat_interleave(num_repeats, dim=0)
            elif isinstance(value, mmpack.PackedTensor):
                raise NotImplementedError(
                    "PackedTensor does not currently support repeat_interleave"
                )
            else:
                rows = []
                for item in value:
                    shared = (
                        prepare_sharing(item, media_context=key in MEDIA_KEYS)
                        if share_immutable_media
                        else {}
                    )
                    rows.extend(copy.deepcopy(item, dict(shared)) for _ in range(num_repeats))
                out[key] = rows
        return out

    #: plain tensors that travel with the media keys
    ADDITIONAL_OPTIONAL_KEY_TENSORS = ("second_per_grid_ts",)

    def get_multimodal_dict(
        self, as_tensors: bool = False, device: Any = None, pixel_dtype: Any = None
    ) -> dict[str, Any]:
        """Every packed key, as the value or (``as_tensors``) every row's own copy of its media,
        after checking that coupled keys agree row by row; ``pixel_dtype`` casts pixels."""
        if as_tensors:
            for value_key, metadata_key in COUPLED_MULTIMODAL_KEYS:
                value, metadata = self.data.get(value_key), self.data.get(metadata_key)
                if isinstance(value, PackedTensor) and isinstance(metadata, PackedTensor):
                    a = value.logical_segment_counts_by_row()
                    b = metadata.logical_segment_counts_by_row()
                    if a != b:
                        raise ValueError(
                            "Coupled multimodal keys must have the same ordered per-row "
                            f"segment counts, but {value_key!r} has {a} and {metadata_key!r} "
                            f"has {b}."
                        )
        out: dict[str, Any] = {}
        for key, value in self.data.items():
            if isinstance(value, PackedTensor):
                if pixel_dtype is not None and key.startswith("pixel_values"):
                    value = value.to_dtype(pixel_dtype)
                out[key] = value.as_tensor(device=device) if as_tensors else value
            elif key in self.ADDITIONAL_OPTIONAL_KEY_TENSORS:
                out[key] = value
        return out

    def select_indices(self, indices: list[int]) -> Any:
        out = type(self)()
        for key, value in self.data.items():
            if torch.is_tensor(value):
                out[key] = value[indices]
            elif isinstance(value, PackedTensor):
                out[key] = value.slice(indices)
            elif isinstance(value, list):
                out[key] = [value[i] for i in indices]
            else:
                raise TypeError(f"Unsupported type {type(value)} for index selection")
        return out

    @classmethod
    def from_batches(
        cls,
        batches: list[Any],
        pad_value_dict: dict[str, Any] | None = None,
        *,
        allow_missing_packed_tensors: bool = False,
    ) -> Any:
        out = cls()
        pads = pad_value_dict or {}
        if not batches:
            return out
        for key in sorted({k for item in batches for k in item}):
            values = [item[key] for item in batches]  # KeyError for a missing key
            if isinstance(values[0], list):
                out[key] = [x for part in values for x in part]
            elif isinstance(values[0], PackedTensor):
                out[key] = PackedTensor.concat(values)
            elif all(v.ndim == 1 for v in values):
                out[key] = torch.cat(values)
            elif values[0].ndim >= 3:
                longest = max(v.shape[1] for v in values)
                padded = [
                    torch.nn.functional.pad(
                        v, (0, 0) * (v.ndim - 2) + (0, longest - v.shape[1]), value=pads.get(key, 0)
                    )
                    for v in values
                ]
                out[key] = torch.cat(padded, dim=0)
            else:
                rows = [row.flatten() for v in values for row in v]
                out[key] = torch.nn.utils.rnn.pad_sequence(
                    rows, batch_first=True, padding_value=pads.get(key, 0)
                )
        return out

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: dict[str, Any] | None = None,
        sequence_packing_args: dict[str, Any] | None = None,
    ) -> Any:
        ReferenceBatchedDataDict.reference_calls += 1
        if allow_uneven_shards or (dynamic_batching_args is None) == (
            sequence_packing_args is None
        ):
            raise NotImplementedError("the reference shards only one way at a time, evenly")
        total = len(next(iter(self.data.values())))
        batch_size = batch_size or total
        assert total % batch_size == 0 and batch_size % shards == 0, "uneven"
        chunks = total // batch_size
        if sequence_packing_args is not None:
            return self._shard_packing(shards, batch_size, chunks, sequence_packing_args)
        assert dynamic_batching_args is not None
        return self._shard_dynamic(shards, batch_size, chunks, dynamic_batching_args)

    reference_calls = 0

    def _shard_packing(self, shards: int, batch_size: int, chunks: int, args: Any) -> Any:
        packer = get_packer(
            algorithm=args["algorithm"],
            bin_capacity=args["max_tokens_per_microbatch"],
            min_bin_count=shards,
            bin_count_multiple=shards,
        )
        lengths = self.data[args["input_lengths_key"]]
        multiple = args["sequence_length_pad_multiple"]
        per_shard: list[list[Any]] = [[] for _ in range(shards)]
        micro: list[list[Any]] = [[] for _ in range(shards)]
        micro_lengths: list[list[Any]] = [[] for _ in range(shards)]
        counts: list[list[int]] = [[] for _ in range(shards)]
        order: list[int] = []
        order_by_shard: list[list[int]] = [[] for _ in range(shards)]
        for c in range(chunks):
            padded = [
                -(-int(lengths[c * batch_size + i].item()) // multiple) * multiple
                for i in range(batch_size)
            ]
            bins = packer.pack(sequence_lengths=padded)
            for s in range(shards):
                mine = bins[s::shards]
                if args.get("microbatch_order") == "largest_first":
                    mine = sorted(mine, key=lambda b: sum(padded[i] for i in b), reverse=True)
                spans, spans_lengths, end = [], [], 0
                for b in mine:
                    rows = [i + c * batch_size for i in b]
                    per_shard[s].append(self.select_indices(rows))
                    order_by_shard[s].extend(rows)
                    spans.append([end, end + len(b)])
                    end += len(b)
                    spans_lengths.append(sum(padded[i] for i in b))
                micro[s].append(spans)
                micro_lengths[s].append(spans_lengths)
                counts[s].append(end)
        out = []
        for s in range(shards):
            order.extend(order_by_shard[s])
            shard = ReferenceSlicedDataDict.from_batches(per_shard[s])
            shard.micro_batch_indices = micro[s]
            shard.micro_batch_lengths = micro_lengths[s]
            shard.elem_counts_per_gb = counts[s]
            out.append(shard)
        return out, order

    def _shard_dynamic(self, shards: int, batch_size: int, chunks: int, args: Any) -> Any:
        lengths = self.data[args["input_lengths_key"]]
        order: list[int] = []
        for c in range(chunks):
            chunk = lengths[c * batch_size : (c + 1) * batch_size]
            ranked = sorted(range(batch_size), key=lambda i: chunk[i])  # 0-dim tensors
            ranked = [i + c * batch_size for i in ranked]
            for s in range(shards):
                order.extend(ranked[s::shards])
        data = self.select_indices(order).data
        size = batch_size // shards
        out = []
        for s in range(shards):
            rows = [c * batch_size + s * size + r for c in range(chunks) for r in range(size)]
            shard = ReferenceSlicedDataDict()
            for key, value in data.items():
                if isinstance(value, PackedTensor):
                    # NeMo-RL concatenates one slice a chunk
                    shard[key] = PackedTensor.concat(
                        [
                            value.slice(
                                list(
                                    range(
                                        c * batch_size + s * size, c * batch_size + (s + 1) * size
                                    )
                                )
                            )
                            for c in range(chunks)
                        ]
                    )
                elif torch.is_tensor(value):
                    shard[key] = value[rows]
                else:
                    shard[key] = [value[i] for i in rows]
            out.append(shard)
        width = data[args["input_key"]].shape[1]
        cap, round_to = args["max_tokens_per_microbatch"], args["sequence_length_round"]
        micro, micro_lengths = [], []
        for c in range(chunks):
            spans, spans_lengths, longest_in_mb = [[0, 0]], [0], 0
            for r in range(size):
                longest = 0
                for shard in out:
                    longest = max(longest, shard[args["input_lengths_key"]][c * size + r].item())
                longest = min(-(-longest // round_to) * round_to, width)
                assert longest <= cap, f"got an input of padded length {longest}"
                longest_in_mb = max(longest_in_mb, longest)
                if (spans[-1][1] - spans[-1][0] + 1) * longest_in_mb <= cap:
                    spans[-1][-1] += 1
                    spans_lengths[-1] = longest_in_mb
                else:
                    spans.append([r, r + 1])
                    longest_in_mb = longest
                    spans_lengths.append(longest)
            micro.append(spans)
            micro_lengths.append(spans_lengths)
        for shard in out:
            shard.micro_batch_indices = micro
            shard.micro_batch_lengths = micro_lengths
        return out, order


class ReferenceSlicedDataDict(ReferenceBatchedDataDict):
    pass


def reference_flatten(
    message_log_batch: list[Any],
    pad_value_dict: dict[str, Any] | None = None,
    make_sequence_length_divisible_by: int = 1,
) -> tuple[Any, torch.Tensor]:
    """Every conversation flattened on its own (a ``torch.cat`` a key), padded, stacked; keys
    collected into sets conversation by conversation, then over the batch."""
    flats = []
    for log in message_log_batch:
        keys: set[str] = set()
        for message in log:
            keys.update(message.keys())
        flat: dict[str, Any] = {}
        for key in keys:
            values = [m[key] for m in log if key in m]
            if isinstance(values[0], torch.Tensor):
                flat[key] = torch.cat(values)
            elif any(isinstance(v, PackedTensor) for v in values):
                flat[key] = PackedTensor.merge_segments([v for v in values if v is not None])
            else:
                flat[key] = values
        flats.append(flat)
    all_keys = {k for flat in flats for k in flat}
    lengths = [
        max((v.shape[0] for v in flat.values() if isinstance(v, torch.Tensor)), default=0)
        for flat in flats
    ]
    longest = max(lengths)
    if longest % make_sequence_length_divisible_by:
        m = make_sequence_length_divisible_by
        longest = (longest // m + 1) * m
    out = ReferenceBatchedDataDict()
    for key in all_keys:
        values = [flat.get(key) for flat in flats]
        if any(isinstance(v, PackedTensor) for v in values):
            template = next(v for v in values if isinstance(v, PackedTensor))
            out[key] = PackedTensor.flattened_concat(
                [v if v is not None else PackedTensor.empty_rows_like(template, 1) for v in values]
            )
        elif not isinstance(values[0], torch.Tensor):
            out[key] = values
        else:
            present = [v for v in values if v is not None]
            assert all(v.dtype == present[0].dtype for v in present), "inconsistent types"
            pad = (pad_value_dict or {}).get(key, 0)
            rows = []
            for v in values:
                if v is None:
                    v = torch.zeros(0, dtype=present[0].dtype)
                if longest > v.shape[0]:
                    fill = torch.full((longest - v.shape[0], *v.shape[1:]), pad, dtype=v.dtype)
                    v = torch.cat([v, fill])
                rows.append(v)
            out[key] = torch.stack(rows)
    return out, torch.tensor(lengths, dtype=torch.int32)
