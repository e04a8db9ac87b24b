"""``encode_once(model)``: the model's vision tower runs once per unique segment, and each
feature goes to every placeholder of every row that uses it, with exact gradients.

After the call, ``model(...)`` accepts media as :class:`~mmpack.packed.unique.UniqueSegments`
(``PackedTensor.unique_segments()``, or the NeMo-RL drop-in's unique mode) wherever it accepted
the tensor of ``as_tensor()``: ``pixel_values`` with ``image_grid_thw`` (Qwen2-VL, Qwen2.5-VL,
videos too), ``pixel_values`` with ``image_sizes`` (LLaVA, LLaVA-NeXT). The adapter calls the
model's own ``get_<modality>_features`` on the unique segments, repeats each unique feature
tensor for its occurrences (an index, so autograd sums the gradients of all occurrences into
the one encode) and passes them through the forward's ``mm_encoder_outputs``. Plain tensors go
through untouched: the logical path stays as it was.

In no-grad passes a model adapted with ``feature_cache_bytes > 0`` keeps the features of the
unique segments it encoded (keyed by provenance) and serves later micro-batches of the same
step from them, until its weights change (see ``mmpack.vision.feature_cache``).
"""

from __future__ import annotations

import copy
import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmpack.errors import UniqueMediaError, UnsupportedModelError
from mmpack.packed.unique import UniqueSegments
from mmpack.vision.families import FAMILIES, Family, Modality, family_of
from mmpack.vision.feature_cache import FeatureCache, weights_stamp

__all__ = ["EncodeStats", "encode_once", "encode_stats"]


@dataclass
class EncodeStats:
    """What an adapted model's vision tower did: feature tensors (images or videos) encoded, the
    occurrences they were served to, and those served from the no-grad cache."""

    encoded: int = 0
    occurrences: int = 0
    cached: int = 0


def encode_once(model: Any, *, feature_cache_bytes: int = 0) -> Any:
    """Adapt ``model`` (in place; returned) to take unique media; see the module docs.
    ``feature_cache_bytes``: the budget for features reused across no-grad micro-batches (0:
    none). Calling it again on an adapted model only sets the budget.

    Raises :class:`~mmpack.errors.UnsupportedModelError` for a model of another family, or one
    whose forward has no ``mm_encoder_outputs`` (transformers too old)."""
    cache = FeatureCache(feature_cache_bytes)
    adapter = getattr(model, "forward", None)
    if isinstance(adapter, _Adapter):
        adapter.cache = cache
        return model
    family = family_of(model)
    if family is None:
        supported = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise UnsupportedModelError(
            f"mmpack.vision.encode_once cannot adapt {type(model).__name__} "
            f"(model_type {model_type!r}); it supports {supported}"
        )
    _check_surface(model, family)
    model.forward = _Adapter(model, family, model.forward, cache)
    return model


def encode_stats(model: Any) -> EncodeStats:
    """The counters of a model adapted by :func:`encode_once` (``TypeError`` otherwise)."""
    adapter = getattr(model, "forward", None)
    if not isinstance(adapter, _Adapter):
        raise TypeError(f"{type(model).__name__} was not adapted by mmpack.vision.encode_once")
    return adapter.stats


def _check_surface(model: Any, family: Family) -> None:
    params = inspect.signature(type(model).forward).parameters
    missing = [f"get_{m.name}_features" for m in family.modalities]
    missing = [name for name in missing if not callable(getattr(model, name, None))]
    if "mm_encoder_outputs" not in params:
        missing.append("forward(mm_encoder_outputs=...)")
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__} ({family.name}) lacks {', '.join(missing)}: this "
            "transformers version has no public way to hand the forward precomputed features"
        )


class _Adapter:
    """The adapted forward (an instance attribute of the model). It holds the model weakly and
    the forward as a plain function, so that the model is freed as soon as it is dropped (no
    reference cycle through its own ``__dict__``); it keeps the forward's signature, which
    transformers' ``generate`` and the Trainer read."""

    def __init__(self, model: Any, family: Family, forward: Any, cache: FeatureCache) -> None:
        self._model = weakref.ref(model)
        self.family = family
        bound = getattr(forward, "__self__", None) is model
        self._function = forward.__func__ if bound else None
        self._forward = None if bound else forward  # something else's wrapper: kept as given
        self.cache = cache
        self.stats = EncodeStats()
        self.__signature__ = inspect.signature(forward)
        self.__wrapped__ = forward.__func__ if bound else forward
        self.__doc__ = getattr(forward, "__doc__", None)

    @property
    def model(self) -> Any:
        model = self._model()
        if model is None:
            raise ReferenceError("the adapted model was freed")
        return model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, UniqueSegments) for a in args):
            raise UniqueMediaError("pass unique media to an adapted model by keyword")
        if any(isinstance(v, UniqueSegments) for v in kwargs.values()):
            kwargs = self._with_features(kwargs)
        if self._function is not None:
            return self._function(self.model, *args, **kwargs)
        assert self._forward is not None
        return self._forward(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Adapter:
        # Copied with its model (``copy.deepcopy(model)``): the copy adapts the model's copy,
        # with a cache and counters of its own.
        model = self.model
        copied = memo.get(id(model))
        if copied is None:
            copied = copy.deepcopy(model, memo)
        if self._function is None:
            forward = copy.deepcopy(self._forward, memo)
        else:
            forward = self._function.__get__(copied)
        return _Adapter(copied, self.family, forward, FeatureCache(self.cache.max_bytes))

    def __reduce__(self) -> tuple[Any, ...]:
        forward = self._forward if self._function is None else self._function.__name__
        return (_restore, (self.model, self.family, forward, self.cache.max_bytes))

    def _with_features(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(kwargs)
        outputs = dict(kwargs.pop("mm_encoder_outputs", None) or {})
        for modality in self.family.modalities:
            values = kwargs.get(modality.values_key)
            if not isinstance(values, UniqueSegments):
                continue
            if modality.name in outputs:
                raise UniqueMediaError(
                    f"{modality.values_key!r} and mm_encoder_outputs[{modality.name!r}] both given"
                )
            del kwargs[modality.values_key]
            outputs[modality.name] = self._modality_outputs(modality, values, kwargs)
        for key in self.family.logical_keys:
            value = kwargs.get(key)
            if isinstance(value, UniqueSegments):
                kwargs[key] = value.logical()
        left = sorted(k for k, v in kwargs.items() if isinstance(v, UniqueSegments))
        if left:
            raise UniqueMediaError(
                f"unique media under {left} that {self.family.name} does not encode here: a "
                "metadata key is unique only together with its media key"
            )
        kwargs["mm_encoder_outputs"] = outputs
        return kwargs

    def _modality_outputs(
        self, modality: Modality, values: UniqueSegments, kwargs: dict[str, Any]
    ) -> Any:
        encoder: dict[str, torch.Tensor] = {}
        offsets: dict[str, np.ndarray] = {}
        for key in modality.encoder_keys:
            meta = kwargs.get(key)
            if meta is None:
                continue
            if not isinstance(meta, UniqueSegments):
                raise UniqueMediaError(
                    f"{key!r} is a plain tensor beside unique {modality.values_key!r}: give both "
                    "from unique_segments() (the NeMo-RL drop-in's unique mode does)"
                )
            encoder[key], offsets[key] = per_unique(meta, values, key, modality.values_key)
            kwargs[key] = meta.logical() if key in modality.logical_keys else None
            if kwargs[key] is None:
                del kwargs[key]
        if modality.items_key != modality.values_key and modality.items_key not in offsets:
            raise UniqueMediaError(
                f"unique {modality.values_key!r} needs {modality.items_key!r}, also from "
                "unique_segments(): it says where each image's patches end"
            )
        items = offsets.get(modality.items_key, values.offsets)
        options = {k: _option(self.model, kwargs, k) for k in modality.config_keys}
        features = self._unique_features(modality, values, encoder, offsets, items, options)
        counts = np.diff(items)
        order = values.index.cpu().numpy()
        logical = [f for u in order.tolist() for f in features[u]]
        self.stats.occurrences += int(counts[order].sum())
        return _pooled(logical)

    def _unique_features(
        self,
        modality: Modality,
        values: UniqueSegments,
        encoder: dict[str, torch.Tensor],
        offsets: dict[str, np.ndarray],
        items: np.ndarray,
        options: dict[str, Any],
    ) -> list[tuple[torch.Tensor, ...]]:
        """Per unique segment, its feature tensors; encoded now, or (no grad) cached."""
        n = values.num_unique
        keys: list[Any] = [None] * n
        found: list[tuple[torch.Tensor, ...] | None] = [None] * n
        if self.cache.max_bytes and not torch.is_grad_enabled():
            self.cache.validate((weights_stamp(self.model), module_state(self.model)))
            for u in range(n):
                keys[u] = _cache_key(modality, values, encoder, offsets, options, u)
                found[u] = None if keys[u] is None else self.cache.get(keys[u])
        missing = [u for u in range(n) if found[u] is None]
        self.stats.cached += sum(len(f) for f in found if f is not None)
        if missing:
            fresh = self._encode(modality, values, encoder, offsets, items, options, missing)
            for u, feats in zip(missing, fresh, strict=True):
                found[u] = feats
                if keys[u] is not None:
                    self.cache.put(keys[u], tuple(f.detach() for f in feats))
        return [f for f in found if f is not None]

    def _encode(
        self,
        modality: Modality,
        values: UniqueSegments,
        encoder: dict[str, torch.Tensor],
        offsets: dict[str, np.ndarray],
        items: np.ndarray,
        options: dict[str, Any],
        which: list[int],
    ) -> list[tuple[torch.Tensor, ...]]:
        """Run the model's own feature call on the unique segments ``which``; per segment, its
        feature tensors."""
        every = len(which) == values.num_unique
        media = (
            values.values
            if every
            else _select(values.values, values.offsets, which, values.dim_to_pack)
        )
        extra = {k: t if every else _select(t, offsets[k], which, 0) for k, t in encoder.items()}
        call = getattr(self.model, f"get_{modality.name}_features")
        out = call(media, **extra, **options, return_dict=True)
        pooled = list(out.pooler_output)
        counts = np.diff(items)[which]
        if len(pooled) != int(counts.sum()):
            raise UniqueMediaError(
                f"{self.family.name}'s get_{modality.name}_features gave {len(pooled)} feature "
                f"tensors for {int(counts.sum())} {modality.name}s of {modality.items_key!r}"
            )
        self.stats.encoded += len(pooled)
        starts = (np.cumsum(counts) - counts).tolist()
        return [tuple(pooled[s : s + c]) for s, c in zip(starts, counts.tolist(), strict=True)]


def _restore(model: Any, family: Family, forward: Any, budget: int) -> _Adapter:
    """Unpickle an adapter (with its model: ``torch.save(model)``)."""
    if isinstance(forward, str):
        forward = getattr(type(model), forward).__get__(model)
    return _Adapter(model, family, forward, FeatureCache(budget))


def module_state(model: Any) -> tuple[Any, ...]:
    """What decides a module's behaviour beside its weights: its hooks and its plain settings
    (flags, numbers, names: a LoRA adapter switched off, dropout's rate, an active adapter's
    name), for every module; and the global module hooks."""
    from torch.nn.modules import module as nn_module

    # None is left out: attributes that hold a per-call tensor or None (Qwen's rope_deltas)
    # are state, not settings
    plain = (bool, int, float, str)
    state = []
    for m in model.modules():
        d = m.__dict__
        settings = tuple(
            (k, v if isinstance(v, plain) else tuple(v))
            for k, v in d.items()
            if isinstance(v, plain)
            or (
                isinstance(v, (list, tuple, set, frozenset))
                and all(isinstance(x, plain) for x in v)
            )
        )
        hooks = tuple(
            tuple(d.get(name, {}).keys()) for name in ("_forward_hooks", "_forward_pre_hooks")
        )
        state.append((type(m), settings, hooks, getattr(m, "forward", None).__class__))
    globals_ = (
        tuple(nn_module._global_forward_hooks.keys()),
        tuple(nn_module._global_forward_pre_hooks.keys()),
    )
    return (tuple(state), globals_)


def per_unique(
    meta: UniqueSegments, values: UniqueSegments, key: str, values_key: str
) -> tuple[torch.Tensor, np.ndarray]:
    """``meta`` (a metadata key such as ``image_grid_thw``) arranged by the unique segments of
    ``values`` (its media key): one segment per unique media segment, from its first occurrence,
    and their offsets. Every other occurrence must carry equal metadata."""
    if meta.dim_to_pack != 0:
        raise UniqueMediaError(f"{key!r} must be packed along dimension 0, not {meta.dim_to_pack}")
    if meta.num_logical != values.num_logical:
        raise UniqueMediaError(
            f"{key!r} has {meta.num_logical} segment occurrences and {values_key!r} "
            f"{values.num_logical}: they must come from the same rows"
        )
    value_index = values.index.cpu().numpy()
    meta_index = meta.index.cpu().numpy()
    _, first = np.unique(value_index, return_index=True)  # sorted by unique id = first use
    chosen = meta_index[first]
    sizes = np.diff(meta.offsets)[chosen]
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    arranged = _select(meta.values, meta.offsets, chosen.tolist(), meta.dim_to_pack)
    same = np.array_equal(chosen[value_index], meta_index) or torch.equal(
        _select(arranged, offsets, value_index.tolist(), meta.dim_to_pack), meta.logical()
    )
    if not same:
        raise UniqueMediaError(
            f"rows that share a {values_key!r} segment carry different {key!r}: the media and "
            "its metadata do not describe the same segments"
        )
    return arranged, offsets


def _select(t: torch.Tensor, offsets: np.ndarray, which: list[int], dim: int) -> torch.Tensor:
    parts = [t.narrow(dim, int(offsets[u]), int(offsets[u + 1] - offsets[u])) for u in which]
    return torch.cat(parts, dim=dim) if len(parts) != 1 else parts[0]


def _option(model: Any, kwargs: dict[str, Any], key: str) -> Any:
    value = kwargs.get(key)
    return getattr(model.config, key, None) if value is None else value


def _cache_key(
    modality: Modality,
    values: UniqueSegments,
    encoder: dict[str, torch.Tensor],
    offsets: dict[str, np.ndarray],
    options: dict[str, Any],
    u: int,
) -> Any:
    identity = values.identities[u]
    if identity is None:
        return None
    meta = tuple(
        (k, _select(t, offsets[k], [u], 0).cpu().numpy().tobytes()) for k, t in encoder.items()
    )
    return (modality.name, identity, meta, repr(sorted(options.items())), values.values.dtype)


def _pooled(features: list[torch.Tensor]) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    # declared a tensor; the VLMs' own get_*_features put one tensor per image there, as here
    return BaseModelOutputWithPooling(pooler_output=tuple(features))  # type: ignore[arg-type]
