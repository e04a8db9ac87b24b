"""`mmpack.safe_load.load` reads a file within `max_bytes`: a longer file is refused before it
is read whole, and a bad `max_bytes` before anything is read."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
from mmpack import PackedTensor
from mmpack.errors import PickleTooLargeError
from mmpack.safe_load import load


class _CountingReader(io.BytesIO):
    """A file object that records how much it was asked to read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.largest_request = 0

    def read(self, size: int | None = -1) -> bytes:
        self.largest_request = max(self.largest_request, -1 if size is None else size)
        return super().read(size)


def test_a_file_longer_than_max_bytes_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    data = b"\x80\x05" + b"N" * (4 << 20) + b"."
    reader = _CountingReader(data)
    with pytest.raises(PickleTooLargeError, match="max_bytes=1048576"):
        load(reader, max_bytes=1 << 20)
    assert reader.tell() <= (2 << 20) and 0 < reader.largest_request <= (1 << 20)
    path = tmp_path / "big.pkl"
    path.write_bytes(data)
    with pytest.raises(PickleTooLargeError):
        load(path, max_bytes=1 << 20)


def test_a_huge_max_bytes_reads_in_pieces_and_loads() -> None:
    value = PackedTensor([torch.arange(6.0).reshape(2, 3)], dim_to_pack=0)
    reader = _CountingReader(pickle.dumps(value))
    back = load(reader, max_bytes=2**62)  # read(2**62 + 1) would ask for that much up front
    assert torch.equal(back.as_tensor(), value.as_tensor())
    assert reader.largest_request <= (1 << 20)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "10"])
def test_a_bad_max_bytes_is_refused_before_reading(bad: object) -> None:
    reader = _CountingReader(b"N.")
    with pytest.raises(TypeError, match="max_bytes"):
        load(reader, max_bytes=bad)  # type: ignore[arg-type]
    assert reader.largest_request == 0
