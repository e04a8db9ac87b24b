"""One media item through a Hugging Face processor: which sub-processor, placeholder token and
keywords each media kind uses (`KINDS`), the call itself, and the split of its output into the
text's token ids and the item's tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmpack.energon.processors.video import VideoFrames

__all__ = [
    "KINDS",
    "MediaKind",
    "call_processor",
    "component",
    "kind_kwargs",
    "placeholder_token",
]


@dataclasses.dataclass(frozen=True)
class MediaKind:
    """How a processor names one media kind."""

    components: tuple[str, ...]  # attribute names of the sub-processor, first found wins
    token_attr: str  # placeholder token attribute of the processor
    call_arg: str  # keyword of the processor's __call__
    sizes_arg: str  # keyword of _get_num_multimodal_tokens
    count_key: str  # field of its MultiModalData
    kwargs_key: str  # the per-kind keyword dict of the call (``images_kwargs``, ...)


#: media kind -> how the processor names it
KINDS: dict[str, MediaKind] = {
    "image": MediaKind(
        ("image_processor",),
        "image_token",
        "images",
        "image_sizes",
        "num_image_tokens",
        "images_kwargs",
    ),
    "video": MediaKind(
        ("video_processor",),
        "video_token",
        "videos",
        "video_sizes",
        "num_video_tokens",
        "videos_kwargs",
    ),
    "audio": MediaKind(
        ("audio_processor", "feature_extractor"),
        "audio_token",
        "audio",
        "",
        "num_audio_tokens",
        "audio_kwargs",
    ),
}

#: Keys of a processor's output that belong to the text, not to the media item (or that are
#: not model inputs: the video metadata a processor may hand back).
_NON_MEDIA_KEYS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "mm_token_type_ids",
        "position_ids",
        "video_metadata",
    }
)


def component(processor: Any, kind: str) -> Any:
    """`processor`'s sub-processor for `kind` (None: it has none)."""
    spec = KINDS.get(kind)
    if spec is None:
        return None
    for attr in spec.components:
        value = getattr(processor, attr, None)
        if value is not None:
            return value
    return None


def placeholder_token(processor: Any, kind: str) -> str | None:
    """`processor`'s placeholder token for `kind` (None: it has none)."""
    spec = KINDS.get(kind)
    token = getattr(processor, spec.token_attr, None) if spec else None
    return token if isinstance(token, str) and token else None


def kind_kwargs(call_kwargs: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The per-kind keyword dict of `call_kwargs` for `kind` (``{"videos_kwargs": {...}}``), or
    nothing."""
    key = KINDS[kind].kwargs_key
    extra = call_kwargs.get(key)
    return {key: dict(extra)} if extra else {}


def call_processor(
    processor: Any, kind: str, item: Any, call_kwargs: Mapping[str, Any]
) -> tuple[list[int], dict[str, Any]]:
    """Run `processor` on one placeholder and one decoded `item` of `kind`: the token ids it
    puts in the text, and the item's tensors by output key."""
    spec = KINDS[kind]
    kwargs: dict[str, Any] = {
        "text": [placeholder_token(processor, kind)],
        spec.call_arg: [item],
        "return_tensors": "pt",
        "add_special_tokens": False,
        **{k: v for k, v in call_kwargs.items() if not k.endswith("_kwargs")},
        **kind_kwargs(call_kwargs, kind),
    }
    if kind == "audio":
        kwargs["sampling_rate"] = int(component(processor, "audio").sampling_rate)
    if isinstance(item, VideoFrames):
        # the frame rate and frame indices: time-dependent outputs (Qwen2.5-VL's
        # second_per_grid_ts) and fps-based frame sampling read them
        kwargs[spec.call_arg] = [item.frames]
        kwargs["video_metadata"] = [item.metadata]
    out = processor(**kwargs)
    ids = out["input_ids"]
    ids = ids[0].tolist() if hasattr(ids, "tolist") else list(ids[0])
    values = {k: v for k, v in out.items() if k not in _NON_MEDIA_KEYS}
    return [int(t) for t in ids], values
