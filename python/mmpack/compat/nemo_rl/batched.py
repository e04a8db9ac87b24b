"""Faster versions of NeMo-RL's hot ``BatchedDataDict`` methods, with the same results.

Opt-in: ``mmpack.compat.nemo_rl.install(accelerate=True)`` sets them on
``nemo_rl.distributed.batched_data_dict.BatchedDataDict`` (``uninstall()`` restores NeMo-RL's).
Each one keeps NeMo-RL's signature, result (values, types, key order, sharing between rows) and
errors; only the time changes. A call outside the common case each one speeds up (a value of
another type, an argument combination it does not handle, input NeMo-RL refuses) runs NeMo-RL's
own method, so its result and its error are NeMo-RL's by construction:

* ``repeat_interleave``: GRPO's G-expansion deep-copies every prompt row G times. The copies are
  made by ``mmpack.compat.nemo_rl.deepcopy.deepcopy`` (``copy.deepcopy``'s result, with plain
  CPU tensors cloned instead of going through ``Tensor.__deepcopy__``), with NeMo-RL's own sharing
  of immutable media (``_prepare_multimodal_sharing``).
* ``shard_by_batch_size`` with ``sequence_packing_args``: NeMo-RL selects every bin's rows into
  its own small batch and stacks a shard's bins back with ``from_batches`` (``pad_sequence`` of
  every row). Here each shard's tensors are selected in one indexing of the bins' rows in order,
  which is the same tensor, since every bin's rows have the batch's width; PackedTensors are
  still sliced per bin and concatenated, as NeMo-RL does. The packer is NeMo-RL's ``get_packer``.
* ``shard_by_batch_size`` with ``dynamic_batching_args``: NeMo-RL sorts each chunk's rows by
  comparing 0-dim tensors and reads every length with ``.item()``; here the lengths are Python
  numbers read once, which compare the same way (the sort is the same stable sort).
* ``from_batches``: two-dimensional tensors are stacked with one copy a batch into a tensor made
  as ``pad_sequence`` makes it, instead of ``pad_sequence`` over every row.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmpack.compat.nemo_rl import placement
from mmpack.compat.nemo_rl.deepcopy import deepcopy
from mmpack.compat.nemo_rl.micro_batches import dynamic_micro_batches
from mmpack.packed.buffers import BUFFER_DTYPES

__all__ = ["BATCHED_DATA_DICT_MODULE", "accelerated_methods"]

BATCHED_DATA_DICT_MODULE = "nemo_rl.distributed.batched_data_dict"


def accelerated_methods(batched_data_dict: type) -> dict[str, Any]:
    """The attributes to set on NeMo-RL's ``BatchedDataDict`` (the class given), by name; each
    falls back to the class's own method as it is now."""
    shard_original = inspect.getattr_static(batched_data_dict, "shard_by_batch_size")
    from_batches_original = inspect.getattr_static(batched_data_dict, "from_batches").__func__

    def shard_by_batch_size(
        self: Any,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: Mapping[str, Any] | None = None,
        sequence_packing_args: Mapping[str, Any] | None = None,
    ) -> Any:
        args = (shards, batch_size, allow_uneven_shards, dynamic_batching_args)
        result = _shard(self, *args, sequence_packing_args)
        if result is None:
            return shard_original(self, *args, sequence_packing_args)
        return result

    shard_by_batch_size.__doc__ = shard_original.__doc__

    def from_batches(
        cls: Any,
        batches: Sequence[Mapping[Any, Any]],
        pad_value_dict: dict[str, int | float] | None = None,
        *,
        allow_missing_packed_tensors: bool = False,
    ) -> Any:
        result = None
        if not allow_missing_packed_tensors:
            result = _from_batches(cls, batches, pad_value_dict)
        if result is None:
            return from_batches_original(
                cls,
                batches,
                pad_value_dict,
                allow_missing_packed_tensors=allow_missing_packed_tensors,
            )
        return result

    from_batches.__doc__ = from_batches_original.__doc__
    return {
        "repeat_interleave": repeat_interleave,
        "shard_by_batch_size": shard_by_batch_size,
        "from_batches": classmethod(from_batches),
    }


def _nemo_rl() -> Any:
    return importlib.import_module(BATCHED_DATA_DICT_MODULE)


def repeat_interleave(self: Any, num_repeats: int, *, share_immutable_media: bool = False) -> Any:
    """NeMo-RL's ``BatchedDataDict.repeat_interleave``: every row ``num_repeats`` times in place
    order; tensors with ``Tensor.repeat_interleave``, other values by deep copies (sharing only
    the explicit multimodal leaves with ``share_immutable_media``)."""
    module = _nemo_rl()
    packed_cls = module.PackedTensor
    media_keys = module.NATIVE_MULTIMODAL_KEYS
    prepare = module._prepare_multimodal_sharing
    repeated = type(self)()
    for key, value in self.data.items():
        if torch.is_tensor(value):
            repeated[key] = value.repeat_interleave(num_repeats, dim=0)
        elif isinstance(value, packed_cls):
            raise NotImplementedError("PackedTensor does not currently support repeat_interleave")
        else:
            rows: list[Any] = []
            for item in value:
                shared = (
                    prepare(item, media_context=key in media_keys) if share_immutable_media else {}
                )
                rows.extend(deepcopy(item, dict(shared)) for _ in range(num_repeats))
            repeated[key] = rows
    return repeated


# ---------------------------------------------------------------------------------------------
# shard_by_batch_size


def _rows(value: Any, packed_cls: type) -> int | None:
    """The row count of a value this module handles (a tensor of rank >= 1, a list, a
    PackedTensor), else ``None``."""
    if torch.is_tensor(value):
        return int(value.shape[0]) if value.ndim >= 1 else None
    if isinstance(value, (list, packed_cls)):
        return len(value)  # type: ignore[arg-type]
    return None


_PACKING_KEYS = (
    "algorithm",
    "max_tokens_per_microbatch",
    "input_lengths_key",
    "sequence_length_pad_multiple",
)
_DYNAMIC_KEYS = (
    "max_tokens_per_microbatch",
    "sequence_length_round",
    "input_key",
    "input_lengths_key",
)


_ORDERED = frozenset(
    (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
)


def _selectable(t: torch.Tensor) -> bool:
    """A tensor whose ``index_select`` and ``torch.cat`` are NeMo-RL's indexing and stacking: a
    strided tensor of the common dtypes (the bit-packed, quantized and scaling dtypes, and sparse
    layouts, fail there in their own ways) of rank 3 at most (memory formats such as
    channels_last come out of NeMo-RL's stacking its own way)."""
    return t.dtype in BUFFER_DTYPES and t.layout is torch.strided and t.ndim <= 3


def _has(args: Mapping[str, Any], keys: tuple[str, ...]) -> bool:
    return isinstance(args, Mapping) and all(k in args for k in keys)


def _shard(
    self: Any,
    shards: int,
    batch_size: int | None,
    allow_uneven_shards: bool,
    dynamic_args: Mapping[str, Any] | None,
    packing_args: Mapping[str, Any] | None,
) -> Any:
    """The fast sharding, or ``None`` where NeMo-RL's own method must run (another value type,
    arguments it refuses or this does not handle)."""
    if allow_uneven_shards or (dynamic_args is None) == (packing_args is None):
        return None
    module = _nemo_rl()
    packed_cls = module.PackedTensor
    data = self.data
    if not data or not all(isinstance(k, str) for k in data):
        return None
    if not all(_selectable(v) for v in data.values() if torch.is_tensor(v)):
        return None
    sizes = {_rows(v, packed_cls) for v in data.values()}
    if len(sizes) != 1 or None in sizes:
        return None
    total = sizes.pop()
    assert total is not None
    if batch_size is None:
        batch_size = total
    if not isinstance(batch_size, int) or not isinstance(shards, int):
        return None
    if total == 0 or batch_size <= 0 or shards <= 0 or total % batch_size or batch_size % shards:
        return None
    if packing_args is not None:
        return _shard_packing(self, module, shards, batch_size, total // batch_size, packing_args)
    assert dynamic_args is not None
    return _shard_dynamic(self, module, shards, batch_size, total // batch_size, dynamic_args)


def _row_media(data: Mapping[str, Any], module: Any, total: int) -> placement.RowMedia | None:
    """The rows' shared media under ``placement="groups"``, else ``None`` (NeMo-RL's placement)."""
    if placement.settings().mode != "groups":
        return None
    return placement.RowMedia.of(data, module.PackedTensor, total)


def _shard_packing(
    self: Any, module: Any, shards: int, batch_size: int, chunks: int, args: Mapping[str, Any]
) -> Any:
    order = args.get("microbatch_order")
    if order not in (None, "packer", "largest_first") or not _has(args, _PACKING_KEYS):
        return None
    packer = module.get_packer(
        algorithm=args["algorithm"],
        bin_capacity=args["max_tokens_per_microbatch"],
        collect_metrics=False,
        min_bin_count=shards,
        bin_count_multiple=shards,
    )
    lengths = self.data[args["input_lengths_key"]]
    if not torch.is_tensor(lengths):
        lengths = torch.tensor(lengths)
    if lengths.ndim != 1 or lengths.is_meta:
        return None
    lengths_list = lengths.tolist()
    multiple = args["sequence_length_pad_multiple"]
    media = _row_media(self.data, module, total=chunks * batch_size)
    padded_by_chunk = []
    bins_by_chunk: list[list[list[list[int]]]] = []  # per chunk, per shard, its bins
    for c in range(chunks):
        padded = [
            (n + multiple - 1) // multiple * multiple
            for n in lengths_list[c * batch_size : (c + 1) * batch_size]
        ]
        padded_by_chunk.append(padded)
        start = c * batch_size
        bins = packer.pack(sequence_lengths=padded)  # NeMo-RL's, and its errors
        nemo_bins = [bins[s::shards] for s in range(shards)]
        cap = args["max_tokens_per_microbatch"]
        if (
            media is not None
            and type(cap) is int
            and all(type(n) is int and 0 < n <= cap for n in padded)
            and media.shared_within(start, start + batch_size)
        ):
            nemo_bins = placement.packing_shards(media, start, padded, shards, args, nemo_bins)
        bins_by_chunk.append(nemo_bins)

    shard_bins: list[list[list[int]]] = [[] for _ in range(shards)]  # global rows per bin
    micro_indices: list[list[list[list[int]]]] = [[] for _ in range(shards)]
    micro_lengths: list[list[list[int]]] = [[] for _ in range(shards)]
    elem_counts: list[list[int]] = [[] for _ in range(shards)]
    for c in range(chunks):
        start = c * batch_size
        padded = padded_by_chunk[c]
        for s in range(shards):
            bins = bins_by_chunk[c][s]
            if order == "largest_first":
                bins = sorted(bins, key=lambda b: sum(padded[i] for i in b), reverse=True)
            if not bins or any(len(b) == 0 for b in bins):
                return None  # NeMo-RL stacks empty selections its own way
            spans: list[list[int]] = []
            spans_lengths: list[int] = []
            end = 0
            for b in bins:
                shard_bins[s].append([i + start for i in b])
                spans.append([end, end + len(b)])
                end += len(b)
                spans_lengths.append(sum(padded[i] for i in b))
            micro_indices[s].append(spans)
            micro_lengths[s].append(spans_lengths)
            elem_counts[s].append(end)

    order_out: list[int] = []
    for s in range(shards):
        for b in shard_bins[s]:
            order_out.extend(b)
    out = []
    for s in range(shards):
        shard = _select_bins(self.data, shard_bins[s], module)
        shard.micro_batch_indices = micro_indices[s]
        shard.micro_batch_lengths = micro_lengths[s]
        shard.elem_counts_per_gb = elem_counts[s]
        out.append(shard)
    return out, order_out


def _select_bins(data: Mapping[str, Any], bins: list[list[int]], module: Any) -> Any:
    """``SlicedDataDict.from_batches`` of ``select_indices`` of every bin, in one selection a
    tensor: the keys sorted, tensors indexed by all the bins' rows in order, PackedTensors
    sliced per bin and concatenated, lists flattened."""
    packed_cls = module.PackedTensor
    rows = [i for b in bins for i in b]
    index = torch.tensor(rows, dtype=torch.int64)
    shard = module.SlicedDataDict()
    for key in sorted(data):
        value = data[key]
        if torch.is_tensor(value):
            shard[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, packed_cls):
            shard[key] = packed_cls.concat([value.slice(b) for b in bins])
        else:
            shard[key] = [value[i] for i in rows]
    return shard


def _shard_dynamic(
    self: Any, module: Any, shards: int, batch_size: int, chunks: int, args: Mapping[str, Any]
) -> Any:
    packed_cls = module.PackedTensor
    if not _has(args, _DYNAMIC_KEYS):
        return None
    lengths_key = args["input_lengths_key"]
    lengths = self.data.get(lengths_key)
    inputs = self.data.get(args["input_key"])
    if not torch.is_tensor(lengths) or lengths.ndim != 1 or lengths.dtype not in _ORDERED:
        return None  # NeMo-RL compares 0-dim tensors: other dtypes raise there
    if not torch.is_tensor(inputs) or inputs.ndim < 2:
        return None
    if any(torch.is_tensor(v) and v.device.type != "cpu" for v in self.data.values()):
        return None  # NeMo-RL's CPU index meets them in its own way
    cap = args["max_tokens_per_microbatch"]
    round_to = args["sequence_length_round"]
    if not all(type(v) in (int, float) for v in (cap, round_to)):
        return None  # NeMo-RL's arithmetic meets them with its own error
    width = inputs.shape[1]
    lengths_list = lengths.tolist()
    media = None
    integral = not lengths.is_floating_point() and lengths.dtype is not torch.bool
    if integral and type(cap) is int and type(round_to) is int and round_to > 0:
        media = _row_media(self.data, module, total=chunks * batch_size)
    order: list[int] = []
    for c in range(chunks):
        start = c * batch_size
        chunk = lengths_list[start : start + batch_size]
        ranked = sorted(range(batch_size), key=chunk.__getitem__)
        nemo_order = [i for s in range(shards) for i in ranked[s::shards]]
        if media is not None and min(chunk) >= 0 and media.shared_within(start, start + batch_size):
            nemo_order = placement.dynamic_order(
                media, start, chunk, shards, nemo_order, (cap, round_to, width)
            )
        order.extend(i + start for i in nemo_order)

    # NeMo-RL reorders every value by ``order`` and then copies each shard's ranges out of the
    # reordered copy; a tensor's shard is the same rows selected from the source in one copy.
    reordered = {
        key: value.slice(order) for key, value in self.data.items() if isinstance(value, packed_cls)
    }
    shard_size = batch_size // shards
    out = [module.SlicedDataDict() for _ in range(shards)]
    for s, shard in enumerate(out):
        ranges = [
            (c * batch_size + s * shard_size, c * batch_size + (s + 1) * shard_size)
            for c in range(chunks)
        ]
        rows = [order[i] for lo, hi in ranges for i in range(lo, hi)]
        index = torch.tensor(rows, dtype=torch.int64)
        for key, value in self.data.items():
            if torch.is_tensor(value):
                shard[key] = value.index_select(0, index.to(value.device))
            elif isinstance(value, packed_cls):
                shard[key] = packed_cls.concat(
                    [reordered[key].slice(list(range(lo, hi))) for lo, hi in ranges]
                )
            else:
                shard[key] = [value[i] for i in rows]

    shard_lengths = [shard[lengths_key].tolist() for shard in out]
    micro_indices = []
    micro_lengths = []
    for c in range(chunks):
        per_shard = [lengths[c * shard_size : (c + 1) * shard_size] for lengths in shard_lengths]
        found = dynamic_micro_batches(per_shard, cap, round_to, width)
        if found is None:
            return None  # NeMo-RL refuses it with its own message
        spans, spans_lengths = found
        micro_indices.append(spans)
        micro_lengths.append(spans_lengths)
    for shard in out:
        shard.micro_batch_indices = micro_indices
        shard.micro_batch_lengths = micro_lengths
    return out, order


# ---------------------------------------------------------------------------------------------
# from_batches


def _from_batches(
    cls: Any, batches: Sequence[Mapping[Any, Any]], pad_value_dict: dict[str, Any] | None
) -> Any:
    """The fast stacking, or ``None`` where NeMo-RL's own must run (a batch missing a key, a
    type or a mix of tensors this does not handle)."""
    if not batches:
        return None
    packed_cls = _nemo_rl().PackedTensor
    keys = {key for item in batches for key in item}
    if not all(isinstance(k, str) for k in keys):
        return None
    if any(len(item) != len(keys) for item in batches):
        return None
    pads = pad_value_dict or {}
    stacked = cls()
    for key in sorted(keys):
        values = [item[key] for item in batches]
        first = values[0]
        if isinstance(first, list):
            stacked[key] = [x for part in values for x in part]
        elif isinstance(first, packed_cls):
            stacked[key] = packed_cls.concat(values)
        elif not all(torch.is_tensor(v) and _selectable(v) for v in values):
            return None
        elif all(v.ndim == 1 for v in values):
            stacked[key] = torch.cat(values)
        elif all(v.ndim == 2 for v in values) and _same_kind(values):
            stacked[key] = _pad_rows(values, pads.get(key, 0))
        else:
            return None
    return stacked


def _same_kind(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(t.dtype == first.dtype and t.device == first.device for t in tensors)


def _pad_rows(tensors: list[torch.Tensor], pad_value: Any) -> torch.Tensor:
    """``pad_sequence`` of every row of the two-dimensional ``tensors`` (batch first): the
    output made as ``pad_sequence`` makes it (``new_full`` of the first row's options), each
    tensor copied into its block."""
    rows = sum(int(t.shape[0]) for t in tensors)
    if rows == 0:
        return _pad_sequence_of_rows(tensors, pad_value)
    # pad_sequence sees rows only: a tensor without rows does not widen the output
    width = max(int(t.shape[1]) for t in tensors if t.shape[0])
    with_rows = [t for t in tensors if t.shape[0]]
    if all(int(t.shape[1]) == width for t in with_rows):
        # Nothing to pad, but pad_sequence converts the pad value into the dtype all the same
        # (its output is a new_full): one row of it meets a bad value with pad_sequence's error.
        _pad_sequence_of_rows([with_rows[0][:1]], pad_value)
        return torch.cat(with_rows)  # pad_sequence's rows one after the other
    # pad_sequence converts the pad value its own way (a C double): let it pad
    return _pad_sequence_of_rows(tensors, pad_value)


def _pad_sequence_of_rows(tensors: list[torch.Tensor], pad_value: Any) -> torch.Tensor:
    # No rows: pad_sequence refuses an empty list, and its error is the result.
    rows = [row.flatten() for t in tensors for row in t]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_value)
