"""What `PackingTaskEncoder` refuses at construction, before any sample is read: a modality the
run needs that the processor does not fully configure, and a missing optional dependency (named
with the extra that installs it)."""

from __future__ import annotations

import re
import sys
from typing import Any

import mmpack.energon.validation as validation
import pytest
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.errors import ModalityConfigError

AUDIO_OK = {"patch_size": 16, "sampling_rate": 16000, "hop_length": 160, "downsample_factor": 4}


def test_audio_without_its_three_settings_is_refused_at_construction(
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


def test_missing_audio_dependency_names_the_extra(
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
