"""What ``encode_once`` and an adapted model refuse, with typed errors that name the model or the
keys: models of other families (a text-only Llama, Qwen3-VL), an unadapted model fed
``UniqueSegments`` (it never runs without its media), media and metadata that do not describe
the same segments, unique media passed positionally or beside ``mm_encoder_outputs``. Then
re-adapting only sets the budget, and a deep copy of an adapted model works on its own."""

from __future__ import annotations

import copy
import dataclasses
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
from support.tiny_vlms import (
    MicroBatch,
    Prompt,
    build_model,
    make_image,
    micro_batch,
    model_inputs,
    twin,
)

G = 3
TOL = 1e-10


@pytest.fixture(scope="module")
def base() -> Any:
    return build_model("qwen2_vl")


@pytest.fixture(scope="module")
def batch(base: Any) -> MicroBatch:
    generator = torch.Generator().manual_seed(4)
    a = make_image(base, (1, 4, 4), generator)
    b = make_image(base, (1, 2, 8), generator)
    return micro_batch([Prompt([a], [10, 20]), Prompt([b], [11])], G)


@pytest.fixture
def adapted(base: Any) -> Any:
    return encode_once(twin(base))


def unique_inputs(base: Any, batch: MicroBatch, **kwargs: Any) -> dict[str, Any]:
    return model_inputs(base, batch, "padded", unique=True, **kwargs)


# --------------------------------------------------------------------------------- models


def _tiny_llama() -> Any:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return tf.LlamaForCausalLM(config)


def _tiny_qwen3_vl() -> Any:
    import transformers as tf

    config = tf.Qwen3VLConfig(
        text_config={
            "vocab_size": 96,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
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
        (_tiny_qwen3_vl, "Qwen3VLForConditionalGeneration", "qwen3_vl"),
    ],
)
def test_unsupported_models_are_refused_by_name(make: Any, name: str, model_type: str) -> None:
    model = make()
    forward = model.forward
    with pytest.raises(UnsupportedModelError, match=name) as info:
        encode_once(model, feature_cache_bytes=1024)
    assert isinstance(info.value, TypeError) and isinstance(info.value, VisionError)
    assert repr(model_type) in str(info.value) and "Qwen2-VL" in str(info.value)
    assert model.forward == forward  # left as it was
    with pytest.raises(TypeError, match=name):
        encode_stats(model)


def test_objects_without_a_config_are_refused() -> None:
    class NotAModel:
        pass

    with pytest.raises(UnsupportedModelError, match="NotAModel"):
        encode_once(NotAModel())


# --------------------------------------------------------------------------------- unadapted


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_unadapted_model_never_runs_on_unique_media(family: str, base: Any) -> None:
    model = base if family == "qwen2_vl" else build_model(family)
    generator = torch.Generator().manual_seed(1)
    image = make_image(model, (1, 4, 4), generator)
    mb = micro_batch([Prompt([image], [10, 20])], G)
    kwargs = unique_inputs(model, mb)
    assert isinstance(kwargs["pixel_values"], UniqueSegments)
    with torch.no_grad(), pytest.raises(UnadaptedModelError, match="encode_once"):
        model(**kwargs)


# --------------------------------------------------------------------------------- media


def test_unique_pixels_with_plain_grid(adapted: Any, base: Any, batch: MicroBatch) -> None:
    kwargs = unique_inputs(base, batch, plain=("image_grid_thw",))
    with pytest.raises(UniqueMediaError, match=r"'image_grid_thw'.*'pixel_values'"):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0


def test_unique_grid_without_its_media(adapted: Any, base: Any, batch: MicroBatch) -> None:
    kwargs = unique_inputs(base, batch, plain=("pixel_values",))
    assert isinstance(kwargs["image_grid_thw"], UniqueSegments)
    with pytest.raises(UniqueMediaError, match="image_grid_thw"):
        adapted(**kwargs)


def test_grid_of_other_rows(adapted: Any, base: Any, batch: MicroBatch) -> None:
    kwargs = unique_inputs(base, batch)
    fewer = batch.media["image_grid_thw"].slice(list(range(G + 1))).unique_segments()
    assert fewer is not None and fewer.num_logical != kwargs["pixel_values"].num_logical
    kwargs["image_grid_thw"] = fewer
    with pytest.raises(UniqueMediaError, match=r"'image_grid_thw' has .* 'pixel_values'"):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0


def test_rows_sharing_pixels_with_different_grids(
    adapted: Any, base: Any, batch: MicroBatch
) -> None:
    kwargs = unique_inputs(base, batch)
    # one grid per row without provenance: row 1 claims another grid of the same patch count
    grids = [t.clone() for t in batch.media["image_grid_thw"].iter_logical_segments()]
    assert grids[1].tolist() == [[1, 4, 4]]
    grids[1] = torch.tensor([[1, 2, 8]])
    unique = PackedTensor(grids, 0).unique_segments()
    assert unique is not None and unique.num_logical == kwargs["pixel_values"].num_logical
    kwargs["image_grid_thw"] = unique
    with pytest.raises(UniqueMediaError, match="carry different 'image_grid_thw'"):
        adapted(**kwargs)
    # the same grids, all equal to their pixels' (no provenance either): accepted
    grids[1] = torch.tensor([[1, 4, 4]])
    kwargs["image_grid_thw"] = PackedTensor(grids, 0).unique_segments()
    with torch.no_grad():
        got = adapted(**kwargs).logits
        want = base(**model_inputs(base, batch, "padded", unique=False)).logits
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_index_swapped_metadata_is_caught(adapted: Any, base: Any, batch: MicroBatch) -> None:
    kwargs = unique_inputs(base, batch)
    grid = kwargs["image_grid_thw"]
    index = grid.index.clone()
    index[[0, G]] = index[[G, 0]]  # row 0 gets prompt 1's grid, row G prompt 0's
    kwargs["image_grid_thw"] = dataclasses.replace(grid, index=index)
    with pytest.raises(UniqueMediaError, match="carry different"):
        adapted(**kwargs)


def test_unique_media_positionally(adapted: Any, base: Any, batch: MicroBatch) -> None:
    kwargs = unique_inputs(base, batch)
    ids = kwargs.pop("input_ids")
    pixels = kwargs.pop("pixel_values")
    with pytest.raises(UniqueMediaError, match="keyword"):
        adapted(ids, kwargs.pop("attention_mask"), None, None, None, None, None, pixels, **kwargs)
    assert encode_stats(adapted).encoded == 0


def test_unique_media_and_encoder_outputs(adapted: Any, base: Any, batch: MicroBatch) -> None:
    kwargs = unique_inputs(base, batch)
    kwargs["mm_encoder_outputs"] = {"image": None}
    with pytest.raises(
        UniqueMediaError, match="'pixel_values' and mm_encoder_outputs\\['image'\\]"
    ):
        adapted(**kwargs)
    assert encode_stats(adapted).encoded == 0


def test_metadata_packed_along_another_dimension(
    adapted: Any, base: Any, batch: MicroBatch
) -> None:
    kwargs = unique_inputs(base, batch)
    grids = list(batch.media["image_grid_thw"].iter_logical_segments())
    kwargs["image_grid_thw"] = PackedTensor([g.T for g in grids], 1).unique_segments()
    with pytest.raises(UniqueMediaError, match="dimension 0"):
        adapted(**kwargs)


# --------------------------------------------------------------------------------- adapting


def test_readapting_only_changes_the_budget(base: Any, batch: MicroBatch) -> None:
    model = encode_once(twin(base), feature_cache_bytes=1 << 20)
    adapter = model.forward
    original = adapter.forward
    with torch.no_grad():
        model(**unique_inputs(base, batch))
    stats = encode_stats(model)
    assert stats.encoded == 2 and len(adapter.cache) == 2
    assert encode_once(model, feature_cache_bytes=0) is model
    assert model.forward is adapter and adapter.forward is original  # not wrapped twice
    assert adapter.cache.max_bytes == 0 and len(adapter.cache) == 0
    assert encode_stats(model) is stats and stats.encoded == 2
    with pytest.raises(TypeError, match="feature_cache_bytes"):
        encode_once(model, feature_cache_bytes=-1)
    assert adapter.cache.max_bytes == 0  # a refused budget changes nothing
    encode_once(model, feature_cache_bytes=1 << 20)
    with torch.no_grad():
        for _ in range(2):
            got = model(**unique_inputs(base, batch)).logits
    assert stats.encoded == 4 and stats.cached == 2  # encoded once more, then served
    with torch.no_grad():
        want = base(**model_inputs(base, batch, "padded", unique=False)).logits
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_deep_copy_of_an_adapted_model(base: Any, batch: MicroBatch) -> None:
    model = encode_once(twin(base), feature_cache_bytes=1 << 20)
    with torch.no_grad():
        model(**unique_inputs(base, batch))
    clone = copy.deepcopy(model)
    assert clone.forward is not model.forward and clone.forward.model is clone
    assert encode_stats(clone) is not encode_stats(model)
    # the original's weights change: the copy must run on its own (unchanged) weights
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.mul_(2.0)
    before = dataclasses.replace(encode_stats(model))
    copied = dataclasses.replace(encode_stats(clone))
    with torch.no_grad():
        got = clone(**unique_inputs(base, batch)).logits
        want = base(**model_inputs(base, batch, "padded", unique=False)).logits
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert encode_stats(model) == before  # nothing counted on the original
    after = encode_stats(clone)
    assert after.occurrences == copied.occurrences + 2 * G
    assert after.encoded + after.cached == copied.encoded + copied.cached + 2
    with torch.no_grad():
        changed = model(**unique_inputs(base, batch)).logits
    assert (changed - want).abs().max() > 1e-6
    assert encode_stats(clone) == after and encode_stats(model).occurrences > before.occurrences
