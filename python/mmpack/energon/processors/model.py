"""`ModelProcessor`: the `MediaDecoder` that calls a model's Hugging Face processor on the media
of a selected sample, and counts each item's tokens and media units before decoding by the
processor's own arithmetic (see the `mmpack.energon.processors` package docstring)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from mmpack.energon.chat_template import TemplateMedia
from mmpack.energon.decoders import DecodedMedia
from mmpack.energon.media import MEDIA_LOG, MediaHandle, decode_waveform
from mmpack.energon.processors import calling
from mmpack.energon.processors.families import (
    AUDIO_TOKEN_RULES,
    MEDIA_UNIT_RULES,
    PADDED_KEYS,
    UnitRule,
)
from mmpack.energon.processors.pixels import open_image
from mmpack.energon.processors.probe import Expansion, check_probe, run_probe
from mmpack.energon.processors.video import video_frames
from mmpack.errors import (
    MediaTokenCountError,
    MmpackError,
    ModalityConfigError,
    SampleFormatError,
    UncountableMediaError,
)

__all__ = ["ModelProcessor", "is_model_processor"]


def is_model_processor(processor: Any) -> bool:
    """Whether `processor` is a Hugging Face ``ProcessorMixin`` (as opposed to a mapping of
    settings for mmpack's own patchifier)."""
    try:
        from transformers import ProcessorMixin
    except ImportError:
        return False
    return isinstance(processor, ProcessorMixin)


class ModelProcessor:
    """A Hugging Face processor called for real (see the package docstring); a `MediaDecoder`
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
        self._expansions: dict[str, Expansion] = {}

    # ------------------------------------------------------------------ what it handles

    def component(self, kind: str) -> Any:
        return calling.component(self.processor, kind)

    def placeholder_token(self, kind: str) -> str | None:
        return calling.placeholder_token(self.processor, kind)

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media kinds this processor handles (a component and a placeholder token)."""
        return tuple(
            kind
            for kind in calling.KINDS
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
        extra = calling.kind_kwargs(self.call_kwargs, kind)
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
        size = self.size_of(handle)
        with self._counting(handle, size):
            return int(rule.before(self, handle.kind, size, tokens))

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

    def probe(self, modalities: Iterable[str]) -> None:
        """Process one small synthetic item per kind through the real processor: learns what
        replaces the placeholder and which tensors come back, and checks that the count
        arithmetic agrees with the real output (`mmpack.energon.processors.probe`). Raises
        `ModalityConfigError`."""
        for kind in modalities:
            probe = run_probe(self, kind)
            self._expansions[kind] = probe.expansion
            check_probe(self, probe)

    def output_keys(self, kind: str) -> tuple[str, ...]:
        return self._expansion(kind).keys

    def padded_keys(self, kind: str) -> tuple[str, ...]:
        """Output keys of `kind` packed zero-padded to the largest item (`PADDED_KEYS`)."""
        return PADDED_KEYS.get(self.name, {}).get(kind, ())

    def expansion(self, kind: str, count: int) -> list[int]:
        """The token ids that replace one placeholder of `kind` for an item of `count`
        tokens."""
        return self._expansion(kind).ids(count)

    def _expansion(self, kind: str) -> Expansion:
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
        spec = calling.KINDS[kind]
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is None:
            raise ModalityConfigError(
                f"the processor {self.name} cannot count {kind} tokens before decoding "
                "(no _get_num_multimodal_tokens)"
            )
        kwargs = calling.kind_kwargs(self.call_kwargs, kind)
        data = counter(**{spec.sizes_arg: [list(size)]}, **kwargs)
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
        """Tokens `handle` takes, from its metadata or header (nothing decoded). Raises
        `UncountableMediaError` when the processor refuses the item's size."""
        size = self.size_of(handle)
        with self._counting(handle, size):
            return self.count_for_size(handle.kind, size)

    @contextlib.contextmanager
    def _counting(self, handle: MediaHandle, size: tuple[int, ...]) -> Iterator[None]:
        """Errors the processor's own arithmetic raises for `handle` (a size beyond its limits)
        as `UncountableMediaError` naming the sample and the item; mmpack's own errors pass."""
        try:
            yield
        except MmpackError:
            raise
        except Exception as err:
            raise UncountableMediaError(
                f"sample {handle.sample_key!r}: the processor {self.name} cannot count the "
                f"tokens of {handle.kind} {handle.key!r} ({handle.identity}) of size "
                f"{_size_text(handle.kind, size)} ({_declared(handle)}): "
                f"{type(err).__name__}: {err}; the sample is not packed"
            ) from err

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
                return open_image(data)
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
            ids, values = calling.call_processor(
                self.processor, handle.kind, item, self.call_kwargs
            )
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


def _declared(handle: MediaHandle) -> str:
    meta = handle.meta
    fields: Sequence[str] = {
        "image": ("width", "height"),
        "video": ("frames", "width", "height"),
        "audio": ("duration",),
    }.get(handle.kind, ())
    declared = {f: meta[f] for f in fields if f in meta}
    return f"declared {declared}" if declared else "from the file's header"


def _size_text(kind: str, size: tuple[int, ...]) -> str:
    """`size` as `ModelProcessor.size_of` gives it, written width x height."""
    if kind == "image":
        height, width = size
        return f"{width}x{height}"
    if kind == "video":
        frames, height, width = size
        return f"{frames} frames of {width}x{height}"
    return f"{size[0]} samples"
