"""Serialization reads a ``PackedTensor`` only through its state surface
(``mmpack.packed.state``): the pickle format, the Ray store path and the payload meter are
adapters that never touch a value's private members, a value's walk through pickling goes one
way (value -> pickling -> ray_store), and a pickling operation's start can be followed."""

from __future__ import annotations

import ast
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
