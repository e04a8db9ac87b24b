"""``encode_once`` on every family it supports (Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT), in the
padded and the packed (THD) layout: a GRPO micro-batch fed to an adapted model as
``unique_segments()`` gives the logits, the loss and every parameter's gradient of the same
model fed ``as_tensor()`` (float64, to 1e-10), while its tower encodes each unique image or
video once. The micro-batches cover G rows of one prompt, several images per row (one shared by
two prompts), Qwen videos (and Qwen2.5-VL's ``second_per_grid_ts`` both ways), and rows of
different prompts shuffled, sliced out of a bigger batch and pickled. The tests then show the
comparison has teeth: a row given another prompt's image, or a row's images in another order,
changes that row's logits; and the packed layout reads as separate samples."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from mmpack.packed.unique import UniqueSegments
from mmpack.vision import encode_once, encode_stats
from support.tiny_vlms import (
    FAMILY_NAMES,
    QWEN,
    MicroBatch,
    Prompt,
    build_model,
    keep_float64,
    loss_sum,
    make_image,
    make_video,
    micro_batch,
    model_inputs,
    reorder,
    targets,
    twin,
)

G = 4
TOL = 1e-10
LAYOUTS = ("padded", "packed")
#: sizes of the images A, B, C of each family (A and B alike, C different): Qwen patch grids,
#: LLaVA-NeXT original sizes (C takes fewer tiles, so its pixels are padded); LLaVA has one size
SIZES: dict[str, tuple[Any, Any, Any]] = {
    "qwen2_vl": ((1, 4, 4), (1, 4, 4), (1, 2, 4)),
    "qwen2_5_vl": ((1, 4, 8), (1, 4, 8), (1, 8, 4)),
    "llava": (None, None, None),
    "llava_next": ((8, 14), (8, 14), (6, 6)),
}
#: parameters no loss reaches: CLIP's pooled output, which LLaVA does not read
UNUSED = {"model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"}


@pytest.fixture
def exact(monkeypatch: pytest.MonkeyPatch) -> None:
    keep_float64(monkeypatch)


@functools.cache
def _model(family: str) -> Any:
    return build_model(family)


def _images(family: str, seed: int = 1) -> list[Any]:
    model = _model(family)
    generator = torch.Generator().manual_seed(seed)
    a, b, c = SIZES[family]
    return [make_image(model, a, generator), make_image(model, b, generator)] + [
        make_image(model, c, generator) for _ in range(2)
    ]


def _batch(family: str, scenario: str) -> MicroBatch:
    """The micro-batch of ``scenario`` (see the module docs) for ``family``."""
    a, b, c, d = _images(family)
    if scenario == "grpo":  # P = 2 prompts, one image each, G rows each
        return micro_batch([Prompt([a], [10, 20, 21]), Prompt([c], [11, 20, 22])], G)
    if scenario == "multi":  # two images per row, A shared by both prompts
        prompts = [Prompt([a, b], [10, 20]), Prompt([c, a], [11, 21])]
        return micro_batch(prompts, G, layout="per_item")
    if scenario == "shuffled":  # rows of three prompts, interleaved, cut and pickled
        prompts = [Prompt([a, b], [10, 20]), Prompt([c], [11, 21]), Prompt([d], [12, 22])]
        return reorder(micro_batch(prompts, G), [9, 1, 4, 10, 0, 6, 3, 11])
    if scenario == "video":
        model = _model(family)
        generator = torch.Generator().manual_seed(2)
        v1 = make_video(model, (2, 4, 4), generator, seconds=0.5)
        v2 = make_video(model, (2, 2, 4), generator, seconds=1.0)
        return micro_batch([Prompt([a, v1], [10, 20]), Prompt([v2], [11, 21])], G)
    raise ValueError(scenario)


def _run(model: Any, kwargs: dict[str, Any], target: torch.Tensor) -> tuple[Any, ...]:
    out = model(**kwargs)
    loss = loss_sum(out.logits, target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), loss.detach(), grads


def _compare(
    family: str, layout: str, batch: MicroBatch, *, plain: tuple[str, ...] = (), tol: float = TOL
) -> dict[str, float]:
    """Run the logical and the unique path; assert they agree; the largest differences."""
    base = _model(family)
    target = targets(batch, layout)
    logits, loss, grads = _run(twin(base), model_inputs(base, batch, layout, unique=False), target)
    adapted = encode_once(twin(base))
    kwargs = model_inputs(base, batch, layout, unique=True, plain=plain)
    assert isinstance(kwargs["pixel_values"], UniqueSegments)
    u_logits, u_loss, u_grads = _run(adapted, kwargs, target)

    assert torch.isfinite(loss) and loss > 0
    names = {n for n, _ in base.named_parameters()}
    assert set(grads) == set(u_grads) == names - UNUSED
    vision = [n for n in grads if ".visual." in n or ".vision_tower." in n]
    assert vision and all(grads[n].abs().sum() > 0 for n in vision)
    diffs = {
        "logits": (logits - u_logits).abs().max().item(),
        "loss": (loss - u_loss).abs().item(),
        "grads": max((grads[n] - u_grads[n]).abs().max().item() for n in grads),
    }
    for n in grads:
        torch.testing.assert_close(u_grads[n], grads[n], rtol=tol, atol=tol, msg=n)
    assert diffs["logits"] <= TOL and diffs["loss"] <= TOL, diffs

    stats = encode_stats(adapted)
    assert stats.encoded == batch.num_unique_items < batch.num_items == stats.occurrences
    assert stats.cached == 0
    return diffs


CASES = [
    (family, layout, scenario)
    for family in FAMILY_NAMES
    for scenario in ("grpo", "multi", "shuffled")
    for layout in LAYOUTS
]


@pytest.mark.usefixtures("exact")
@pytest.mark.parametrize(("family", "layout", "scenario"), CASES)
def test_unique_path_matches_logical_path(family: str, layout: str, scenario: str) -> None:
    batch = _batch(family, scenario)
    if scenario == "shuffled":
        index = batch.media["pixel_values"].unique_segments().index.tolist()
        assert index != sorted(index) and len(set(batch.prompt_of_row)) == 3
    _compare(family, layout, batch)


VIDEO_CASES = [
    (family, layout, seconds)
    for family in QWEN
    for layout in LAYOUTS
    for seconds in (("unique", "plain") if family == "qwen2_5_vl" else ("none",))
]


@pytest.mark.usefixtures("exact")
@pytest.mark.parametrize(("family", "layout", "seconds"), VIDEO_CASES)
def test_qwen_videos(family: str, layout: str, seconds: str) -> None:
    """Images and videos in one micro-batch; prompt 1 has no image (a ``None`` row). Qwen2.5-VL's
    ``second_per_grid_ts`` (which the padded forward reads for its rope index) goes in as
    ``UniqueSegments`` or as the plain logical tensor."""
    batch = _batch(family, "video")
    assert batch.media["pixel_values"].logical_segment_counts_by_row() == [1] * G + [0] * G
    plain = ("second_per_grid_ts",) if seconds == "plain" else ()
    _compare(family, layout, batch, plain=plain)


@pytest.mark.parametrize("family", QWEN)
def test_qwen_float32_rounding_alone_separates_unpatched_gradients(family: str) -> None:
    """Without ``keep_float64``, Qwen's float32 vision rotary embedding (and Qwen2.5-VL's RMS
    norms) round each occurrence's gradient in the logical path and the summed one in the unique
    path: the forward still agrees exactly, the gradients to float32's precision."""
    _compare(family, "padded", _batch(family, "grpo"), tol=1e-6)


def _swapped(kwargs: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """``kwargs`` with occurrences ``i`` and ``j`` of every image key's unique index swapped."""
    out = dict(kwargs)
    for key in ("pixel_values", "image_grid_thw", "image_sizes"):
        value = kwargs.get(key)
        if isinstance(value, UniqueSegments):
            index = value.index.clone()
            index[[i, j]] = index[[j, i]]
            out[key] = dataclasses.replace(value, index=index)
    return out


def _changed_rows(family: str, batch: MicroBatch, i: int, j: int) -> list[int]:
    """The padded rows whose logits change when the adapted model gets occurrences ``i`` and
    ``j`` swapped (every other row must stay equal to the logical path)."""
    base = _model(family)
    with torch.no_grad():
        logical = twin(base)(**model_inputs(base, batch, "padded", unique=False)).logits
        kwargs = _swapped(model_inputs(base, batch, "padded", unique=True), i, j)
        swapped = encode_once(twin(base))(**kwargs).logits
    diff = (logical - swapped).abs().amax(dim=(1, 2))
    assert all(d <= TOL or d > 1e-6 for d in diff.tolist()), diff
    return [r for r, d in enumerate(diff.tolist()) if d > 1e-6]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_another_prompts_image_is_caught(family: str) -> None:
    a, b, _, _ = _images(family)
    batch = micro_batch([Prompt([a], [10, 20]), Prompt([b], [10, 20])], G)
    # row 0 (prompt 0) and row G + 1 (prompt 1) trade their image
    assert _changed_rows(family, batch, 0, G + 1) == [0, G + 1]
    assert _changed_rows(family, batch, 0, 1) == []  # two rows of one prompt: same image


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_images_out_of_order_within_a_row_are_caught(family: str) -> None:
    a, b, c, _ = _images(family)
    batch = micro_batch([Prompt([a, b], [10, 20]), Prompt([c], [11])], G, layout="per_item")
    # occurrences 2 and 3 are row 1's two images
    assert _changed_rows(family, batch, 2, 3) == [1]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_layout_reads_as_separate_samples(family: str) -> None:
    """Each sample of the packed row gives the logits of its padded row: the position ids
    restart per sample as the family's transformers code reads them (and Qwen's rope index)."""
    base = _model(family)
    batch = _batch(family, "video" if family in QWEN else "shuffled")
    with torch.no_grad():
        padded = base(**model_inputs(base, batch, "padded", unique=False)).logits
        packed = base(**model_inputs(base, batch, "packed", unique=False)).logits[0]
    start = 0
    for r, row in enumerate(batch.rows):
        sample = packed[start : start + len(row)]
        torch.testing.assert_close(sample, padded[r, : len(row)], rtol=TOL, atol=TOL)
        start += len(row)
