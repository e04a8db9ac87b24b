"""`ModelProcessor`: a model's Hugging Face processor (``transformers.ProcessorMixin``), called
for real on the media of the samples that are packed.

What it reads from the processor (nothing is configured twice):

* which media kinds it handles: ``image`` (an ``image_processor`` and an ``image_token``),
  ``video`` (a ``video_processor`` and a ``video_token``), ``audio`` (a ``feature_extractor`` /
  ``audio_processor`` and an ``audio_token``);
* the placeholder token of each kind, and what the processor puts in its place (learned at
  construction by processing one small probe item per kind: a prefix, a run of placeholder
  tokens, a suffix);
* token counts before decoding, from the processor's own arithmetic on the item's size
  (``_get_num_multimodal_tokens`` for images and videos, which e.g. applies Qwen2-VL's
  min/max pixels, patch size and ``merge_size``; for audio, the feature extractor's window
  settings and the model family's length rule in `AUDIO_TOKEN_RULES`);
* after decoding, the real output: every tensor the processor returns for the item
  (``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw``,
  ``input_features`` + ``feature_attention_mask``, ...) and the real placeholder expansion,
  which must equal the one the sample was encoded with (else `MediaTokenCountError`).

`ModelProcessor` is a `MediaDecoder`: the loop of `mmpack.energon.decoders.decode_media` makes
each output key one `PackedTensor` row per sample; every key of one media item carries the
item's provenance, so coupled keys keep equal per-row counts and deduplicate together.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mmpack.energon.chat_template import TemplateMedia
from mmpack.energon.decoders import DecodedMedia
from mmpack.energon.media import MEDIA_LOG, MediaHandle, decode_waveform
from mmpack.errors import MediaTokenCountError, ModalityConfigError, SampleFormatError

__all__ = [
    "AUDIO_TOKEN_RULES",
    "ModelProcessor",
    "is_model_processor",
]


@dataclasses.dataclass(frozen=True)
class _Kind:
    components: tuple[str, ...]  # attribute names of the sub-processor, first found wins
    token_attr: str  # placeholder token attribute of the processor
    call_arg: str  # keyword of the processor's __call__
    sizes_arg: str  # keyword of _get_num_multimodal_tokens
    count_key: str  # field of its MultiModalData


_KINDS: dict[str, _Kind] = {
    "image": _Kind(
        ("image_processor",), "image_token", "images", "image_sizes", "num_image_tokens"
    ),
    "video": _Kind(
        ("video_processor",), "video_token", "videos", "video_sizes", "num_video_tokens"
    ),
    "audio": _Kind(
        ("audio_processor", "feature_extractor"), "audio_token", "audio", "", "num_audio_tokens"
    ),
}

#: Keys of a processor's output that belong to the text, not to the media item.
_TEXT_KEYS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "position_ids"}
)


def _qwen2_audio_tokens(samples: int, extractor: Any) -> int:
    # the feature extractor pads to n_samples (30 s) and keeps one frame per hop_length
    # samples; the encoder's conv (stride 2) and pooling (stride 2) follow
    frames = min(math.ceil(samples / int(extractor.hop_length)), int(extractor.nb_max_frames))
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


#: processor class name -> tokens of an audio clip of `samples` samples (at the feature
#: extractor's rate), from the feature extractor's settings
AUDIO_TOKEN_RULES: dict[str, Callable[[int, Any], int]] = {
    "Qwen2AudioProcessor": _qwen2_audio_tokens,
}


def is_model_processor(processor: Any) -> bool:
    """Whether `processor` is a Hugging Face ``ProcessorMixin`` (as opposed to a mapping of
    settings for mmpack's own patchifier)."""
    try:
        from transformers import ProcessorMixin
    except ImportError:
        return False
    return isinstance(processor, ProcessorMixin)


@dataclasses.dataclass(frozen=True)
class _Expansion:
    prefix: tuple[int, ...]
    token_id: int
    suffix: tuple[int, ...]
    keys: tuple[str, ...]

    def ids(self, count: int) -> list[int]:
        return [*self.prefix, *([self.token_id] * count), *self.suffix]


class ModelProcessor:
    """A Hugging Face processor called for real (see the module docstring); a `MediaDecoder`
    of `mmpack.energon.decoders`.

    Args:
        processor: a ``transformers.ProcessorMixin`` with its tokenizer.
        call_kwargs: extra keyword arguments of every processor call (e.g.
            ``{"videos_kwargs": {"fps": 2}}``); they also apply to the token counts.
    """

    def __init__(self, processor: Any, *, call_kwargs: Mapping[str, Any] | None = None) -> None:
        if not is_model_processor(processor):
            raise ModalityConfigError(
                f"expected a transformers ProcessorMixin, got {type(processor).__name__}"
            )
        self.processor = processor
        self.call_kwargs = dict(call_kwargs or {})
        self.name = type(processor).__name__
        self._expansions: dict[str, _Expansion] = {}

    # ------------------------------------------------------------------ what it handles

    def component(self, kind: str) -> Any:
        spec = _KINDS.get(kind)
        if spec is None:
            return None
        for attr in spec.components:
            value = getattr(self.processor, attr, None)
            if value is not None:
                return value
        return None

    def placeholder_token(self, kind: str) -> str | None:
        spec = _KINDS.get(kind)
        token = getattr(self.processor, spec.token_attr, None) if spec else None
        return token if isinstance(token, str) and token else None

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media kinds this processor handles (a component and a placeholder token)."""
        return tuple(
            kind
            for kind in _KINDS
            if self.component(kind) is not None and self.placeholder_token(kind) is not None
        )

    def check_modalities(self, modalities: Iterable[str]) -> None:
        """Raise `ModalityConfigError` naming the configured kinds the processor cannot
        handle, and what it does handle."""
        handled = self.modalities
        missing = [m for m in modalities if m not in handled]
        if missing:
            what = ", ".join(handled) if handled else "no media at all (text only)"
            raise ModalityConfigError(
                f"modalities {missing} are configured, but the processor {self.name} handles "
                f"{what}. Refusing to start: every sample with such media would fail. Use the "
                "model's own multimodal processor, or remove the modality from the config"
            )

    def settings(self, kind: str) -> dict[str, Any]:
        """The settings of `kind`'s sub-processor that decide token counts (read from it, for
        logs and errors)."""
        comp = self.component(kind)
        names = (
            "patch_size",
            "merge_size",
            "temporal_patch_size",
            "size",
            "crop_size",
            "min_pixels",
            "max_pixels",
            "sampling_rate",
            "hop_length",
            "n_samples",
            "feature_size",
        )
        out: dict[str, Any] = {}
        for name in names:
            value = getattr(comp, name, None)
            if value is not None:
                out[name] = dict(value) if hasattr(value, "keys") else value
        return out

    def placeholder_id(self, kind: str) -> int:
        token = self.placeholder_token(kind)
        ids = self.processor.tokenizer.convert_tokens_to_ids([token])
        if not ids or ids[0] is None or ids[0] == self.processor.tokenizer.unk_token_id:
            raise ModalityConfigError(
                f"the processor's {kind} placeholder {token!r} is not a token of its tokenizer"
            )
        return int(ids[0])

    # ------------------------------------------------------------------ startup probe

    def probe(self, modalities: Iterable[str]) -> None:
        """Process one small synthetic item per kind through the real processor: learns what
        replaces the placeholder and which tensors come back, and checks that the count
        arithmetic agrees with the real output. Raises `ModalityConfigError`."""
        for kind in modalities:
            item, size = _probe_item(kind, self.component(kind))
            try:
                ids, values = self._call(kind, item)
            except Exception as err:
                raise ModalityConfigError(
                    f"the processor {self.name} failed on a probe {kind} "
                    f"({type(err).__name__}: {err})"
                ) from err
            token_id = self.placeholder_id(kind)
            where = [i for i, t in enumerate(ids) if t == token_id]
            if not where or where != list(range(where[0], where[-1] + 1)):
                raise ModalityConfigError(
                    f"the processor {self.name} does not replace the {kind} placeholder by one "
                    f"run of placeholder tokens (got {ids[:16]}...); mmpack cannot predict its "
                    "expansion before decoding"
                )
            self._expansions[kind] = _Expansion(
                tuple(ids[: where[0]]), token_id, tuple(ids[where[-1] + 1 :]), tuple(values)
            )
            predicted = self.count_for_size(kind, size)
            if predicted != len(where):
                raise ModalityConfigError(
                    f"the processor {self.name}'s token count for a {kind} of size {size} is "
                    f"{predicted}, but processing it gave {len(where)} placeholder tokens"
                )

    def output_keys(self, kind: str) -> tuple[str, ...]:
        return self._expansion(kind).keys

    def expansion(self, kind: str, count: int) -> list[int]:
        """The token ids that replace one placeholder of `kind` for an item of `count`
        tokens."""
        return self._expansion(kind).ids(count)

    def _expansion(self, kind: str) -> _Expansion:
        try:
            return self._expansions[kind]
        except KeyError:
            raise ModalityConfigError(
                f"{kind} was not probed at construction (is it in modalities?)"
            ) from None

    # ------------------------------------------------------------------ counts before decoding

    def count_for_size(self, kind: str, size: tuple[int, ...]) -> int:
        """Tokens of an item of `size` ((height, width); (frames, height, width); (samples,))
        by the processor's own arithmetic."""
        if kind == "audio":
            rule = AUDIO_TOKEN_RULES.get(self.name)
            if rule is None:
                raise ModalityConfigError(
                    f"no audio token rule for {self.name}; known: {sorted(AUDIO_TOKEN_RULES)}"
                )
            return int(rule(int(size[0]), self.component("audio")))
        spec = _KINDS[kind]
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is None:
            raise ModalityConfigError(
                f"the processor {self.name} cannot count {kind} tokens before decoding "
                "(no _get_num_multimodal_tokens)"
            )
        data = counter(**{spec.sizes_arg: [list(size)]}, **self._kwargs_for(kind))
        counts = getattr(data, spec.count_key, None)
        if not counts:
            raise ModalityConfigError(
                f"the processor {self.name} gives no {spec.count_key} for a {kind} of size {size}"
            )
        return int(counts[0])

    def count(self, handle: MediaHandle) -> int:
        """Tokens `handle` takes, from its metadata or header (nothing decoded)."""
        if handle.kind == "image":
            width, height = handle.image_size()
            return self.count_for_size("image", (height, width))
        if handle.kind == "video":
            return self.count_for_size("video", handle.video_shape())
        if handle.kind == "audio":
            rate = int(self.component("audio").sampling_rate)
            return self.count_for_size("audio", (handle.audio_samples(rate),))
        raise SampleFormatError(f"sample {handle.sample_key!r}: unknown media kind {handle.kind!r}")

    # ------------------------------------------------------------------ decoding

    def decode(self, handle: MediaHandle) -> Any:
        """The processor's input for `handle`: an RGB ``PIL.Image``, the video's frames
        (``uint8 [frames, height, width, 3]``) or the mono waveform at the feature
        extractor's rate."""
        data = handle.read()
        try:
            if handle.kind == "image":
                from PIL import Image

                with Image.open(io.BytesIO(data)) as img:
                    return img.convert("RGB")
            if handle.kind == "video":
                return _video_frames(data)
        except Exception as err:
            raise SampleFormatError(
                f"sample {handle.sample_key!r}: {handle.kind} {handle.key!r} cannot be decoded "
                f"({type(err).__name__}: {err})"
            ) from err
        if handle.kind == "audio":
            rate = int(self.component("audio").sampling_rate)
            return decode_waveform(data, rate, handle)
        raise SampleFormatError(f"sample {handle.sample_key!r}: unknown media kind {handle.kind!r}")

    def process(self, handle: MediaHandle) -> DecodedMedia:
        """Decode `handle` and run the processor on it."""
        item = self.decode(handle)
        try:
            ids, values = self._call(handle.kind, item)
        except Exception as err:
            raise SampleFormatError(
                f"sample {handle.sample_key!r}: the processor {self.name} failed on "
                f"{handle.kind} {handle.key!r} ({type(err).__name__}: {err})"
            ) from err
        MEDIA_LOG.decodes.append(handle.identity)
        return DecodedMedia(values, ids)

    def check_tokens(
        self, sample_key: str, handle: MediaHandle, decoded: DecodedMedia, encoded: int
    ) -> None:
        """The real expansion must be the one the sample was encoded with (`encoded`
        placeholder tokens); raises `MediaTokenCountError`."""
        expected = self.expansion(handle.kind, encoded)
        if decoded.token_ids != expected:
            token_id = self._expansion(handle.kind).token_id
            real = sum(1 for t in decoded.token_ids if t == token_id)
            raise MediaTokenCountError(
                f"sample {sample_key!r}: {handle.kind} {handle.key!r} ({handle.identity}) "
                f"takes {real} tokens through {self.name}, but the sample was encoded with "
                f"{encoded} tokens for it (size {_declared(handle)}); the sample is not "
                "packed. Fix the size in the metadata, or leave it out so it is read from the "
                "file's header"
            )

    def template_media(self, modalities: Iterable[str]) -> TemplateMedia:
        """How the chat template's placeholders expand through this processor."""
        configured = tuple(modalities)
        return TemplateMedia(
            placeholder_ids={kind: self.placeholder_id(kind) for kind in configured},
            count=self.count,
            expansion=self.expansion,
            list_content=True,
            # the processor reads these as media too, configured or not
            other_placeholder_ids={
                kind: self.placeholder_id(kind)
                for kind in self.modalities
                if kind not in configured
            },
        )

    def _kwargs_for(self, kind: str) -> dict[str, Any]:
        key = {"image": "images_kwargs", "video": "videos_kwargs", "audio": "audio_kwargs"}[kind]
        extra = self.call_kwargs.get(key)
        return {key: dict(extra)} if extra else {}

    def _call(self, kind: str, item: Any) -> tuple[list[int], dict[str, Any]]:
        spec = _KINDS[kind]
        kwargs: dict[str, Any] = {
            "text": [self.placeholder_token(kind)],
            spec.call_arg: [item],
            "return_tensors": "pt",
            "add_special_tokens": False,
            **{k: v for k, v in self.call_kwargs.items() if not k.endswith("_kwargs")},
            **self._kwargs_for(kind),
        }
        if kind == "audio":
            kwargs["sampling_rate"] = int(self.component("audio").sampling_rate)
        out = self.processor(**kwargs)
        ids = out["input_ids"]
        ids = ids[0].tolist() if hasattr(ids, "tolist") else list(ids[0])
        values = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        return [int(t) for t in ids], values


def _probe_item(kind: str, component: Any) -> tuple[Any, tuple[int, ...]]:
    """A small synthetic item of `kind` and its size as `count_for_size` takes it."""
    rng = np.random.default_rng(0)
    if kind == "image":
        from PIL import Image

        height, width = 40, 60
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        return Image.fromarray(pixels), (height, width)
    if kind == "video":
        frames, height, width = 4, 40, 60
        return rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8), (
            frames,
            height,
            width,
        )
    rate = int(getattr(component, "sampling_rate", 16000))
    samples = rate // 2
    wave = (0.1 * np.sin(np.arange(samples) * 0.05)).astype(np.float32)
    return wave, (samples,)


def _video_frames(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError("the video has no frames")
    return np.stack(frames)


def _declared(handle: MediaHandle) -> str:
    meta = handle.meta
    fields: Sequence[str] = {
        "image": ("width", "height"),
        "video": ("frames", "width", "height"),
        "audio": ("duration",),
    }.get(handle.kind, ())
    declared = {f: meta[f] for f in fields if f in meta}
    return f"declared {declared}" if declared else "from the file's header"
