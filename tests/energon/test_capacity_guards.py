"""What stops a pack longer than ``capacity`` from reaching the trainer when the hooks disagree
(a subclass's `pack_length`, `plan_packs` or `build_pack`), and a ``capacity`` no THD
micro-batch can hold (``cu_seqlens`` are int32)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from megatron.energon.errors import FatalSampleError
from mmpack.batch import PackedBatch, pack_samples
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.samples import Conversation, EncodedConversation, Part, Turn
from mmpack.errors import EnergonConfigError
from mmpack_dev.synthetic import PATCH_SIZE
from support.conversations import cooked_conversation

CAPACITY = 64
MULTIPLE = 8
#: words per answer: 25, 33, 26 and 34 tokens
WORDS = (20, 28, 21, 29)


def conversation(key: str, words: int) -> Conversation:
    return cooked_conversation(
        key,
        [
            Turn("user", (Part(text="kaka"),)),
            Turn("assistant", (Part(text=" ".join(["lolo"] * words)),)),
        ],
    )


class RawLength(PackingTaskEncoder):
    """Plans on the tokens alone, forgetting the padding."""

    def pack_length(self, sample: EncodedConversation) -> int:
        return sample.num_tokens


class OnePack(PackingTaskEncoder):
    """A packer that puts the whole buffer in one pack."""

    def plan_packs(self, lengths: np.ndarray, media: np.ndarray | None, *, seed: int) -> Any:
        n = len(lengths)
        return SimpleNamespace(bin_offsets=np.array([0, n]), item_indices=np.arange(n))


class WiderPadding(PackingTaskEncoder):
    """Builds with a larger padding multiple than the one the packs were planned on."""

    def build_pack(self, samples: Any) -> PackedBatch:
        options = self.batch_options.replace(pad_to_multiple_of=6 * MULTIPLE)
        return pack_samples([self.to_encoded_sample(s) for s in samples], options)


def encoder(tokenizer: Any, cls: type[PackingTaskEncoder], **overrides: Any) -> PackingTaskEncoder:
    config = PackingEncoderConfig(
        **{"capacity": CAPACITY, "pad_to_multiple_of": MULTIPLE, **overrides}
    )
    return cls(config, tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE})


@pytest.mark.parametrize("cls", [RawLength, OnePack, WiderPadding])
def test_a_pack_longer_than_capacity_stops_the_job(tokenizer: Any, worker: Any, cls: Any) -> None:
    enc = encoder(tokenizer, cls)
    samples = [enc.preencode_sample(conversation(f"s{i}", w)) for i, w in enumerate(WORDS)]
    # two to a pack on their tokens alone (34 + 26, 33 + 25), 72 positions once padded
    assert [s.num_tokens for s in samples] == [25, 33, 26, 34]
    with pytest.raises(FatalSampleError, match=r"capacity 64.*pack_length"):
        for group in enc.select_samples_to_pack(samples):
            enc.pack_selected_samples([enc.postencode_sample(s) for s in group])


class NoPolicy(PackingTaskEncoder):
    """A policy override that forgets the oversize check."""

    def check_policy(self, conversation: Conversation, encoded: EncodedConversation) -> None:
        pass


def test_an_oversize_sample_past_the_policy_stops_the_job_naming_it(
    tokenizer: Any, worker: Any
) -> None:
    enc = encoder(tokenizer, NoPolicy)
    samples = [enc.preencode_sample(conversation(f"s{i}", w)) for i, w in enumerate(WORDS)]
    samples.append(enc.preencode_sample(conversation("long", 60)))  # 65 tokens: 72 padded
    with pytest.raises(FatalSampleError, match=r"'long'.*pack_length 72 > capacity 64"):
        enc.select_samples_to_pack(samples)


def test_the_encoders_own_hooks_pass_the_guard(tokenizer: Any, worker: Any) -> None:
    enc = encoder(tokenizer, PackingTaskEncoder)
    samples = [enc.preencode_sample(conversation(f"s{i}", w)) for i, w in enumerate(WORDS)]
    packs = [
        enc.pack_selected_samples([enc.postencode_sample(s) for s in group])
        for group in enc.select_samples_to_pack(samples)
    ]
    assert sorted(k for p in packs for k in p.sample_keys) == sorted(s.__key__ for s in samples)
    assert all(p.packed.input_ids.numel() <= CAPACITY for p in packs)


@pytest.mark.parametrize(
    ("capacity", "batch_size"), [(2**31, 1), (2**30, 2), (2**32, 1), (2**20, 2**12)]
)
def test_capacity_past_int32_is_refused_at_construction(
    tokenizer: Any, capacity: int, batch_size: int
) -> None:
    with pytest.raises(EnergonConfigError, match=r"capacity \* batch_size.*2\*\*31 - 1"):
        encoder(tokenizer, PackingTaskEncoder, capacity=capacity, batch_size=batch_size)


def test_the_largest_micro_batch_int32_holds_is_accepted(tokenizer: Any) -> None:
    enc = encoder(tokenizer, PackingTaskEncoder, capacity=2**30 - 8, batch_size=2)
    assert enc.config.capacity * enc.config.batch_size <= 2**31 - 1
