"""An adapted model as the rest of a training stack treats it: its forward keeps its signature
(``generate`` validates kwargs against it), it is freed when dropped (no reference cycle), it
survives ``torch.save``, and the no-grad feature cache follows what changes the tower besides
its weights: a LoRA-style switch and hooks."""

from __future__ import annotations

import copy
import gc
import inspect
import io
import weakref
from typing import Any

import pytest
import torch
from mmpack.vision import encode_once, encode_stats
from support.tiny_vlms import Prompt, build_model, make_image, micro_batch, model_inputs

G = 3


@pytest.fixture(scope="module")
def base() -> Any:
    return build_model("qwen2_vl")


def _batch(model: Any, seed: int = 0) -> Any:
    gen = torch.Generator().manual_seed(seed)
    prompts = [Prompt([make_image(model, (1, 4, 4), gen)], [3 + p, 5]) for p in range(2)]
    return micro_batch(prompts, G)


def _logits(model: Any, batch: Any, unique: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(model, batch, "padded", unique=unique)).logits


def test_the_forward_keeps_its_signature_and_generate_runs(base: Any) -> None:
    plain = copy.deepcopy(base)
    adapted = encode_once(copy.deepcopy(base))
    assert inspect.signature(adapted.forward) == inspect.signature(plain.forward)
    batch = _batch(base)
    inputs = model_inputs(base, batch, "padded", unique=False)
    inputs.pop("use_cache", None)
    want = plain.generate(**inputs, max_new_tokens=2, do_sample=False)
    got = adapted.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert torch.equal(got, want)


def test_an_adapted_model_is_freed_without_the_cycle_collector(base: Any) -> None:
    gc.collect()
    gc.disable()
    try:
        model = encode_once(copy.deepcopy(base), feature_cache_bytes=1 << 20)
        _logits(model, _batch(base), unique=True)
        ref = weakref.ref(model)
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_torch_save_round_trip_keeps_the_adapter(base: Any) -> None:
    model = encode_once(copy.deepcopy(base), feature_cache_bytes=1 << 20)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    batch = _batch(base)
    assert torch.equal(_logits(back, batch, unique=True), _logits(base, batch, unique=False))
    assert encode_stats(back).encoded == 2 and back.forward.model is back


class _Switchable(torch.nn.Module):
    """A LoRA-style wrapper: adds a low-rank delta while ``enabled`` (PEFT's
    ``disable_adapter()`` flips such a flag and no weight)."""

    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.enabled = True
        self.down = torch.nn.Linear(inner.in_features, 2, bias=False, dtype=inner.weight.dtype)
        self.up = torch.nn.Linear(2, inner.out_features, bias=False, dtype=inner.weight.dtype)
        torch.nn.init.normal_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out + self.up(self.down(x)) if self.enabled else out


def test_a_switched_off_adapter_is_never_served_its_cached_features(base: Any) -> None:
    model = copy.deepcopy(base)
    merger = model.model.visual.merger
    merger.mlp[0] = _Switchable(merger.mlp[0])
    reference = copy.deepcopy(model)
    reference.model.visual.merger.mlp[0].enabled = False
    adapted = encode_once(model, feature_cache_bytes=1 << 20)
    batch = _batch(base)
    _logits(adapted, batch, unique=True)  # the cache holds the adapter-on features
    merger.mlp[0].enabled = False  # the reference pass of LoRA GRPO
    got = _logits(adapted, batch, unique=True)
    want = _logits(reference, batch, unique=False)
    assert (got - want).abs().max().item() <= 1e-12
    assert encode_stats(adapted).cached == 0


def test_a_hook_added_after_caching_is_honoured(base: Any) -> None:
    adapted = encode_once(copy.deepcopy(base), feature_cache_bytes=1 << 20)
    batch = _batch(base)
    _logits(adapted, batch, unique=True)
    handle = adapted.model.visual.merger.register_forward_hook(lambda m, a, out: out * 2)
    try:
        hooked = copy.deepcopy(base)
        hooked.model.visual.merger.register_forward_hook(lambda m, a, out: out * 2)
        got = _logits(adapted, batch, unique=True)
        want = _logits(hooked, batch, unique=False)
        assert (got - want).abs().max().item() <= 1e-12
    finally:
        handle.remove()
    # with the hook gone the same segments are served from the cache again
    before = encode_stats(adapted).encoded
    _logits(adapted, batch, unique=True)
    _logits(adapted, batch, unique=True)
    assert encode_stats(adapted).encoded == before + 2 and encode_stats(adapted).cached >= 2


def test_unique_pixels_without_their_grid_are_refused_by_name(base: Any) -> None:
    from mmpack.errors import UniqueMediaError

    adapted = encode_once(copy.deepcopy(base))
    inputs = model_inputs(base, _batch(base), "padded", unique=True)
    del inputs["image_grid_thw"]
    with pytest.raises(UniqueMediaError, match="image_grid_thw"), torch.no_grad():
        adapted(**inputs)
