"""``install(unique_media=True)``: NeMo-RL's ``get_multimodal_dict(as_tensors=True)`` gives each
packed key as ``UniqueSegments``, and an adapted model trained on it gets NeMo-RL's loss and
gradients; NeMo-RL's own behaviour everywhere else (``as_tensors=False``, the default mode,
``unique=False``, the coupled-key check, uninstall). Runs on the stand-in NeMo-RL modules
(``support.nemo_rl_standins``) with a tiny random-init Qwen2-VL as the consumer."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import mmpack
import pytest
import torch
from mmpack.compat import nemo_rl as compat
from mmpack.errors import UnadaptedModelError
from mmpack.packed.unique import UniqueSegments
from mmpack.vision import encode_once, encode_stats
from support.nemo_rl_standins import installed_standins
from support.tiny_vlms import IMAGE as IMAGE_TOKEN
from support.tiny_vlms import VISION_END, VISION_START, build_model

G = 4
#: (t, h, w) patch grids of each prompt's images; a merged token is 2 x 2 patches
GRIDS = (((1, 4, 4),), ((1, 2, 4), (1, 4, 2)), ((1, 2, 2),))


@pytest.fixture
def nemo() -> Iterator[Any]:
    with installed_standins() as batched:
        yield batched


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model("qwen2_vl")


def _batch(batched: Any) -> Any:
    """A GRPO-shaped batch: each prompt's media one dedup-enabled row, then G rows per prompt
    sharing it (what NeMo-RL's G-expansion and flatten give)."""
    generator = torch.Generator().manual_seed(1)
    pixels, grids, ids = [], [], []
    for p, images in enumerate(GRIDS):
        grid = torch.tensor(images)
        patches = int(grid.prod(-1).sum())
        pixels.append(torch.randn(patches, 3 * 2 * 2 * 2, generator=generator, dtype=torch.float64))
        grids.append(grid)
        row = [3 + p]
        for t, h, w in images:
            row += [VISION_START, *[IMAGE_TOKEN] * (t * h * w // 4), VISION_END]
        ids.append(row + [10 + p] * (24 - len(row)))
    return batched.BatchedDataDict(
        input_ids=torch.tensor(ids).repeat_interleave(G, dim=0),
        pixel_values=_expanded(pixels),
        image_grid_thw=_expanded(grids),
    )


def _expanded(segments: list[torch.Tensor]) -> Any:
    return mmpack.PackedTensor(segments, dim_to_pack=0).enable_deduplication().repeat_interleave(G)


def _loss(model: Any, ids: torch.Tensor, media: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    model.zero_grad()
    mask = torch.ones_like(ids)
    types = (ids == IMAGE_TOKEN).long()
    out = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, **media)
    loss = out.logits.pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def test_unique_mode_trains_as_nemo_rl_does(nemo: Any, model: Any) -> None:
    compat.install(accelerate=True, unique_media=True)
    batch = _batch(nemo)
    # a rank's micro-batch: some rows of each prompt, out of order
    shard = batch.select_indices([5, 1, 2, 7, 11, 4, 6])
    unique = shard.get_multimodal_dict(as_tensors=True)
    logical = shard.get_multimodal_dict(as_tensors=True, unique=False)
    assert isinstance(unique["pixel_values"], UniqueSegments)
    assert torch.is_tensor(logical["pixel_values"])
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(unique[key].logical(), logical[key])
    # each prompt's images once, whatever the shard holds of its G rows
    assert unique["pixel_values"].num_unique < unique["pixel_values"].num_logical
    ids = shard["input_ids"]
    adapted = encode_once(copy.deepcopy(model))
    loss_a, grads_a = _loss(model, ids, logical)
    loss_b, grads_b = _loss(adapted, ids, unique)
    assert abs(loss_a - loss_b) <= 1e-12
    assert grads_a.keys() == grads_b.keys()
    assert max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a) <= 1e-10
    # one encode per image of each prompt on the shard (the grids' rows), not per row
    assert encode_stats(adapted).encoded == len(unique["image_grid_thw"].values)
    assert encode_stats(adapted).occurrences == len(logical["image_grid_thw"])


def test_an_unadapted_model_refuses_unique_media(nemo: Any, model: Any) -> None:
    compat.install(accelerate=True, unique_media=True)
    batch = _batch(nemo)
    media = batch.get_multimodal_dict(as_tensors=True)
    with pytest.raises(UnadaptedModelError, match="encode_once"):
        _loss(model, batch["input_ids"], media)


def test_nemo_rl_behaviour_outside_the_unique_mode(nemo: Any, model: Any) -> None:
    compat.install(accelerate=True)  # the method is set, the mode is off
    batch = _batch(nemo)
    default = batch.get_multimodal_dict(as_tensors=True)
    assert torch.is_tensor(default["pixel_values"])
    packed = batch.get_multimodal_dict(as_tensors=False, unique=True)
    assert isinstance(packed["pixel_values"], mmpack.PackedTensor)
    chosen = batch.get_multimodal_dict(as_tensors=True, unique=True)
    assert isinstance(chosen["pixel_values"], UniqueSegments)
    compat.uninstall()
    assert "get_multimodal_dict" in nemo.BatchedDataDict.__dict__
    restored = batch.get_multimodal_dict(as_tensors=True)
    assert torch.is_tensor(restored["pixel_values"])
    with pytest.raises(TypeError):
        batch.get_multimodal_dict(as_tensors=True, unique=True)


def test_coupled_keys_are_checked_as_nemo_rl_checks_them(nemo: Any, model: Any) -> None:
    compat.install(unique_media=True)
    batch = _batch(nemo)
    # prompt 1's two images as two grid segments, beside one pixel segment
    grids = [torch.tensor(g) for images in GRIDS for g in images]
    split = mmpack.PackedTensor(
        [g[None] for g in grids],
        dim_to_pack=0,
        _row_offsets=[0, 1, 3, 4],
        _segment_indices=[0, 1, 2, 3],
    ).enable_deduplication()
    batch["image_grid_thw"] = split.repeat_interleave(G)  # counts per row: 1, 2, 1 (pixels: 1)
    with pytest.raises(ValueError, match="Coupled multimodal keys"):
        batch.get_multimodal_dict(as_tensors=True)


def test_unique_media_must_be_a_bool(nemo: Any) -> None:
    with pytest.raises(TypeError, match="unique_media"):
        compat.install(unique_media="yes")  # type: ignore[arg-type]
