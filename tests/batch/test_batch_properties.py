"""Hypothesis: the native batch builders (packs, padded rows, micro-batches) equal the
plain-torch reference builders for random samples, both loss-mask modes and random options,
errors included (same exception class); the native field checks accept exactly the batches the
plain rules call consistent."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from mmpack import PackedTensor
from mmpack.batch import EncodedSample, PackedBatch, micro_batch, pack_samples
from mmpack.batch.padded import PaddedBatch, pad_samples
from mmpack.errors import BatchLayoutError, MmpackError
from reference import batch as ref_batch
from reference.errors import ReferenceInputError
from reference.packed_tensor import PackedTensor as RefPackedTensor

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


def _options(draw: st.DrawFn, allow_bad: bool = False) -> dict[str, object]:
    opts: dict[str, object] = {
        "loss_mask_mode": draw(st.sampled_from([None, "precomputed"])),
        "train_roles": tuple(draw(st.sets(st.sampled_from(ROLES), max_size=3))),
        "pad_token_id": draw(st.integers(-1 if allow_bad else 0, 5)),
        "pad_to_multiple_of": draw(st.sampled_from([1, 2, 3, 8, 64])),
        # a non-negative ignore_index within the token ids is refused; past them it is fine
        "ignore_index": draw(st.sampled_from([-100, -1, 10**6] + ([0, 7] if allow_bad else []))),
        "cp_size": draw(st.sampled_from([1, 1, 2, 3, 4])),
    }
    if draw(st.booleans()):
        extra = draw(st.integers(-1 if allow_bad else 0, 3))
        opts["pad_to_length"] = ("room", extra)  # resolved against the samples by _resolve
    return opts


def _resolve(opts: dict[str, object], batch: list[EncodedSample], padded: bool) -> None:
    """``pad_to_length``: the natural length plus ``extra`` padding multiples (-1: too short,
    or not a multiple when that cannot be)."""
    room = opts.pop("pad_to_length", None)
    if room is None:
        return
    extra = room[1]  # type: ignore[index]
    pad, cp = int(opts["pad_to_multiple_of"]), int(opts["cp_size"])  # type: ignore[call-overload]
    multiple = int(np.lcm(pad, 2 * cp)) if cp > 1 else pad
    lens = [len(s.token_ids) for s in batch] or [1]
    sizes = [-(-n // multiple) * multiple for n in lens]
    natural = max(sizes) if padded else sum(sizes)
    opts["pad_to_length"] = max(natural + extra * multiple, 1) if extra >= 0 else natural - 1


FIELDS = PackedBatch._TENSOR_FIELDS


@given(st.data())
def test_native_equals_reference_on_valid_samples(data: st.DataObject) -> None:
    batch = data.draw(st.lists(samples(allow_bad=False), min_size=1, max_size=8))
    opts = _options(data.draw)
    _resolve(opts, batch, padded=False)
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
    assert torch.equal(got.loss_mask, got.labels != ignore)
    assert int(got.loss_mask.sum()) <= int(got.token_mask.sum())
    if "pad_to_length" in opts:
        assert got.input_ids.numel() == opts["pad_to_length"]
    # the core's own output passes the checks a hand-built batch goes through
    dataclasses.replace(got)


@given(st.data())
def test_padded_rows_equal_reference(data: st.DataObject) -> None:
    batch = data.draw(st.lists(samples(allow_bad=False), min_size=1, max_size=6))
    opts = _options(data.draw)
    _resolve(opts, batch, padded=True)
    got = pad_samples(batch, **opts)  # type: ignore[arg-type]
    want = ref_batch.pad_samples(batch, **opts)  # type: ignore[arg-type]
    for name in PaddedBatch._TENSOR_FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and torch.equal(g, w), name
    dataclasses.replace(got)
    # each row holds the fields of its sample packed alone
    for r, s in enumerate(batch):
        alone = pack_samples([s], **{k: v for k, v in opts.items() if k != "pad_to_length"})  # type: ignore[arg-type]
        n = len(s.token_ids)
        for name in ("input_ids", "labels", "loss_mask", "token_mask", "position_ids"):
            assert torch.equal(getattr(got, name)[r, :n], getattr(alone, name)[:n]), name


@given(st.data())
def test_micro_batch_equals_reference_and_one_big_pack(data: st.DataObject) -> None:
    packs_samples = data.draw(
        st.lists(st.lists(samples(allow_bad=False), min_size=1, max_size=4), min_size=1, max_size=4)
    )
    opts = _options(data.draw)
    opts.pop("pad_to_length", None)
    packs = [pack_samples(ps, **opts) for ps in packs_samples]  # type: ignore[arg-type]
    layout = {"pad_to_multiple_of": opts["pad_to_multiple_of"], "cp_size": opts["cp_size"]}
    flat = [s for ps in packs_samples for s in ps]
    extra = data.draw(st.integers(0, 2))
    if extra:
        room = {"pad_to_length": ("room", extra - 1), **layout}
        _resolve(room, flat, padded=False)
        layout["pad_to_length"] = room["pad_to_length"]
    got = micro_batch(packs, **layout)  # type: ignore[arg-type]
    ref_packs = [ref_batch.pack_samples(ps, **opts) for ps in packs_samples]  # type: ignore[arg-type]
    want = ref_batch.micro_batch(ref_packs, **layout)  # type: ignore[arg-type]
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.max_seqlen == want.max_seqlen and got.sample_ids == want.sample_ids
    # several packs are one pack of all their samples
    one = pack_samples(flat, **opts, pad_to_length=layout.get("pad_to_length"))  # type: ignore[arg-type]
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(one, name)), name


@given(st.data())
def test_field_checks_accept_exactly_the_consistent_batches(data: st.DataObject) -> None:
    """Corrupt one value of a valid pack: the native check refuses it exactly when the plain
    rules (``reference.batch.consistent``) do."""
    batch = data.draw(st.lists(samples(allow_bad=False), min_size=1, max_size=4))
    good = pack_samples(batch, loss_mask_mode="precomputed", pad_to_multiple_of=4)
    name = data.draw(
        st.sampled_from(["input_ids", "labels", "loss_mask", "token_mask", "position_ids"])
    )
    values = getattr(good, name).clone()
    at = data.draw(st.integers(0, values.numel() - 1))
    if values.dtype == torch.bool:
        values[at] = not bool(values[at])
    else:
        values[at] = data.draw(st.sampled_from([-100, -1, 0, 1, 2, 3, int(values[at]) + 1]))
    bad = {f: getattr(good, f) for f in FIELDS} | {name: values}
    cu, cup = good.cu_seqlens.tolist(), good.cu_seqlens_padded.tolist()
    rows = [
        {f: [int(v) for v in bad[f][cup[i] : cup[i + 1]]] for f in FIELDS if not f.startswith("cu")}
        for i in range(len(cu) - 1)
    ]
    lengths = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    ok = ref_batch.consistent(rows, lengths, good.pad_token_id, good.ignore_index)
    try:
        dataclasses.replace(good, **{name: values})
        accepted = True
    except BatchLayoutError:
        accepted = False
    assert accepted == ok


@given(st.data())
def test_native_and_reference_fail_alike(data: st.DataObject) -> None:
    batch = data.draw(st.lists(samples(allow_bad=True), min_size=0, max_size=6))
    opts = _options(data.draw, allow_bad=True)
    padded = data.draw(st.booleans())
    _resolve(opts, batch, padded=padded)
    builders = (
        (pad_samples, ref_batch.pad_samples) if padded else (pack_samples, ref_batch.pack_samples)
    )
    outcome = []
    for build, errors in zip(builders, (MmpackError, ReferenceInputError), strict=True):
        try:
            build(batch, **opts)  # type: ignore[operator]
            outcome.append(None)
        except errors as e:  # the same kind of failure: classes of the same name
            outcome.append(type(e).__name__)
    assert outcome[0] == outcome[1]


# ---- media: the same items joined by mmpack's PackedTensor and by NeMo-RL's (the reference)

POOL = [torch.full((k + 1, 3), float(k)) for k in range(5)]


def _media_value(cls: type, items: list[int]) -> object:
    """One sample's media row over `POOL` items (one provenance per item), built in `cls`."""
    if not items:
        return cls([], 0, _row_offsets=[0, 0], _segment_indices=[], _segment_provenance=[])
    parts = [cls([POOL[i]], 0, _segment_provenance=[bytes([i + 1]) * 16]) for i in items]
    return cls.merge_segments(parts)


def _with_media(batch: list[EncodedSample], media: list[list[int] | None], cls: type) -> list:
    """The samples of `batch` with the media `media` (None: no media key) in `cls`, as
    mmpack's `EncodedSample` (mmpack's class) or the reference's (the reference's class)."""
    make = EncodedSample if cls is PackedTensor else ref_batch.EncodedSample
    return [
        make(
            s.sample_id,
            s.token_ids,
            loss_mask=s.loss_mask,
            message_lengths=s.message_lengths,
            message_roles=s.message_roles,
            media=None if items is None else {"pixel_values": _media_value(cls, items)},
        )
        for s, items in zip(batch, media, strict=True)
    ]


def _media_view(media: dict[str, object]) -> dict[str, object]:
    """What the model reads of each media key, as plain data: the materialized tensor, the
    physical segments and which of them each row references (provenance left out)."""
    out = {}
    for key, value in media.items():
        whole = value.as_tensor()  # type: ignore[attr-defined]
        out[key] = (
            None if whole is None else whole.tolist(),
            [t.tolist() for t in value.tensors],  # type: ignore[attr-defined]
            value._row_offsets,  # type: ignore[attr-defined]
            value._segment_indices,  # type: ignore[attr-defined]
        )
    return out


@given(st.data())
def test_media_joins_equal_the_reference(data: st.DataObject) -> None:
    batch = data.draw(st.lists(samples(allow_bad=False), min_size=1, max_size=5))
    items = st.none() | st.lists(st.integers(0, len(POOL) - 1), max_size=3)
    media = data.draw(st.lists(items, min_size=len(batch), max_size=len(batch)))
    mine = _with_media(batch, media, PackedTensor)
    theirs = _with_media(batch, media, RefPackedTensor)
    opts = {"loss_mask_mode": "precomputed", "pad_to_multiple_of": 2}
    got, want = pack_samples(mine, **opts), ref_batch.pack_samples(theirs, **opts)  # type: ignore[arg-type]
    assert _media_view(got.media) == _media_view(want.media)
    rows, ref_rows = pad_samples(mine, **opts), ref_batch.pad_samples(theirs, **opts)  # type: ignore[arg-type]
    assert _media_view(rows.media) == _media_view(ref_rows.media)
    cut = data.draw(st.integers(1, len(batch)))
    step = micro_batch([pack_samples(mine[:cut], **opts), got], pad_to_multiple_of=2)  # type: ignore[arg-type]
    ref_step = ref_batch.micro_batch(
        [ref_batch.pack_samples(theirs[:cut], **opts), want],  # type: ignore[arg-type]
        pad_to_multiple_of=2,
    )
    assert _media_view(step.media) == _media_view(ref_step.media)
