"""What ``encode_once`` and an adapted model refuse, with typed errors that name the model or the
keys: models of other families (a text-only Llama, a GPT-2, Qwen3-VL, a Qwen2-VL look-alike
without the feature calls), an unadapted model fed ``UniqueSegments`` (it never runs without its
media), media and metadata that do not describe the same segments, unique media passed
positionally or beside ``mm_encoder_outputs``, unique keys the family does not encode. Then
re-adapting only sets the budget, and a deep copy of an adapted model works and counts on its
own. Nothing refused reaches the vision tower."""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from mmpack.errors import (
    UnadaptedModelError,
    UniqueMediaError,
    UnsupportedModelError,
    VisionError,
)
from mmpack.packed import PackedTensor
from mmpack.packed.unique import UniqueSegments
from mmpack.vision import encode_once, encode_stats

G = 3
TOL = 1e-10
VOCAB, PAD, BOS, EOS = 64, 0, 1, 2
IMAGE, VIDEO, START, END = 60, 61, 62, 63
PATCH = 3 * 2 * 2 * 2
TEXT = {
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
}


def build_qwen() -> Any:
    """A tiny random-init Qwen2-VL, float64, eval."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2}
    config = Qwen2VLConfig(
        text_config={**TEXT, "rope_parameters": rope},
        vision_config={**vision, "patch_size": 2, "temporal_patch_size": 2},
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).to(torch.float64).eval()


def build_llava() -> Any:
    """A tiny LLaVA: a CLIP tower over 8 x 8 images (4 tokens each), float64, eval."""
    import transformers as tf

    clip = {
        "model_type": "clip_vision_model",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 8,
        "patch_size": 4,
    }
    config = tf.LlavaConfig(
        vision_config=clip,
        text_config={**TEXT, "model_type": "llama"},
        image_token_id=IMAGE,
        image_seq_length=4,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    return tf.LlavaForConditionalGeneration(config).to(torch.float64).eval()


@dataclasses.dataclass
class Batch:
    rows: list[list[int]]
    media: dict[str, PackedTensor]


def qwen_batch(grids: Sequence[tuple[int, int, int]], seed: int = 4) -> Batch:
    """One prompt per grid, an image of that grid each, G rows per prompt (deduplicated, then
    repeated as GRPO does)."""
    generator = torch.Generator().manual_seed(seed)
    rows, pixels, thws = [], [], []
    for p, grid in enumerate(grids):
        thw = torch.tensor([grid])
        thws.append(thw)
        pixels.append(torch.randn(int(thw.prod()), PATCH, generator=generator, dtype=torch.float64))
        head = [10 + p, START, *[IMAGE] * (int(thw.prod()) // 4), END, 20]
        rows += [head + [30 + g] * (1 + g) for g in range(G)]
    media = {
        "pixel_values": PackedTensor(pixels, 0).enable_deduplication().repeat_interleave(G),
        "image_grid_thw": PackedTensor(thws, 0).enable_deduplication().repeat_interleave(G),
    }
    return Batch(rows, media)


def llava_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    image = torch.randn(1, 3, 8, 8, generator=generator, dtype=torch.float64)
    pixels = PackedTensor([image], 0).enable_deduplication().repeat_interleave(G)
    return Batch([[10, *[IMAGE] * 4, 20, 30 + g] for g in range(G)], {"pixel_values": pixels})


def inputs(batch: Batch, *, unique: bool, plain: Sequence[str] = ()) -> dict[str, Any]:
    """Padded rows; media as ``unique_segments()`` (keys in ``plain``: ``as_tensor()``)."""
    length = max(map(len, batch.rows))
    ids = torch.full((len(batch.rows), length), PAD)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(batch.rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    media = {
        k: v.unique_segments() if unique and k not in plain else v.as_tensor()
        for k, v in batch.media.items()
    }
    out = {"input_ids": ids, "attention_mask": mask, "use_cache": False, **media}
    if "image_grid_thw" in batch.media:
        out["mm_token_type_ids"] = (ids == IMAGE).long()
    return out


@pytest.fixture(scope="module")
def base() -> Any:
    return build_qwen()


@pytest.fixture(scope="module")
def batch() -> Batch:
    return qwen_batch([(1, 4, 4), (1, 2, 8)])


@pytest.fixture
def adapted(base: Any) -> Any:
    return encode_once(copy.deepcopy(base))


def logical_logits(base: Any, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return base(**inputs(batch, unique=False)).logits


# --------------------------------------------------------------------------------- models


def _tiny_llama() -> Any:
    import transformers as tf

    config = tf.LlamaConfig(**{**TEXT, "hidden_size": 16, "intermediate_size": 32})
    return tf.LlamaForCausalLM(config)


def _tiny_gpt2() -> Any:
    import transformers as tf

    config = tf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=BOS
    )
    config.eos_token_id = EOS
    return tf.GPT2LMHeadModel(config)


def _tiny_qwen3_vl() -> Any:
    import transformers as tf

    config = tf.Qwen3VLConfig(
        text_config={
            **TEXT,
            "head_dim": 16,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
    )
    return tf.Qwen3VLForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("make", "name", "model_type"),
    [
        (_tiny_llama, "LlamaForCausalLM", "llama"),
        (_tiny_gpt2, "GPT2LMHeadModel", "gpt2"),
        (_tiny_qwen3_vl, "Qwen3VLForConditionalGeneration", "qwen3_vl"),
    ],
    ids=["llama", "gpt2", "qwen3_vl"],
)
def test_unsupported_models_are_refused_by_name(make: Any, name: str, model_type: str) -> None:
    model = make()
    forward = model.forward
    with pytest.raises(UnsupportedModelError, match=name) as info:
        encode_once(model, feature_cache_bytes=1024)
    assert isinstance(info.value, TypeError) and isinstance(info.value, VisionError)
    message = str(info.value)
    assert repr(model_type) in message
    assert all(f in message for f in ("Qwen2-VL", "Qwen2.5-VL", "LLaVA", "LLaVA-NeXT"))
    assert model.forward == forward and "forward" not in vars(model)  # left as it was
    with pytest.raises(TypeError, match=name):
        encode_stats(model)


def test_objects_without_a_config_are_refused() -> None:
    class NotAModel:
        pass

    with pytest.raises(UnsupportedModelError, match=r"NotAModel.*model_type None"):
        encode_once(NotAModel())


def test_a_look_alike_without_the_feature_calls_is_refused() -> None:
    class LookAlike(torch.nn.Module):
        config = types.SimpleNamespace(model_type="qwen2_vl")

        def forward(self, input_ids: Any = None) -> Any:
            return input_ids

    model = LookAlike()
    with pytest.raises(UnsupportedModelError, match="LookAlike") as info:
        encode_once(model)
    for missing in ("get_image_features", "get_video_features", "mm_encoder_outputs"):
        assert missing in str(info.value)
    assert "forward" not in vars(model)


# --------------------------------------------------------------------------------- unadapted


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_unadapted_model_never_runs_on_unique_media(family: str, base: Any) -> None:
    if family == "qwen2_vl":
        model, mb = base, qwen_batch([(1, 4, 4)])
    else:
        model, mb = build_llava(), llava_batch()
    kwargs = inputs(mb, unique=True)
    assert isinstance(kwargs["pixel_values"], UniqueSegments)
    with torch.no_grad(), pytest.raises(UnadaptedModelError, match="encode_once"):
        model(**kwargs)
    # the same model runs on the logical media, and adapted it gives the same on unique media
    with torch.no_grad():
        want = model(**inputs(mb, unique=False)).logits
        got = encode_once(copy.deepcopy(model))(**kwargs).logits
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_unadapted_model_never_runs_on_unique_metadata(base: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True, plain=("pixel_values",))
    assert isinstance(kwargs["image_grid_thw"], UniqueSegments)
    with torch.no_grad(), pytest.raises(UnadaptedModelError):
        base(**kwargs)


def test_torch_functions_refuse_unique_segments(batch: Batch) -> None:
    us = batch.media["pixel_values"].unique_segments()
    assert us is not None
    for call in (lambda: torch.cat([us]), lambda: torch.prod(us), lambda: us.type(torch.float)):
        with pytest.raises(UnadaptedModelError):
            call()


# --------------------------------------------------------------------------------- media


def test_unique_pixels_with_plain_grid(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True, plain=("image_grid_thw",))
    with pytest.raises(UniqueMediaError, match=r"'image_grid_thw'.*'pixel_values'"):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0


def test_unique_grid_without_its_media(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True, plain=("pixel_values",))
    with pytest.raises(UniqueMediaError, match="image_grid_thw"):
        adapted(**kwargs)
    kwargs["pixel_values"] = None
    with pytest.raises(UniqueMediaError, match="image_grid_thw"):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0


def test_unique_key_the_family_does_not_encode(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True)
    seconds = PackedTensor([torch.ones(1)] * 2, 0).repeat_interleave(G).unique_segments()
    kwargs["second_per_grid_ts"] = seconds  # Qwen2.5-VL's, not Qwen2-VL's
    with pytest.raises(UniqueMediaError, match=r"\['second_per_grid_ts'\].*Qwen2-VL"):
        adapted(**kwargs)


def test_grid_of_other_rows(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True)
    fewer = batch.media["image_grid_thw"].slice(list(range(G + 1))).unique_segments()
    assert fewer is not None and fewer.num_logical != kwargs["pixel_values"].num_logical
    kwargs["image_grid_thw"] = fewer
    with pytest.raises(UniqueMediaError, match=r"'image_grid_thw' has 4 .* 'pixel_values' 6"):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0


def test_rows_sharing_pixels_with_different_grids(adapted: Any, base: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True)
    # one grid per row without provenance: row 1 claims another grid of the same patch count
    grids = [t.clone() for t in batch.media["image_grid_thw"].iter_logical_segments()]
    assert grids[1].tolist() == [[1, 4, 4]]
    grids[1] = torch.tensor([[1, 2, 8]])
    unique = PackedTensor(grids, 0).unique_segments()
    assert unique is not None and unique.num_logical == kwargs["pixel_values"].num_logical
    kwargs["image_grid_thw"] = unique
    with pytest.raises(UniqueMediaError, match="share a 'pixel_values' segment carry different"):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0
    # the same grids, all equal to their pixels' (no provenance either): accepted
    grids[1] = torch.tensor([[1, 4, 4]])
    kwargs["image_grid_thw"] = PackedTensor(grids, 0).unique_segments()
    with torch.no_grad():
        got = adapted(**kwargs).logits
    torch.testing.assert_close(got, logical_logits(base, batch), rtol=TOL, atol=TOL)


def test_index_swapped_metadata_is_caught(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True)
    grid = kwargs["image_grid_thw"]
    index = grid.index.clone()
    index[[0, G]] = index[[G, 0]]  # row 0 gets prompt 1's grid, row G prompt 0's
    kwargs["image_grid_thw"] = dataclasses.replace(grid, index=index)
    with pytest.raises(UniqueMediaError, match="carry different"):
        adapted(**kwargs)


def test_unique_media_positionally(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True)
    ids, mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask")
    pixels = kwargs.pop("pixel_values")
    with pytest.raises(UniqueMediaError, match="keyword"):
        adapted(ids, mask, None, None, None, None, None, pixels, **kwargs)
    assert encode_stats(adapted).encoded == 0


def test_unique_media_and_encoder_outputs(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True)
    kwargs["mm_encoder_outputs"] = {"image": None}
    with pytest.raises(UniqueMediaError, match=r"'pixel_values' and mm_encoder_outputs\['image'\]"):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0


def test_metadata_packed_along_another_dimension(adapted: Any, batch: Batch) -> None:
    kwargs = inputs(batch, unique=True)
    grids = list(batch.media["image_grid_thw"].iter_logical_segments())
    kwargs["image_grid_thw"] = PackedTensor([g.T for g in grids], 1).unique_segments()
    with pytest.raises(UniqueMediaError, match="'image_grid_thw' must be packed along dimension 0"):
        adapted(**kwargs)


# --------------------------------------------------------------------------------- adapting


def test_readapting_only_changes_the_budget(base: Any, batch: Batch) -> None:
    model = encode_once(copy.deepcopy(base), feature_cache_bytes=1 << 20)
    adapter = model.forward
    original = adapter.__wrapped__
    with torch.no_grad():
        model(**inputs(batch, unique=True))
    stats = encode_stats(model)
    assert stats.encoded == 2 and len(adapter.cache) == 2
    assert encode_once(model, feature_cache_bytes=0) is model
    assert model.forward is adapter and adapter.__wrapped__ is original  # not wrapped twice
    assert adapter.cache.max_bytes == 0 and len(adapter.cache) == 0
    assert encode_stats(model) is stats and stats.encoded == 2  # the counters go on
    with pytest.raises(TypeError, match="feature_cache_bytes"):
        encode_once(model, feature_cache_bytes=-1)
    assert model.forward is adapter and adapter.cache.max_bytes == 0  # a refused budget: nothing
    with torch.no_grad():
        model(**inputs(batch, unique=True))
    assert stats.encoded == 4 and stats.cached == 0  # no budget: nothing kept
    encode_once(model, feature_cache_bytes=1 << 20)
    with torch.no_grad():
        for _ in range(2):
            got = model(**inputs(batch, unique=True)).logits
    assert stats.encoded == 6 and stats.cached == 2  # encoded once more, then served
    torch.testing.assert_close(got, logical_logits(base, batch), rtol=TOL, atol=TOL)


def test_deep_copy_of_an_adapted_model(base: Any, batch: Batch) -> None:
    model = encode_once(copy.deepcopy(base), feature_cache_bytes=1 << 20)
    with torch.no_grad():
        model(**inputs(batch, unique=True))
    clone = copy.deepcopy(model)
    assert clone.forward is not model.forward and clone.forward.model is clone
    assert encode_stats(clone) is not encode_stats(model)
    assert clone.forward.cache is not model.forward.cache
    # the original's weights change: the copy must run on its own (unchanged) weights
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.mul_(2.0)
    before = dataclasses.replace(encode_stats(model))
    copied = dataclasses.replace(encode_stats(clone))
    want = logical_logits(base, batch)
    with torch.no_grad():
        got = clone(**inputs(batch, unique=True)).logits
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert encode_stats(model) == before  # nothing counted on the original
    after = encode_stats(clone)
    assert after.occurrences == copied.occurrences + 2 * G
    assert after.encoded + after.cached == copied.encoded + copied.cached + 2
    with torch.no_grad():
        changed = model(**inputs(batch, unique=True)).logits
    assert (changed - want).abs().max() > 1e-6  # the original: its own new weights
    assert encode_stats(clone) == after and encode_stats(model).occurrences > before.occurrences
    # an unadapted deep copy of the base stays unadapted
    with pytest.raises(TypeError, match="not adapted"):
        encode_stats(copy.deepcopy(base))
