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
* media units before decoding (`MEDIA_UNIT_RULES`, per processor family): the rows the model's
  vision or audio tower reads for the item (image and video patches, audio feature frames),
  which is what ``media_capacity`` budgets; checked against the real output at construction;
* after decoding, the real output: every tensor the processor returns for the item
  (``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw`` (+
  ``second_per_grid_ts``), ``input_features`` + ``feature_attention_mask``, ...) and the real
  placeholder expansion, which must equal the one the sample was encoded with (else
  `MediaTokenCountError`).

The processor gets what transformers' documented loading hands it (`ModelProcessor.decode`):
an image as ``PIL.Image.open`` gives it, unconverted, so its own RGB conversion decides how
transparency and other modes become pixels, turned upright by its EXIF orientation as
``load_image`` turns it (``ImageOps.exif_transpose``; token counts use the upright size); a
video's frames with their metadata (frame rate, frame indices), so time-dependent outputs are
the ones ``load_video`` would give.

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
from mmpack.energon.media import MEDIA_LOG, MediaHandle, decode_waveform, upright_image
from mmpack.errors import MediaTokenCountError, ModalityConfigError, SampleFormatError

__all__ = [
    "AUDIO_TOKEN_RULES",
    "MEDIA_UNIT_RULES",
    "PADDED_KEYS",
    "ModelProcessor",
    "UnitRule",
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


def _merged_patches(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # Qwen2-VL / Qwen2.5-VL: one placeholder token per merge_size x merge_size patches, and
    # the vision tower reads every patch (a row of pixel_values / pixel_values_videos)
    merge = int(bridge.setting(kind, "merge_size"))
    return tokens * merge * merge


def _grid_rows(kind: str, values: Mapping[str, Any]) -> int:
    key = "pixel_values" if kind == "image" else "pixel_values_videos"
    return int(values[key].shape[0])


def _crop_patches(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # LLaVA: every image is resized and cropped to crop_size; the vision tower reads its
    # (crop / patch_size)^2 patches, whatever the placeholder count (CLS, feature strategy)
    crop = bridge.setting(kind, "crop_size")
    patch = int(bridge.processor.patch_size)
    return (int(crop["height"]) // patch) * (int(crop["width"]) // patch)


def _crop_rows(bridge: ModelProcessor, values: Mapping[str, Any]) -> int:
    crops, _, height, width = values["pixel_values"].shape
    patch = int(bridge.processor.patch_size)
    return int(crops) * (int(height) // patch) * (int(width) // patch)


def _feature_frames(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # Qwen2-Audio pads every clip's features to the extractor's 30 s window: the audio tower
    # reads nb_max_frames feature frames per clip
    return int(bridge.component("audio").nb_max_frames)


def _feature_rows(values: Mapping[str, Any]) -> int:
    return int(values["input_features"].shape[-1])


@dataclasses.dataclass(frozen=True)
class UnitRule:
    """How many rows an item costs the model's vision / audio tower (`media_capacity`'s unit):
    ``before(bridge, kind, size, tokens)`` from the item's size (as `count_for_size` takes it)
    and token count (nothing decoded), ``after(bridge, kind, values)`` from the processor's
    real output (checked equal at construction)."""

    before: Callable[[ModelProcessor, str, tuple[int, ...], int], int]
    after: Callable[[ModelProcessor, str, Mapping[str, Any]], int]


def _anyres_patches(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # LLaVA-NeXT: the base crop plus the tiles of the best grid pinpoint for the image's size;
    # the vision tower reads the (crop / patch_size)^2 patches of each (padding tiles dropped)
    from transformers.image_processing_utils import select_best_resolution

    height, width = size
    crop = bridge.setting("image", "crop_size")
    ch, cw = int(crop["height"]), int(crop["width"])
    pinpoints = bridge.setting("image", "image_grid_pinpoints")
    best_h, best_w = select_best_resolution((height, width), pinpoints)
    tiles = (int(best_h) // ch) * (int(best_w) // cw) + 1
    patch = int(bridge.processor.patch_size)
    return tiles * (ch // patch) * (cw // patch)


def _anyres_rows(bridge: ModelProcessor, values: Mapping[str, Any]) -> int:
    _, tiles, _, height, width = values["pixel_values"].shape
    patch = int(bridge.processor.patch_size)
    return int(tiles) * (int(height) // patch) * (int(width) // patch)


_QWEN_VL_UNITS = UnitRule(_merged_patches, lambda bridge, kind, values: _grid_rows(kind, values))

#: processor class name -> its media units rule: image and video patches the vision tower
#: reads, audio feature frames the audio tower reads
MEDIA_UNIT_RULES: dict[str, UnitRule] = {
    "Qwen2VLProcessor": _QWEN_VL_UNITS,
    "Qwen2_5_VLProcessor": _QWEN_VL_UNITS,
    "LlavaProcessor": UnitRule(
        _crop_patches, lambda bridge, kind, values: _crop_rows(bridge, values)
    ),
    "Qwen2AudioProcessor": UnitRule(
        _feature_frames, lambda bridge, kind, values: _feature_rows(values)
    ),
    "LlavaNextProcessor": UnitRule(
        _anyres_patches,
        lambda bridge, kind, values: _anyres_rows(bridge, values),
    ),
}

#: processor class name -> media kind -> output keys whose per-item rows differ in a
#: non-leading dimension (LLaVA-NeXT: one row per image of ``[tiles, 3, H, W]``, the tile
#: count depending on the image's aspect ratio). They are packed as the processor batches
#: them: zero-padded to the largest item (``PackedTensor(pad_to_max_shape=True)``); the model
#: drops the padding from ``image_sizes``. A key whose rows differ that is not listed here
#: refuses the processor at construction.
PADDED_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "LlavaNextProcessor": {"image": ("pixel_values",)},
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

    def setting(self, kind: str, name: str) -> Any:
        """One setting of `kind`'s sub-processor, as this processor's calls use it (a value in
        ``call_kwargs`` overrides the sub-processor's own)."""
        extra = self._kwargs_for(kind)
        for value in extra.values():
            if name in value:
                return value[name]
        value = getattr(self.component(kind), name, None)
        if value is None:
            raise ModalityConfigError(f"the processor {self.name} has no {kind} setting {name!r}")
        return value

    @property
    def unit_rule(self) -> UnitRule | None:
        """How this processor family's items cost its media towers (`MEDIA_UNIT_RULES`), or
        None for a family without a rule."""
        return MEDIA_UNIT_RULES.get(self.name)

    def require_unit_rule(self) -> None:
        """Raise `ModalityConfigError` unless this processor family has a media unit rule
        (needed when ``media_capacity`` is configured)."""
        if self.unit_rule is None:
            raise self._no_unit_rule()

    def units(self, handle: MediaHandle, tokens: int) -> int:
        """Rows `handle` costs the model's vision / audio tower (image and video patches, audio
        feature frames: `media_capacity`'s unit), for an item of `tokens` placeholder tokens
        (nothing decoded)."""
        rule = self.unit_rule
        if rule is None:
            raise self._no_unit_rule()
        return int(rule.before(self, handle.kind, self.size_of(handle), tokens))

    def _no_unit_rule(self) -> ModalityConfigError:
        return ModalityConfigError(
            f"media_capacity is configured, but mmpack has no media unit rule for the "
            f"processor {self.name} (known: {sorted(MEDIA_UNIT_RULES)}); add one to "
            "mmpack.energon.processors.MEDIA_UNIT_RULES, or leave media_capacity unset"
        )

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
            if kind == "video":
                self._check_frame_count(token_id)
            predicted = self.count_for_size(kind, size)
            if predicted != len(where):
                raise ModalityConfigError(
                    f"the processor {self.name}'s token count for a {kind} of size {size} is "
                    f"{predicted}, but processing it gave {len(where)} placeholder tokens"
                )
            if kind == "image":
                self._check_concatenable(kind, values)
            rule = self.unit_rule
            if rule is not None:
                units = rule.before(self, kind, size, predicted)
                rows = rule.after(self, kind, values)
                if units != rows:
                    raise ModalityConfigError(
                        f"the processor {self.name}'s media units for a {kind} of size {size} "
                        f"are {units}, but its output holds {rows} rows for the {kind} tower"
                    )

    def output_keys(self, kind: str) -> tuple[str, ...]:
        return self._expansion(kind).keys

    def padded_keys(self, kind: str) -> tuple[str, ...]:
        """Output keys of `kind` packed zero-padded to the largest item (`PADDED_KEYS`)."""
        return PADDED_KEYS.get(self.name, {}).get(kind, ())

    def _check_frame_count(self, token_id: int) -> None:
        """Refuse (`ModalityConfigError`) a video processor that keeps another number of frames
        than the file holds (frame sampling: ``do_sample_frames`` with ``fps`` or
        ``num_frames``): tokens are counted before decoding from the container's frame count,
        so every video would fail its count check after decoding. A long probe clip shows it
        where the short one can hide it (sampling clamped to its ``min_frames``)."""
        frames, height, width = 48, 40, 60
        pixels = np.zeros((frames, height, width, 3), dtype=np.uint8)
        clip = VideoFrames(pixels, _all_frames_metadata(frames, 4.0, width, height))
        try:
            ids, _ = self._call("video", clip)
        except Exception as err:
            raise ModalityConfigError(
                f"the processor {self.name} failed on a probe video ({type(err).__name__}: {err})"
            ) from err
        real = sum(1 for t in ids if t == token_id)
        predicted = self.count_for_size("video", (frames, height, width))
        if predicted != real:
            raise ModalityConfigError(
                f"the processor {self.name} gives {real} placeholder tokens for a probe video "
                f"of {frames} frames, but its count from the frame count is {predicted}: it "
                "samples frames (do_sample_frames, fps, num_frames in its videos_kwargs), which "
                "mmpack cannot count before decoding. Sample the frames when writing the "
                "dataset, or call the processor with do_sample_frames=False"
            )

    def _check_concatenable(self, kind: str, values: Mapping[str, Any]) -> None:
        """Refuse (`ModalityConfigError`) a processor whose rows of one key differ beyond the
        leading dimension between a small wide image and a large square one (any-resolution
        tilings give them different tile counts), unless `PADDED_KEYS` pads that key: such
        rows cannot be concatenated into a pack, and would fail in the training loop at the
        first pack holding two of them."""
        other, _ = _probe_item(kind, self.component(kind), image_size=(448, 448))
        try:
            _, others = self._call(kind, other)
        except Exception as err:
            raise ModalityConfigError(
                f"the processor {self.name} failed on a probe {kind} ({type(err).__name__}: {err})"
            ) from err
        padded = self.padded_keys(kind)
        for key, value in values.items():
            a, b = getattr(value, "shape", None), getattr(others.get(key), "shape", None)
            if a is None or b is None or key in padded:
                continue
            if tuple(a[1:]) != tuple(b[1:]):
                raise ModalityConfigError(
                    f"the processor {self.name} gives {kind} {key!r} rows of shape "
                    f"{tuple(a[1:])} for one item and {tuple(b[1:])} for another, so a pack "
                    "of several cannot be concatenated, and mmpack has no padding rule for "
                    f"it (PADDED_KEYS knows {sorted(PADDED_KEYS)}). Use a processor whose "
                    "per-item rows share their shape"
                )

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

    def size_of(self, handle: MediaHandle) -> tuple[int, ...]:
        """`handle`'s size as `count_for_size` takes it, from its metadata or header."""
        if handle.kind == "image":
            width, height = handle.image_size()
            return (height, width)
        if handle.kind == "video":
            return handle.video_shape()
        if handle.kind == "audio":
            rate = int(self.component("audio").sampling_rate)
            return (handle.audio_samples(rate),)
        raise SampleFormatError(f"sample {handle.sample_key!r}: unknown media kind {handle.kind!r}")

    def count(self, handle: MediaHandle) -> int:
        """Tokens `handle` takes, from its metadata or header (nothing decoded)."""
        return self.count_for_size(handle.kind, self.size_of(handle))

    # ------------------------------------------------------------------ decoding

    def decode(self, handle: MediaHandle) -> Any:
        """The processor's input for `handle`, as transformers' documented loading gives it:
        the ``PIL.Image`` as opened, turned upright by its EXIF orientation (in its own mode:
        the processor's RGB conversion composites transparency onto white and converts CMYK,
        palette, grayscale and 16-bit modes); the
        video's frames with their metadata (`VideoFrames`, as ``load_video(...,
        backend="pyav")`` reads them); or the mono waveform at the feature extractor's rate."""
        data = handle.read()
        try:
            if handle.kind == "image":
                from PIL import Image

                img = Image.open(io.BytesIO(data))
                img.load()  # the pixels now, while the bytes are at hand
                return upright_image(img)
            if handle.kind == "video":
                return video_frames(data)
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
            units=self.units if self.unit_rule is not None else None,
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
        if isinstance(item, VideoFrames):
            # the frame rate and frame indices: time-dependent outputs (Qwen2.5-VL's
            # second_per_grid_ts) and fps-based frame sampling read them
            kwargs[spec.call_arg] = [item.frames]
            kwargs["video_metadata"] = [item.metadata]
        out = self.processor(**kwargs)
        ids = out["input_ids"]
        ids = ids[0].tolist() if hasattr(ids, "tolist") else list(ids[0])
        values = {k: v for k, v in out.items() if k not in _NON_MEDIA_KEYS}
        return [int(t) for t in ids], values


def _probe_item(
    kind: str, component: Any, *, image_size: tuple[int, int] = (40, 60)
) -> tuple[Any, tuple[int, ...]]:
    """A small synthetic item of `kind` and its size as `count_for_size` takes it (an image
    of `image_size`, (height, width))."""
    rng = np.random.default_rng(0)
    if kind == "image":
        from PIL import Image

        height, width = image_size
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        return Image.fromarray(pixels), (height, width)
    if kind == "video":
        frames, height, width = 4, 40, 60
        pixels = rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
        metadata = _all_frames_metadata(frames, 4.0, width, height)
        return VideoFrames(pixels, metadata), (frames, height, width)
    rate = int(getattr(component, "sampling_rate", 16000))
    samples = rate // 2
    wave = (0.1 * np.sin(np.arange(samples) * 0.05)).astype(np.float32)
    return wave, (samples,)


@dataclasses.dataclass(frozen=True)
class VideoFrames:
    """A decoded video: its frames (``uint8 [frames, height, width, 3]``) and their
    ``transformers.video_utils.VideoMetadata`` (frame rate, frame indices, duration)."""

    frames: np.ndarray
    metadata: Any


def video_frames(data: bytes) -> VideoFrames:
    """Every frame of the video in `data` and its metadata, as transformers'
    ``load_video(path, backend="pyav")`` reads a file (``read_video_pyav``: the stream's frame
    count and average rate; all frames)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        declared = int(stream.frames)
        rate = stream.average_rate
        fps = float(rate) if rate else 0.0
        height, width = int(stream.height), int(stream.width)
        frames = []
        for i, frame in enumerate(container.decode(video=0)):
            if declared and i >= declared:
                break
            frames.append(frame.to_ndarray(format="rgb24"))
    if not frames:
        raise ValueError("the video has no frames")
    metadata = _all_frames_metadata(declared or len(frames), fps, width, height)
    return VideoFrames(np.stack(frames), metadata)


def _all_frames_metadata(total: int, fps: float, width: int, height: int) -> Any:
    """``VideoMetadata`` of a pyav read of every frame (``read_video_pyav``'s fields)."""
    from transformers.video_utils import VideoMetadata

    fields: dict[str, Any] = {
        "total_num_frames": total,
        "fps": fps or None,
        "width": width,
        "height": height,
        "duration": total / fps if fps else 0.0,
        "video_backend": "pyav",
        "frames_indices": np.arange(total, dtype=int),  # load_video samples every frame
    }
    return VideoMetadata(**fields)


def _declared(handle: MediaHandle) -> str:
    meta = handle.meta
    fields: Sequence[str] = {
        "image": ("width", "height"),
        "video": ("frames", "width", "height"),
        "audio": ("duration",),
    }.get(handle.kind, ())
    declared = {f: meta[f] for f in fields if f in meta}
    return f"declared {declared}" if declared else "from the file's header"
