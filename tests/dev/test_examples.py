"""The model-family examples under ``examples/`` run offline: a small real WebDataset packed
through the Energon loader with the model's real processor, the model's forward on the packed
batch (its own placeholder/feature check included), and the loss equal to the unpacked one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import llava
import qwen2_audio
import qwen2_vl

# Energon's loader asks for pinned memory, which a CPU-only machine cannot give
pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")

#: float32 forward of the same tokens, once packed and once per sample
LOSS_TOLERANCE = 1e-5


def check(result: dict[str, Any], samples: int) -> None:
    assert result["stats"]["failed"] == 0 and result["stats"]["skipped_total"] == 0
    assert result["samples"] == samples
    assert result["packs"] >= 2  # samples really share packs, across more than one
    assert any(len(p) > 1 for p in result["packs_data"])
    assert result["max_abs_diff"] < LOSS_TOLERANCE, result["losses"]
    assert all(count > 0 for _, _, count in result["losses"])


@pytest.mark.parametrize("workers", [0, 2])
def test_qwen2_vl_images_and_videos(tmp_path: Path, workers: int) -> None:
    result = qwen2_vl.run(tmp_path, video=True, workers=workers)
    if workers:  # each worker packs its own half: the counters live in the workers
        assert result["samples"] == 8 and result["max_abs_diff"] < LOSS_TOLERANCE
        return
    check(result, 8)
    media = [p.media for p in result["packs_data"]]
    assert sum(int(m["video_grid_thw"].logical_segment_counts_by_row()[0]) for m in media) == 2
    # the sample that shows one picture twice stores it once
    assert any(
        len(m["pixel_values"].tensors) < m["pixel_values"].logical_segment_counts_by_row()[0]
        for m in media
    )


@pytest.mark.parametrize("mode", [None, "precomputed"])
def test_llava_images_with_generation_markers(tmp_path: Path, mode: str | None) -> None:
    result = llava.run(tmp_path, loss_mask_mode=mode)
    check(result, 8)
    tokenizer = result["encoder"].tokenizer
    header = tokenizer.convert_tokens_to_ids("ASSISTANT")
    for pack in result["packs_data"]:
        labels = pack.labels
        assert not (labels == header).any()  # the template's header is never a target


def test_qwen2_audio(tmp_path: Path) -> None:
    result = qwen2_audio.run(tmp_path)
    check(result, 6)


def test_examples_print_their_losses(capsys: pytest.CaptureFixture[str]) -> None:
    llava.main()
    out = capsys.readouterr().out
    assert "LLaVA: 8 samples" in out and "max |packed - unpacked|" in out
