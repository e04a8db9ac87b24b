"""The no-grad feature cache of ``encode_once(model, feature_cache_bytes=N)`` on a tiny float64
Qwen2-VL. Micro-batches of one step that share prompts give the logical path's outputs while
the tower encodes each unique image once across them; nothing is served, or kept, with gradients
enabled. Whatever may change a feature drops what was cached: an optimizer step, other weights
loaded, writes through ``.data`` that keep every norm (a sign flip, rows reversed), a train/eval
switch (of the model or of its tower alone), a dtype move, autocast, another grid for the same
pixels. Each of these tests makes stale features visible in the outputs (they are compared with
the logical path of the model as it is NOW), not only in the counters. Budgets smaller than an
image cache nothing, LRU eviction keeps results exact, segments without provenance are never
cached. ``FeatureCache`` and ``weights_stamp`` on their own: budgets, eviction order, compact
copies, and the writes the stamp must see."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from mmpack.packed import PackedTensor
from mmpack.vision import encode_once, encode_stats
from mmpack.vision.feature_cache import FeatureCache, weights_stamp

G = 2
TOL = 1e-10
VOCAB, PAD, BOS, EOS = 64, 0, 1, 2
IMAGE, VIDEO, START, END = 60, 61, 62, 63
#: one patch: 3 channels x 2 frames x 2 x 2 pixels
PATCH = 3 * 2 * 2 * 2
#: bytes of one (1, 4, 4) image's features: 4 merged tokens of width 32, float64
IMAGE_BYTES = 4 * 32 * 8
BIG = 1 << 20


def build_qwen(seed: int = 0) -> Any:
    """A tiny random-init Qwen2-VL (one decoder layer, one vision block), float64, eval."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    }
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={**vision, "patch_size": 2, "temporal_patch_size": 2},
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).to(torch.float64).eval()


@dataclass(eq=False)
class Image:
    """One image: single-segment values with their own provenance, and its placeholders."""

    pixels: PackedTensor
    grid: PackedTensor
    tokens: int


def make_image(grid: tuple[int, int, int], generator: torch.Generator) -> Image:
    thw = torch.tensor([grid])
    pixels = torch.randn(int(thw.prod()), PATCH, generator=generator, dtype=torch.float64)
    return Image(
        PackedTensor([pixels], 0).enable_deduplication(),
        PackedTensor([thw], 0).enable_deduplication(),
        int(thw.prod()) // 4,
    )


@dataclass
class Batch:
    rows: list[list[int]]
    media: dict[str, PackedTensor]

    def num_unique(self) -> int:
        us = self.media["pixel_values"].unique_segments()
        assert us is not None
        return us.num_unique

    def num_images(self) -> int:
        us = self.media["pixel_values"].unique_segments()
        assert us is not None
        return us.num_logical


def batch_of(prompts: Sequence[Sequence[Image]], group: int = G) -> Batch:
    """GRPO rows: ``group`` rows per prompt (its images, then completions of different
    lengths), the media one segment per image (an image of two prompts is one segment)."""
    rows = []
    for p, images in enumerate(prompts):
        head = [10 + p] + [t for im in images for t in (START, *[IMAGE] * im.tokens, END)] + [20]
        rows += [head + [30 + p + g] * (1 + g) for g in range(group)]
    media = {
        key: PackedTensor.concat(
            [PackedTensor.merge_segments([getattr(im, attr) for im in ims]) for ims in prompts]
        ).repeat_interleave(group)
        for key, attr in (("pixel_values", "pixels"), ("image_grid_thw", "grid"))
    }
    return Batch(rows, media)


def cut(batch: Batch, order: Sequence[int]) -> Batch:
    """Rows ``order`` as a micro-batch reaches a worker: sliced, then pickled."""
    media = {k: pickle.loads(pickle.dumps(v.slice(list(order)))) for k, v in batch.media.items()}
    return Batch([batch.rows[r] for r in order], media)


def inputs(batch: Batch, *, unique: bool) -> dict[str, Any]:
    length = max(map(len, batch.rows))
    ids = torch.full((len(batch.rows), length), PAD)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(batch.rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    media = {k: v.unique_segments() if unique else v.as_tensor() for k, v in batch.media.items()}
    kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    return {**kwargs, "mm_token_type_ids": (ids == IMAGE).long(), **media}


def logits(model: Any, batch: Batch, *, unique: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(batch, unique=unique)).logits


def assert_logical(
    adapted: Any, batch: Batch, weights: Any | None = None, tol: float = TOL
) -> None:
    """The adapted model's no-grad logits on unique media equal the logical path of a copy of
    ``weights`` (default: the adapted model as it is now)."""
    ref = copy.deepcopy(adapted if weights is None else weights)
    want = logits(ref, batch, unique=False)
    got = logits(adapted, batch, unique=True)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def base() -> Any:
    return build_qwen()


@pytest.fixture(scope="module")
def images() -> list[Image]:
    generator = torch.Generator().manual_seed(3)
    return [make_image((1, 4, 4), generator) for _ in range(4)]


def step_batches(images: list[Image]) -> list[Batch]:
    """One step: three prompts (the second and third share image C, the first and third A), G
    rows each, cut into three micro-batches of interleaved rows."""
    a, b, c, _ = images
    batch = batch_of([[a], [b, c], [c, a]])
    return [cut(batch, [r for r in range(3 * G) if r % 3 == s]) for s in range(3)]


def adapt(base: Any, budget: int = BIG) -> Any:
    return encode_once(copy.deepcopy(base), feature_cache_bytes=budget)


# --------------------------------------------------------------------------------- reuse


def test_micro_batches_of_a_step_encode_each_image_once(base: Any, images: list[Image]) -> None:
    batches = step_batches(images)
    adapted = adapt(base)
    per_batch = [b.num_unique() for b in batches]
    assert per_batch == [3, 2, 3]  # three images in all, shared across the micro-batches
    for batch in batches:
        assert_logical(adapted, batch, base)
    stats = encode_stats(adapted)
    assert (stats.encoded, stats.cached) == (3, sum(per_batch) - 3)
    assert stats.occurrences == sum(b.num_images() for b in batches)
    for batch in batches:  # a second pass over the step encodes nothing
        assert_logical(adapted, batch, base)
    assert encode_stats(adapted).encoded == 3


def test_inference_mode_fills_what_no_grad_reads(base: Any, images: list[Image]) -> None:
    batches = step_batches(images)
    adapted = adapt(base)
    with torch.inference_mode():
        adapted(**inputs(batches[0], unique=True))
    assert_logical(adapted, batches[1], base)
    assert encode_stats(adapted).encoded == 3 and encode_stats(adapted).cached == 2


def test_grad_enabled_is_never_served_nor_kept(base: Any, images: list[Image]) -> None:
    batches = step_batches(images)
    adapted = adapt(base)
    logits(adapted, batches[0], unique=True)  # fills the cache: A, B, C
    for batch in batches:
        out = adapted(**inputs(batch, unique=True)).logits
        assert out.requires_grad
        out.square().sum().backward()
    stats = encode_stats(adapted)
    assert stats.cached == 0 and stats.encoded == 3 + sum(b.num_unique() for b in batches)
    tower = [p for n, p in adapted.named_parameters() if ".visual." in n]
    assert tower and all(p.grad is not None and p.grad.abs().sum() > 0 for p in tower)
    # and a model that only ran with gradients has nothing to serve
    fresh = adapt(base)
    fresh(**inputs(batches[0], unique=True))
    assert len(fresh.forward.cache) == 0
    assert_logical(fresh, batches[0], base)
    assert encode_stats(fresh).cached == 0 and encode_stats(fresh).encoded == 6


# --------------------------------------------------------------------------------- invalidation


def _sgd_step(model: Any) -> None:
    generator = torch.Generator().manual_seed(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
    optimizer.step()
    model.zero_grad(set_to_none=True)


def _load_other(model: Any) -> None:
    model.load_state_dict(build_qwen(seed=5).state_dict())


def _tower_mul(model: Any) -> None:
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.mul_(1.5)


def _data_negated(model: Any) -> None:
    for p in model.model.visual.parameters():  # no version counter moves; every norm stays
        p.data.neg_()


def _data_rows_reversed(model: Any) -> None:
    for p in model.model.visual.parameters():
        p.data.copy_(p.data.flip(0))


CHANGES: dict[str, Callable[[Any], None]] = {
    "sgd step": _sgd_step,
    "load_state_dict": _load_other,
    "in-place mul": _tower_mul,
    ".data negated": _data_negated,
    ".data rows reversed": _data_rows_reversed,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_weights_are_never_served_stale(
    base: Any, images: list[Image], change: str
) -> None:
    batch = step_batches(images)[0]
    n = batch.num_unique()
    adapted = adapt(base)
    assert_logical(adapted, batch, base)
    old = logits(base, batch, unique=False)
    CHANGES[change](adapted)
    new = logits(copy.deepcopy(adapted), batch, unique=False)
    assert (new - old).abs().max() > 1e-4  # stale features would be seen
    assert_logical(adapted, batch)  # the NEW weights' logical path
    assert encode_stats(adapted).encoded == 2 * n and encode_stats(adapted).cached == 0
    assert_logical(adapted, batch)  # unchanged since: served
    assert encode_stats(adapted).cached == n


def _train_offset(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
    """A forward hook that makes the tower's features depend on its mode."""
    return output + 0.25 if module.training else output


@pytest.mark.parametrize("which", ["model", "tower"])
def test_train_eval_switch_drops_the_cache(base: Any, images: list[Image], which: str) -> None:
    batch = step_batches(images)[0]
    n = batch.num_unique()
    model = copy.deepcopy(base)
    model.model.visual.merger.register_forward_hook(_train_offset)
    adapted = encode_once(model, feature_cache_bytes=BIG)
    module = adapted if which == "model" else adapted.model.visual
    assert_logical(adapted, batch)
    eval_logits = logits(adapted, batch, unique=True)
    module.train()
    assert_logical(adapted, batch)  # eval features served here would miss the offset
    assert (logits(adapted, batch, unique=True) - eval_logits).abs().max() > 1e-3
    module.eval()
    assert_logical(adapted, batch)
    stats = encode_stats(adapted)
    assert stats.encoded == 3 * n and stats.cached == 2 * n  # each mode's second call served


def test_dtype_moves_drop_the_cache(base: Any, images: list[Image]) -> None:
    batch = step_batches(images)[0]
    n = batch.num_unique()
    adapted = adapt(base)
    assert_logical(adapted, batch)
    adapted.to(torch.float32)
    assert_logical(adapted, batch, tol=1e-5)
    assert encode_stats(adapted).encoded == 2 * n and encode_stats(adapted).cached == 0
    adapted.to(torch.float64)  # float32 features served now would miss TOL
    assert_logical(adapted, batch, base)
    assert encode_stats(adapted).encoded == 3 * n


def test_autocast_change_drops_the_cache(base: Any, images: list[Image]) -> None:
    batch = step_batches(images)[0]
    n = batch.num_unique()
    adapted = adapt(base).float()  # float64 ops do not autocast
    ref = copy.deepcopy(adapted)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lowered = logits(adapted, batch, unique=True)
        lowered_ref = logits(ref, batch, unique=False)
    plain = logits(ref, batch, unique=False)
    assert (lowered_ref - plain).abs().max() > 1e-3  # bfloat16 features would be seen
    torch.testing.assert_close(lowered, lowered_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logits(adapted, batch, unique=True), plain, rtol=1e-5, atol=1e-5)
    assert encode_stats(adapted).encoded == 2 * n and encode_stats(adapted).cached == 0


def test_other_grid_for_the_same_pixels_is_not_served(base: Any, images: list[Image]) -> None:
    image = images[0]
    other = Image(image.pixels, PackedTensor([torch.tensor([[1, 2, 8]])], 0), image.tokens)
    adapted = adapt(base)
    assert_logical(adapted, batch_of([[image]]), base)
    assert (
        (logits(base, batch_of([[other]]), unique=False))
        - logits(base, batch_of([[image]]), unique=False)
    ).abs().max() > 1e-4  # the grid changes the features
    assert_logical(adapted, batch_of([[other]]), base)
    assert encode_stats(adapted).encoded == 2 and encode_stats(adapted).cached == 0


# --------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("budget", [1, IMAGE_BYTES - 1])
def test_budget_below_one_image_caches_nothing(base: Any, images: list[Image], budget: int) -> None:
    batches = step_batches(images)
    adapted = adapt(base, budget)
    for batch in batches * 2:
        assert_logical(adapted, batch, base)
    stats = encode_stats(adapted)
    assert stats.cached == 0
    assert stats.encoded == 2 * sum(b.num_unique() for b in batches)
    assert adapted.forward.cache.nbytes == 0 and len(adapted.forward.cache) == 0


def test_exact_budget_caches_one_image(base: Any, images: list[Image]) -> None:
    adapted = adapt(base, IMAGE_BYTES)
    for _ in range(3):
        assert_logical(adapted, batch_of([[images[0]]]), base)
    assert encode_stats(adapted).encoded == 1 and encode_stats(adapted).cached == 2
    assert adapted.forward.cache.nbytes == IMAGE_BYTES


def test_lru_eviction_keeps_results_exact(base: Any, images: list[Image]) -> None:
    a, b, c, _ = images
    adapted = adapt(base, 2 * IMAGE_BYTES)
    # kept after each: {A,B}; A touched -> {B,A}; C evicts B; B evicts A; C served; A again
    sequence = [[a, b], [a], [c], [b], [c], [a]]
    encoded, cached = [], []
    for prompt in sequence:
        before = copy.copy(encode_stats(adapted))
        assert_logical(adapted, batch_of([prompt]), base)
        encoded.append(encode_stats(adapted).encoded - before.encoded)
        cached.append(encode_stats(adapted).cached - before.cached)
        assert adapted.forward.cache.nbytes <= 2 * IMAGE_BYTES
    assert encoded == [2, 0, 1, 1, 0, 1]
    assert cached == [0, 1, 0, 0, 1, 0]


def test_segments_without_provenance_are_never_cached(base: Any, images: list[Image]) -> None:
    batch = batch_of([[images[0]]])
    for key in batch.media:  # each row its own copy, without provenance
        rows = [t.clone() for t in batch.media[key].iter_logical_segments()]
        batch.media[key] = PackedTensor(rows, 0)
    us = batch.media["pixel_values"].unique_segments()
    assert us is not None and us.identities == (None,) * G
    adapted = adapt(base)
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
    model = copy.deepcopy(base)
    forward = model.forward
    with pytest.raises(TypeError, match="feature_cache_bytes"):
        encode_once(model, feature_cache_bytes=-5)
    assert model.forward == forward  # not adapted


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


def test_entries_are_compact_private_copies() -> None:
    output = torch.arange(64.0, dtype=torch.float64).reshape(16, 4)  # a whole batch's output
    cache = FeatureCache(64)
    cache.put("a", (output[2:4],))  # one image's features: a view of it
    (kept,) = cache.get("a") or ()
    assert kept.untyped_storage().nbytes() == 64 == cache.nbytes  # not the batch's 512 bytes
    output.zero_()  # the model writing into what it was given
    assert kept.tolist() == [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]


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
    model = copy.deepcopy(base)
    stamp = weights_stamp(model)
    assert weights_stamp(model) == stamp
    with torch.no_grad():
        next(model.parameters()).add_(0)  # a version bump alone
    assert weights_stamp(model) != stamp
    stamp = weights_stamp(model)
    model.model.visual.train()
    assert weights_stamp(model) != stamp
    model.model.visual.eval()
    assert weights_stamp(model) == stamp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weights_stamp(model) != stamp
    assert weights_stamp(model) == stamp


NORM_KEEPING_WRITES: dict[str, Callable[[torch.Tensor], Any]] = {
    "negated": lambda w: w.neg_(),
    "transposed": lambda w: w.copy_(w.t().clone()),
    "rows swapped": lambda w: w.copy_(w[[1, 0, *range(2, w.shape[0])]].clone()),
    "columns swapped": lambda w: w.copy_(w[:, [1, 0, *range(2, w.shape[1])]].clone()),
    "entries reversed": lambda w: w.view(-1).copy_(w.view(-1).flip(0).clone()),
    "two entries swapped": lambda w: w.view(-1).index_copy_(
        0, torch.tensor([0, w.numel() - 1]), w.view(-1)[[w.numel() - 1, 0]].clone()
    ),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("write", list(NORM_KEEPING_WRITES))
def test_weights_stamp_sees_writes_that_keep_every_norm(dtype: torch.dtype, write: str) -> None:
    model = torch.nn.Linear(48, 48).to(dtype)
    before = weights_stamp(model)
    version = model.weight._version
    norms = [torch.linalg.vector_norm(model.weight.double(), o).item() for o in (1, 2)]
    NORM_KEEPING_WRITES[write](model.weight.data)  # through .data: no version counter moves
    assert model.weight._version == version
    after = [torch.linalg.vector_norm(model.weight.double(), o).item() for o in (1, 2)]
    assert after == pytest.approx(norms, rel=1e-12)
    assert weights_stamp(model) != before
    assert weights_stamp(model) == weights_stamp(model)


def test_weights_stamp_reads_every_dtype() -> None:
    model = torch.nn.Module()
    model.register_buffer("steps", torch.arange(5))
    model.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    model.register_buffer("scale", torch.randn(4).to(torch.float8_e4m3fn))
    model.register_buffer("phase", torch.randn(3, dtype=torch.complex64))
    model.register_buffer("scalar", torch.tensor(3.0))
    model.register_buffer("empty", torch.zeros(0, 3))
    stamp = weights_stamp(model)
    assert weights_stamp(model) == stamp
    model.phase.data.mul_(1j)  # the same magnitudes, turned
    assert weights_stamp(model) != stamp
