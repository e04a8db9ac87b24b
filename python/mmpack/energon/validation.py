"""Startup validation: every configured modality must be fully supported by the processor /
feature-extractor settings, and its optional dependencies must be importable. Runs when the task
encoder is constructed, before any sample is read, so a run never starts that would drop or fail
every sample of a modality one by one, or die on a missing module mid-training."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from typing import Any

from mmpack.energon.media import MediaSettings
from mmpack.errors import ModalityConfigError

__all__ = ["MODALITY_EXTRAS", "check_optional_dependencies", "resolve_media_settings"]

#: setting -> (description, accepted names on the processor or its image processor /
#: feature extractor)
_IMAGE_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "image_patch_size": ("patch size", ("patch_size", "image_patch_size"))
}
_AUDIO_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "audio_sampling_rate": ("resample rate", ("sampling_rate", "resample_rate", "sample_rate")),
    "audio_hop_length": ("window step", ("hop_length", "window_step", "stride")),
    "audio_downsample_factor": (
        "downsampling factor",
        ("downsample_factor", "downsampling_factor", "audio_downsample_factor"),
    ),
}
_SETTINGS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "image": _IMAGE_SETTINGS,
    "audio": _AUDIO_SETTINGS,
}

#: modality -> (extra name, importable modules it needs)
MODALITY_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "image": ("energon", ("PIL",)),
    "audio": ("audio", ("librosa", "soxr", "soundfile")),
}

_SUB_OBJECTS = ("image_processor", "feature_extractor", "audio_processor")


def _lookup(processor: Any, names: Iterable[str]) -> Any:
    holders = [processor]
    for sub in _SUB_OBJECTS:
        inner = _get(processor, sub)
        if inner is not None:
            holders.append(inner)
    for holder in holders:
        for name in names:
            value = _get(holder, name)
            if value is not None:
                if isinstance(value, Mapping):  # HF-style {"height": 14, "width": 14}
                    sizes = {v for v in value.values() if isinstance(v, int)}
                    value = sizes.pop() if len(sizes) == 1 else None
                if value is not None:
                    return value
    return None


def _get(holder: Any, name: str) -> Any:
    if holder is None:
        return None
    if isinstance(holder, Mapping):
        return holder.get(name)
    return getattr(holder, name, None)


def resolve_media_settings(processor: Any, modalities: Iterable[str]) -> MediaSettings:
    """Read the settings each modality needs from `processor` (an object or a mapping; nested
    ``image_processor`` / ``feature_extractor`` are searched too). Raises `ModalityConfigError`
    naming every missing or invalid setting."""
    modalities = tuple(modalities)
    found: dict[str, int] = {}
    problems: list[str] = []
    for modality in modalities:
        table = _SETTINGS.get(modality)
        if table is None:
            problems.append(f"unknown modality {modality!r}")
            continue
        missing = []
        for field, (label, names) in table.items():
            value = _lookup(processor, names) if processor is not None else None
            if value is None:
                missing.append(f"{field} ({label}; one of {', '.join(names)})")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                missing.append(f"{field} ({label}) must be a positive integer, got {value!r}")
            else:
                found[field] = int(value)
        if missing:
            problems.append(
                f"modality {modality!r} is not fully configured by the processor: missing "
                + "; ".join(missing)
            )
    if problems:
        raise ModalityConfigError(
            "; ".join(problems)
            + ". Refusing to start: samples needing this modality would otherwise fail or be "
            "dropped one by one during training."
        )
    return MediaSettings(**found)


def check_optional_dependencies(modalities: Iterable[str]) -> None:
    """Raise ImportError naming the extra to install when a modality's dependencies are missing."""
    for modality in modalities:
        extra, modules = MODALITY_EXTRAS.get(modality, ("", ()))
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(
                f"modality {modality!r} needs {', '.join(missing)}, which is not installed; "
                f"install the extra: pip install 'mmpack[{extra}]'"
            )
