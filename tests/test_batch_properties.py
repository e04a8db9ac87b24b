"""Hypothesis: the native batch builder equals the plain-torch reference builder for random
samples, both loss-mask modes and random options, errors included (same exception class)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from mmpack.batch import EncodedSample, pack_samples
from mmpack.errors import MmpackError
from reference import batch as ref_batch

ROLES = ["system", "user", "assistant", "tool"]


@st.composite
def samples(draw: st.DrawFn, allow_bad: bool) -> EncodedSample:
    n_msgs = draw(st.integers(1, 5))
    lengths = draw(
        st.lists(st.integers(0 if allow_bad else 1, 12), min_size=n_msgs, max_size=n_msgs)
    )
    roles = draw(st.lists(st.sampled_from(ROLES), min_size=n_msgs, max_size=n_msgs))
    n = sum(lengths)
    tokens = draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n))
    mask_values = st.integers(0, 1)
    if allow_bad and draw(st.integers(0, 9)) == 0:
        mask_values = st.integers(-1, 2)
    mask = draw(st.lists(mask_values, min_size=n, max_size=n))
    if allow_bad and draw(st.integers(0, 9)) == 0:
        mask = mask[:-1]  # wrong length
    if allow_bad and draw(st.integers(0, 9)) == 0:
        lengths = [*lengths, 1]  # lengths no longer sum to the token count
        roles = [*roles, "user"]
    token_kind = draw(st.sampled_from(["numpy", "torch", "list", "int32"]))
    tok: object
    if token_kind == "numpy":
        tok = np.array(tokens, dtype=np.int64)
    elif token_kind == "torch":
        tok = torch.tensor(tokens, dtype=torch.long)
    elif token_kind == "int32":
        tok = np.array(tokens, dtype=np.int32)
    else:
        tok = tokens
    mask_kind = draw(st.sampled_from([np.int64, np.bool_, np.uint8, np.float32]))
    mask_arr = np.array(mask, dtype=np.int64)
    if mask_kind is np.bool_ and not ((mask_arr == 0) | (mask_arr == 1)).all():
        mask_kind = np.int64  # bool cannot hold a bad value
    return EncodedSample(
        sample_id=f"s{draw(st.integers(0, 10**6))}",
        token_ids=tok,
        loss_mask=mask_arr.astype(mask_kind),
        message_lengths=lengths,
        message_roles=roles,
    )


def _options(draw: st.DrawFn) -> dict[str, object]:
    return {
        "loss_mask_mode": draw(st.sampled_from([None, "precomputed"])),
        "train_roles": tuple(draw(st.sets(st.sampled_from(ROLES), max_size=3))),
        "pad_token_id": draw(st.integers(0, 5)),
        "pad_to_multiple_of": draw(st.sampled_from([1, 2, 3, 8, 64])),
        "ignore_index": draw(st.sampled_from([-100, -1])),
        "cp_size": draw(st.sampled_from([1, 1, 2, 3, 4])),
    }


FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded")


@given(st.data())
def test_native_equals_reference_on_valid_samples(data: st.DataObject) -> None:
    batch = data.draw(st.lists(samples(allow_bad=False), min_size=1, max_size=8))
    opts = _options(data.draw)
    got = pack_samples(batch, **opts)  # type: ignore[arg-type]
    want = ref_batch.pack_samples(batch, **opts)  # type: ignore[arg-type]
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype, name
        assert torch.equal(g, w), name
    assert got.max_seqlen == want.max_seqlen
    assert got.sample_ids == want.sample_ids
    # invariants of the layout
    assert got.input_ids.numel() == int(got.cu_seqlens_padded[-1])
    assert bool((torch.diff(got.cu_seqlens_padded) >= torch.diff(got.cu_seqlens)).all())
    ignore = int(opts["ignore_index"])  # type: ignore[call-overload]
    trained = got.labels != ignore
    assert int(trained.sum()) <= int(got.loss_mask.sum())


@given(st.data())
def test_native_and_reference_fail_alike(data: st.DataObject) -> None:
    batch = data.draw(st.lists(samples(allow_bad=True), min_size=0, max_size=6))
    opts = _options(data.draw)
    outcome = []
    for build in (pack_samples, ref_batch.pack_samples):
        try:
            build(batch, **opts)  # type: ignore[operator]
            outcome.append(None)
        except MmpackError as e:
            outcome.append(type(e))
    assert outcome[0] == outcome[1]
