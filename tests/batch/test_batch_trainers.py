"""mmpack's batch fields read by real trainers, on a tiny random-init Llama (float64, CPU):

* packed forward (``position_ids`` alone, and an explicit block-diagonal mask from
  ``cu_seqlens_padded``) against each sample's own unpacked forward: per-token logits, the
  total loss and the parameter gradients agree to 1e-9 relative;
* the loss each trainer computes from our fields, against that reference: Megatron-Core's
  (``vocab_parallel_cross_entropy`` times ``loss_mask``), Hugging Face's (the model's own loss
  with ``shift_labels=labels``) and NeMo-RL's (``token_mask[1:]`` with ``logits[:-1]``, per
  sample); the first two compute in float32 inside (both call ``.float()`` on the logits), so
  they agree to 1e-6, NeMo-RL's formula (float64 here) to 1e-9;
* the same for padded rows with pad = eos, and for several packs in one micro-batch.

Cases: multi-turn, a system prompt, a conversation that opens with the assistant, one-token
samples (trainable and not), padding (``pad_to_multiple_of`` 8, ``cp_size`` 2 and 4), a
fixed-length micro-batch of two packs, and both mask modes (roles, precomputed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mmpack.batch import EncodedSample, PackedBatch, masks, micro_batch, pack_samples
from mmpack.batch.padded import PaddedBatch, pad_samples
from reference import trainers

# megatron-core warns on import about Transformer Engine / Apex being absent (CPU machine)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

EXACT = 1e-9  # float64 end to end
FLOAT32 = 1e-6  # the trainer's loss computes in float32 inside
EOS = 2  # also the padding of the padded rows

#: (role, tokens) per message; an assistant message ends with EOS
CONVERSATIONS = [
    [("user", 5), ("assistant", 6), ("user", 4), ("assistant", 7)],  # multi-turn
    [("assistant", 1)],  # one trainable token: no prediction inside its sample reaches it
    [("system", 4), ("user", 5), ("assistant", 6)],  # system prompt
    [("assistant", 5), ("user", 3), ("assistant", 4)],  # opens with the assistant
    [("user", 1)],  # one untrained token
    [("user", 9), ("assistant", 14)],
]


def _conversation(k: int, messages: list[tuple[str, int]]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 + k)
    parts = []
    for role, n in messages:
        t = torch.randint(3, trainers.VOCAB, (n,), generator=gen)
        if role == "assistant":
            t[-1] = EOS
        parts.append(t)
    lengths = [n for _, n in messages]
    roles = [r for r, _ in messages]
    trainable = masks.from_roles(lengths, roles)
    # precomputed mode: an encoder's own mask, here also leaving out the first token of the
    # first assistant message (so the two modes train different tokens)
    precomputed = trainable.copy()
    if k == 0:
        precomputed[lengths[0]] = False
    return {
        "tokens": torch.cat(parts),
        "lengths": lengths,
        "roles": roles,
        "trainable": {"roles": trainable, "precomputed": precomputed},
    }


SAMPLES = [_conversation(k, m) for k, m in enumerate(CONVERSATIONS)]


def encoded(mode: str) -> list[EncodedSample]:
    if mode == "roles":
        return [
            EncodedSample(
                f"c{k}", s["tokens"], message_lengths=s["lengths"], message_roles=s["roles"]
            )
            for k, s in enumerate(SAMPLES)
        ]
    return [
        EncodedSample(f"c{k}", s["tokens"], loss_mask=s["trainable"]["precomputed"])
        for k, s in enumerate(SAMPLES)
    ]


def build(mode: str, layout: str) -> PackedBatch:
    opts: dict[str, Any] = {"loss_mask_mode": None if mode == "roles" else "precomputed"}
    samples = encoded(mode)
    if layout == "micro-batch":
        packs = [
            pack_samples(samples[:3], cp_size=2, **opts),
            pack_samples(samples[3:], cp_size=2, **opts),
        ]
        return micro_batch(packs, cp_size=2, pad_to_length=128)
    layouts = {
        "plain": {},
        "pad8": {"pad_to_multiple_of": 8},
        "cp2": {"cp_size": 2},
        "cp4-pad8": {"pad_to_multiple_of": 8, "cp_size": 4},
    }
    return pack_samples(samples, **opts, **layouts[layout])


LAYOUTS = ["plain", "pad8", "cp2", "cp4-pad8", "micro-batch"]
MODES = ["roles", "precomputed"]


@dataclasses.dataclass
class Reference:
    logits: list[torch.Tensor]
    loss_sum: torch.Tensor
    count: int
    grads_sum: list[torch.Tensor]
    grads_mean: list[torch.Tensor]


@pytest.fixture(scope="module")
def model() -> Any:
    return trainers.tiny_llama()


@pytest.fixture(scope="module")
def reference(model: Any) -> Any:
    @functools.cache
    def of(mode: str) -> Reference:
        pairs = [(s["tokens"], torch.from_numpy(s["trainable"][mode])) for s in SAMPLES]
        logits, loss_sum, count = trainers.unpacked(model, pairs)
        return Reference(
            logits=[lg.detach() for lg in logits],
            loss_sum=loss_sum.detach(),
            count=count,
            grads_sum=trainers.gradients(model, loss_sum),
            grads_mean=trainers.gradients(model, loss_sum / count),
        )

    return of


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    with trainers.megatron_parallel_state():
        yield


def _forward(model: Any, batch: PackedBatch, attention: str) -> torch.Tensor:
    kwargs: dict[str, Any] = {"position_ids": batch.position_ids[None]}
    if attention == "block-mask":
        kwargs["attention_mask"] = trainers.block_causal_mask(
            batch.cu_seqlens_padded, torch.float64
        )
    return model(batch.input_ids[None], **kwargs).logits[0]


@pytest.mark.parametrize("attention", ["position_ids", "block-mask"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_packed_forward_equals_each_sample_alone(
    model: Any, reference: Any, mode: str, layout: str, attention: str
) -> None:
    ref = reference(mode)
    batch = build(mode, layout)
    logits = _forward(model, batch, attention)
    starts = batch.cu_seqlens_padded.tolist()
    for k, want in enumerate(ref.logits):
        got = logits[starts[k] : starts[k] + len(want)]
        assert trainers.relative(got.detach(), want) <= EXACT, f"sample {k}"
    # the loss from labels: one term per trained prediction, nothing else
    assert int(batch.loss_mask.sum()) == ref.count
    loss_sum = F.cross_entropy(logits, batch.labels, reduction="sum")
    assert trainers.relative(loss_sum.detach(), ref.loss_sum) <= EXACT
    assert trainers.relative(trainers.gradients(model, loss_sum), ref.grads_sum) <= EXACT


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_each_trainers_loss_from_our_fields(
    model: Any, reference: Any, megatron: None, mode: str, layout: str
) -> None:
    ref = reference(mode)
    want = ref.loss_sum / ref.count
    batch = build(mode, layout)
    logits = _forward(model, batch, "position_ids")

    # Megatron-Core GPT: vocab_parallel_cross_entropy(logits, labels) * loss_mask
    mega = trainers.megatron_loss(logits, batch.labels, batch.loss_mask)
    assert trainers.relative(mega.detach().double(), want) <= FLOAT32
    assert trainers.relative(trainers.gradients(model, mega), ref.grads_mean) <= FLOAT32

    # Hugging Face: our labels are already shifted, so they go in as shift_labels
    hf = model(
        batch.input_ids[None],
        position_ids=batch.position_ids[None],
        labels=batch.labels[None],
        shift_labels=batch.labels[None],
    ).loss
    assert trainers.relative(hf.detach().double(), want) <= FLOAT32
    assert trainers.relative(trainers.gradients(model, hf), ref.grads_mean) <= FLOAT32

    # NeMo-RL NLL: token_mask[1:] with logits[:-1], per sample by cu_seqlens_padded
    nll = trainers.nemo_rl_nll(logits, batch.input_ids, batch.token_mask, batch.cu_seqlens_padded)
    assert trainers.relative(nll.detach(), want) <= EXACT
    assert trainers.relative(trainers.gradients(model, nll), ref.grads_mean) <= EXACT


@pytest.mark.parametrize("pad_to_multiple_of", [1, 8])
@pytest.mark.parametrize("mode", MODES)
def test_padded_rows_with_pad_equal_to_eos(
    model: Any, reference: Any, megatron: None, mode: str, pad_to_multiple_of: int
) -> None:
    ref = reference(mode)
    want = ref.loss_sum / ref.count
    opts = {"loss_mask_mode": None if mode == "roles" else "precomputed"}
    rows = pad_samples(
        encoded(mode), pad_token_id=EOS, pad_to_multiple_of=pad_to_multiple_of, **opts
    )
    assert rows.input_ids.shape[1] % pad_to_multiple_of == 0
    # real EOS tokens stay attended although EOS is also the padding
    assert bool((rows.input_ids[rows.attention_mask] == EOS).any())
    logits = model(
        rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids
    ).logits
    for k, expected in enumerate(ref.logits):
        got = logits[k, : len(expected)]
        assert trainers.relative(got.detach(), expected) <= EXACT, f"row {k}"
    assert int(rows.loss_mask.sum()) == ref.count
    loss_sum = F.cross_entropy(logits.flatten(0, 1), rows.labels.flatten(), reduction="sum")
    assert trainers.relative(loss_sum.detach(), ref.loss_sum) <= EXACT
    assert trainers.relative(trainers.gradients(model, loss_sum), ref.grads_sum) <= EXACT

    mega = trainers.megatron_loss(logits, rows.labels, rows.loss_mask)
    assert trainers.relative(mega.detach().double(), want) <= FLOAT32
    assert trainers.relative(trainers.gradients(model, mega), ref.grads_mean) <= FLOAT32
    hf = model(
        rows.input_ids,
        attention_mask=rows.attention_mask,
        position_ids=rows.position_ids,
        labels=rows.labels,
        shift_labels=rows.labels,
    ).loss
    assert trainers.relative(hf.detach().double(), want) <= FLOAT32
    assert trainers.relative(trainers.gradients(model, hf), ref.grads_mean) <= FLOAT32
    nll = trainers.nemo_rl_nll(logits, rows.input_ids, rows.token_mask)
    assert trainers.relative(nll.detach(), want) <= EXACT
    assert trainers.relative(trainers.gradients(model, nll), ref.grads_mean) <= EXACT


@pytest.mark.parametrize(("cp_size", "pad_to_multiple_of"), [(1, 1), (2, 1), (4, 8)])
def test_micro_batch_offsets_fit_megatrons_packed_seq_params(
    megatron: None, cp_size: int, pad_to_multiple_of: int
) -> None:
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    layout = {"cp_size": cp_size, "pad_to_multiple_of": pad_to_multiple_of}
    samples = encoded("roles")
    packs = [pack_samples(samples[:3], **layout), pack_samples(samples[3:], **layout)]
    multiple = int(np.lcm(pad_to_multiple_of, 2 * cp_size)) if cp_size > 1 else 1
    length = 256 - 256 % multiple
    batch = micro_batch(packs, pad_to_length=length, **layout)
    # one shape per micro-batch (pipeline parallelism): the last sample absorbs the padding
    assert batch.input_ids.numel() == int(batch.cu_seqlens_padded[-1]) == length
    assert batch.cu_seqlens[-1] == sum(len(s["tokens"]) for s in SAMPLES)
    widths = torch.diff(batch.cu_seqlens_padded)
    assert bool((widths % (2 * cp_size if cp_size > 1 else 1) == 0).all())  # zigzag CP halves
    assert bool((widths >= torch.diff(batch.cu_seqlens)).all())
    assert batch.max_seqlen == int(widths.max())
    # Megatron's own THD helper builds the same PackedSeqParams from our fields
    _, theirs = get_thd_batch_on_this_cp_rank(
        {"tokens": batch.input_ids[None]},
        batch.cu_seqlens,
        batch.cu_seqlens_padded,
        torch.tensor([batch.max_seqlen]),
        cp_size=1,
        cp_rank=0,
    )
    ours = batch.packed_seq_params()
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert (ours.max_seqlen_q, ours.max_seqlen_kv) == (theirs.max_seqlen_q, theirs.max_seqlen_kv)
    assert ours.qkv_format == theirs.qkv_format == "thd"
    # the micro-batch is the pack of all its samples with the same options
    one = pack_samples(samples, pad_to_length=length, **layout)
    for name in PackedBatch._TENSOR_FIELDS:
        assert torch.equal(getattr(batch, name), getattr(one, name)), name


def test_padded_rows_are_the_packed_fields_row_by_row() -> None:
    samples = encoded("roles")
    rows = pad_samples(samples, pad_token_id=EOS)
    assert isinstance(rows, PaddedBatch)
    assert rows.lengths.tolist() == [len(s["tokens"]) for s in SAMPLES]
    assert rows.attention_mask.tolist() == [
        [p < n for p in range(rows.input_ids.shape[1])] for n in rows.lengths.tolist()
    ]
    for k, s in enumerate(samples):
        alone = pack_samples([s], pad_token_id=EOS)
        n = len(SAMPLES[k]["tokens"])
        for name in ("input_ids", "labels", "loss_mask", "token_mask", "position_ids"):
            assert torch.equal(getattr(rows, name)[k, :n], getattr(alone, name)), name
