"""Startup validation: every configured modality must be fully supported by the processor (a
model's Hugging Face processor, whose settings are read from it and which is run once on a
probe item per modality, or a mapping of settings for mmpack's own patchifier), its optional
dependencies must be importable, and the tokenizer must be able to encode conversations (its
chat template renders a probe conversation with every configured modality, or it carries the
markup's tokens). Runs when the task encoder is constructed, before any sample is read, so a
run never starts that would drop or fail every sample of a modality one by one, or die on a
missing module mid-training."""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Iterable, Mapping
from typing import Any

from mmpack.batch import templates
from mmpack.energon.markup import special_token_ids
from mmpack.energon.media import MediaSettings
from mmpack.energon.processors import ModelProcessor, is_model_processor
from mmpack.errors import EnergonConfigError, ModalityConfigError

__all__ = [
    "MODALITY_EXTRAS",
    "check_model_processor",
    "check_optional_dependencies",
    "resolve_conversation_format",
    "resolve_media_settings",
    "resolve_processor",
]

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
    "video": ("video", ("av", "torchvision")),
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


def check_model_processor(processor: ModelProcessor, modalities: Iterable[str]) -> None:
    """A model's processor must handle every configured modality (`ModalityConfigError`
    otherwise, e.g. a text-only processor with audio configured), and each is probed once
    through the real processor (`ModelProcessor.probe`)."""
    modalities = tuple(modalities)
    processor.check_modalities(modalities)
    check_optional_dependencies(modalities)
    processor.probe(modalities)


def resolve_processor(
    processor: Any, modalities: Iterable[str], *, media_capacity: int | None
) -> tuple[ModelProcessor | None, MediaSettings]:
    """The media side of a task encoder's `processor`: a model's Hugging Face processor becomes
    a `ModelProcessor`, checked and probed (`check_model_processor`; with `media_capacity`, its
    family must have a media unit rule), with default media settings; anything else (an object
    or mapping of patchifier settings, or None) gives no model processor and the settings read
    from it (`resolve_media_settings`), whose modalities' dependencies must be importable."""
    modalities = tuple(modalities)
    if is_model_processor(processor):
        model_processor = ModelProcessor(processor)
        check_model_processor(model_processor, modalities)
        if media_capacity is not None:
            model_processor.require_unit_rule()
        return model_processor, MediaSettings()
    settings = resolve_media_settings(processor, modalities)
    check_optional_dependencies(modalities)
    return None, settings


def resolve_conversation_format(
    requested: str,
    tokenizer: Any,
    modalities: Iterable[str],
    *,
    model_processor: bool,
    processor: Any = None,
) -> str:
    """``"chat_template"`` or ``"markup"`` for the configured `requested` format (see
    `PackingEncoderConfig.conversation_format`); raises `EnergonConfigError` when the tokenizer
    cannot encode conversations that way. A template on the model's `processor` counts as the
    tokenizer's."""
    if tokenizer is None:
        return requested
    templated = templates.template_text(tokenizer, processor) is not None
    if requested == "chat_template" and not templated:
        raise EnergonConfigError(
            f"conversation_format is 'chat_template' but the tokenizer "
            f"{type(tokenizer).__name__} has no chat template (set tokenizer.chat_template)"
        )
    if requested == "markup" or (requested == "auto" and not templated):
        if model_processor:
            raise EnergonConfigError(
                "a model's processor needs the tokenizer's chat template (its placeholders "
                "are the model's own tokens), but "
                + (
                    "conversation_format is 'markup'"
                    if requested == "markup"
                    else f"the tokenizer {type(tokenizer).__name__} has no chat template"
                )
            )
        if requested == "auto":
            try:
                special_token_ids(tokenizer, modalities)
            except EnergonConfigError as err:
                raise EnergonConfigError(
                    f"the tokenizer {type(tokenizer).__name__} has no chat template, and "
                    f"mmpack's markup does not fit it ({err}). Set tokenizer.chat_template to "
                    "the model's template, or add the markup's tokens and set "
                    "conversation_format: markup"
                ) from None
        return "markup"
    return "chat_template"


def resolve_media_settings(processor: Any, modalities: Iterable[str]) -> MediaSettings:
    """Read the settings each modality needs from `processor` (an object or a mapping; nested
    ``image_processor`` / ``feature_extractor`` are searched too). Raises `ModalityConfigError`
    naming every missing or invalid setting, and a mapping's first unknown setting name."""
    modalities = tuple(modalities)
    if isinstance(processor, Mapping):
        _check_setting_names(processor, "processor")
    found: dict[str, int] = {}
    problems: list[str] = []
    for modality in modalities:
        table = _SETTINGS.get(modality)
        if table is None and modality == "video":
            problems.append(
                "modality 'video' needs a model's Hugging Face processor with a video processor "
                "(mmpack's own patchifier has none)"
            )
            continue
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


def _check_setting_names(settings: Mapping[Any, Any], where: str) -> None:
    """A mapping of patchifier settings holds only names mmpack reads (and the nested
    sub-processor mappings); anything else is a typo that would leave a default in force."""
    known = sorted(
        {n for table in _SETTINGS.values() for _, names in table.values() for n in names}
    )
    for name, value in settings.items():
        if name in _SUB_OBJECTS and where == "processor":
            if isinstance(value, Mapping):
                _check_setting_names(value, f"processor[{name!r}]")
            continue
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ModalityConfigError(
                f"{where}: unknown setting {name!r}{hint}; mmpack's own media processing reads "
                f"{', '.join(known)} (and the nested {', '.join(_SUB_OBJECTS)})"
            )


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


def check_chat_template(encode: Any, modalities: Iterable[str]) -> None:
    """Encode a probe conversation (a user turn with one item of each configured modality,
    sizes declared so nothing is read, and an assistant answer) with `encode`, so a template
    that cannot be mapped onto messages and parts stops the run at construction."""
    from mmpack.energon.media import MediaHandle
    from mmpack.energon.samples import Conversation, Part, Turn

    meta: dict[str, dict[str, Any]] = {
        "image": {"width": 56, "height": 56},
        "video": {"frames": 2, "width": 56, "height": 56},
        "audio": {"duration": 0.5},
    }
    parts = [
        Part(
            media=MediaHandle(
                kind=kind,
                key=f"probe.{kind}",
                sample_key="startup-probe",
                source=("startup-probe", kind),
                data=b"",
                meta=meta.get(kind, {}),
            )
        )
        for kind in modalities
    ]
    probe = Conversation(
        __key__="startup-probe",
        __restore_key__=(),
        __subflavors__=None,
        __sources__=(),
        source_format="probe",
        turns=[
            Turn("user", (*parts, Part(text="hello"))),
            Turn("assistant", (Part(text="hello"),)),
        ],
    )
    try:
        encode(probe)
    except (EnergonConfigError, ModalityConfigError):
        raise
    except Exception as err:
        raise EnergonConfigError(
            f"the tokenizer's chat template cannot encode a probe conversation with "
            f"{list(modalities) or 'text only'}: {type(err).__name__}: {err}"
        ) from err
