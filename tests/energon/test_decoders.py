"""One media-decode loop (`mmpack.energon.decoders.decode_media`) over a decoder chosen at
construction: mmpack's own decoding and a model's Hugging Face processor are two `MediaDecoder`
implementations, so deduplication, the token check and empty rows behave the same for both."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from mmpack import PackedTensor
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, decoders
from mmpack.energon.decoders import BuiltinDecoder, DecodedMedia, decode_media
from mmpack.energon.media import MediaHandle
from mmpack.energon.processors import ModelProcessor
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import MediaTokenCountError, SampleFormatError, UndeclaredModalityError
from mmpack_dev.synthetic import build_tokenizer, png_bytes
from support.conversations import cooked_conversation

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def image(key: str, size: tuple[int, int], *, meta: Any = None) -> MediaHandle:
    return MediaHandle(
        kind="image",
        key=key,
        sample_key="s0",
        source=("test", key),
        data=png_bytes(*size, seed=sum(size)),
        meta={} if meta is None else meta,
    )


def conversation(*media: MediaHandle) -> Conversation:
    return cooked_conversation(
        "s0",
        [
            Turn("user", (*(Part(media=m) for m in media), Part(text="ka lo mi"))),
            Turn("assistant", (Part(text="ne su"),)),
        ],
    )


def builtin_encoder() -> PackingTaskEncoder:
    return PackingTaskEncoder(
        PackingEncoderConfig(), tokenizer=build_tokenizer(), processor={"patch_size": 16}
    )


def processor_encoder() -> PackingTaskEncoder:
    import qwen2_vl
    import torchvision  # noqa: F401  (the video processor needs it)

    return PackingTaskEncoder(
        PackingEncoderConfig(modalities=["image"]), processor=qwen2_vl.build_processor()
    )


@pytest.mark.parametrize("build", [builtin_encoder, processor_encoder], ids=["builtin", "hf"])
def test_both_decoders_go_through_the_one_loop(build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    enc = build()
    expected = BuiltinDecoder if build is builtin_encoder else ModelProcessor
    assert isinstance(enc.media_decoder, expected)
    seen: list[Any] = []

    def spy(decoder: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(decoder)
        return decode_media(decoder, *args, **kwargs)

    monkeypatch.setattr(decoders, "decode_media", spy)
    shared = image("shared.png", (64, 48))
    encoded = enc.encode_conversation(conversation(shared, image("own.png", (32, 32)), shared))
    decoded = enc.postencode_sample(encoded)
    assert seen == [enc.media_decoder]
    values = decoded.decoded_media[enc.media_decoder.output_keys("image")[0]]
    assert values.logical_segment_counts_by_row() == [3]
    assert len(values.tensors) == 2  # the item referenced twice is stored once
    assert enc.stats.snapshot()["decoded"] == 2  # ... and decoded once


class CountingDecoder:
    """A `MediaDecoder` with two output keys per item, counting what it decodes."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.processed: list[str] = []

    def output_keys(self, kind: str) -> tuple[str, ...]:
        return (f"{kind}_values", f"{kind}_sizes")

    def padded_keys(self, kind: str) -> tuple[str, ...]:
        return ()

    def count(self, handle: MediaHandle) -> int:
        return self.tokens

    def process(self, handle: MediaHandle) -> DecodedMedia:
        import torch

        self.processed.append(handle.key)
        return DecodedMedia(
            {"image_values": torch.ones(self.tokens, 2), "image_sizes": torch.tensor([[1, 2]])}
        )

    def check_tokens(
        self, sample_key: str, handle: MediaHandle, decoded: DecodedMedia, encoded: int
    ) -> None:
        if decoded.values["image_values"].shape[0] != encoded:
            raise MediaTokenCountError(f"sample {sample_key!r}: {handle.key!r} miscounted")


def test_the_loop_deduplicates_checks_tokens_and_fills_empty_rows() -> None:
    decoder = CountingDecoder(tokens=3)
    a, b = image("a.png", (8, 8)), image("b.png", (8, 8))
    out, n = decode_media(
        decoder,
        "s0",
        [a, b, a],
        [3, 3, 3],
        modalities=["image", "audio"],
        packed_tensor_type=PackedTensor,
        by_content=False,
    )
    assert n == 2 and decoder.processed == ["a.png", "b.png"]
    assert list(out) == ["image_values", "image_sizes", "audio_values", "audio_sizes"]
    assert out["image_values"].logical_segment_counts_by_row() == [3]
    assert out["image_sizes"]._segment_indices == out["image_values"]._segment_indices
    assert out["audio_values"].logical_segment_counts_by_row() == [0]
    # recorded counts are checked per reference, recounted when the sample has none
    with pytest.raises(MediaTokenCountError, match=r"sample 's0': 'b\.png' miscounted"):
        decode_media(
            decoder,
            "s0",
            [a, b],
            [3, 4],
            modalities=["image"],
            packed_tensor_type=PackedTensor,
            by_content=False,
        )
    out, _ = decode_media(
        CountingDecoder(tokens=1),
        "s0",
        [a],
        None,
        modalities=["image"],
        packed_tensor_type=PackedTensor,
        by_content=False,
    )
    assert out["image_values"].logical_segment_counts_by_row() == [1]
    with pytest.raises(UndeclaredModalityError, match=r"sample 's0': image media 'a\.png'"):
        decode_media(
            decoder,
            "s0",
            [a],
            [3],
            modalities=["audio"],
            packed_tensor_type=PackedTensor,
            by_content=False,
        )


def test_a_decoder_missing_an_output_key_names_the_sample() -> None:
    class Forgetful(CountingDecoder):
        def process(self, handle: MediaHandle) -> DecodedMedia:
            decoded = super().process(handle)
            del decoded.values["image_sizes"]
            return decoded

    with pytest.raises(SampleFormatError, match=r"sample 's0'.*'a.png'.*'image_sizes'"):
        decode_media(
            Forgetful(tokens=3),
            "s0",
            [image("a.png", (8, 8))],
            [3],
            modalities=["image"],
            packed_tensor_type=PackedTensor,
            by_content=False,
        )


def test_the_builtin_decoder_catches_a_lying_size() -> None:
    enc = builtin_encoder()
    lying = image("a.png", (64, 64), meta={"width": 32, "height": 32})
    encoded = enc.encode_conversation(conversation(lying))
    assert encoded.media_tokens == [4]
    with pytest.raises(MediaTokenCountError, match=r"decodes to 16 tokens.*encoded with 4"):
        enc.postencode_sample(encoded)
