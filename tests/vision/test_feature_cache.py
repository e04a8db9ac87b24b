"""The no-grad feature cache of ``encode_once(model, feature_cache_bytes=N)`` on a tiny
Qwen2-VL: micro-batches of one step that share prompts give the logical path's outputs while the
tower encodes each unique image once across them; nothing is served with gradients enabled; an
optimizer step, other weights loaded, a train/eval switch (of the model or of its tower alone)
or a dtype move drop what was cached (the outputs are the NEW weights' logical path, which stale
features would miss); budgets smaller than an image cache nothing; LRU eviction keeps results
exact; segments without provenance are never cached. ``FeatureCache`` itself: budgets and
eviction order."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from mmpack.packed import PackedTensor
from mmpack.vision import encode_once, encode_stats
from mmpack.vision.feature_cache import FeatureCache, weights_stamp
from support.tiny_vlms import (
    Item,
    MicroBatch,
    Prompt,
    build_model,
    make_image,
    micro_batch,
    model_inputs,
    reorder,
    twin,
)

G = 2
TOL = 1e-10
#: bytes of one (1, 4, 4) image's features: 4 merged tokens of width 32, float64
IMAGE_BYTES = 4 * 32 * 8


@pytest.fixture(scope="module")
def base() -> Any:
    return build_model("qwen2_vl")


@pytest.fixture(scope="module")
def images(base: Any) -> list[Item]:
    generator = torch.Generator().manual_seed(3)
    return [make_image(base, (1, 4, 4), generator) for _ in range(4)]


def step_batches(images: list[Item]) -> list[MicroBatch]:
    """One step: three prompts (the third shares image A), G rows each, cut into three
    micro-batches of interleaved rows (each sliced and pickled)."""
    a, b, c, _ = images
    prompts = [Prompt([a], [10, 20]), Prompt([b, c], [11, 21]), Prompt([c, a], [12])]
    batch = micro_batch(prompts, G, layout="per_item")
    return [reorder(batch, [r for r in range(3 * G) if r % 3 == s]) for s in range(3)]


def one_prompt(images: list[Item]) -> Any:
    """The micro-batch of the images ``images`` (one prompt, G rows)."""
    return micro_batch([Prompt(list(images), [10, 20])], G, layout="per_item")


def logits(model: Any, reference: Any, batch: MicroBatch, *, unique: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(reference, batch, "padded", unique=unique)).logits


def assert_logical(adapted: Any, batch: MicroBatch, weights: Any | None = None) -> None:
    """The adapted model's no-grad logits on ``batch`` equal the logical path of the model with
    ``weights`` (default: the adapted model's own current weights, on a twin)."""
    ref = twin(adapted if weights is None else weights)
    want = logits(ref, ref, batch, unique=False)
    got = logits(adapted, ref, batch, unique=True)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def unique_of(batch: MicroBatch) -> set[bytes | None]:
    us = batch.media["pixel_values"].unique_segments()
    assert us is not None
    return set(us.identities)


def test_micro_batches_of_a_step_encode_each_image_once(base: Any, images: list[Item]) -> None:
    batches = step_batches(images)
    adapted = encode_once(twin(base), feature_cache_bytes=1 << 20)
    per_batch = [len(unique_of(b)) for b in batches]
    every = set().union(*(unique_of(b) for b in batches))
    assert len(every) == 3 and sum(per_batch) > len(every)  # the batches share images
    for batch in batches:
        assert_logical(adapted, batch, base)
    stats = encode_stats(adapted)
    assert stats.encoded == len(every)
    assert stats.cached == sum(per_batch) - len(every)
    assert stats.occurrences == sum(b.num_items for b in batches)
    # a second pass over the same step encodes nothing
    for batch in batches:
        assert_logical(adapted, batch, base)
    assert encode_stats(adapted).encoded == len(every)


def test_grad_enabled_is_never_served(base: Any, images: list[Item]) -> None:
    batches = step_batches(images)
    adapted = encode_once(twin(base), feature_cache_bytes=1 << 20)
    logits(adapted, base, batches[0], unique=True)  # fills the cache
    before = encode_stats(adapted).encoded
    for batch in batches:
        out = adapted(**model_inputs(base, batch, "padded", unique=True)).logits
        assert out.requires_grad
        out.sum().backward()
    stats = encode_stats(adapted)
    assert stats.cached == 0
    assert stats.encoded == before + sum(len(unique_of(b)) for b in batches)
    vision = [p for n, p in adapted.named_parameters() if ".visual." in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vision)


def _sgd_step(model: Any) -> None:
    generator = torch.Generator().manual_seed(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
    optimizer.step()
    model.zero_grad(set_to_none=True)


def _load_other(model: Any) -> None:
    model.load_state_dict(build_model("qwen2_vl", seed=5).state_dict())


def _inplace_tower(model: Any) -> None:
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.mul_(1.5)


CHANGES = {"sgd step": _sgd_step, "load_state_dict": _load_other, "in-place mul": _inplace_tower}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_weights_are_never_served_stale(base: Any, images: list[Item], change: str) -> None:
    batch = step_batches(images)[0]
    adapted = encode_once(twin(base), feature_cache_bytes=1 << 20)
    assert_logical(adapted, batch, base)
    old = logits(twin(base), base, batch, unique=False)
    CHANGES[change](adapted)
    new = logits(twin(adapted), base, batch, unique=False)
    assert (new - old).abs().max() > 1e-4  # stale features would be seen
    encoded = encode_stats(adapted).encoded
    assert_logical(adapted, batch)  # the new weights' logical path
    assert encode_stats(adapted).encoded == encoded + len(unique_of(batch))
    assert encode_stats(adapted).cached == 0


@pytest.mark.parametrize("which", ["model", "tower"])
def test_train_eval_switch_drops_the_cache(base: Any, images: list[Item], which: str) -> None:
    batch = step_batches(images)[0]
    n = len(unique_of(batch))
    adapted = encode_once(twin(base), feature_cache_bytes=1 << 20)
    module = adapted if which == "model" else adapted.model.visual
    assert_logical(adapted, batch, base)
    module.train()
    assert_logical(adapted, batch, base)  # this tiny tower has no dropout: same outputs
    module.eval()
    assert_logical(adapted, batch, base)
    stats = encode_stats(adapted)
    assert stats.encoded == 3 * n and stats.cached == 0
    assert_logical(adapted, batch, base)  # unchanged since: served from the cache
    assert encode_stats(adapted).cached == n


def test_dtype_move_drops_the_cache(base: Any, images: list[Item]) -> None:
    batch = step_batches(images)[0]
    n = len(unique_of(batch))
    adapted = encode_once(twin(base), feature_cache_bytes=1 << 20)
    assert_logical(adapted, batch, base)
    adapted.to(torch.float32)
    ref = twin(base).to(torch.float32)
    want = logits(ref, ref, batch, unique=False)
    got = logits(adapted, ref, batch, unique=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert encode_stats(adapted).encoded == 2 * n and encode_stats(adapted).cached == 0
    adapted.to(torch.float64)  # the same values again, but new storage
    assert_logical(adapted, batch, base)
    assert encode_stats(adapted).encoded == 3 * n


@pytest.mark.parametrize("budget", [1, IMAGE_BYTES - 1])
def test_budget_below_one_image_caches_nothing(base: Any, images: list[Item], budget: int) -> None:
    batches = step_batches(images)
    adapted = encode_once(twin(base), feature_cache_bytes=budget)
    for batch in batches * 2:
        assert_logical(adapted, batch, base)
    stats = encode_stats(adapted)
    assert stats.cached == 0
    assert stats.encoded == 2 * sum(len(unique_of(b)) for b in batches)
    assert adapted.forward.cache.nbytes == 0 and len(adapted.forward.cache) == 0


def test_exact_budget_caches_one_image(base: Any, images: list[Item]) -> None:
    a = images[0]
    adapted = encode_once(twin(base), feature_cache_bytes=IMAGE_BYTES)
    for _ in range(3):
        assert_logical(adapted, one_prompt([a]), base)
    assert encode_stats(adapted).encoded == 1 and encode_stats(adapted).cached == 2


def test_lru_eviction_keeps_results_exact(base: Any, images: list[Item]) -> None:
    a, b, c, _ = images
    adapted = encode_once(twin(base), feature_cache_bytes=2 * IMAGE_BYTES)
    # cache after each: {A,B}; A touched -> {B,A}; C evicts B; B evicts A; C hit; A again
    sequence = [[a, b], [a], [c], [b], [c], [a]]
    encoded, cached = [], []
    for items in sequence:
        before = encode_stats(adapted)
        e0, c0 = before.encoded, before.cached
        assert_logical(adapted, one_prompt(items), base)
        encoded.append(encode_stats(adapted).encoded - e0)
        cached.append(encode_stats(adapted).cached - c0)
    assert encoded == [2, 0, 1, 1, 0, 1]
    assert cached == [0, 1, 0, 0, 1, 0]
    assert adapted.forward.cache.nbytes <= 2 * IMAGE_BYTES


def _without_provenance(batch: MicroBatch) -> MicroBatch:
    """``batch`` with its media as legacy values (one segment per row, no provenance)."""
    media = {}
    for key in batch.media:
        rows = [torch.cat([i.segments[key] for i in items]) for items in batch.items_of_row]
        media[key] = PackedTensor(rows, 0, pad_to_max_shape=key == "pixel_values")
    return dataclasses.replace(batch, media=media)


def test_segments_without_provenance_are_never_cached(base: Any, images: list[Item]) -> None:
    batch = _without_provenance(one_prompt([images[0]]))
    us = batch.media["pixel_values"].unique_segments()
    assert us is not None and us.identities == (None,) * G
    adapted = encode_once(twin(base), feature_cache_bytes=1 << 20)
    for _ in range(3):
        assert_logical(adapted, batch, base)
    stats = encode_stats(adapted)
    assert stats.cached == 0 and stats.encoded == 3 * G
    assert len(adapted.forward.cache) == 0


# --------------------------------------------------------------------------------- unit


@pytest.mark.parametrize("budget", [-1, 1.5, "1", None, True, False, 2**0.5])
def test_bad_budgets_are_refused(budget: Any) -> None:
    with pytest.raises(TypeError, match="feature_cache_bytes"):
        FeatureCache(budget)


def test_bad_budget_refused_by_encode_once(base: Any) -> None:
    with pytest.raises(TypeError, match="feature_cache_bytes"):
        encode_once(twin(base), feature_cache_bytes=-5)


def _feat(nbytes: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(nbytes // 8, dtype=torch.float64),)


def test_eviction_order_is_least_recently_used() -> None:
    cache = FeatureCache(3 * 64)
    cache.validate(("w",))
    for key in "abc":
        cache.put(key, _feat(64))
    assert len(cache) == 3 and cache.nbytes == 192
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", _feat(64))  # evicts b
    assert cache.get("b") is None and all(cache.get(k) is not None for k in "acd")
    # order is now a, c, d (gets refresh): a 128-byte entry evicts a and c
    cache.put("e", _feat(128))
    assert [k for k in "abcde" if cache.get(k) is not None] == ["d", "e"]
    assert cache.nbytes == 192
    cache.put("big", _feat(256))  # over the whole budget: kept out, nothing evicted
    assert cache.get("big") is None and len(cache) == 2
    first = cache.get("d")
    cache.put("d", _feat(64))  # present already: kept as it was
    assert cache.get("d") is first and cache.nbytes == 192


def test_validate_drops_everything_on_a_new_stamp() -> None:
    cache = FeatureCache(1024)
    cache.validate(("w", 1))
    cache.put("a", _feat(64))
    cache.validate(("w", 1))
    assert cache.get("a") is not None
    cache.validate(("w", 2))
    assert cache.get("a") is None and cache.nbytes == 0 and len(cache) == 0
    zero = FeatureCache(0)
    zero.put("a", _feat(8))
    assert len(zero) == 0


def test_weights_stamp_sees_every_kind_of_change(base: Any) -> None:
    model = twin(base)
    stamp = weights_stamp(model)
    assert weights_stamp(model) == stamp
    with torch.no_grad():
        next(model.parameters()).add_(0)
    assert weights_stamp(model) != stamp
    stamp = weights_stamp(model)
    model.model.visual.train()
    assert weights_stamp(model) != stamp
    model.model.visual.eval()
    assert weights_stamp(model) == stamp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weights_stamp(model) != stamp
