# Hand-written stubs for the Rust extension; checked by mypy.stubtest in `make test`.
# Each area keeps its stubs in its own section.
from typing import Any

import numpy

__version__: str

# --- shared ---
class MmpackError(ValueError): ...
class IndexOverflowError(MmpackError): ...

# --- csr / intern ---
class LayoutError(MmpackError): ...
class ProvenanceError(LayoutError): ...
class ShardError(MmpackError): ...

import typing as _typing  # noqa: E402

@_typing.final
class PackedLayout:
    @staticmethod
    def build(
        n_physical: int,
        offsets: numpy.ndarray | None = None,
        indices: numpy.ndarray | None = None,
        provenance: Any | None = None,
        provenance_blob: bytes | None = None,
    ) -> PackedLayout: ...
    @staticmethod
    def legacy_dedup(n_physical: int) -> PackedLayout: ...
    @staticmethod
    def mint(n: int) -> list[bytes]: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def n_physical(self) -> int: ...
    @property
    def is_csr(self) -> bool: ...
    @property
    def has_provenance(self) -> bool: ...
    def offsets(self) -> numpy.ndarray | None: ...
    def indices(self) -> numpy.ndarray | None: ...
    def offsets_list(self) -> list[int] | None: ...
    def indices_list(self) -> list[int] | None: ...
    def provenance_list(self) -> list[bytes] | None: ...
    def provenance_blob(self) -> bytes | None: ...
    def with_provenance(self, provenance: Any | None) -> PackedLayout: ...
    def reminted(self) -> PackedLayout: ...
    def counts(self, tensors: list[Any]) -> list[int]: ...
    @staticmethod
    def presence(tensors: list[Any]) -> list[int]: ...
    def reference_counts(self, n_physical: int) -> numpy.ndarray: ...
    def logical_nbytes(self, nbytes: Any) -> int: ...
    def slice(
        self, tensors: list[Any], rows: numpy.ndarray | list[int]
    ) -> tuple[PackedLayout, list[Any]]: ...
    def shard(
        self, tensors: list[Any], num_shards: int
    ) -> list[tuple[PackedLayout, list[Any]]]: ...
    def repeat_interleave(
        self, tensors: list[Any], repeats: int
    ) -> tuple[PackedLayout, list[Any]]: ...
    def __copy__(self) -> PackedLayout: ...
    def __deepcopy__(self, memo: Any, /) -> PackedLayout: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

def packed_concat(
    values: Any, mode: int = 0
) -> tuple[Any, Any, PackedLayout | None, list[Any] | None]: ...
def measure_segments(
    tensors: list[Any],
    indices: numpy.ndarray | None,
    seen: set[int],
    array_types: tuple[type, ...],
) -> tuple[int, int, int, int]: ...

# --- packing ---
class ItemTooLargeError(MmpackError): ...
class InvalidLengthError(MmpackError): ...
class PackingArgumentError(MmpackError): ...
class BinCountError(MmpackError): ...

def pack(
    lengths: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    capacity: int,
    algorithm: str,
    *,
    media: numpy.ndarray[Any, numpy.dtype[numpy.int64]] | None = None,
    media_capacity: int | None = None,
    max_items_per_bin: int | None = None,
    min_bins: int | None = None,
    bins_multiple_of: int | None = None,
    on_oversize: str = "error",
    order: numpy.ndarray[Any, numpy.dtype[numpy.int64]] | None = None,
    allow_zero: bool = False,
    search_budget: int = 256,
) -> tuple[
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]] | None,
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    int,
]: ...
def shuffle_permutation(
    state: numpy.ndarray[Any, numpy.dtype[numpy.uint32]], pos: int, n: int
) -> tuple[
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.uint32]],
    int,
]: ...
def csr_to_lists(
    offsets: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    items: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
) -> list[list[int]]: ...
def assign_to_ranks(
    bin_offsets: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    item_indices: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    lengths: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    num_ranks: int,
    cost: str,
) -> tuple[
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
]: ...

# --- mask / batch ---
class LossMaskError(MmpackError): ...
class MessageSpanError(LossMaskError): ...
class TurnStructureError(MmpackError): ...
class MissingFieldError(MmpackError): ...
class EmptySampleError(MmpackError): ...
class InvalidTokenError(MmpackError): ...
class BatchOptionError(MmpackError): ...

def validate_mask(
    mask: numpy.ndarray[Any, Any], num_tokens: int, require_trainable: bool, sample: str
) -> None: ...
def mask_from_roles(
    lengths: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    roles: list[str],
    train_roles: list[str],
    num_tokens: int | None,
    sample: str,
) -> numpy.ndarray[Any, numpy.dtype[numpy.bool_]]: ...
def mask_from_fragments(
    lengths: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    trainable: numpy.ndarray[Any, numpy.dtype[numpy.bool_]],
    num_tokens: int | None,
    sample: str,
) -> numpy.ndarray[Any, numpy.dtype[numpy.bool_]]: ...
def turn_spans(
    token_ids: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    markers: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    sample: str,
) -> numpy.ndarray[Any, numpy.dtype[numpy.int64]]: ...
def build_pack(
    names: list[str],
    tokens: list[numpy.ndarray[Any, numpy.dtype[numpy.int64]]],
    masks: list[numpy.ndarray[Any, Any] | None],
    message_lengths: list[list[int] | None],
    message_roles: list[list[str] | None],
    *,
    precomputed: bool,
    train_roles: list[str],
    pad_token_id: int,
    pad_to_multiple_of: int,
    ignore_index: int,
    cp_size: int,
) -> tuple[
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.bool_]],
    numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    numpy.ndarray[Any, numpy.dtype[numpy.int32]],
    numpy.ndarray[Any, numpy.dtype[numpy.int32]],
    int,
]: ...

# --- gather ---
class GatherIndexError(MmpackError): ...
class GatherSizeError(MmpackError): ...

def gather_into(
    out: numpy.ndarray[Any, numpy.dtype[numpy.uint8]],
    sources: list[numpy.ndarray[Any, numpy.dtype[numpy.uint8]]],
    order: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    outer: int = 1,
) -> None: ...
def gather_ranges_into(
    out: numpy.ndarray[Any, numpy.dtype[numpy.uint8]],
    src: numpy.ndarray[Any, numpy.dtype[numpy.uint8]],
    starts: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    lens: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    order: numpy.ndarray[Any, numpy.dtype[numpy.int64]],
    outer: int = 1,
    src_stride: int = 0,
) -> None: ...
