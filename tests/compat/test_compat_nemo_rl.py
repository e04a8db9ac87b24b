"""``mmpack.compat.nemo_rl``: install() into NeMo-RL, and loads()/load() of NeMo-RL pickles.

NeMo-RL is not installed here. To write pickles exactly as NeMo-RL does, each test registers a
tiny fake ``nemo_rl.data.multimodal_utils`` module whose ``PackedTensor`` is a plain class (right
``__module__``/``__qualname__``, plain instance ``__dict__``, no reduce hooks), pickles instances of
it, then removes the fake module before loading.
"""

from __future__ import annotations

import collections
import copy
import functools
import io
import os
import pickle
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import mmpack
import pytest
import torch
from mmpack.compat import nemo_rl as compat
from mmpack.errors import CorruptPickleError, MmpackError, UnsafePickleError

MODULE = "nemo_rl.data.multimodal_utils"


def _fake_modules() -> dict[str, types.ModuleType]:
    class PackedTensor:  # the attribute layout NeMo-RL pickles: a plain instance __dict__
        pass

    PackedTensor.__module__ = MODULE
    PackedTensor.__qualname__ = "PackedTensor"
    root = types.ModuleType("nemo_rl")
    root.__path__ = []
    data = types.ModuleType("nemo_rl.data")
    data.__path__ = []
    leaf = types.ModuleType(MODULE)
    leaf.PackedTensor = PackedTensor  # type: ignore[attr-defined]
    root.data = data  # type: ignore[attr-defined]
    data.multimodal_utils = leaf  # type: ignore[attr-defined]
    return {"nemo_rl": root, "nemo_rl.data": data, MODULE: leaf}


class FakeNemoRL:
    """Registers the fake NeMo-RL modules while writing; ``dumps`` builds NeMo-RL objects."""

    def __init__(self) -> None:
        self.modules = _fake_modules()
        self.cls: type = self.modules[MODULE].PackedTensor  # type: ignore[attr-defined]

    def make(self, state: dict[str, Any]) -> Any:
        obj = self.cls.__new__(self.cls)
        obj.__dict__.update(state)
        return obj

    def write(self, payload: Any, writer: Callable[[Any], bytes]) -> bytes:
        saved = {name: sys.modules.get(name) for name in self.modules}
        sys.modules.update(self.modules)
        try:
            return writer(payload)
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


@pytest.fixture
def nemo() -> Iterator[FakeNemoRL]:
    assert MODULE not in sys.modules
    yield FakeNemoRL()
    compat.uninstall()
    assert MODULE not in sys.modules


def state_six(tensors: list[Any], offsets: list[int], indices: list[int]) -> dict[str, Any]:
    return {
        "tensors": tensors,
        "dim_to_pack": 0,
        "pad_to_max_shape": False,
        "_row_offsets": offsets,
        "_segment_indices": indices,
        "_segment_provenance": [uuid.uuid4().bytes for _ in tensors],
    }


def state_three(tensors: list[Any]) -> dict[str, Any]:
    return {"tensors": tensors, "dim_to_pack": 0, "pad_to_max_shape": False}


def torch_save_bytes(payload: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


WRITERS: dict[str, Callable[[Any], bytes]] = {
    "pickle0": lambda x: pickle.dumps(x, protocol=0),
    "pickle2": lambda x: pickle.dumps(x, protocol=2),
    "pickle5": lambda x: pickle.dumps(x, protocol=5),
    "cloudpickle": cloudpickle.dumps,
    "torch.save": torch_save_bytes,
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_loads_current_six_field_state(nemo: FakeNemoRL, writer: str) -> None:
    img = torch.randn(2, 3)
    grid = torch.tensor([[1, 2, 2]])
    state = state_six([img, None, grid], [0, 2, 2, 4], [0, 2, 0, 2])
    data = nemo.write(nemo.make(state), WRITERS[writer])
    assert MODULE not in sys.modules
    with pytest.raises(ModuleNotFoundError):  # the stock readers need nemo_rl; compat does not
        if writer == "torch.save":
            torch.load(io.BytesIO(data), weights_only=False)
        else:
            pickle.loads(data)
    got = compat.loads(data)
    assert isinstance(got, mmpack.PackedTensor)
    assert len(got) == 3 and got.deduplication_enabled
    assert list(got._row_offsets) == [0, 2, 2, 4]
    assert list(got._segment_indices) == [0, 2, 0, 2]
    assert list(got._segment_provenance) == state["_segment_provenance"]
    assert got.tensors[1] is None
    assert torch.equal(got.tensors[0], img) and torch.equal(got.tensors[2], grid)
    assert got.tensors[2].dtype == torch.int64
    assert list(got.logical_segment_counts_by_row()) == [2, 0, 2]
    assert got.slice([2]).tensors[0] is got.tensors[0]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_loads_old_three_field_state(nemo: FakeNemoRL, writer: str) -> None:
    a, b = torch.randn(1, 4).to(torch.bfloat16), torch.randn(2, 4).to(torch.bfloat16)
    data = nemo.write(nemo.make(state_three([a, b])), WRITERS[writer])
    got = compat.loads(data)
    assert isinstance(got, mmpack.PackedTensor)
    assert len(got) == 2 and not got.deduplication_enabled and got._row_offsets is None
    assert torch.equal(got.as_tensor(), torch.cat([a, b]))
    got.enable_deduplication()
    assert got.deduplication_enabled


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_loads_nested_payload_keeps_sharing_and_reinterns(nemo: FakeNemoRL, writer: str) -> None:
    img = torch.randn(3, 2)
    prov = uuid.uuid4().bytes

    def one_row() -> dict[str, Any]:
        return {
            "tensors": [img],
            "dim_to_pack": 0,
            "pad_to_max_shape": False,
            "_row_offsets": [0, 1],
            "_segment_indices": [0],
            "_segment_provenance": [prov],
        }

    payload = {
        "batch": [{"pixel_values": nemo.make(one_row())}, {"pixel_values": nemo.make(one_row())}],
        "meta": ("grpo", 16, [1.5, None], collections.OrderedDict(step=3)),
        "legacy": nemo.make(state_three([img])),
        "loss": torch.ones(4),
    }
    got = compat.loads(nemo.write(payload, WRITERS[writer]))
    first, second = (row["pixel_values"] for row in got["batch"])
    assert isinstance(first, mmpack.PackedTensor) and isinstance(got["legacy"], mmpack.PackedTensor)
    assert first.tensors[0] is second.tensors[0] is got["legacy"].tensors[0]  # one pickle memo
    assert got["meta"] == ("grpo", 16, [1.5, None], collections.OrderedDict(step=3))
    assert torch.equal(got["loss"], torch.ones(4))
    merged = mmpack.PackedTensor.concat([first, second])
    assert len(merged) == 2 and len(merged.tensors) == 1  # provenance survived: re-interned


def test_load_from_path_and_file_object(nemo: FakeNemoRL, tmp_path: Path) -> None:
    img = torch.randn(2, 2)
    state = state_six([img], [0, 1, 2], [0, 0])
    checkpoint = {"trajectories": [{"pixel_values": nemo.make(state)}], "next_ng_task_index": 42}
    path = tmp_path / "replay.pt"
    path.write_bytes(nemo.write(checkpoint, torch_save_bytes))
    for source in (path, str(path)):
        got = compat.load(source)
        value = got["trajectories"][0]["pixel_values"]
        assert got["next_ng_task_index"] == 42
        assert len(value) == 2 and len(value.tensors) == 1
        assert torch.equal(value.as_tensor(), torch.cat([img, img]))
    with open(path, "rb") as fh:
        assert len(compat.load(fh)["trajectories"][0]["pixel_values"]) == 2
    pkl = tmp_path / "batch.pkl"
    pkl.write_bytes(nemo.write([nemo.make(state_three([img]))], WRITERS["pickle5"]))
    assert len(compat.load(pkl)[0]) == 1


def test_torch_save_views_share_storage(nemo: FakeNemoRL) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base[:, 1]
    state = state_six([base, view], [0, 2], [0, 1])
    got = compat.loads(nemo.write(nemo.make(state), torch_save_bytes))
    assert torch.equal(got.tensors[1], view) and got.tensors[1].stride() == view.stride()
    assert (
        got.tensors[0].untyped_storage().data_ptr() == got.tensors[1].untyped_storage().data_ptr()
    )


@pytest.mark.parametrize("protocol", [0, 2, 5])
@pytest.mark.parametrize("segments", [2, 20])
def test_loads_mmpack_written_pickles(protocol: int, segments: int) -> None:
    tensors: list[Any] = [torch.randn(2, 2) for _ in range(segments)] + [None]
    tensors[1] = tensors[1].to(torch.bfloat16)
    value = mmpack.PackedTensor(tensors, 0).enable_deduplication().repeat_interleave(3)
    got = compat.loads(pickle.dumps({"v": value, "n": 1}, protocol=protocol))
    assert isinstance(got["v"], mmpack.PackedTensor)
    assert list(got["v"]._segment_provenance) == list(value._segment_provenance)
    assert list(got["v"]._row_offsets) == list(value._row_offsets)
    assert torch.equal(got["v"].as_tensor(), value.as_tensor())


def _mmpack_edge_values() -> dict[str, mmpack.PackedTensor]:
    """Values whose states hold empty tables (``b""``, written as ``bytes()`` under protocols
    0-2) or 0-d segments."""
    dedup = mmpack.PackedTensor([torch.ones(2)], 0).enable_deduplication()
    plain = mmpack.PackedTensor([torch.ones(2)], 0)
    csr = mmpack.PackedTensor([torch.ones(1, 2)], 0, _row_offsets=[0, 1], _segment_indices=[0])
    scalars = [torch.tensor(1.5), torch.tensor(7), torch.tensor(True)]
    return {
        "empty_rows_like of a dedup value": mmpack.PackedTensor.empty_rows_like(dedup, 3),
        "empty_rows_like, no rows": mmpack.PackedTensor.empty_rows_like(plain, 0),
        "empty_rows_like of a CSR value": mmpack.PackedTensor.empty_rows_like(csr, 2),
        "0-d segments": mmpack.PackedTensor(list(scalars), 0),
        "0-d segments, dedup": mmpack.PackedTensor(list(scalars), 0).enable_deduplication(),
        "0-d segments, CSR": mmpack.PackedTensor(
            [*scalars, None], 0, _row_offsets=[0, 2, 4], _segment_indices=[0, 3, 2, 1]
        ),
        "only None": mmpack.PackedTensor([None, None], 0),
        "empty segment": mmpack.PackedTensor([torch.ones(0, 3)], 0).enable_deduplication(),
    }


def _same_value(got: Any, want: mmpack.PackedTensor) -> None:
    assert type(got) is mmpack.PackedTensor and len(got) == len(want)
    assert got._row_offsets == want._row_offsets
    assert got._segment_indices == want._segment_indices
    assert got._segment_provenance == want._segment_provenance
    for x, y in zip(got.tensors, want.tensors, strict=True):
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))


MMPACK_WRITERS: dict[str, Callable[[Any], bytes]] = {
    **{f"pickle{p}": functools.partial(pickle.dumps, protocol=p) for p in range(6)},
    "cloudpickle": cloudpickle.dumps,
    "torch.save": torch_save_bytes,
}


@pytest.mark.parametrize("writer", sorted(MMPACK_WRITERS))
@pytest.mark.parametrize("name", sorted(_mmpack_edge_values()))
def test_loads_every_mmpack_value_every_protocol(name: str, writer: str) -> None:
    """Files mmpack itself writes load through the restricted loader, empty tables and 0-d
    segments included, with every protocol and through torch.save."""
    value = _mmpack_edge_values()[name]
    got = compat.loads(MMPACK_WRITERS[writer]({"v": value, "w": [value]}))
    _same_value(got["v"], value)
    assert got["w"][0] is got["v"]


@pytest.mark.parametrize("writer", sorted(MMPACK_WRITERS))
def test_loads_nemo_rl_values_with_empty_fields_every_protocol(
    nemo: FakeNemoRL, writer: str
) -> None:
    """NeMo-RL's own edge cases: no rows, 0-d tensors, empty provenance."""
    empty = nemo.make(
        {
            "tensors": [],
            "dim_to_pack": 0,
            "pad_to_max_shape": False,
            "_row_offsets": [0, 0, 0],
            "_segment_indices": [],
            "_segment_provenance": [],
        }
    )
    scalars = nemo.make(state_six([torch.tensor(2.0), torch.tensor(3)], [0, 1, 2], [1, 0]))
    got = compat.loads(nemo.write([empty, scalars], MMPACK_WRITERS[writer]))
    assert len(got[0]) == 2 and got[0].tensors == [] and got[0].deduplication_enabled
    assert got[1]._segment_indices == [1, 0] and torch.equal(got[1].tensors[0], torch.tensor(2.0))


# ----------------------------------------------------------------------------- refusals


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_refuses_os_system_payload(nemo: FakeNemoRL, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _Evil(marker)
    for writer in ("pickle0", "pickle2", "pickle5", "torch.save"):
        data = nemo.write(
            {"pixel_values": nemo.make(state_three([torch.ones(1)])), "x": evil}, WRITERS[writer]
        )
        with pytest.raises(UnsafePickleError, match=r"system") as info:
            compat.loads(data)
        assert os.system.__module__ in str(info.value)  # names the refused global ('posix.system')
        assert isinstance(info.value, MmpackError)
        assert isinstance(info.value, pickle.UnpicklingError)
        assert isinstance(info.value, ValueError)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("payload", "name"),
    [
        (collections.Counter(a=1), "collections.Counter"),
        (eval, "builtins.eval"),
        (torch.nn.Linear(1, 1), "torch.nn.modules.linear.Linear"),
        (types.SimpleNamespace(a=1), "types.SimpleNamespace"),
    ],
)
def test_refuses_other_globals_and_names_them(payload: Any, name: str) -> None:
    with pytest.raises(UnsafePickleError, match=name.replace(".", r"\.")):
        compat.loads(pickle.dumps(payload, protocol=5))


def test_refuses_codec_tricks_and_stray_persistent_ids() -> None:
    # _codecs.encode is admitted only for the latin-1 encoding protocol 2 uses for bytes
    crafted = (
        b"\x80\x02c_codecs\nencode\nq\x00X\x03\x00\x00\x00abcq\x01"
        b"X\x04\x00\x00\x00zlibq\x02\x86q\x03Rq\x04."
    )
    with pytest.raises(UnsafePickleError, match="zlib"):
        compat.loads(crafted)
    with pytest.raises(UnsafePickleError, match="persistent id"):
        compat.loads(b"\x80\x02X\x01\x00\x00\x00aQ.")  # BINPERSID outside a torch.save archive
    assert compat.loads(pickle.dumps(b"\x00\xffabc", protocol=2)) == b"\x00\xffabc"


def test_refused_inside_torch_save(nemo: FakeNemoRL) -> None:
    data = nemo.write({"ok": torch.ones(2), "bad": collections.Counter(a=1)}, torch_save_bytes)
    with pytest.raises(UnsafePickleError, match=r"collections\.Counter"):
        compat.loads(data)


# ----------------------------------------------------------------------------- install


def test_install_without_nemo_rl_registers_a_shim(nemo: FakeNemoRL) -> None:
    data = nemo.write(nemo.make(state_three([torch.ones(2)])), WRITERS["pickle5"])
    assert compat.installed() is None
    assert compat.install() == "shim"
    assert compat.install() == "shim"  # idempotent
    assert compat.installed() == "shim"
    from nemo_rl.data.multimodal_utils import PackedTensor  # type: ignore[import-not-found]

    assert PackedTensor is mmpack.PackedTensor
    loaded = pickle.loads(data)  # a plain unpickler now finds mmpack's class
    assert isinstance(loaded, mmpack.PackedTensor) and len(loaded) == 1
    compat.uninstall()
    assert compat.installed() is None
    assert "nemo_rl" not in sys.modules and MODULE not in sys.modules


def test_install_patches_importable_nemo_rl_and_its_importers(nemo: FakeNemoRL) -> None:
    original = nemo.cls
    consumer = types.ModuleType("fake_nemo_rl_consumer")
    consumer.PackedTensor = original  # type: ignore[attr-defined]  # `from ... import PackedTensor`
    consumer.Alias = original  # type: ignore[attr-defined]
    added = {**nemo.modules, consumer.__name__: consumer}
    sys.modules.update(added)
    try:
        assert compat.install() == "patched"
        leaf = sys.modules[MODULE]
        assert leaf.PackedTensor is mmpack.PackedTensor  # type: ignore[attr-defined]
        assert consumer.PackedTensor is mmpack.PackedTensor  # type: ignore[attr-defined]
        assert consumer.Alias is mmpack.PackedTensor  # type: ignore[attr-defined]
        from nemo_rl.data.multimodal_utils import PackedTensor  # type: ignore[import-not-found]

        assert PackedTensor is mmpack.PackedTensor
        value = PackedTensor([torch.ones(1)], 0).enable_deduplication()
        assert len(copy.deepcopy(value)) == 1
        compat.uninstall()
        assert leaf.PackedTensor is original  # type: ignore[attr-defined]
        assert consumer.PackedTensor is original  # type: ignore[attr-defined]
    finally:
        compat.uninstall()
        for name in added:
            sys.modules.pop(name, None)


def test_malformed_inputs_raise_unpickling_errors() -> None:
    with pytest.raises(CorruptPickleError, match=r"torch\.save archive"):
        compat.loads(b"PK\x03\x04 definitely not a zip file")
    with pytest.raises(CorruptPickleError):
        compat.loads(b"\x80\x05garbage")


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"", EOFError),  # pickle: "Ran out of input"
        (b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01s.", pickle.UnpicklingError),  # stack underflow
    ],
    ids=["empty", "stack underflow"],
)
def test_corrupt_bytes_raise_a_typed_error_with_the_cause_chained(
    data: bytes, cause: type[BaseException]
) -> None:
    with pytest.raises(CorruptPickleError, match="not a readable pickle") as info:
        compat.loads(data)
    assert isinstance(info.value, MmpackError) and isinstance(info.value, pickle.UnpicklingError)
    assert type(info.value.__cause__) is cause


@pytest.mark.parametrize(
    ("data", "declared"),
    [
        (b"\x80\x04\x8d" + b"\xff" * 8, 2**64 - 1),  # BINUNICODE8 length beyond sys.maxsize
        (b"\x80\x04\x8e" + (2**62).to_bytes(8, "little"), 2**62),  # BINBYTES8: 4 EiB
        (b"\x80\x05\x96" + (2**31).to_bytes(8, "little") + b"x", 2**31),  # BYTEARRAY8: 2 GiB
        (b"\x80\x02\x8b" + (2**30).to_bytes(4, "little"), 2**30),  # LONG4: a 1 GiB int
    ],
    ids=["length beyond maxsize", "length beyond memory", "bytearray of 2 GiB", "huge int"],
)
def test_length_fields_beyond_the_data_are_refused_before_allocating(
    data: bytes, declared: int
) -> None:
    """CPython's unpickler allocates a declared length before it reads the bytes: the check of
    the opcodes refuses a length larger than what follows, so nothing is allocated."""
    with pytest.raises(CorruptPickleError, match=f"declares {declared} bytes but .* follow"):
        compat.loads(data)


@pytest.mark.parametrize("data", [None, "text", 5, [1, 2]], ids=repr)
def test_loads_rejects_non_bytes(data: Any) -> None:
    with pytest.raises(TypeError, match="loads expects bytes"):
        compat.loads(data)


def _tensor_record(size: Any, stride: Any, offset: Any, storage_bytes: int = 16) -> bytes:
    """A ``torch.save``-style archive with one float32 tensor record over ``storage_bytes``."""
    import zipfile

    import torch._utils

    marker = object()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if obj is marker:
                return ("storage", torch.FloatStorage, "0", "cpu", storage_bytes // 4)
            return None

    class Rebuild:
        def __reduce__(self) -> tuple[Any, ...]:
            args = (marker, offset, size, stride, False, collections.OrderedDict())
            return (torch._utils._rebuild_tensor_v2, args)

    body = io.BytesIO()
    Pickler(body, protocol=2).dump(Rebuild())
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", body.getvalue())
        z.writestr("archive/byteorder", sys.byteorder)
        z.writestr("archive/data/0", bytes(range(storage_bytes)))
    return out.getvalue()


def test_tensor_records_inside_their_storage_load() -> None:
    whole = compat.loads(_tensor_record((4,), (1,), 0))
    assert whole.shape == (4,) and whole.untyped_storage().nbytes() == 16
    # a strided view whose last element is the storage's last: offset 1 + (2 - 1) * 2 = 3
    view = compat.loads(_tensor_record((2,), (2,), 1))
    assert torch.equal(view, whole[1::2])
    assert compat.loads(_tensor_record((0, 3), (3, 1), 4)).shape == (0, 3)  # empty, at the end


@pytest.mark.parametrize(
    ("size", "stride", "offset", "match"),
    [
        ((5,), (1,), 0, "needs 5 elements but its storage holds 4"),
        ((2, 2), (2, 1), 1, "needs 5 elements"),
        ((0,), (1,), 5, "needs 5 elements"),
        ((2**40,), (1,), 0, "storage holds 4"),
        ((4,), (-1,), 0, "non-negative int"),
        ((4,), (1,), -1, "non-negative int"),
        ((4.0,), (1,), 0, "non-negative int"),
        ((4,), (1, 1), 0, "non-negative int"),
        ("4", (1,), 0, "non-negative int"),
    ],
)
def test_tensor_records_larger_than_their_storage_are_refused(
    size: Any, stride: Any, offset: Any, match: str
) -> None:
    """torch would grow the storage (uninitialized memory as the tensor's contents)."""
    with pytest.raises(UnsafePickleError, match=match):
        compat.loads(_tensor_record(size, stride, offset))


def test_nested_load_from_bytes_must_give_a_storage() -> None:
    """``torch.storage._load_from_bytes`` stands for a storage; a nested archive holding a
    tensor (or anything else the restricted loader admits) is refused."""
    import torch.storage

    class Nested:
        def __reduce__(self) -> tuple[Any, ...]:
            return (torch.storage._load_from_bytes, (torch_save_bytes(torch.ones(2)),))

    with pytest.raises(UnsafePickleError, match="must give a storage, got Tensor"):
        compat.loads(pickle.dumps(Nested(), protocol=2))


def _nested_storage(declared_numel: int) -> bytes:
    """A pickled float32 storage of 2 elements whose legacy record declares another size."""
    import warnings

    import torch.storage

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        torch.save(torch.ones(2).storage(), buf, _use_new_zipfile_serialization=False)
    good = b"X\x03\x00\x00\x00cpuq\x03K\x02N"  # location 'cpu', numel 2, no view
    assert buf.getvalue().count(good) == 1
    nested = buf.getvalue().replace(
        good, good.replace(b"K\x02", b"J" + declared_numel.to_bytes(4, "little"))
    )

    class Nested:
        def __reduce__(self) -> tuple[Any, ...]:
            return (torch.storage._load_from_bytes, (nested,))

    return pickle.dumps(Nested(), protocol=2)


def test_nested_legacy_storage_must_carry_the_bytes_it_declares() -> None:
    """torch's legacy loader would allocate the declared size before reading anything."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert compat.loads(_nested_storage(2)).tolist() == [1.0, 1.0]
        with pytest.raises(UnsafePickleError, match="declare 8000000008 bytes but 16 follow"):
            compat.loads(_nested_storage(2 * 10**9))
