"""Loss masks: derive them from message roles or fragment spans, validate them, find turns.

A loss mask has one entry per token: 1 where the token is a training *target*, 0 elsewhere.
``mmpack.batch.pack_samples`` turns it into next-token labels (the mask at a token gates the
label that predicts it). Every function here runs in the Rust core; masks come back as 1-D numpy
``bool`` arrays.

Errors are typed and name the sample: ``LossMaskError`` (length, values, no trainable token),
its subclass ``MessageSpanError`` (message / fragment lengths inconsistent with the roles, the
flags or the token count), ``TurnStructureError`` (turn markers missing or unpaired), and
``ChatTemplateError`` (a chat template whose rendering is not prefix-stable).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mmpack import _native
from mmpack.errors import ChatTemplateError, IndexOverflowError, LossMaskError

__all__ = [
    "from_chat_template",
    "from_fragments",
    "from_roles",
    "turn_spans",
    "validate",
]

_I64_MAX = 2**63 - 1
# dtypes the native validator reads as they are (no cast that could hide a bad value)
_NATIVE_MASK_DTYPES = frozenset(
    np.dtype(t) for t in (np.bool_, np.uint8, np.int8, np.int32, np.int64, np.float32, np.float64)
)


def sample_name(sample_id: Hashable | None) -> str:
    """How errors name a sample: its ``repr``, or ``<unnamed>``."""
    return "<unnamed>" if sample_id is None else repr(sample_id)


def as_mask_array(mask: Any, sample_id: Hashable | None = None) -> np.ndarray:
    """A 1-D numpy array the native validator reads directly (no value-changing cast).

    Accepts numpy arrays, torch tensors (any device; moved to the host) and sequences. Integer
    dtypes other than the native ones become int64 and floats become float64, both exact.
    """
    if type(mask) is np.ndarray:
        arr = mask
    elif _is_tensor(mask):
        t = mask
        if t.dtype.is_floating_point and t.dtype not in _torch_float_dtypes():
            t = t.double()  # bfloat16 / float16: exact in float64
        arr = tensor_numpy(t, "loss mask", sample_id)
    else:
        arr = np.asarray(mask)
    if arr.ndim != 1:
        raise LossMaskError(
            f"loss mask of sample {sample_name(sample_id)} has shape {tuple(arr.shape)} "
            "(rule: a mask is 1-D, one value per token)"
        )
    if arr.dtype not in _NATIVE_MASK_DTYPES:
        kind = arr.dtype.kind
        if kind in "iu":
            arr = arr.astype(np.int64)
        elif kind == "f":
            arr = arr.astype(np.float64)
        else:
            raise TypeError(
                f"loss mask of sample {sample_name(sample_id)} has dtype {arr.dtype}; "
                "expected bool, an integer or a float dtype"
            )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return bools_as_bytes(arr)


def bools_as_bytes(arr: np.ndarray) -> np.ndarray:
    """A ``bool`` array as a ``uint8`` view (no copy); other arrays unchanged.

    numpy and torch can hold bytes other than 0 and 1 in a bool array (through a view or a
    buffer); read as bytes, such a value is reported like any other bad value, instead of
    passing as ``True`` and landing in the packed mask as it is.
    """
    return arr.view(np.uint8) if arr.dtype == np.bool_ else arr


def _torch_float_dtypes() -> tuple[Any, ...]:
    import torch

    return (torch.float32, torch.float64)


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "detach") and hasattr(x, "numpy")


def tensor_numpy(t: Any, what: str, sample_id: Hashable | None = None) -> np.ndarray:
    """A torch tensor's values as a numpy array: a view on the CPU, else a host copy.

    Raises ``TypeError`` naming the sample for a ``meta`` tensor (it has no values; torch
    would raise ``NotImplementedError``) or a dtype numpy lacks (bfloat16).
    """
    if t.device.type == "meta":
        raise TypeError(
            f"{what} of sample {sample_name(sample_id)} is a meta tensor, which has no values"
        )
    try:
        return t.numpy()
    except (RuntimeError, TypeError):  # needs grad, not on the CPU, or no numpy dtype
        return t.detach().cpu().numpy()


def as_int64(values: Any, what: str, sample_id: Hashable | None = None) -> np.ndarray:
    """A contiguous 1-D int64 numpy array from a numpy array, torch tensor or sequence of ints.

    Raises ``TypeError`` for other dtypes and shapes and ``IndexOverflowError`` for an integer
    beyond int64 (never wrapped into a negative value), both naming the sample.
    """
    if type(values) is np.ndarray:
        arr = values
    elif _is_tensor(values):
        arr = tensor_numpy(values, what, sample_id)
    else:
        arr = np.asarray(values)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.dtype != np.int64:
        if _beyond_int64(arr, values):
            raise IndexOverflowError(
                f"{what} of sample {sample_name(sample_id)} holds a value beyond int64"
            )
        if arr.dtype.kind not in "iu":
            raise TypeError(
                f"{what} of sample {sample_name(sample_id)} must be integers, got dtype {arr.dtype}"
            )
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise TypeError(
            f"{what} of sample {sample_name(sample_id)} must be 1-D, got shape {tuple(arr.shape)}"
        )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def _beyond_int64(arr: np.ndarray, values: Any) -> bool:
    """Whether ``arr`` (``np.asarray(values)``, not int64) holds integers beyond int64: uint64
    values over its max, or Python ints numpy stored as floats or objects because they did
    not fit."""
    if arr.dtype == np.uint64:
        return bool(arr.size) and int(arr.max()) > _I64_MAX
    return (
        arr.dtype.kind in "fO"
        and isinstance(values, (list, tuple))
        and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    )


def _count(num_tokens: Any, sample_id: Hashable | None) -> int:
    """``num_tokens`` as an int: ``TypeError`` for a non-integer (a float, a string, a bool:
    nothing is truncated or parsed), ``LossMaskError`` outside ``[0, 2**63 - 1]``."""
    if isinstance(num_tokens, bool):
        raise TypeError(f"num_tokens of sample {sample_name(sample_id)} must be an int, got bool")
    try:
        n = operator.index(num_tokens)
    except TypeError:
        raise TypeError(
            f"num_tokens of sample {sample_name(sample_id)} must be an int, "
            f"got {type(num_tokens).__name__}"
        ) from None
    if not 0 <= n <= _I64_MAX:
        raise LossMaskError(
            f"num_tokens of sample {sample_name(sample_id)} must be >= 0 and <= 2**63 - 1, "
            f"got {num_tokens}"
        )
    return n


def role_list(roles: Any, what: str, sample_id: Hashable | None = None) -> list[str]:
    """``roles`` as a list of role names; ``TypeError`` (naming the sample when given) for a
    single string or a non-string item."""
    of = "" if sample_id is None else f" of sample {sample_name(sample_id)}"
    if isinstance(roles, str):
        raise TypeError(
            f"{what}{of} must be a sequence of role names, not the single string {roles!r}"
        )
    out = list(roles)
    for r in out:
        if not isinstance(r, str):
            raise TypeError(f"{what}{of} must contain strings, got {type(r).__name__}")
    return out


def validate(
    mask: Any,
    num_tokens: int,
    *,
    sample_id: Hashable | None = None,
    require_trainable: bool = False,
) -> None:
    """Check a loss mask; return ``None`` or raise ``LossMaskError``.

    Rules, checked in this order: the mask is 1-D and its length equals ``num_tokens``; every
    value is 0 or 1 (``True``/``False``, ``0.0``/``1.0`` count; nothing is cast first, so ``2``,
    ``-1`` or ``0.5`` are caught); with ``require_trainable``, at least one value is 1. The
    message names the sample (``sample_id``), the rule and, for a bad value, the first bad
    position.
    """
    arr = as_mask_array(mask, sample_id)
    n = _count(num_tokens, sample_id)
    _native.validate_mask(arr, n, bool(require_trainable), sample_name(sample_id))


def from_roles(
    message_lengths: Sequence[int] | npt.ArrayLike,
    message_roles: Sequence[str],
    train_roles: Sequence[str] = ("assistant",),
    *,
    num_tokens: int | None = None,
    sample_id: Hashable | None = None,
) -> np.ndarray:
    """Mask from message roles: message ``i`` covers the next ``message_lengths[i]`` tokens and
    is trained on (1) when ``message_roles[i]`` is in ``train_roles`` (exact, case-sensitive).

    With ``num_tokens`` the lengths must sum to it. Raises ``MessageSpanError`` when the two
    sequences differ in length, a length is negative, or the sum is wrong.
    """
    lengths = as_int64(message_lengths, "message_lengths", sample_id)
    roles = role_list(message_roles, "message_roles", sample_id)
    train = role_list(train_roles, "train_roles")
    n = None if num_tokens is None else _count(num_tokens, sample_id)
    return _native.mask_from_roles(lengths, roles, train, n, sample_name(sample_id))


def from_fragments(
    fragment_lengths: Sequence[int] | npt.ArrayLike,
    trainable: Sequence[bool] | npt.ArrayLike,
    *,
    num_tokens: int | None = None,
    sample_id: Hashable | None = None,
) -> np.ndarray:
    """Mask from per-fragment trainable spans: fragment ``i`` covers the next
    ``fragment_lengths[i]`` tokens, all set to ``trainable[i]``.

    With ``num_tokens`` the lengths must sum to it. Raises ``MessageSpanError`` when the two
    sequences differ in length, a length is negative, or the sum is wrong.
    """
    lengths = as_int64(fragment_lengths, "fragment_lengths", sample_id)
    flags = bools_as_bytes(np.asarray(trainable))
    if flags.size == 0:
        flags = flags.astype(np.uint8)
    if flags.dtype.kind not in "iu" or not np.isin(flags, (0, 1)).all():
        raise LossMaskError(
            f"trainable flags of sample {sample_name(sample_id)} must be booleans or 0/1"
        )
    flags = flags.astype(np.bool_)
    flags = np.ascontiguousarray(flags.reshape(-1))
    n = None if num_tokens is None else _count(num_tokens, sample_id)
    return _native.mask_from_fragments(lengths, flags, n, sample_name(sample_id))


def turn_spans(
    token_ids: Sequence[int] | npt.ArrayLike,
    turn_marker_ids: Sequence[int] | npt.ArrayLike,
    *,
    sample_id: Hashable | None = None,
) -> np.ndarray:
    """User/assistant turn spans from marker tokens.

    Every position whose token id is in ``turn_marker_ids`` starts a turn. Turns alternate
    user, assistant, user, assistant, ..., so markers must come in pairs. Returns an int64 array
    of shape ``(pairs, 4)``; row ``k`` is ``[user_start, user_end, assistant_start,
    assistant_end]``, half-open: ``user_start`` is the user marker's position, ``user_end ==
    assistant_start`` is the assistant marker's position (the marker belongs to the turn it
    opens), and ``assistant_end`` is the next user marker's position, or ``len(token_ids)`` for
    the last pair. Tokens before the first marker (a BOS, a system prompt) belong to no turn.

    Raises ``TurnStructureError`` naming the sample when there is no marker or an odd number of
    them (a conversation that ends on a user turn), never an ``IndexError``.
    """
    tokens = as_int64(token_ids, "token_ids", sample_id)
    markers = as_int64(turn_marker_ids, "turn_marker_ids", sample_id)
    flat = _native.turn_spans(tokens, markers, sample_name(sample_id))
    return flat.reshape(-1, 4)


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _template_of(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(
            f"tokenizer {type(tokenizer).__name__} has no chat template (set chat_template)"
        )
    return template


def _ids_of(encoded: Any) -> list[int]:
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    ids = encoded.tolist() if hasattr(encoded, "tolist") else list(encoded)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def from_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    train_roles: Sequence[str] = ("assistant",),
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of a conversation rendered by a Hugging Face chat template.

    Returns ``(token_ids, mask)``: 1-D int64 and bool numpy arrays of equal length.

    * When the template marks assistant output with ``{% generation %}`` and ``train_roles`` is
      ``("assistant",)``, the mask is the template's own assistant-token mask
      (``apply_chat_template(..., return_assistant_tokens_mask=True)``): exactly the tokens
      inside the generation blocks.
    * Otherwise the mask follows per-message boundaries: the conversation is rendered for each
      prefix ``messages[:k]``; the tokens that message ``k`` adds are trained on when its role is
      in ``train_roles``. This needs a prefix-stable template (each prefix's tokens are a prefix
      of the next one's), else ``ChatTemplateError``. Everything a message's rendering adds
      (its header and end marker included) counts as that message's.

    The two agree whenever the generation block wraps each assistant message's whole rendering.
    """
    roles = role_list(train_roles, "train_roles")
    template = _template_of(tokenizer)
    msgs = [dict(m) for m in messages]
    if not msgs:
        raise ChatTemplateError("from_chat_template needs at least one message")
    if _GENERATION_TAG.search(template) and roles == ["assistant"]:
        out = tokenizer.apply_chat_template(
            msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = _ids_of(out)
        mask = np.asarray(out["assistant_masks"], dtype=np.int64).reshape(-1)
        if len(mask) != len(ids):
            raise ChatTemplateError(
                f"the template's assistant mask has {len(mask)} entries for {len(ids)} tokens"
            )
        return np.asarray(ids, dtype=np.int64), mask.astype(np.bool_)

    lengths: list[int] = []
    prev: list[int] = []
    for k in range(1, len(msgs) + 1):
        text = tokenizer.apply_chat_template(msgs[:k], tokenize=False)
        ids = _ids_of(tokenizer(text, add_special_tokens=False))
        if ids[: len(prev)] != prev:
            raise ChatTemplateError(
                f"the chat template is not prefix-stable: the tokens of messages[:{k - 1}] are "
                f"not a prefix of those of messages[:{k}], so per-message boundaries are unknown"
            )
        lengths.append(len(ids) - len(prev))
        prev = ids
    msg_roles = [str(m.get("role", "")) for m in msgs]
    mask = from_roles(lengths, msg_roles, roles, num_tokens=len(prev))
    return np.asarray(prev, dtype=np.int64), mask
