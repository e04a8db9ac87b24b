"""The main job (`make demo`) on a shortened run of the same path: synthetic data in both formats
with images, a video and an audio clip, the real Energon loader with 2 workers, Qwen2-VL's
processor and real tokenizer in both mask modes, mmpack's THD micro-batches, and a tiny Qwen2-VL
trained on them and on padded rows of the same samples: the losses agree, the accounting
balances; its GRPO step gives the same loss and gradients on logical and on unique media, with
one vision encode per image."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mmpack_dev.demos import DEFAULT_PIPELINE, TOY_OPTION, TOY_PIPELINE, grpo_step
from mmpack_dev.demos import train as demo
from mmpack_dev.tiny_qwen2_vl import LinearCrossEntropy

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    # a few seconds of CPU per step (the loss head spans the real 151,936-token vocabulary); a
    # busy shared machine stretches that many times over
    pytest.mark.timeout(600),
]

SHORT = [
    "--samples", "40", "--steps", "2", "--capacity", "160", "--packs-per-step", "1",
    "--buffer", "8", "--words", "3", "--exchanges", "2", "--no-progress",
    "--grpo-prompts", "2", "--grpo-group", "3",
]  # fmt: skip


def test_the_default_pipeline_trains_and_the_toy_is_an_option() -> None:
    assert DEFAULT_PIPELINE == "train" and TOY_OPTION == "--toy" and TOY_PIPELINE == "sft"


def test_short_run_losses_agree_and_accounting_balances(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "work"
    summary_path = tmp_path / "r.json"
    rc = demo.main([*SHORT, "--out", str(out), "--json", str(summary_path)])
    text = capsys.readouterr().out
    assert rc == 0, text
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] and set(summary["modes"]) == {"roles", "precomputed"}
    for mode, result in summary["modes"].items():
        packed, padded = result["packed"], result["padded"]
        assert len(packed["losses"]) == len(padded["losses"]) == 2, mode
        assert result["max_loss_diff"] <= demo.DEFAULT_TOLERANCE, (mode, result)
        assert packed["losses"][0] > 10.0  # a random init over 151,936 tokens: ~ln(151936)
        assert packed["token_fill"] > padded["token_fill"], mode
        stats = result["stats"]
        assert result["accounting_balanced"], (mode, stats)
        assert stats["skipped"]["undeclared_modality"] >= 1  # the audio clip: not Qwen2-VL's
        assert stats["packed"] > 0
    assert summary["modes"]["precomputed"]["stats"]["failed"] >= 1  # the broken samples
    # the two modes mask differently, so their losses differ
    assert (
        summary["modes"]["roles"]["packed"]["losses"]
        != (summary["modes"]["precomputed"]["packed"]["losses"])
    )
    assert "-> balanced" in text and "MISMATCH" not in text
    assert "loss packed == padded on every step: yes" in text
    assert (out / "train-demo.png").stat().st_size > 10_000
    grpo = summary["grpo"]
    assert grpo["ok"] and not grpo["problems"], grpo
    assert (grpo["prompts"], grpo["group"], grpo["rows"]) == (2, 3, 6)
    assert grpo["loss_diff"] <= grpo_step.LOSS_TOLERANCE
    assert grpo["max_grad_rel_diff"] <= grpo_step.GRAD_TOLERANCE
    assert grpo["worst_parameter"].startswith("model.")
    assert grpo["parameters"] > grpo["vision_parameters"] > 0  # the vision tower is compared
    logical, unique = grpo["logical"], grpo["unique"]
    # every row's copy encoded vs each prompt's image once, as the vision tower saw them
    assert (logical["encodes"], unique["encodes"]) == (6, 2)
    assert (logical["tower_images"], unique["tower_images"]) == (6, 2)
    assert logical["tower_patches"] == 3 * unique["tower_patches"]
    assert logical["seconds"] > 0 and unique["seconds"] > 0
    assert "| GRPO step (2 prompts x G=3) |" in text
    assert "| logical | as_tensor() |" in text and "| unique | unique_segments() |" in text
    assert "| max grad diff / scale |" in text
    assert (
        "loss and gradients logical == unique: yes" in text
        and "relative to the gradient's scale" in text
    )


def test_the_grpo_step_fails_beyond_its_tolerance(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmpack_dev.tiny_qwen2_vl import build_processor

    args = demo.build_parser().parse_args([*SHORT, "--grpo-group", "2"])
    # no difference passes: both checks fail
    monkeypatch.setattr(grpo_step, "LOSS_TOLERANCE", -1.0)
    monkeypatch.setattr(grpo_step, "GRAD_TOLERANCE", -1.0)
    result = grpo_step.run_step(build_processor(), args)
    assert not result.ok
    assert any(p.startswith("loss differs") for p in result.problems), result.problems
    assert any(p.startswith("gradients differ") for p in result.problems), result.problems
    assert "FAIL" in grpo_step.verdict(result)


def test_the_grpo_gradient_check_is_relative_to_each_parameters_scale() -> None:
    big = torch.full((3, 4), 1e3, dtype=torch.float64)
    small = torch.full((5,), 1e-6, dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    a = {"big": big, "small": small, "zero": zero}
    names = list(a)
    # float32-island-sized differences on each scale: inside the tolerance though the absolute
    # difference on the large gradient is 1e-8
    b = {"big": big + 1e-8, "small": small * (1 + 1e-11), "zero": zero.clone()}
    diff, rel, _ = grpo_step.compare_gradients(a, b, names)
    assert diff == pytest.approx(1e-8, rel=1e-3) and rel <= grpo_step.GRAD_TOLERANCE
    # a wrong gradient on a small scale: tiny in absolute terms, caught relative to its scale
    b["small"] = small * 1.5
    diff, rel, worst = grpo_step.compare_gradients(a, b, names)
    assert diff < 1e-6 and rel > grpo_step.GRAD_TOLERANCE and worst == "small"
    # a gradient where the other path has none: off by its whole scale
    b["small"], b["zero"] = small.clone(), zero + 1e-300
    assert grpo_step.compare_gradients(a, b, names)[1:] == (1.0, "zero")


def test_the_dataset_holds_every_media_kind(tmp_path: Path) -> None:
    args = demo.build_parser().parse_args(SHORT)
    with open(tmp_path / "log", "w") as log:
        ds = demo.write_dataset(tmp_path / "ds", args, log)
    kinds = {k for v in ds.media_kinds.values() for k in v}
    assert kinds == {"image", "video", "audio"}
    assert set(ds.formats) == {"generic", "fragments"}
    # what each mode must do with each sample covers the whole dataset it reads
    assert len(demo.expected_outcomes(ds, "precomputed")) == ds.num_samples
    roles = demo.expected_outcomes(ds, "roles")
    assert roles and all(key.startswith("gene") for key in roles)


def test_accounting_finds_a_missing_sample(tmp_path: Path) -> None:
    args = demo.build_parser().parse_args(SHORT)
    with open(tmp_path / "log", "w") as log:
        ds = demo.write_dataset(tmp_path / "ds", args, log)
    outcomes = demo.expected_outcomes(ds, "precomputed")
    packed = [k for k, o in outcomes.items() if o == "packed"]
    counts: dict[str, int] = {}
    for o in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    skipped = {r: 0 for r in ("ends_on_user_turn", "oversize", "undeclared_modality")}
    for o, n in counts.items():
        if o.startswith("skip:"):
            skipped[o.removeprefix("skip:")] = n
    stats = {
        "seen": len(outcomes),
        "packed": len(packed),
        "skipped": skipped,
        "skipped_total": sum(skipped.values()),
        "failed": counts.get("failed", 0),
        "failed_by_reason": {"SampleFormatError": counts.get("failed", 0)},
    }
    empty = demo.Training("packed")
    run = demo.ModeRun("precomputed", stats, counts, packed, 1.0, 1, 0, 0, 0, 0, empty, empty)
    assert demo.accounting(ds, run)[0]
    # one sample delivered twice instead of another: the counts still add up, the keys do not
    run.delivered = [*packed[:-1], packed[0]]
    ok, line = demo.accounting(ds, run)
    assert not ok and "MISMATCH" in line


def test_fused_loss_equals_cross_entropy() -> None:
    torch.manual_seed(0)
    weight = (0.1 * torch.randn(1000, 8, dtype=torch.float64)).requires_grad_()
    hidden = torch.randn(300, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 1000, (300,))
    labels[::4] = -100
    fused = LinearCrossEntropy.apply(hidden, weight, labels, -100)
    (0.5 * fused).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = torch.nn.functional.cross_entropy(
        hidden @ weight.T, labels, ignore_index=-100, reduction="sum"
    )
    (0.5 * plain).backward()
    assert abs(float(fused.detach()) - float(plain.detach())) < 1e-9
    assert torch.allclose(grads[0], hidden.grad, atol=1e-12)
    assert torch.allclose(grads[1], weight.grad, atol=1e-12)


def test_fused_loss_with_a_scale_equals_weighted_cross_entropy() -> None:
    torch.manual_seed(0)
    weight = (0.1 * torch.randn(1000, 8, dtype=torch.float64)).requires_grad_()
    hidden = torch.randn(300, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 1000, (300,))
    labels[::5] = -100
    scale = torch.randn(300, dtype=torch.float64)  # advantages: either sign
    fused = LinearCrossEntropy.apply(hidden, weight, labels, -100, scale)
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    per_position = torch.nn.functional.cross_entropy(
        hidden @ weight.T, labels, ignore_index=-100, reduction="none"
    )
    plain = (scale * per_position).sum()
    plain.backward()
    assert abs(float(fused.detach()) - float(plain.detach())) < 1e-9
    assert torch.allclose(grads[0], hidden.grad, atol=1e-12)
    assert torch.allclose(grads[1], weight.grad, atol=1e-12)
