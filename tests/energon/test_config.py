"""PackingEncoderConfig, startup validation and the shipped example configs (no loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mmpack.energon import (
    KNOWN_ROLES,
    RENAMED_FIELDS,
    RETIRED_FIELDS,
    PackingEncoderConfig,
    PackingTaskEncoder,
    resolve_media_settings,
)
from mmpack.errors import EnergonConfigError, MmpackError, ModalityConfigError
from reference.energon import ReferencePackingTaskEncoder
from reference.errors import EnergonConfigError as RefConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_defaults_are_finite_and_valid() -> None:
    cfg = PackingEncoderConfig()
    assert cfg.failure_tolerance == 100
    assert cfg.max_consecutive_skips >= 1
    assert cfg.loss_mask_mode is None
    assert PackingEncoderConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_field_suggests_the_closest_name() -> None:
    with pytest.raises(
        EnergonConfigError, match=r"unknown field 'capacty' \(did you mean 'capacity'\?\)"
    ):
        PackingEncoderConfig.from_dict({"capacty": 10})


def test_unknown_constructor_keyword_is_a_typed_error_with_a_hint() -> None:
    with pytest.raises(
        EnergonConfigError, match=r"unknown field 'capacty' \(did you mean 'capacity'\?\)"
    ):
        PackingEncoderConfig(capacty=10)  # type: ignore[call-arg]
    with pytest.raises(EnergonConfigError, match=r"field 'seq_length' was retired"):
        PackingEncoderConfig(seq_length=10)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("field", "replacement"),
    [
        ("max_seq_length", "capacity"),
        ("packing_buffer", "packing_buffer_size"),
        ("model_family", "loss_mask_mode"),
    ],
)
def test_retired_field_names_its_replacement(field: str, replacement: str) -> None:
    with pytest.raises(
        EnergonConfigError, match=rf"field '{field}' was retired; use .*{replacement}"
    ):
        PackingEncoderConfig.from_dict({field: 1})


def test_packing_limits_use_the_packers_names() -> None:
    names = PackingEncoderConfig.field_names()
    assert "max_items_per_bin" in names and "media_capacity" in names
    assert "max_samples_per_pack" not in names and "media_budget" not in names
    assert not set(RETIRED_FIELDS) & set(names)
    assert RENAMED_FIELDS == {
        "max_samples_per_pack": "max_items_per_bin",
        "media_budget": "media_capacity",
    }


RENAMED = [("max_samples_per_pack", "max_items_per_bin"), ("media_budget", "media_capacity")]


@pytest.mark.parametrize(("old", "new"), RENAMED)
def test_deprecated_names_still_work_with_a_warning_naming_the_new_field(
    old: str, new: str, tmp_path: Path
) -> None:
    want = PackingEncoderConfig(**{new: 7})
    assert getattr(want, new) == 7
    match = rf"'{old}' is deprecated; use '{new}'"
    with pytest.warns(DeprecationWarning, match=match):
        assert PackingEncoderConfig(**{old: 7}) == want
    with pytest.warns(DeprecationWarning, match=match):
        assert PackingEncoderConfig.from_dict({old: 7}) == want
    path = tmp_path / "old.yaml"
    path.write_text(f"capacity: 2048\n{old}: 7\n")
    with pytest.warns(DeprecationWarning, match=rf"old\.yaml: .*{match}"):
        assert PackingEncoderConfig.from_yaml(path) == want
    with pytest.warns(DeprecationWarning, match=match):
        assert PackingEncoderConfig().replace(**{old: 7}) == want
    with pytest.warns(DeprecationWarning, match=match):
        assert getattr(want, old) == 7
    # the value is validated like the new field's
    with pytest.warns(DeprecationWarning), pytest.raises(EnergonConfigError, match=new):
        PackingEncoderConfig.from_dict({old: 0})
    # both names at once: which one wins would be a guess
    with pytest.warns(DeprecationWarning), pytest.raises(EnergonConfigError, match="give only"):
        PackingEncoderConfig.from_dict({old: 7, new: 8})
    with pytest.warns(DeprecationWarning), pytest.raises(EnergonConfigError, match="give only"):
        PackingEncoderConfig(**{old: 7, new: 8})


def test_new_names_warn_nowhere(recwarn: pytest.WarningsRecorder) -> None:
    cfg = PackingEncoderConfig(max_items_per_bin=3, media_capacity=9)
    again = PackingEncoderConfig.from_dict(cfg.to_dict()).replace(capacity=4096)
    assert (again.max_items_per_bin, again.media_capacity, again.capacity) == (3, 9, 4096)
    assert len(recwarn) == 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"capacity": 0}, "capacity must be a positive integer"),
        ({"capacity": 1.5}, "capacity must be a positive integer"),
        ({"packing_buffer_size": True}, "packing_buffer_size must be a positive integer"),
        ({"loss_mask_mode": "roles"}, "loss_mask_mode must be None"),
        ({"on_oversize": "drop"}, "on_oversize must be one of"),
        ({"modalities": ["depth"]}, "unknown modality 'depth'"),
        ({"modalities": "image"}, "modalities must be a list"),
        ({"train_roles": []}, "train_roles must be a non-empty list"),
        ({"max_consecutive_skips": 0}, "Energon hangs silently"),
        ({"failure_tolerance": -3}, "failure_tolerance must be a positive integer"),
    ],
)
def test_invalid_values_are_typed_errors(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(EnergonConfigError, match=message) as info:
        PackingEncoderConfig().replace(**changes)
    assert isinstance(info.value, MmpackError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        (["asistant"], r"unknown role 'asistant' \(did you mean 'assistant'\?\)"),
        (["Assistant"], "unknown role 'Assistant'.*case-sensitive"),
        (["assistant", "gpt"], "unknown role 'gpt'"),
        (["<template-markup>"], "unknown role '<template-markup>'"),
    ],
)
def test_an_unknown_train_role_is_refused_by_name(roles: list[str], message: str) -> None:
    # a typo would otherwise train on nothing: every sample skipped as having no trainable token
    with pytest.raises(EnergonConfigError, match=message):
        PackingEncoderConfig(train_roles=roles)
    with pytest.raises(EnergonConfigError, match=r"my\.yaml: train_roles: unknown role"):
        PackingEncoderConfig.from_dict({"train_roles": roles}, source="my.yaml")
    assert PackingEncoderConfig(train_roles=["assistant", "tool"]).train_roles == (
        "assistant",
        "tool",
    )
    assert PackingEncoderConfig(train_roles=list(KNOWN_ROLES)).train_roles == KNOWN_ROLES


def test_the_markup_refuses_a_role_it_has_no_marker_for(tokenizer: Any) -> None:
    cfg = PackingEncoderConfig(train_roles=["assistant", "tool"], conversation_format="markup")
    with pytest.raises(EnergonConfigError, match=r"train_roles \['tool'\]: mmpack's markup"):
        PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})


@pytest.mark.parametrize(
    ("processor", "bad"),
    [
        ({"patch_size": 16, "patch_sz": 8}, r"'patch_sz' \(did you mean 'patch_size'\?\)"),
        ({"patch_size": 16, "sampling_rat": 16000}, "'sampling_rat'"),
        ({"image_processor": {"patch_size": 16, "merge": 2}}, r"processor\['image_processor'\]"),
    ],
)
def test_an_unknown_processor_setting_is_refused_by_name(
    tokenizer: Any, processor: dict[str, Any], bad: str
) -> None:
    # a misspelt setting would leave the default in force without a word
    with pytest.raises(ModalityConfigError, match=rf"unknown setting.*{bad}|{bad}.*unknown"):
        PackingTaskEncoder(PackingEncoderConfig(), tokenizer=tokenizer, processor=processor)
    with pytest.raises(ModalityConfigError, match="unknown setting"):
        resolve_media_settings(processor, ["image"])


def test_from_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("capacity: 128\nseq_length: 4096\n")
    with pytest.raises(EnergonConfigError, match=r"bad\.yaml: field 'seq_length' was retired"):
        PackingEncoderConfig.from_yaml(path)
    path.write_text("")
    assert PackingEncoderConfig.from_yaml(path) == PackingEncoderConfig()


def test_example_configs_exist() -> None:
    assert len(sorted(EXAMPLES.glob("*.yaml"))) >= 3


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_builds_an_encoder(path: Path, tokenizer: Any) -> None:
    cfg = PackingEncoderConfig.from_yaml(path)
    encoder = PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})
    assert encoder.config == cfg
    assert encoder.__default_failure_tolerance__ == cfg.failure_tolerance > 0


def test_encoder_rejects_invalid_packing_options_at_construction(tokenizer: Any) -> None:
    cfg = PackingEncoderConfig(algorithm="no_such_algorithm")
    with pytest.raises(EnergonConfigError, match="packing options rejected"):
        PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})


@pytest.mark.parametrize("ignore_index", [0, 5])
def test_encoder_rejects_an_ignore_index_that_is_a_token_id(
    tokenizer: Any, ignore_index: int
) -> None:
    cfg = PackingEncoderConfig(ignore_index=ignore_index)
    with pytest.raises(EnergonConfigError, match=rf"ignore_index={ignore_index} is a valid token"):
        PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})
    beyond = cfg.replace(ignore_index=len(tokenizer))
    encoder = PackingTaskEncoder(beyond, tokenizer=tokenizer, processor={"patch_size": 16})
    assert encoder.config.ignore_index == len(tokenizer)


def test_encoder_rejects_a_plain_dict_config(tokenizer: Any) -> None:
    with pytest.raises(EnergonConfigError, match=r"PackingEncoderConfig\.from_dict"):
        PackingTaskEncoder({"capacity": 8}, tokenizer=tokenizer)  # type: ignore[arg-type]


def test_tokenizer_without_special_tokens_is_refused(tokenizer: Any) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    )
    with pytest.raises(EnergonConfigError, match=r"lacks the special tokens .*<\|user\|>"):
        PackingTaskEncoder(PackingEncoderConfig(), tokenizer=bare, processor={"patch_size": 16})


def test_reference_encoder_refuses_what_it_does_not_implement(tokenizer: Any) -> None:
    cfg = PackingEncoderConfig(algorithm="first_fit_decreasing", media_capacity=100)
    with pytest.raises(RefConfigError, match="reference packer"):
        ReferencePackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})
    # the default algorithm is mmpack's own: the reference cannot run it, and says so
    with pytest.raises(RefConfigError, match=r"only NeMo-RL's .*'best_fit_decreasing' is not"):
        ReferencePackingTaskEncoder(
            PackingEncoderConfig(), tokenizer=tokenizer, processor={"patch_size": 16}
        )
    with pytest.raises(RefConfigError, match=r"only NeMo-RL's .*'no_such_algorithm' is not"):
        ReferencePackingTaskEncoder(
            PackingEncoderConfig(algorithm="no_such_algorithm"),
            tokenizer=tokenizer,
            processor={"patch_size": 16},
        )
    # aliases resolve as in mmpack.packing.pack
    encoder = ReferencePackingTaskEncoder(
        PackingEncoderConfig(algorithm="ffd"), tokenizer=tokenizer, processor={"patch_size": 16}
    )
    assert encoder.plan([3, 5, 2]) == [[1, 0, 2]]  # first fit, longest first


def test_the_package_has_no_reference_switch(tokenizer: Any) -> None:
    # the comparison implementations live in the test suite and come in as subclasses
    with pytest.raises(TypeError, match="backend"):
        PackingTaskEncoder(  # type: ignore[call-arg]
            PackingEncoderConfig(),
            tokenizer=tokenizer,
            processor={"patch_size": 16},
            backend="reference",
        )


def test_image_settings_are_found_on_nested_processors() -> None:
    class ImageProcessor:
        def __init__(self) -> None:
            self.patch_size = {"height": 14, "width": 14}

    class Processor:
        image_processor = ImageProcessor()

    assert resolve_media_settings(Processor(), ["image"]).image_patch_size == 14
    with pytest.raises(ModalityConfigError, match="image_patch_size"):
        resolve_media_settings({"patch_size": 0}, ["image"])
    with pytest.raises(ModalityConfigError, match="image_patch_size"):
        resolve_media_settings(None, ["image"])


def test_missing_energon_names_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['megatron.energon'] = None\n"
        "try:\n    import mmpack.energon\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'mmpack[energon]'" in out.stdout, out.stdout + out.stderr


def test_a_bad_precomputed_mask_fails_only_its_own_sample(tokenizer: Any) -> None:
    # validated in preencode_sample: found later by the batch builder, it would fail the whole
    # pack the sample was selected into
    from mmpack.energon import EncodedConversation, cook_generic
    from mmpack.errors import LossMaskError

    class TwoInMask(PackingTaskEncoder):
        def encode_conversation(self, conversation: Any) -> EncodedConversation:
            encoded = super().encode_conversation(conversation)
            assert encoded.loss_mask is not None
            encoded.loss_mask[-1] = 2
            return encoded

    encoder = TwoInMask(
        PackingEncoderConfig(loss_mask_mode="precomputed"),
        tokenizer=tokenizer,
        processor={"patch_size": 16},
    )
    raw = {
        "__key__": "bad-mask",
        "__restore_key__": ("t", 1),
        "json": b'{"messages": [{"role": "user", "content": "kaka"}, {"role": "assistant", '
        b'"content": "lolo"}]}',
    }
    with pytest.raises(LossMaskError, match=r"sample 'bad-mask' has value 2 at position \d+"):
        encoder.preencode_sample(cook_generic(raw))
