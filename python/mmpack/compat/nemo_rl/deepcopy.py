"""``copy.deepcopy`` with fast paths for what message logs are made of, and the same result.

GRPO's G-expansion deep-copies every prompt's message log G times; ``copy.deepcopy`` spends most
of that in ``torch.Tensor.__deepcopy__`` (tens of microseconds a tensor, in Python). Here:

* dicts, lists and tuples of exactly those types are walked as ``copy.deepcopy`` walks them (the
  memo first, then the same construction, so shared and cyclic references come out shared);
* a plain CPU tensor of an ordinary dtype that is the only view of all of its storage is
  cloned, and the clone's storage is put in the memo where ``copy.deepcopy`` and
  ``UntypedStorage.__deepcopy__`` look for a copied storage (under the storage's id, and under
  its handle in the memo's ``"torch"`` table), so that a later view of the same storage still
  shares it;
* everything else (tensors with autograd, attributes, views into larger storages, subclasses,
  other devices, bool and sub-byte dtypes, whose bytes a clone may normalise, any other object)
  goes to ``copy.deepcopy`` itself with the same memo, and so does the whole call while a torch
  function or dispatch mode is active (it must see ``Tensor.__deepcopy__``).

Known differences that no result shows: the copies' autograd version counter (``_version``)
starts at 0 rather than 1, and the recursion limit is reached at a different depth.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["deepcopy"]

_ATOMIC = frozenset((type(None), int, float, bool, complex, str, bytes))
# Dtypes whose clone copies every byte as it is.
_CLONED_DTYPES = frozenset(
    (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    )
)
_MISSING = object()


def deepcopy(x: Any, memo: dict[Any, Any] | None = None) -> Any:
    """``copy.deepcopy(x, memo)``, faster on dicts, lists, tuples and plain CPU tensors."""
    if memo is None:
        memo = {}
    if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack():
        return copy.deepcopy(x, memo)
    return _copy(x, memo)


def _copy(x: Any, memo: dict[Any, Any]) -> Any:
    found = memo.get(id(x), _MISSING)
    if found is not _MISSING:
        return found
    cls = type(x)
    if cls in _ATOMIC:
        return x
    if cls is dict:
        y: Any = {}
        memo[id(x)] = y
        for key, item in x.items():
            y[_copy(key, memo)] = _copy(item, memo)
        _keep_alive(x, memo)
        return y
    if cls is list:
        y = []
        memo[id(x)] = y
        append = y.append
        for item in x:
            append(_copy(item, memo))
        _keep_alive(x, memo)
        return y
    if cls is tuple:
        items = [_copy(item, memo) for item in x]
        # A tuple that contains itself was already copied while copying its items.
        found = memo.get(id(x), _MISSING)
        if found is not _MISSING:
            return found
        y = x if all(a is b for a, b in zip(x, items, strict=True)) else tuple(items)
        if y is not x:
            memo[id(x)] = y
            _keep_alive(x, memo)
        return y
    if cls is torch.Tensor:
        y = _copy_tensor(x, memo)
        if y is not None:
            return y
    return copy.deepcopy(x, memo)


def _copy_tensor(x: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor | None:
    """A clone equal to ``Tensor.__deepcopy__``'s result, or ``None`` to let it run."""
    if (
        x.dtype not in _CLONED_DTYPES
        or x.requires_grad
        or not x.is_cpu
        or x.layout is not torch.strided
        or x.is_nested
        or x.is_quantized
        or x.is_conj()
        or x.is_neg()
        or x.storage_offset() != 0
        or not x.is_contiguous()
        or x.__dict__
        or x.grad is not None
    ):
        return None
    storage = x.untyped_storage()
    torch_memo = memo.get("torch")
    if (
        id(storage) in memo
        or (torch_memo is not None and storage._cdata in torch_memo)
        or storage.nbytes() != x.nbytes
    ):
        return None
    y = x.clone()
    if y.stride() != x.stride():
        return None
    copied = y.untyped_storage()
    memo[id(x)] = y
    memo[id(storage)] = copied
    memo.setdefault("torch", {})[storage._cdata] = copied
    _keep_alive(x, memo)
    _keep_alive(storage, memo)
    return y


def _keep_alive(x: Any, memo: dict[Any, Any]) -> None:
    """As ``copy.deepcopy`` does: the memo holds the originals so that their ids stay theirs."""
    memo.setdefault(id(memo), []).append(x)
