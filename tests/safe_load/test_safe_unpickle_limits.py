"""The memory bound of the restricted loader (``mmpack.compat.nemo_rl.loads`` / ``load``).

A load allocates at most ``max_bytes`` (default 32 x the input's size + 64 MiB, see
``mmpack.safe_load.budget``): no name a payload may call allocates from a size, no
``torch.save`` entry may be compressed, and every declared length is checked against the bytes
that follow before anything is allocated. The bomb payloads below each cost gigabytes through
the loader as it was; here each is refused, and the peak memory of the loading process is
measured (RSS, in a subprocess) to stay flat.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import mmpack
import pytest
import torch
from mmpack.compat import nemo_rl as compat
from mmpack.errors import (
    CorruptPickleError,
    PickleSecurityError,
    PickleTooLargeError,
    UnsafePickleError,
)
from mmpack.safe_load.budget import DEFAULT_FACTOR, DEFAULT_FLOOR

GIB = 1 << 30


def _torch_save(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _inflating_archive(numel: int, method: int) -> bytes:
    """A ``torch.save`` archive of a float32 tensor of ``numel`` zeros whose storage entry is
    compressed with ``method``: a few kilobytes that inflate to ``4 * numel`` bytes."""
    src = zipfile.ZipFile(io.BytesIO(_torch_save(torch.zeros(4))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            if name.endswith("data.pkl"):
                pkl = src.read(name)
                patched = pkl.replace(b"K\x04", b"J" + struct.pack("<i", numel), 1)
                assert patched != pkl
                dst.writestr(name, patched)
            elif name.endswith("/data/0"):
                info = zipfile.ZipInfo(name)
                info.compress_type = method
                with dst.open(info, "w", force_zip64=True) as fh:
                    chunk = bytes(1 << 22)
                    for _ in range(4 * numel // len(chunk)):
                        fh.write(chunk)
            else:
                dst.writestr(name, src.read(name))
    return out.getvalue()


def _bombs() -> dict[str, tuple[bytes, type[PickleSecurityError], int]]:
    """name -> (payload, error, the bytes it asks the loader to allocate)."""
    long2g = b"\x8a\x05\x00\x00\x00\x80\x00"  # LONG1: 2**31
    return {
        "bytearray(2**31)": (
            b"\x80\x02c__builtin__\nbytearray\n" + long2g + b"\x85R.",
            UnsafePickleError,
            2 * GIB,
        ),
        "bytes(2**31)": (
            b"\x80\x02c__builtin__\nbytes\n" + long2g + b"\x85R.",
            UnsafePickleError,
            2 * GIB,
        ),
        "memo index 2**27": (
            b"\x80\x02Nr" + struct.pack("<I", 1 << 27) + b".",
            CorruptPickleError,
            2 * GIB,
        ),
        "BYTEARRAY8 of 2 GiB": (
            b"\x80\x05\x96" + struct.pack("<Q", 2 * GIB) + b"x",
            CorruptPickleError,
            2 * GIB,
        ),
        "a million empty sets": (
            b"\x80\x04(" + b"\x8f" * 1_000_000 + b"l.",
            PickleTooLargeError,
            220 << 20,
        ),
        "LZMA storage (64 MiB)": (
            _inflating_archive(1 << 24, zipfile.ZIP_LZMA),
            UnsafePickleError,
            128 << 20,
        ),
        "deflate storage (256 MiB)": (
            _inflating_archive(1 << 26, zipfile.ZIP_DEFLATED),
            UnsafePickleError,
            512 << 20,
        ),
    }


_MEASURE = textwrap.dedent(
    """
    import json, resource, sys
    from mmpack.compat import nemo_rl as compat
    compat.loads(b"\\x80\\x05N.")  # warm: imports done before the first measure
    out = {}
    for path in sys.argv[1:]:
        data = open(path, "rb").read()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            compat.loads(data)
            outcome = "loaded"
        except Exception as exc:
            outcome = type(exc).__name__
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out[path] = [outcome, (after - before) * 1024]
    print(json.dumps(out))
    """
)


def test_bombs_are_refused_before_they_allocate(tmp_path: Path) -> None:
    bombs = _bombs()
    paths = {}
    for i, (name, (payload, _, _)) in enumerate(bombs.items()):
        paths[name] = tmp_path / f"bomb{i}"
        paths[name].write_bytes(payload)
    for payload, error, _ in bombs.values():
        with pytest.raises(error):
            compat.loads(payload)
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, *map(str, paths.values())],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    report = []
    for name, (payload, error, asks) in bombs.items():
        outcome, peak = measured[str(paths[name])]
        report.append(
            f"{name}: {len(payload)} B in, asks {asks >> 20} MiB, peak RSS +{peak >> 20} MiB"
        )
        assert outcome == error.__name__, (name, outcome)
        assert peak < 16 << 20, report[-1]
    print("\n".join(report))


def test_the_default_bound_and_max_bytes() -> None:
    sets = b"\x80\x04(" + b"\x8f" * 100_000 + b"l."  # 100 kB in, about 23 MB out
    assert len(compat.loads(sets)) == 100_000  # within 32 x 100 kB + 64 MiB
    with pytest.raises(PickleTooLargeError, match=r"max_bytes=") as info:
        compat.loads(sets, max_bytes=1 << 20)
    assert f"payload of {len(sets)} bytes" in str(info.value) and "1048576" in str(info.value)
    many = b"\x80\x04(" + b"\x8f" * 1_000_000 + b"l."
    limit = DEFAULT_FACTOR * len(many) + DEFAULT_FLOOR
    with pytest.raises(PickleTooLargeError, match=str(limit)):
        compat.loads(many)
    # a legitimate payload needs a few times its size
    value = mmpack.PackedTensor([torch.randn(64, 64) for _ in range(40)], 0)
    data = pickle.dumps(value, protocol=5)
    assert len(compat.loads(data, max_bytes=4 * len(data)).tensors) == 40
    with pytest.raises(PickleTooLargeError):
        compat.loads(data, max_bytes=len(data) // 2)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(TypeError, match="max_bytes"):
            compat.loads(data, max_bytes=bad)  # type: ignore[arg-type]


def test_load_takes_max_bytes_too(tmp_path: Path) -> None:
    path = tmp_path / "v.pkl"
    path.write_bytes(pickle.dumps(mmpack.PackedTensor([torch.ones(256)], 0), protocol=5))
    assert compat.load(path).tensors[0].shape == (256,)
    with pytest.raises(PickleTooLargeError):
        compat.load(path, max_bytes=100)
    with path.open("rb") as fh, pytest.raises(PickleTooLargeError):
        compat.load(fh, max_bytes=100)


@pytest.mark.parametrize("protocol", range(6))
def test_bytes_and_bytearray_copies_still_load(protocol: int) -> None:
    """What ``bytes`` / ``bytearray`` are admitted for: the copies picklers write."""
    payload = {"a": bytearray(b"\x00\xffab"), "b": b"", "c": bytearray(), "d": b"\x01" * 300}
    assert compat.loads(pickle.dumps(payload, protocol=protocol)) == payload


@pytest.mark.parametrize(
    ("payload", "phrase"),
    [
        (b"\x80\x02c__builtin__\nbytes\n]\x85R.", r"bytes\(list\)"),
        (b"\x80\x02c__builtin__\nbytearray\nK\x05\x85R.", r"bytearray\(int\)"),
        (b"\x80\x02c__builtin__\nset\nK\x05\x85R.", "set"),
        # copyreg._reconstructor(set, set, [1]): a base class called with payload arguments
        (
            b"\x80\x02ccopy_reg\n_reconstructor\nc__builtin__\nset\nc__builtin__\nset\n]K\x01a\x87R.",
            "reconstructor",
        ),
    ],
    ids=["bytes of a list", "bytearray of a size", "set of an int", "reconstructor of a set"],
)
def test_allocation_through_admitted_names_is_refused(payload: bytes, phrase: str) -> None:
    with pytest.raises(UnsafePickleError, match=phrase):
        compat.loads(payload)


def test_archive_entries_must_be_stored_and_fit() -> None:
    data = _torch_save({"t": torch.arange(6.0)})
    assert torch.equal(compat.loads(data)["t"], torch.arange(6.0))
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            compressed = zipfile.ZipInfo(info.filename)
            compressed.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(compressed, src.read(info.filename))
    with pytest.raises(UnsafePickleError, match="compressed with deflate"):
        compat.loads(out.getvalue())
    # a central directory entry declaring more bytes than the archive holds
    name = next(n for n in src.namelist() if n.endswith("/data/0")).encode()
    forged = bytearray(data)
    at = data.index(b"PK\x01\x02")
    while data[at + 46 : at + 46 + len(name)] != name:
        at = data.index(b"PK\x01\x02", at + 4)
    forged[at + 20 : at + 28] = struct.pack("<II", 10**9, 10**9)  # compressed, plain sizes
    with pytest.raises(CorruptPickleError, match="declares 1000000000 bytes"):
        compat.loads(bytes(forged))
