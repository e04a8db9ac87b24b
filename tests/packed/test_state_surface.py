"""Serialization reads a ``PackedTensor`` only through its state surface
(``mmpack.packed.state``): the pickle format, the Ray store path and the payload meter are
adapters that never touch a value's private members, a value's walk through pickling goes one
way (value -> pickling -> ray_store), and a pickling operation's start can be followed."""

from __future__ import annotations

import ast
import gc
import pickle
import sys
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import mmpack.packed
import pytest
import torch
from mmpack.errors import LayoutError
from mmpack.packed import PackedTensor
from mmpack.packed.pickling import operation, operation_start
from mmpack.packed.state import VALUE_FIELDS, PackedState
from mmpack.packed.storage import SegmentStorage

PACKED = Path(mmpack.packed.__file__).resolve().parent
ADAPTERS = [
    *sorted((PACKED / "pickling").glob("*.py")),
    *sorted((PACKED / "ray_store").glob("*.py")),
    PACKED / "payload.py",
]
#: NeMo-RL's row-mapping attributes are its public face of the layout, not mmpack's internals.
NEMO_RL_ATTRIBUTES = {"_row_offsets", "_segment_indices", "_segment_provenance"}


def _value_privates() -> set[str]:
    """Every private member the value's classes define or set on an instance."""
    names = set(VALUE_FIELDS) - {"tensors", "dim_to_pack", "pad_to_max_shape"}
    for cls in (PackedTensor, SegmentStorage):
        names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
    return names - NEMO_RL_ATTRIBUTES


def test_the_walk_check_sees_a_wrong_way_call() -> None:
    """A guard on the guard: the format naming a value in an error calls ``len(value)``, a call
    back into the value, and the check sees it."""
    from mmpack.errors import LayoutMismatchError

    value = _values()[0]
    value.tensors.append(torch.ones(1, 3))  # no longer fits its provenance

    def write() -> None:
        with pytest.raises(LayoutMismatchError):
            pickle.dumps(value)

    edges = _edges(write)
    assert ("pickling", "value") in edges and not _one_way(edges)


def test_the_privates_list_sees_the_value() -> None:
    privates = _value_privates()
    assert {"_lay", "_phys", "_store", "_layout", "_make", "_take_state"} <= privates


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_adapters_never_touch_a_values_private_members(path: Path) -> None:
    privates = _value_privates() | {"__dict__"}
    tree = ast.parse(path.read_text(), str(path))
    touched = [
        f"{path.name}:{node.lineno} .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in privates
    ]
    assert touched == []


def _room(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if name in ("mmpack.packed.value", "mmpack.packed.storage"):
        return "value"
    if name.startswith("mmpack.packed.pickling"):
        return "pickling"
    if name.startswith("mmpack.packed.ray_store"):
        return "ray_store"
    return None


ORDER = {"value": 0, "pickling": 1, "ray_store": 2}


def _edges(run: Any) -> set[tuple[str, str]]:
    """The (caller room, callee room) pairs of every Python call ``run()`` makes between the
    value, the pickle format and the Ray store path (through shared helpers such as
    ``mmpack.packed.state``: the nearest room up the stack is the caller)."""
    edges: set[tuple[str, str]] = set()

    def profile(frame: FrameType, event: str, _: Any) -> None:
        callee = _room(frame) if event == "call" else None
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and _room(caller) is None:
            caller = caller.f_back
        origin = None if caller is None else _room(caller)
        if origin is not None and origin != callee:
            edges.add((origin, callee))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return edges


def _one_way(edges: set[tuple[str, str]]) -> bool:
    return all(ORDER[a] < ORDER[b] for a, b in edges)


def _values() -> list[PackedTensor]:
    images = [torch.randn(4, 3), torch.randn(2, 3)]
    value = PackedTensor.merge_segments([PackedTensor(t, 0).enable_deduplication() for t in images])
    return [value, value.repeat_interleave(3)]


@pytest.mark.parametrize("protocol", [2, 5])
def test_a_plain_pickle_walks_one_way(protocol: int) -> None:
    values = _values()
    blob = pickle.dumps(values, protocol=protocol)
    out = _edges(lambda: pickle.dumps(values, protocol=protocol))
    assert ("value", "pickling") in out and _one_way(out), out
    back = _edges(lambda: pickle.loads(blob))
    assert back == {("value", "pickling")}  # a plain pickle never reaches the store path
    back = pickle.loads(blob)
    assert torch.equal(back[1].as_tensor(), values[1].as_tensor())


def _let_go(*held: list[Any]) -> None:
    """Drop what a Ray test sent and received: the put table holds nothing after it (the next
    test module on this worker starts from an empty table)."""
    from mmpack.packed import ray_store

    for items in held:
        items.clear()
    gc.collect()
    assert ray_store.held_bytes() == 0


def test_a_ray_hop_walks_one_way(ray_store_on: Any) -> None:
    ray = ray_store_on
    values = _values()
    refs: list[Any] = []
    out = _edges(lambda: refs.append(ray.put(values)))
    assert {("value", "pickling"), ("pickling", "ray_store")} <= out and _one_way(out), out
    got: list[Any] = []
    back = _edges(lambda: got.append(ray.get(refs[0])))
    assert {("value", "pickling"), ("pickling", "ray_store")} <= back and _one_way(back), back
    assert got[0][1].packed_state(in_place=True).read_in_place
    assert torch.equal(got[0][1].as_tensor(), values[1].as_tensor())
    _let_go(values, refs, got)


def test_the_state_round_trips_through_the_surface() -> None:
    value = _values()[1]
    value.note = "kept"  # type: ignore[attr-defined]
    state = value.packed_state()
    assert isinstance(state, PackedState) and not state.read_in_place
    assert state.extra == {"note": "kept"} and state.segments is value.tensors
    copy = PackedTensor.from_packed_state(state)
    assert copy.note == "kept"  # type: ignore[attr-defined]
    assert copy._row_offsets == value._row_offsets
    assert copy._segment_provenance == value._segment_provenance
    assert torch.equal(copy.as_tensor(), value.as_tensor())  # type: ignore[arg-type]


def test_a_pickling_operation_starts_where_a_reader_can_follow_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The package's module ``__getattr__`` is the named hook, and the stack of an operation's
    start shows it between the pickler and the operation bookkeeping."""
    assert mmpack.packed.__getattr__ is operation_start.packed_module_getattr  # type: ignore[attr-defined]
    stacks: list[list[str]] = []
    started = operation.ThreadState.pickler_started

    def spy(self: operation.ThreadState) -> None:
        stacks.append([f"{f.name}@{Path(f.filename).name}" for f in traceback.extract_stack()])
        started(self)

    monkeypatch.setattr(operation.ThreadState, "pickler_started", spy)
    values = _values()
    pickle.dumps(values, protocol=5)
    assert len(stacks) == 1  # once per pickler: the memo writes the global once
    (stack,) = stacks
    assert stack[-2:] == ["packed_module_getattr@operation_start.py", "spy@test_state_surface.py"]
    pickle.dumps(values, protocol=5)  # a second pickler starts a second operation
    assert len(stacks) == 2


def test_a_lookup_outside_a_pickler_starts_nothing() -> None:
    from mmpack.packed import PackedTensor as looked_up

    assert looked_up is PackedTensor
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mmpack.packed.Nope  # type: ignore[attr-defined]  # noqa: B018


def test_a_corrupt_store_chunk_is_a_layout_error() -> None:
    """The store path's decoding faults are mmpack's typed errors, as the plain format's are."""
    from mmpack.packed.ray_store import chunks

    fmt = chunks.CHUNK_FORMAT
    good = torch.arange(6, dtype=torch.float32).view(torch.uint8).numpy().copy()
    for payload in (
        ("not-a-chunk", [], [], []),
        (fmt, ["float32"], [(6,)], []),
        (fmt, ["no-such-dtype"], [(6,)], [good]),
        (fmt, ["float32"], [(7,)], [good]),
        (fmt, ["float32"], [(6,)], [good.view(">u2")]),
    ):
        with pytest.raises(LayoutError, match="corrupt PackedTensor pickle"):
            chunks.Chunk(None, payload)
    for segments in (
        ("other-format", b"", b"", [], []),
        (chunks.STORE_FORMAT, b"\0" * 8, b"", [], []),
        (chunks.STORE_FORMAT, (-3).to_bytes(8, "little", signed=True), b"\0" * 8, [], []),
    ):
        with pytest.raises(LayoutError, match="corrupt PackedTensor pickle"):
            chunks.decode_segments(segments)


def test_a_chunk_member_too_large_to_allocate_is_corrupt() -> None:
    from mmpack.packed.ray_store import chunks

    empty = torch.empty(0, dtype=torch.uint8).numpy()
    payload = (chunks.CHUNK_FORMAT, ["float32"], [(2**62, 2**62, 0)], [empty])
    with pytest.raises(LayoutError, match="corrupt PackedTensor pickle"):
        chunks.Chunk(None, payload)
    ok = chunks.Chunk(None, (chunks.CHUNK_FORMAT, ["float32"], [(3, 0)], [empty]))
    assert ok.shapes == [(3, 0)]


@pytest.mark.parametrize("restricted", [False, True])
def test_a_group_buffer_of_a_dtype_never_written_is_refused(restricted: bool) -> None:
    """Groups write only the dtypes of ``BUFFER_DTYPES``: a payload naming another torch dtype
    (quantized, float8, ...) is corrupt, not a tensor that breaks later."""
    from mmpack.compat import nemo_rl

    data = pickle.dumps(PackedTensor([torch.arange(4, dtype=torch.int32)], 0), protocol=2)
    name = b"X\x05\x00\x00\x00int32"
    assert data.count(name) == 1
    bad = data.replace(name, b"X\x06\x00\x00\x00qint32")
    load = nemo_rl.loads if restricted else pickle.loads
    with pytest.raises(LayoutError, match="unknown dtype 'qint32'"):
        load(bad)
    assert torch.equal(load(data).tensors[0], torch.arange(4, dtype=torch.int32))


def test_earlier_internal_module_paths_are_gone_not_aliased() -> None:
    """The format's functions changed shape (``restore`` returns a state): an alias under the
    old path would run them with the old call and fail silently."""
    with pytest.raises(ImportError):
        import mmpack.packed.pickle_format  # noqa: F401


def test_raw_fields_written_into_a_values_dict_are_written_as_its_mapping() -> None:
    """NeMo-RL's own ``__setstate__`` is ``self.__dict__.update(state)``: fields written so
    into a built value are its mapping in the state serialization reads (a pickle that loads
    and means what NeMo-RL's would), never extra attributes."""
    a, b = torch.zeros(2, 3), torch.ones(1, 3)
    v = PackedTensor([a, b], 0)
    v.__dict__.update(_row_offsets=[0, 2], _segment_indices=[1, 0], _segment_provenance=None)
    state = v.packed_state()
    assert state.extra is None and state.layout is not None
    back = pickle.loads(pickle.dumps(v))
    assert back._row_offsets == [0, 2] and len(back) == 1
    assert torch.equal(back.as_tensor(), torch.cat([b, a]))  # type: ignore[arg-type]
    dedup = PackedTensor([a, b], 0).enable_deduplication()
    prov = dedup._segment_provenance
    dedup.__dict__["_row_offsets"] = [0, 1, 2]  # two fields: the third one is kept
    dedup.__dict__["_segment_indices"] = [1, 1]
    back = pickle.loads(pickle.dumps(dedup))
    assert back._segment_provenance == prov and back._segment_indices == [1, 1]
    assert torch.equal(back.as_tensor(), torch.cat([b, b]))  # type: ignore[arg-type]


class DefaultPad(PackedTensor):
    pad_to_max_shape = False  # a class default: an instance dict may hold three fields


def test_extra_attributes_survive_when_the_dict_lacks_a_field() -> None:
    s = DefaultPad.__new__(DefaultPad)
    s.__dict__.update(tensors=[torch.ones(2, 3)], dim_to_pack=0, note="kept")
    assert s.packed_state().extra == {"note": "kept"}
    assert pickle.loads(pickle.dumps(s)).note == "kept"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"extra": {"tensors": []}}, "own fields"),
        ({"extra": {"_layout": None}}, "own fields"),
        ({"extra": {"as_tensor": "x"}}, "would hide"),
        ({"extra": {1: "x"}}, "not a string"),
        ({"extra": ["x"]}, "extra attributes must be a dict"),
        ({"layout": "garbage"}, "must be a PackedLayout"),
        ({"segments": None}, "segments must be a list"),
        ({"segments": []}, "do not fit"),
        ({"dim_to_pack": True}, "dim_to_pack must be an int"),
        ({"pad_to_max_shape": 1}, "pad_to_max_shape must be a bool"),
        ({"read_in_place": "yes"}, "read_in_place must be a bool"),
    ],
)
def test_from_packed_state_refuses_what_no_value_can_hold(
    change: dict[str, Any], message: str
) -> None:
    state = _values()[1].packed_state()
    with pytest.raises(LayoutError, match=message):
        PackedTensor.from_packed_state(state._replace(**change))


def test_from_packed_state_owns_its_lists() -> None:
    value = _values()[0]
    value.note = "kept"  # type: ignore[attr-defined]
    state = value.packed_state()
    copy = PackedTensor.from_packed_state(state)
    copy.tensors.append(None)
    copy.note = "changed"  # type: ignore[attr-defined]
    assert len(value.tensors) == len(state.segments) and value.note == "kept"  # type: ignore[attr-defined]


def test_reading_sizes_of_a_received_value_keeps_it_in_place(ray_store_on: Any) -> None:
    """The payload meter, ``csr`` and ``enable_deduplication`` need shapes only: a value read
    in place from the store stays so, and the meter counts its bytes once."""
    from mmpack.packed.payload import measure

    ray = ray_store_on
    sent = PackedTensor([torch.randn(64, 32) for _ in range(3)], 0)
    ref = ray.put([sent, sent.slice([2, 1, 0])])  # two values over the same three segments
    for look in (measure, lambda w: w[0].csr(), lambda w: w[0].enable_deduplication()):
        got = ray.get(ref)
        assert got[0].packed_state(in_place=True).read_in_place
        look(got)
        assert got[0].packed_state(in_place=True).read_in_place
    stats = measure(ray.get(ref))
    assert stats.physical_bytes == sent.physical_nbytes() == 3 * 64 * 32 * 4
    assert stats.logical_bytes == 2 * stats.physical_bytes
    del sent, ref, got, stats
    _let_go()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tensors": []}, "one of the value's own fields"),
        ({"_segment_indices": [0]}, "one of the value's own fields"),
        (["note"], "must be a dict or None"),
        ({"as_tensor": 1}, "would hide"),
    ],
)
@pytest.mark.parametrize("restricted", [False, True])
def test_a_payload_with_bad_extra_attributes_is_corrupt(
    extra: Any, message: str, restricted: bool
) -> None:
    """Reading a pickle applies the same extra-attribute rule as ``from_packed_state``."""
    import copyreg

    from mmpack.compat import nemo_rl

    state = PackedTensor([torch.ones(2)], 0).__reduce_ex__(2)[2]
    state["extra"] = extra

    class Handmade:
        def __reduce__(self) -> Any:
            return (copyreg._reconstructor, (PackedTensor, object, None), state)  # type: ignore[attr-defined]

    data = pickle.dumps(Handmade(), protocol=2)
    with pytest.raises(LayoutError, match=f"corrupt PackedTensor pickle: .*{message}"):
        (nemo_rl.loads if restricted else pickle.loads)(data)
