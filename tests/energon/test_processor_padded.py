"""A processor whose per-item rows cannot be concatenated: LLaVA-NeXT's ``pixel_values`` per image
are ``[tiles, 3, H, W]`` with a tile count that follows the image's aspect ratio. Its packs are
padded as the processor batches (``pad_to_max_shape``): the packed value equals the processor's
own batched output exactly. A processor with such rows and no padding rule is refused at
construction by name."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from mmpack import PackedTensor
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.media import MediaHandle
from mmpack.energon.processors import PADDED_KEYS
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import ModalityConfigError
from mmpack_dev.synthetic import png_bytes
from PIL import Image
from support.conversations import cooked_conversation
from support.processors import llava_next_processor

#: (width, height) of the pictures: 3, 3 and 5 tiles
SIZES = ((64, 48), (30, 90), (120, 118))


@pytest.fixture(scope="module")
def processor() -> Any:
    return llava_next_processor()


def conversation(key: str, pictures: list[bytes]) -> Conversation:
    media = [
        MediaHandle(
            kind="image", key=f"{key}-{i}.png", sample_key=key, source=(key, str(i)), data=d
        )
        for i, d in enumerate(pictures)
    ]
    return cooked_conversation(
        key,
        [
            Turn("user", (*(Part(media=m) for m in media), Part(text="kaka"))),
            Turn("assistant", (Part(text="lolo"),)),
        ],
    )


def test_llava_next_packs_equal_the_processors_own_batch(processor: Any) -> None:
    pictures = [png_bytes(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=["image"]), processor=processor)
    decoded = [
        enc.postencode_sample(enc.encode_conversation(conversation("s0", pictures[:2]))),
        enc.postencode_sample(enc.encode_conversation(conversation("s1", pictures[2:]))),
    ]
    pack = enc.build_pack(decoded)
    theirs = processor(
        images=[Image.open(io.BytesIO(p)) for p in pictures],
        text=[processor.image_token * len(pictures)],
        return_tensors="pt",
    )
    ours = pack.media["pixel_values"].as_tensor()
    assert tuple(ours.shape) == tuple(theirs["pixel_values"].shape) == (3, 5, 3, 56, 56)
    assert torch.equal(ours, theirs["pixel_values"])
    assert torch.equal(pack.media["image_sizes"].as_tensor(), theirs["image_sizes"])
    # the placeholder tokens are the processor's too
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert int((pack.input_ids == image_id).sum()) == int((theirs["input_ids"] == image_id).sum())
    # media units: the tiles the vision tower reads (padding tiles dropped), 4x4 patches each
    assert sum(s.media_units for s in decoded) == (3 + 3 + 5) * 16


def test_the_same_rows_unpadded_cannot_be_concatenated(processor: Any) -> None:
    # why the padding: the per-image rows differ in their tile dimension
    rows = [
        processor(
            images=[Image.open(io.BytesIO(png_bytes(w, h)))],
            text=[processor.image_token],
            return_tensors="pt",
        )["pixel_values"]
        for w, h in SIZES[1:]
    ]
    with pytest.raises(RuntimeError):
        PackedTensor(rows, 0).as_tensor()


def test_rows_that_cannot_be_concatenated_refuse_an_unknown_family(processor: Any) -> None:
    from transformers import LlavaNextProcessor

    class TiledProcessor(LlavaNextProcessor):
        pass

    assert "TiledProcessor" not in PADDED_KEYS
    mine = TiledProcessor(
        image_processor=processor.image_processor,
        tokenizer=processor.tokenizer,
        patch_size=processor.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=processor.chat_template,
    )
    with pytest.raises(ModalityConfigError, match=r"TiledProcessor gives image 'pixel_values'"):
        PackingTaskEncoder(PackingEncoderConfig(modalities=["image"]), processor=mine)
