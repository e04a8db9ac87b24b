"""A faster ``batched_message_log_to_flat_message`` (NeMo-RL's ``llm_message_utils``), with the
same result.

NeMo-RL flattens each conversation on its own (a ``torch.cat`` of its messages' tensors a key),
pads every row with another ``torch.cat`` and stacks the rows. Here each tensor key is gathered
once: one ``torch.cat`` of every message's tensor in row order, copied into the padded output
(made with ``torch.full`` of the pad value, as NeMo-RL makes its padding) at each row's place.
Everything else is NeMo-RL's own construction in the same order: the keys are collected into
sets the way NeMo-RL collects them, so the output's key order is the same; media keys go through
``PackedTensor.merge_segments`` per row and ``PackedTensor.flattened_concat`` per batch.

The fast path takes message logs whose tensors share one dtype, device and trailing shape a key
(rank >= 1, no autograd, plain strided tensors). Anything else (mixed dtypes, which NeMo-RL's
per-row ``torch.cat`` promotes; keys whose first row is not a tensor; values NeMo-RL refuses)
runs NeMo-RL's own function, so its result and its error are NeMo-RL's by construction.
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LLM_MESSAGE_UTILS_MODULE", "accelerated_flatten"]

LLM_MESSAGE_UTILS_MODULE = "nemo_rl.data.llm_message_utils"

_TENSOR, _PACKED, _LIST = 0, 1, 2
# dtypes masked_scatter_ copies (the unsigned wide, float8 and complex32 types have no kernel)
_SCATTERED = frozenset(
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
        torch.complex64,
        torch.complex128,
    )
)


def accelerated_flatten(original: Callable[..., Any]) -> Callable[..., Any]:
    """The replacement for ``batched_message_log_to_flat_message``; it falls back to
    ``original`` (NeMo-RL's function) outside its fast path."""

    def batched_message_log_to_flat_message(
        message_log_batch: list[Any],
        pad_value_dict: dict[str, int] | None = None,
        make_sequence_length_divisible_by: int = 1,
    ) -> tuple[Any, torch.Tensor]:
        result = _flatten(message_log_batch, pad_value_dict, make_sequence_length_divisible_by)
        if result is None:
            return original(message_log_batch, pad_value_dict, make_sequence_length_divisible_by)
        return result

    batched_message_log_to_flat_message.__doc__ = original.__doc__
    batched_message_log_to_flat_message.__wrapped__ = original  # type: ignore[attr-defined]
    return batched_message_log_to_flat_message


_FLAGS = operator.attrgetter("dtype", "device", "layout", "requires_grad")


def _trailing(t: torch.Tensor) -> Any:
    return t.shape[1:]


class _Row:
    """One conversation's flat keys, in NeMo-RL's key order: for a tensor key the message
    tensors and their total length, for a media key the merged PackedTensor, else the list."""

    __slots__ = ("kinds", "lengths", "values")

    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}
        self.values: dict[str, Any] = {}
        self.lengths: dict[str, int] = {}


def _row(log: Any, packed_cls: type) -> _Row | None:
    if not isinstance(log, list) or not all(isinstance(m, dict) for m in log):
        return None
    keys: set[Any] = set()
    for message in log:
        keys.update(message.keys())
    row = _Row()
    for key in keys:
        values = [message[key] for message in log if key in message]
        if isinstance(values[0], torch.Tensor):
            n = 0
            for v in values:
                if type(v) is not torch.Tensor or v.ndim == 0:
                    return None  # a subclass, or what NeMo-RL's torch.cat refuses
                n += v.shape[0]
            row.kinds[key] = _TENSOR
            row.values[key] = values
            row.lengths[key] = n
        elif any(isinstance(v, packed_cls) for v in values):
            packed = [v for v in values if v is not None]
            if not all(isinstance(v, packed_cls) for v in packed):
                return None  # NeMo-RL refuses the mix
            try:
                row.values[key] = packed_cls.merge_segments(packed)  # type: ignore[attr-defined]
            except Exception:
                return None  # NeMo-RL reports it with its own message
            row.kinds[key] = _PACKED
        else:
            row.kinds[key] = _LIST
            row.values[key] = values
    return row


def _flatten(
    batch: list[Any], pad_value_dict: dict[str, int] | None, divisible_by: int
) -> tuple[Any, torch.Tensor] | None:
    if not isinstance(batch, list) or not batch:
        return None
    if type(divisible_by) is not int or divisible_by < 1:
        return None
    module = importlib.import_module(LLM_MESSAGE_UTILS_MODULE)
    packed_cls = module.PackedTensor
    rows = []
    for log in batch:
        row = _row(log, packed_cls)
        if row is None:
            return None
        rows.append(row)
    all_keys = {key for row in rows for key in row.kinds}
    lengths = [max((n for n in row.lengths.values()), default=0) for row in rows]
    if not any(row.lengths for row in rows):
        return None  # NeMo-RL's batch without tensors
    max_len = max(lengths)
    if max_len % divisible_by != 0:
        max_len = (max_len // divisible_by + 1) * divisible_by

    result = module.BatchedDataDict()
    for key in all_keys:
        kinds = [row.kinds.get(key) for row in rows]
        if _PACKED in kinds:
            if any(k not in (_PACKED, None) for k in kinds):
                return None
            present = [row.values[key] for row in rows if key in row.values]
            template = present[0]
            result[key] = packed_cls.flattened_concat(
                [
                    row.values[key]
                    if key in row.values
                    else packed_cls.empty_rows_like(template, 1)
                    for row in rows
                ]
            )
        elif kinds[0] != _TENSOR:
            if _TENSOR in kinds:
                return None  # NeMo-RL keeps those rows' flat tensors in a list
            result[key] = [row.values[key] if key in row.values else None for row in rows]
        else:
            if any(k not in (_TENSOR, None) for k in kinds):
                return None
            pad = pad_value_dict.get(key, 0) if pad_value_dict else 0
            stacked = _stack(key, rows, max_len, pad)
            if stacked is None:
                return None
            result[key] = stacked
    return result, torch.tensor(lengths, dtype=torch.int32)


def _stack(key: str, rows: list[_Row], max_len: int, pad: Any) -> torch.Tensor | None:
    """The ``[rows, max_len, ...]`` tensor of ``key``: every row's messages one after the other,
    then the pad value."""
    parts: list[torch.Tensor] = []
    row_lengths: list[int] = []
    missing = False
    for row in rows:
        values = row.values.get(key) if row.kinds.get(key) == _TENSOR else None
        if values is None:
            missing = True
            row_lengths.append(0)
        else:
            parts.extend(values)
            row_lengths.append(row.lengths[key])
    first = parts[0]
    rest = first.shape[1:]
    dtype, device, layout, requires_grad = _FLAGS(first)
    if dtype not in _SCATTERED:
        return None  # masked_scatter_ has no kernel for it
    if layout is not torch.strided or requires_grad or len(rest) >= 3:
        return None  # refused, or (channels_last) laid out NeMo-RL's own way there
    # whole-list passes in C: the batch holds a tensor a message a key
    if len(set(map(_FLAGS, parts))) != 1 or len(set(map(_trailing, parts))) != 1:
        return None  # promoted, refused or unstackable in NeMo-RL's own path
    if rest and missing:
        return None  # a row without the key is a 1-D zeros tensor there, which cannot stack
    shape = (len(rows), max_len, *rest)
    if min(row_lengths) < max_len:
        try:
            out = torch.full(shape, pad, dtype=first.dtype, device=first.device)
        except (TypeError, RuntimeError, ValueError, OverflowError):
            return None  # NeMo-RL's padding raises it
    else:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    if flat.shape[0]:
        # the valid places of the output in row-major order are the rows' tokens in order
        counts = torch.tensor(row_lengths, dtype=torch.int64, device=device)
        valid = torch.arange(max_len, device=device)[None, :] < counts[:, None]
        out.masked_scatter_(valid.view(*valid.shape, *([1] * len(rest))), flat)
    return out
