"""Media decoding of one selected sample: `decode_media`, one loop over a `MediaDecoder`, and
`PackMedia`, the items already decoded for the pack being built.

Two decoders implement the interface: `BuiltinDecoder` (mmpack's own image patches and audio
waveforms, `MediaHandle.decode`) and `mmpack.energon.processors.ModelProcessor` (a model's
Hugging Face processor, called for real). The loop is the same for both: each configured
modality's output keys become one `PackedTensor` row per sample (empty when the sample has
none); a media item referenced twice (same provenance: its source, or its bytes under
``media_identity: content``), in one sample or in several samples of one pack (through the
pack's `decoded` cache), is read and decoded once and stored once by ``merge_segments``; each item
must take the tokens the sample was encoded with (`MediaTokenCountError`), since a wrong count
would shift every later media item of the pack against its tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from mmpack.energon.media import MEDIA_KEYS, MediaHandle, MediaSettings
from mmpack.energon.samples import EncodedConversation
from mmpack.errors import MediaTokenCountError, SampleFormatError, UndeclaredModalityError

__all__ = ["BuiltinDecoder", "DecodedMedia", "MediaDecoder", "PackMedia", "decode_media"]


@dataclasses.dataclass
class DecodedMedia:
    """One decoded media item: its tensors per output key (first dimension: this item's rows,
    e.g. patches) and, from a model's processor, the token ids it puts in place of the
    placeholder."""

    values: dict[str, Any]
    token_ids: list[int] = dataclasses.field(default_factory=list)


class MediaDecoder(Protocol):
    """What `decode_media` needs of a decoder."""

    def output_keys(self, kind: str) -> tuple[str, ...]:
        """The keys of the tensors a `kind` item decodes to."""
        ...

    def padded_keys(self, kind: str) -> tuple[str, ...]:
        """The keys among `output_keys` whose items differ beyond their leading dimension:
        packed zero-padded to the largest item (``PackedTensor(pad_to_max_shape=True)``), as
        the processor batches them."""
        ...

    def count(self, handle: MediaHandle) -> int:
        """Tokens `handle` takes, from its metadata or header (nothing decoded)."""
        ...

    def process(self, handle: MediaHandle) -> DecodedMedia:
        """Decode `handle` into the model's input tensors."""
        ...

    def check_tokens(
        self, sample_key: str, handle: MediaHandle, decoded: DecodedMedia, encoded: int
    ) -> None:
        """Raise `MediaTokenCountError` unless `decoded` takes the `encoded` tokens."""
        ...


class BuiltinDecoder:
    """mmpack's own decoding (`MediaHandle.decode`): image -> float32 patches, audio -> float32
    mono waveform at the configured rate, under the keys of `MEDIA_KEYS`."""

    def __init__(self, settings: MediaSettings) -> None:
        self.settings = settings

    def output_keys(self, kind: str) -> tuple[str, ...]:
        return (MEDIA_KEYS[kind],)

    def padded_keys(self, kind: str) -> tuple[str, ...]:
        return ()

    def count(self, handle: MediaHandle) -> int:
        return handle.num_tokens(self.settings)

    def process(self, handle: MediaHandle) -> DecodedMedia:
        return DecodedMedia({MEDIA_KEYS[handle.kind]: handle.decode(self.settings)})

    def check_tokens(
        self, sample_key: str, handle: MediaHandle, decoded: DecodedMedia, encoded: int
    ) -> None:
        real = handle.decoded_tokens(decoded.values[MEDIA_KEYS[handle.kind]], self.settings)
        if real != encoded:
            raise MediaTokenCountError(
                f"sample {sample_key!r}: {handle.kind} {handle.key!r} ({handle.identity}) "
                f"decodes to {real} tokens, but the sample was encoded with {encoded} tokens "
                f"for it ({_declared_size(handle)}); the sample is not packed. Fix the size "
                "in the metadata, or leave it out so it is read from the file's header"
            )


def decode_media(
    decoder: MediaDecoder,
    sample_key: str,
    media: Sequence[MediaHandle],
    media_tokens: Sequence[int] | None,
    *,
    modalities: Sequence[str],
    packed_tensor_type: Any,
    by_content: bool,
    decoded: dict[bytes, DecodedMedia] | None = None,
) -> tuple[dict[str, Any], int]:
    """One `PackedTensor` row per output key of each configured modality (module docstring),
    and the number of items decoded here. `media_tokens`: the tokens each item was encoded with
    (None: counted again from each item's metadata or header). `decoded`: items already
    decoded for this pack, by provenance (filled with the ones decoded here)."""
    cls = packed_tensor_type
    rows: dict[str, list[Any]] = {k: [] for kind in modalities for k in decoder.output_keys(kind)}
    padded = {k for kind in modalities for k in decoder.padded_keys(kind)}
    done: dict[bytes, DecodedMedia] = {} if decoded is None else decoded
    fresh = 0
    for index, handle in enumerate(media):
        if handle.kind not in modalities:
            raise UndeclaredModalityError(
                f"sample {sample_key!r}: {handle.kind} media {handle.key!r} reached decoding, "
                f"but modalities is {list(modalities)}"
            )
        provenance = handle.content_provenance() if by_content else handle.provenance
        item = done.get(provenance)
        if item is None:
            item = done[provenance] = decoder.process(handle)
            fresh += 1
        encoded = media_tokens[index] if media_tokens is not None else decoder.count(handle)
        decoder.check_tokens(sample_key, handle, item, encoded)
        for name in decoder.output_keys(handle.kind):
            value = item.values.get(name)
            if value is None:
                raise SampleFormatError(
                    f"sample {sample_key!r}: decoding {handle.kind} {handle.key!r} gave no {name!r}"
                )
            rows[name].append(
                cls([value], 0, pad_to_max_shape=name in padded, _segment_provenance=[provenance])
            )
    out: dict[str, Any] = {}
    for name, items in rows.items():
        out[name] = (
            cls.merge_segments(items)
            if items
            else cls(
                [],
                0,
                pad_to_max_shape=name in padded,
                _row_offsets=[0, 0],
                _segment_indices=[],
                _segment_provenance=[],
            )
        )
    return out, fresh


class PackMedia:
    """The media decoded for the pack (or padded batch) being built, by provenance: Energon
    post-encodes every member of a pack, then packs them, so an item shared inside a pack is
    decoded once (a cache of equal values: it changes nothing that is produced). Cleared when
    the pack is built, so the next pack starts with no shared media."""

    def __init__(self, modalities: Sequence[str], *, by_content: bool) -> None:
        self.modalities = tuple(modalities)
        self.by_content = by_content
        self._decoded: dict[bytes, DecodedMedia] = {}

    def decode(
        self, decoder: MediaDecoder, sample: EncodedConversation, *, packed_tensor_type: Any
    ) -> tuple[dict[str, Any], int]:
        """`decode_media` of `sample`'s media, sharing the items decoded for this pack."""
        return decode_media(
            decoder,
            sample.__key__,
            sample.media,
            sample.media_tokens,
            modalities=self.modalities,
            packed_tensor_type=packed_tensor_type,
            by_content=self.by_content,
            decoded=self._decoded,
        )

    def clear(self) -> None:
        self._decoded.clear()


def _declared_size(handle: MediaHandle) -> str:
    meta = handle.meta
    if handle.kind == "image" and "width" in meta and "height" in meta:
        return f"declared {meta['width']}x{meta['height']}"
    if handle.kind == "audio" and "duration" in meta:
        return f"declared duration {meta['duration']!r} s"
    return "size from the file's header"
