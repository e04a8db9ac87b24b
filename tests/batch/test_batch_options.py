"""``BatchOptions``: every bad value is refused when the options are made, naming the option;
``options=`` and the keyword arguments build the same batches bit for bit, and contradicting
each other is an error; the native layouts round-trip through the checks and the join; the
field declaration matches the batch classes and the documented table."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from pathlib import Path
from typing import Any, get_type_hints

import mmpack.batch
import numpy as np
import pytest
import torch
from mmpack import _native
from mmpack.batch import (
    BatchOptions,
    EncodedSample,
    PackedBatch,
    micro_batch,
    pack_samples,
)
from mmpack.batch.fields import FIELDS, PADDED_FIELDS, THD_FIELDS
from mmpack.batch.options import OPTION_NAMES, BatchOptionKeywords
from mmpack.batch.padded import PaddedBatch, pad_samples
from mmpack.errors import BatchLayoutError, BatchOptionError, BatchOptionTypeError

BAD_VALUES = [
    ("loss_mask_mode", "roles", False),
    ("train_roles", "assistant", True),
    ("train_roles", ["assistant", 1], True),
    ("pad_token_id", -1, False),
    ("pad_token_id", True, True),
    ("pad_token_id", 2**63, False),
    ("ignore_index", 1.5, True),
    ("ignore_index", -(2**63) - 1, False),
    ("pad_to_multiple_of", 0, False),
    ("pad_to_multiple_of", "8", True),
    ("cp_size", 0, False),
    ("cp_size", 2**63, False),
    ("pad_to_length", 0, False),
    ("pad_to_length", True, True),
]


@pytest.mark.parametrize(("name", "value", "is_type"), BAD_VALUES)
def test_each_bad_value_is_refused_naming_the_option(name: str, value: Any, is_type: bool) -> None:
    with pytest.raises(BatchOptionError, match=rf"\b{name}\b") as caught:
        BatchOptions(**{name: value})
    # a wrong type is also a TypeError, as it was before the options were one value
    assert isinstance(caught.value, TypeError) == is_type
    assert isinstance(caught.value, BatchOptionTypeError) == is_type


def test_options_that_only_fail_together_are_refused_at_construction() -> None:
    with pytest.raises(BatchOptionError, match=r"pad_to_length: 10 is not a multiple of 4"):
        BatchOptions(pad_to_length=10, cp_size=2)
    assert BatchOptions(pad_to_length=12, cp_size=2).pad_to_length == 12


def test_options_are_normalised_frozen_and_picklable() -> None:
    opts = BatchOptions(
        loss_mask_mode="precomputed", train_roles=["assistant", "tool"], pad_to_length=np.int64(8)
    )
    assert opts.train_roles == ("assistant", "tool") and type(opts.pad_to_length) is int
    assert opts.native.precomputed and opts.native.train_roles == ["assistant", "tool"]
    assert opts.native.pad_to_length == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.pad_token_id = 3  # type: ignore[misc]
    for clone in (pickle.loads(pickle.dumps(opts)), copy.deepcopy(opts), copy.copy(opts)):
        assert clone == opts and clone.native.pad_to_length == 8
    assert BatchOptions(**dataclasses.asdict(opts)) == opts
    assert opts == BatchOptions(
        loss_mask_mode="precomputed", train_roles=("assistant", "tool"), pad_to_length=8
    )
    assert hash(opts) == hash(BatchOptions(**opts.keywords()))
    assert opts.keywords() == {
        "loss_mask_mode": "precomputed",
        "train_roles": ("assistant", "tool"),
        "pad_to_length": 8,
    }


def test_the_keyword_types_declare_the_same_options() -> None:
    assert tuple(get_type_hints(BatchOptionKeywords)) == OPTION_NAMES
    assert OPTION_NAMES == (
        "loss_mask_mode",
        "train_roles",
        "pad_token_id",
        "pad_to_multiple_of",
        "ignore_index",
        "cp_size",
        "pad_to_length",
    )


def _samples() -> list[EncodedSample]:
    return [
        EncodedSample("a", [5, 6, 7], loss_mask=[0, 1, 1], message_lengths=[1, 2]),
        EncodedSample("b", [9, 40], loss_mask=[1, 1], message_lengths=[2]),
        EncodedSample("c", [3, 4, 4, 4, 2], loss_mask=[0, 0, 1, 1, 0], message_lengths=[5]),
    ]


def _roles(samples: list[EncodedSample]) -> list[EncodedSample]:
    roles = {"a": ["user", "tool"], "b": ["tool"], "c": ["assistant"]}
    return [dataclasses.replace(s, message_roles=roles[str(s.sample_id)]) for s in samples]


KEYWORD_SETS = [
    {},
    {"loss_mask_mode": "precomputed", "pad_token_id": 2, "ignore_index": -1},
    {"train_roles": ["tool"], "pad_to_multiple_of": 3, "cp_size": 2, "pad_to_length": 36},
    {"loss_mask_mode": "precomputed", "cp_size": 3, "pad_token_id": 7, "ignore_index": 41},
]


def _fields(batch: Any) -> dict[str, Any]:
    return {f.name: getattr(batch, f.name) for f in FIELDS if hasattr(batch, f.name)} | {
        "pad_token_id": batch.pad_token_id,
        "ignore_index": batch.ignore_index,
        "sample_ids": batch.sample_ids,
    }


def _assert_same(a: Any, b: Any) -> None:
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for name, value in fa.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == fb[name].dtype and torch.equal(value, fb[name]), name
        else:
            assert value == fb[name], name


@pytest.mark.parametrize("build", [pack_samples, pad_samples])
@pytest.mark.parametrize("keywords", KEYWORD_SETS)
def test_options_and_keywords_build_the_same_batch(build: Any, keywords: dict[str, Any]) -> None:
    samples = _roles(_samples())
    by_keywords = build(samples, **keywords)
    opts = BatchOptions(**keywords)
    for by_options in (build(samples, opts), build(samples, options=opts)):
        _assert_same(by_options, by_keywords)
    # repeating a value the options hold is no conflict
    _assert_same(build(samples, opts, **keywords), by_keywords)


def test_micro_batch_takes_the_options_the_packs_were_built_with() -> None:
    opts = BatchOptions(loss_mask_mode="precomputed", pad_token_id=1, cp_size=2, ignore_index=-7)
    packs = [pack_samples(_samples()[:2], opts), pack_samples(_samples()[2:], opts)]
    joined = micro_batch(packs, opts.replace(pad_to_length=24))
    _assert_same(joined, micro_batch(packs, cp_size=2, pad_to_length=24))
    assert joined.cu_seqlens_padded.tolist()[-1] == 24 and joined.pad_token_id == 1
    # the keyword path reads only the layout; options= also vouches for the packs' fill values
    with pytest.raises(BatchOptionError, match=r"packs\[0\] has pad_token_id=1, the options 0"):
        micro_batch(packs, BatchOptions(cp_size=2))
    with pytest.raises(BatchLayoutError, match=r"packs\[0\]: sample 0 is padded to 4 positions"):
        micro_batch(packs, opts.replace(cp_size=3))
    # fill values given as keywords are checked too, never silently replaced by the packs'
    with pytest.raises(BatchOptionError, match=r"packs\[0\] has pad_token_id=1, the options 5"):
        micro_batch(packs, cp_size=2, pad_token_id=5)
    with pytest.raises(BatchOptionError, match=r"packs\[0\] has ignore_index=-7, the options -1"):
        micro_batch(packs, cp_size=2, ignore_index=-1)
    _assert_same(joined, micro_batch(packs, cp_size=2, pad_to_length=24, pad_token_id=1))


@pytest.mark.parametrize("roles", [{"assistant": True, "user": False}, {"assistant": 1}])
def test_train_roles_as_a_mapping_is_refused(roles: Any) -> None:
    """Iterating ``{"assistant": True, "user": False}`` would train on both roles."""
    with pytest.raises(BatchOptionTypeError, match="train_roles: a mapping"):
        BatchOptions(train_roles=roles)
    with pytest.raises(BatchOptionTypeError, match="train_roles: a mapping"):
        pack_samples(_roles(_samples()), train_roles=roles)


@pytest.mark.parametrize("build", [pack_samples, pad_samples, micro_batch])
def test_options_and_a_contradicting_keyword_are_refused(build: Any) -> None:
    opts = BatchOptions(pad_token_id=2, cp_size=2)
    name = build.__name__
    with pytest.raises(
        BatchOptionTypeError,
        match=rf"{name}\(\) got options= and keyword arguments that contradict them: "
        r"pad_token_id=5 \(options: 2\)",
    ):
        build(_samples(), opts, pad_token_id=5, cp_size=2)
    with pytest.raises(TypeError, match=rf"{name}\(\) got unexpected keyword arguments: pad\b"):
        build(_samples(), pad=3)
    with pytest.raises(BatchOptionTypeError, match="options must be a BatchOptions, got dict"):
        build(_samples(), {"pad_token_id": 2})


def test_thd_layouts_round_trip_through_check_and_concat() -> None:
    opts = BatchOptions(loss_mask_mode="precomputed", pad_to_multiple_of=4)
    a, b = pack_samples(_samples()[:2], opts), pack_samples(_samples()[2:], opts)
    layout = a.layout()
    assert isinstance(layout, _native.ThdLayout)
    for f in THD_FIELDS:  # the layout shares the batch's memory, field by field
        value = getattr(layout, f.name)
        if f.dtype is None:
            assert value == getattr(a, f.name)
        else:
            assert np.shares_memory(value, getattr(a, f.name).numpy()), f.name
    _native.check_pack(layout, pad_token_id=0, ignore_index=-100)
    joined = _native.concat_packs([layout, b.layout()], opts.native)
    _native.check_pack(joined, pad_token_id=0, ignore_index=-100)
    _assert_same(PackedBatch._from_layout(joined, **_rest(a, b)), micro_batch([a, b], opts))
    # a layout whose fields disagree is refused by both
    labels = layout.labels.copy()
    labels[0] = 99
    bad = _native.ThdLayout(
        **{f.name: getattr(layout, f.name) for f in THD_FIELDS} | {"labels": labels}
    )
    with pytest.raises(BatchLayoutError, match="labels"):
        _native.check_pack(bad, pad_token_id=0, ignore_index=-100)
    with pytest.raises(BatchLayoutError, match=r"packs\[1\]"):
        _native.concat_packs([layout, bad], opts.native)
    # a bool array holding a byte other than 0/1 is read as that byte, and refused
    mask = layout.loss_mask.copy()
    mask.view(np.uint8)[0] = 2
    two = _native.ThdLayout(
        **{f.name: getattr(layout, f.name) for f in THD_FIELDS} | {"loss_mask": mask}
    )
    with pytest.raises(BatchLayoutError, match="loss_mask"):
        _native.check_pack(two, pad_token_id=0, ignore_index=-100)


def _rest(*packs: PackedBatch) -> dict[str, Any]:
    return {
        "sample_ids": [sid for p in packs for sid in p.sample_ids],
        "media": {},
        "pad_token_id": packs[0].pad_token_id,
        "ignore_index": packs[0].ignore_index,
    }


def test_padded_layouts_round_trip_through_check() -> None:
    rows = pad_samples(_samples(), loss_mask_mode="precomputed", pad_to_multiple_of=4)
    layout = rows.layout()
    assert isinstance(layout, _native.PaddedLayout) and layout.input_ids.shape == (3, 8)
    _native.check_padded(layout, pad_token_id=0, ignore_index=-100)
    attention = layout.attention_mask.copy()
    attention[0, 5] = True  # past the row's length
    bad = _native.PaddedLayout(
        **{f.name: getattr(layout, f.name) for f in PADDED_FIELDS} | {"attention_mask": attention}
    )
    with pytest.raises(BatchLayoutError, match="attention_mask"):
        _native.check_padded(bad, pad_token_id=0, ignore_index=-100)
    # Fortran-ordered rows are contiguous too: read flat, rows would be columns
    fortran = _native.PaddedLayout(
        **{
            f.name: np.asfortranarray(getattr(layout, f.name))
            if getattr(layout, f.name).ndim == 2
            else getattr(layout, f.name)
            for f in PADDED_FIELDS
        }
    )
    with pytest.raises(TypeError, match="C-contiguous"):
        _native.check_padded(fortran, pad_token_id=0, ignore_index=-100)


@pytest.mark.parametrize(
    ("cls", "fields"), [(PackedBatch, THD_FIELDS), (PaddedBatch, PADDED_FIELDS)]
)
def test_the_field_declaration_matches_the_batch_classes(cls: type, fields: Any) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    assert names[: len(fields)] == [f.name for f in fields]
    assert names[len(fields) :] == ["sample_ids", "media", "pad_token_id", "ignore_index"]
    hints = get_type_hints(cls)
    for f in fields:
        assert hints[f.name] is (int if f.dtype is None else torch.Tensor), f.name
    assert cls._TENSOR_FIELDS == tuple(f.name for f in fields if f.dtype is not None)  # type: ignore[attr-defined]


def test_the_field_declaration_matches_built_batches_and_the_documented_table() -> None:
    pack = pack_samples(_samples(), loss_mask_mode="precomputed")
    rows = pad_samples(_samples(), loss_mask_mode="precomputed")
    for batch, fields, layout in ((pack, THD_FIELDS, "thd"), (rows, PADDED_FIELDS, "padded")):
        for f in fields:
            value = getattr(batch, f.name)
            if f.dtype is None:
                assert type(value) is int
            else:
                assert value.dtype == f.dtype and value.ndim == f.ndim(layout), f.name
    # the table's body lies between its second and third rule lines
    body = re.split(r"^=+  =+.*$", mmpack.batch.__doc__ or "", flags=re.MULTILINE)[2]
    table = re.findall(r"^``(\w+)``\s+(\w+)\s", body, flags=re.MULTILINE)
    declared = [
        (f.name, "int" if f.dtype is None else str(f.dtype).removeprefix("torch.")) for f in FIELDS
    ]
    assert table == declared


def test_the_readme_table_lists_the_declared_fields_in_order() -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    section = readme.read_text(encoding="utf-8").split("### Batch fields", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert rows[: len(FIELDS)] == [f.name for f in FIELDS]


@dataclasses.dataclass(frozen=True)
class _WithSmoothing(BatchOptions):
    label_smoothing: float = 0.0


def test_a_subclass_keeps_its_own_fields_through_pickle() -> None:
    """Options travel to loader workers by pickle: a subclass's additions come back too."""
    opts = _WithSmoothing(pad_token_id=3, label_smoothing=0.1)
    back = pickle.loads(pickle.dumps(opts))
    assert type(back) is _WithSmoothing and back == opts and back.label_smoothing == 0.1
    assert back.native.pad_token_id == 3
