"""One test per defect of the NeMo-RL Energon SFT loader review (lessons-4108): each is named
``test_lesson<N>_...`` and shows that mmpack does not have it."""

from __future__ import annotations

import collections
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.energon")

import mmpack.energon.validation as validation
from megatron.energon import SkipSample, get_loader, get_train_dataset, stateless
from megatron.energon.errors import FatalSampleError
from megatron.energon.task_encoder.base import get_failure_tolerance, get_stateless
from mmpack.energon import (
    MEDIA_LOG,
    PackingEncoderConfig,
    PackingTaskEncoder,
    cook_generic,
    make_worker_config,
    stateless_with_tolerance,
)
from mmpack.energon.synthetic import PATCH_SIZE, write_synthetic_dataset
from mmpack.errors import EnergonConfigError, ModalityConfigError, TurnStructureError

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "configs"
AUDIO_OK = {"patch_size": 16, "sampling_rate": 16000, "hop_length": 160, "downsample_factor": 4}


def make_encoder(
    tokenizer: Any, cls: type[PackingTaskEncoder] = PackingTaskEncoder, **changes: Any
) -> PackingTaskEncoder:
    cfg = PackingEncoderConfig(
        **{"capacity": 512, "packing_buffer_size": 8, "batch_size": 2, **changes}
    )
    return cls(cfg, tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE})


def iterate(path: Path, encoder: PackingTaskEncoder, workers: int, *, repeat: bool) -> list[Any]:
    dataset = get_train_dataset(
        str(path),
        worker_config=make_worker_config(encoder, num_workers=workers),
        **encoder.dataset_options(),
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=repeat,
    )
    return list(get_loader(dataset, watchdog_timeout_seconds=None))


# -- 1. released dependencies only ------------------------------------------------------------


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text()))


def _requirements(pyproject: dict[str, Any]) -> list[str]:
    project = pyproject["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    for group in pyproject.get("dependency-groups", {}).values():
        reqs += [r for r in group if isinstance(r, str)]
    reqs += pyproject.get("build-system", {}).get("requires", [])
    return reqs


def test_lesson1_dependencies_are_released_versions_with_committed_locks() -> None:
    reqs = _requirements(_pyproject())
    assert any(r.startswith("megatron-energon") for r in reqs)
    bad = [r for r in reqs if re.search(r"(@|git\+|https?://|file:|\.\./)", r)]
    assert bad == [], f"unreleased (git/url/path) dependencies: {bad}"
    for cargo in [ROOT / "Cargo.toml", *ROOT.glob("rust/*/Cargo.toml")]:
        text = cargo.read_text()
        assert not re.search(r"\bgit\s*=", text), f"git dependency in {cargo}"
        assert not re.search(r"\bbranch\s*=|\brev\s*=", text), f"branch/rev pin in {cargo}"
    assert (ROOT / "Cargo.lock").is_file()


# -- 2. no personal scratch configs ---------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_lesson2_example_configs_are_generic(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"(^|[\s:'\"])(/|~/|[A-Za-z]:\\)[\w.-]+/", text, re.M), "machine path"
    assert not re.search(r"(?i)\b(debug|run_name|wandb|token|secret|password)\b\s*:", text)
    PackingEncoderConfig.from_yaml(path)


# -- 3. restore-seeded hooks run in CI, outside a loader ------------------------------------------


class RandomDropEncoder(PackingTaskEncoder):
    """An augmentation that uses randomness: only from restore_seeds=True."""

    @stateless_with_tolerance(restore_seeds=True)
    def preencode_sample(self, sample: Any) -> Any:
        import random

        encoded = super().preencode_sample(sample)
        keep = random.randint(1, len(encoded.token_ids))
        return type(encoded).derive_from(
            encoded,
            token_ids=encoded.token_ids[:keep],
            loss_mask=encoded.loss_mask,
            message_lengths=encoded.message_lengths,
            message_roles=encoded.message_roles,
            media=encoded.media,
            media_units=encoded.media_units,
        )


def test_lesson3_restore_seeded_hooks_run_from_a_worker_fixture(
    tokenizer: Any, worker: Any
) -> None:
    enc = make_encoder(tokenizer, RandomDropEncoder)
    raw = {
        "__key__": "k",
        "__restore_key__": ("t", 0),
        "json": b'{"messages": [{"role": "user", "content": "kaka mimi lolo"}, '
        b'{"role": "assistant", "content": "lolo kaka mimi nene susu"}]}',
    }
    conv = cook_generic(raw)
    first = [len(enc.preencode_sample(conv).token_ids) for _ in range(3)]
    assert len(set(first)) == 1, "same sample index -> same randomness"
    lengths = set()
    for index in range(8):
        worker.worker_push_sample_index(index)
        try:
            lengths.add(len(enc.preencode_sample(conv).token_ids))
        finally:
            worker.worker_pop_sample_index()
    assert len(lengths) > 1, "the seed follows the sample index"


# -- 4. a broken dataset stops; finite tolerance ---------------------------------------------------


@pytest.fixture(scope="module")
def broken_dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("all-broken"),
        40,
        formats=("generic",),
        shards_per_format=2,
        image_fraction=0.0,
        all_fates="broken",
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_lesson4_all_broken_dataset_stops(
    broken_dataset: Any, tokenizer: Any, workers: int
) -> None:
    enc = make_encoder(tokenizer)
    with pytest.raises(FatalSampleError, match="failed 100 times in a row"):
        iterate(broken_dataset.metadataset, enc, workers, repeat=True)
    assert enc.stats.snapshot()["failed"] >= 100


def test_lesson4_zero_failure_tolerance_is_rejected_with_an_explanation() -> None:
    with pytest.raises(EnergonConfigError, match="Energon reads 0 as 'never stop'"):
        PackingEncoderConfig(failure_tolerance=0)
    with pytest.raises(EnergonConfigError, match="never stop"):
        stateless_with_tolerance(failure_tolerance=0)


def _wrappers(dataset: Any) -> Iterator[Any]:
    stack, seen = [dataset], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        inner = node.__dict__.get("datasets") or (
            [node.__dict__["dataset"]] if "dataset" in node.__dict__ else []
        )
        stack.extend(x[0] if isinstance(x, tuple) else x for x in inner)


def test_lesson4_every_failure_counter_of_the_pipeline_is_finite(
    broken_dataset: Any, tokenizer: Any
) -> None:
    """Tolerance 0 also disabled the packing loop's stop in the reviewed loader; here every
    error context Energon builds for the task encoder (cooker, encode, pre-packer, sample
    encoder, final packer, batch) gets the configured finite tolerance."""
    enc = make_encoder(tokenizer, failure_tolerance=37)
    dataset = get_train_dataset(
        str(broken_dataset.metadataset),
        worker_config=make_worker_config(enc, num_workers=0),
        **enc.dataset_options(),
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=enc,
    )
    contexts = {}
    for node in _wrappers(dataset):
        for name, value in vars(node).items():
            if type(value).__name__ == "ErrorContext":
                contexts[f"{type(node).__name__}.{name}: {value.name}"] = value.tolerance
    ours = {k: v for k, v in contexts.items() if "_load_sample_raw" not in k}
    assert all(v > 0 for v in contexts.values()), contexts  # Energon's raw reader: its own 100
    assert len(ours) >= 7 and set(ours.values()) == {37}, ours
    assert any("pre_packer" in k.lower() or "select_samples_to_pack" in k for k in ours), ours
    assert any("cook_crude_sample" in k for k in ours), ours


def test_lesson4_few_broken_samples_train_on_the_rest_and_are_counted(
    tmp_path: Path, tokenizer: Any
) -> None:
    ds = write_synthetic_dataset(
        tmp_path, 60, formats=("generic",), shards_per_format=1, broken_every=10, skip_every=0
    )
    enc = make_encoder(tokenizer, capacity=2048)
    batches = iterate(ds.metadataset, enc, 0, repeat=False)
    delivered = [k for b in batches for k in b.sample_keys]
    stats = enc.stats.snapshot()
    assert sorted(delivered) == sorted(ds.keys_with("ok"))
    assert stats["failed"] == len(ds.keys_with("broken:")) == 6
    assert len(delivered) + stats["failed"] + stats["skipped_total"] == 60


def test_stateless_restore_seeds_keeps_failure_tolerance(tmp_path: Path, tokenizer: Any) -> None:
    """Energon's bug: @stateless(restore_seeds=True, failure_tolerance=N) ignores N."""

    def f(self: Any, x: Any) -> Any:
        return x

    assert get_failure_tolerance(stateless(restore_seeds=True, failure_tolerance=5)(f), 100) == 100
    fixed = stateless_with_tolerance(restore_seeds=True, failure_tolerance=5)(f)
    assert get_failure_tolerance(fixed, 100) == 5
    assert get_stateless(fixed)

    class AlwaysFails(PackingTaskEncoder):
        @stateless_with_tolerance(restore_seeds=True, failure_tolerance=5)
        def preencode_sample(self, sample: Any) -> Any:
            raise ValueError(f"cannot encode {sample.__key__}")

    ds = write_synthetic_dataset(
        tmp_path, 12, formats=("generic",), shards_per_format=1, broken_every=0, skip_every=0
    )
    enc = make_encoder(tokenizer, AlwaysFails)
    with pytest.raises(FatalSampleError, match="failed 5 times in a row"):
        iterate(ds.metadataset, enc, 0, repeat=True)
    assert enc.stats.snapshot()["failed"] == 5


# -- 5. a modality the run needs must be fully configured at construction ------------------------


def test_lesson5_audio_without_its_three_settings_is_refused_at_construction(
    tokenizer: Any,
) -> None:
    cfg = PackingEncoderConfig(modalities=("image", "audio"))
    with pytest.raises(ModalityConfigError) as info:
        PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})
    message = str(info.value)
    for setting in ("audio_sampling_rate", "audio_hop_length", "audio_downsample_factor"):
        assert setting in message
    assert (
        "resample rate" in message and "window step" in message and "downsampling factor" in message
    )
    with pytest.raises(ModalityConfigError) as partial:
        PackingTaskEncoder(
            cfg, tokenizer=tokenizer, processor={"patch_size": 16, "sampling_rate": 16000}
        )
    assert "audio_sampling_rate" not in str(partial.value)
    assert "audio_hop_length" in str(partial.value) and "audio_downsample_factor" in str(
        partial.value
    )


# -- 6. media stays lazy ---------------------------------------------------------------------------


def test_lesson6_media_is_not_decoded_before_selection_nor_for_skipped_samples(
    tokenizer: Any, worker: Any
) -> None:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(buf, "PNG")

    def raw(key: str, ending: str) -> dict[str, Any]:
        msgs = [
            {"role": "user", "content": "<image> kaka"},
            {"role": "assistant", "content": "lolo"},
        ]
        if ending == "user":
            msgs.append({"role": "user", "content": "mimi"})
        body = {
            "messages": msgs,
            "media": [
                {"name": "a.png", "width": 32, "height": 32},
                {"name": "b.png", "width": 32, "height": 32},
            ],
        }
        import json

        return {
            "__key__": key,
            "__restore_key__": ("t", key),
            "__shard__": "s",
            "json": json.dumps(body).encode(),
            "a.png": buf.getvalue(),
            "b.png": buf.getvalue(),
        }

    MEDIA_LOG.clear()
    enc = make_encoder(tokenizer)
    good = enc.preencode_sample(cook_generic(raw("good", "assistant")))
    with pytest.raises(SkipSample):
        enc.preencode_sample(cook_generic(raw("skipped", "user")))
    assert MEDIA_LOG.decodes == [] and MEDIA_LOG.reads == []
    (group,) = enc.select_samples_to_pack([good])
    enc.pack_selected_samples([enc.postencode_sample(s) for s in group])
    assert MEDIA_LOG.decodes == ["s/good/a.png"]  # b.png is in the manifest but never used


# -- 7. a conversation ending on a user turn -------------------------------------------------------


def test_lesson7_conversation_ending_on_user_turn_is_skipped_not_indexerror(
    tokenizer: Any, worker: Any
) -> None:
    enc = make_encoder(tokenizer)
    raw = {
        "__key__": "ends-on-user",
        "__restore_key__": ("t", 1),
        "json": b'{"messages": [{"role": "user", "content": "kaka"}, {"role": "assistant", '
        b'"content": "lolo"}, {"role": "user", "content": "mimi"}]}',
    }
    with pytest.raises(SkipSample, match="ends_on_user_turn"):
        enc.preencode_sample(cook_generic(raw))
    assert enc.stats.snapshot()["skipped"]["ends_on_user_turn"] == 1
    # token-level turn markers: an odd count is a typed error naming the sample
    from mmpack.masks import turn_spans

    with pytest.raises(TurnStructureError, match="ends-on-user"):
        turn_spans([3, 10, 4, 11, 3, 12], [3, 4], sample_id="ends-on-user")


@pytest.fixture(scope="module")
def skipped_dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("all-skipped"),
        30,
        formats=("generic", "fragments"),
        shards_per_format=2,
        all_fates="skip",
        capacity=512,
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_lesson7_all_skipped_dataset_stops_with_a_clear_error(
    skipped_dataset: Any, tokenizer: Any, workers: int
) -> None:
    enc = make_encoder(tokenizer, max_consecutive_skips=300, loss_mask_mode="precomputed")
    with pytest.raises(
        FatalSampleError, match=r"300 consecutive samples were skipped by policy \("
    ):
        iterate(skipped_dataset.metadataset, enc, workers, repeat=True)
    stats = enc.stats.snapshot()
    assert stats["skipped_total"] >= 300
    assert stats["packed"] == 0


# -- 8. every shipped config loads; retired fields name their replacement ------------------------


def test_lesson8_every_shipped_config_loads_and_retired_fields_name_replacements(
    tokenizer: Any,
) -> None:
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert paths
    for path in paths:
        PackingTaskEncoder(
            PackingEncoderConfig.from_yaml(path), tokenizer=tokenizer, processor={"patch_size": 16}
        )
    with pytest.raises(EnergonConfigError, match="'max_seq_length' was retired; use capacity"):
        PackingEncoderConfig.from_dict({"max_seq_length": 4096})


# -- 9. a missing optional dependency is detected at startup, naming the extra ---------------------


def test_lesson9_missing_audio_dependency_names_the_extra(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = validation.importlib.util.find_spec

    def fake_find_spec(name: str, *args: Any) -> Any:
        return None if name in ("librosa", "soxr") else real(name, *args)

    monkeypatch.setattr(validation.importlib.util, "find_spec", fake_find_spec)
    cfg = PackingEncoderConfig(modalities=("image", "audio"))
    with pytest.raises(ImportError, match=re.escape("pip install 'mmpack[audio]'")):
        PackingTaskEncoder(cfg, tokenizer=tokenizer, processor=AUDIO_OK)
    assert "librosa" not in sys.modules or sys.modules["librosa"] is not None


def test_lesson9_audio_extra_is_declared() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    names = collections.Counter(re.split(r"[<>=!~ \[]", r)[0] for r in extras["audio"])
    assert names["librosa"] == 1 and names["soxr"] == 1


def test_lesson4_subclass_hooks_must_stay_stateless_and_finite(tokenizer: Any) -> None:
    class NotStateless(PackingTaskEncoder):
        def preencode_sample(self, sample: Any) -> Any:  # no @stateless: breaks resume
            return super().preencode_sample(sample)

    with pytest.raises(EnergonConfigError, match="preencode_sample is not @stateless"):
        make_encoder(tokenizer, NotStateless)

    class NeverStops(PackingTaskEncoder):
        @stateless(failure_tolerance=0)
        def pack_selected_samples(self, samples: Any) -> Any:
            return super().pack_selected_samples(samples)

    with pytest.raises(EnergonConfigError, match="pack_selected_samples has failure_tolerance=0"):
        make_encoder(tokenizer, NeverStops)
