# Hand-written stubs for the Rust extension; checked by mypy.stubtest in `make test`.
# Each area keeps its stubs in its own section.
import typing as _typing
from typing import Any, Literal

import numpy

__version__: str

# --- errors (the table in rust/py/src/errors.rs, in its order) ---
ERROR_NAMES: tuple[str, ...]

class MmpackError(ValueError): ...
class IndexOverflowError(MmpackError): ...
class PackedTensorError(MmpackError): ...
class LayoutError(PackedTensorError): ...
class ProvenanceError(LayoutError): ...
class ShardError(PackedTensorError): ...
class PackingError(MmpackError): ...
class ItemTooLargeError(PackingError): ...
class InvalidLengthError(PackingError): ...
class PackingArgumentError(PackingError): ...
class BinCountError(PackingError): ...
class BatchError(MmpackError): ...
class LossMaskError(BatchError): ...
class MessageSpanError(LossMaskError): ...
class TurnStructureError(BatchError): ...
class MissingFieldError(BatchError): ...
class EmptySampleError(BatchError): ...
class InvalidTokenError(BatchError): ...
class BatchOptionError(BatchError): ...
class BatchLayoutError(BatchError): ...

# --- PackedTensor layout ---

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

@_typing.final
class ConcatResult:
    @property
    def dim_to_pack(self) -> Any: ...
    @property
    def pad_to_max_shape(self) -> Any: ...
    @property
    def layout(self) -> PackedLayout | None: ...
    @property
    def tensors(self) -> list[Any] | None: ...

def packed_concat(
    values: Any,
    layouts: list[PackedLayout | None],
    mode: Literal["concat", "merge_segments", "flattened_concat"],
) -> ConcatResult: ...

# --- payload accounting ---
@_typing.final
class SeenSegments:
    def __init__(self) -> None: ...
    def add(self, key: int) -> None: ...
    def __contains__(self, key: int, /) -> bool: ...
    def __len__(self) -> int: ...

@_typing.final
class SegmentTotals:
    @property
    def physical_bytes(self) -> int: ...
    @property
    def physical_segments(self) -> int: ...
    @property
    def logical_bytes(self) -> int: ...
    @property
    def logical_segments(self) -> int: ...

def measure_segments(
    tensors: list[Any],
    indices: numpy.ndarray | None,
    seen: SeenSegments,
    array_types: tuple[type, ...],
) -> SegmentTotals: ...

# --- packing ---
_I64Array: _typing.TypeAlias = numpy.ndarray[Any, numpy.dtype[numpy.int64]]

@_typing.final
class PackResult:
    @property
    def bin_offsets(self) -> _I64Array: ...
    @property
    def item_indices(self) -> _I64Array: ...
    @property
    def bin_loads(self) -> _I64Array: ...
    @property
    def bin_media(self) -> _I64Array | None: ...
    @property
    def oversize(self) -> _I64Array: ...
    @property
    def total_length(self) -> int: ...

@_typing.final
class ShuffleResult:
    @property
    def permutation(self) -> _I64Array: ...
    @property
    def state(self) -> numpy.ndarray[Any, numpy.dtype[numpy.uint32]]: ...
    @property
    def pos(self) -> int: ...

@_typing.final
class RankResult:
    @property
    def rank_offsets(self) -> _I64Array: ...
    @property
    def bin_indices(self) -> _I64Array: ...
    @property
    def rank_costs(self) -> _I64Array: ...
    @property
    def bin_costs(self) -> _I64Array: ...

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
) -> PackResult: ...
def shuffle_permutation(
    state: numpy.ndarray[Any, numpy.dtype[numpy.uint32]], pos: int, n: int
) -> ShuffleResult: ...
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
) -> RankResult: ...

# --- mask / batch ---
_BoolArray: _typing.TypeAlias = numpy.ndarray[Any, numpy.dtype[numpy.bool_]]
_I32Array: _typing.TypeAlias = numpy.ndarray[Any, numpy.dtype[numpy.int32]]
_I64Array2: _typing.TypeAlias = numpy.ndarray[tuple[int, int], numpy.dtype[numpy.int64]]
_BoolArray2: _typing.TypeAlias = numpy.ndarray[tuple[int, int], numpy.dtype[numpy.bool_]]

@_typing.final
class BatchOptions:
    """Batch options (mmpack_core::batch::BatchOptions), checked when made: every build_pack,
    build_padded and concat_packs call reads one."""

    def __new__(
        cls,
        *,
        precomputed: bool,
        train_roles: list[str],
        pad_token_id: int,
        pad_to_multiple_of: int,
        ignore_index: int,
        cp_size: int,
        pad_to_length: int | None,
    ) -> BatchOptions: ...
    @property
    def precomputed(self) -> bool:
        """Whether each sample's own loss mask is used (else it is derived from roles)."""
    @property
    def train_roles(self) -> list[str]:
        """Roles whose messages are trained on."""
    @property
    def pad_token_id(self) -> int:
        """The token id of the padding."""
    @property
    def pad_to_multiple_of(self) -> int:
        """Every sample is padded to a multiple of this."""
    @property
    def ignore_index(self) -> int:
        """The label of every position that is not trained on."""
    @property
    def cp_size(self) -> int:
        """Context-parallel ranks: samples are also padded to a multiple of 2 * cp_size."""
    @property
    def pad_to_length(self) -> int | None:
        """The total length of a pack, or the width of every padded row; None: as short as the
        samples allow."""

@_typing.final
class ThdLayout:
    """One pack in Megatron's THD layout (mmpack_core::batch::ThdLayout), as numpy arrays: built
    by build_pack and concat_packs, or made from a batch's fields for check_pack."""

    def __new__(
        cls,
        *,
        input_ids: _I64Array,
        labels: _I64Array,
        loss_mask: _BoolArray,
        token_mask: _BoolArray,
        position_ids: _I64Array,
        cu_seqlens: _I32Array,
        cu_seqlens_padded: _I32Array,
        max_seqlen: int,
    ) -> ThdLayout: ...
    @property
    def input_ids(self) -> _I64Array: ...
    @property
    def labels(self) -> _I64Array: ...
    @property
    def loss_mask(self) -> _BoolArray: ...
    @property
    def token_mask(self) -> _BoolArray: ...
    @property
    def position_ids(self) -> _I64Array: ...
    @property
    def cu_seqlens(self) -> _I32Array: ...
    @property
    def cu_seqlens_padded(self) -> _I32Array: ...
    @property
    def max_seqlen(self) -> int: ...

@_typing.final
class PaddedLayout:
    """Padded rows [rows, width] (mmpack_core::batch::PaddedLayout), as numpy arrays: built by
    build_padded, or made from a batch's fields for check_padded."""

    def __new__(
        cls,
        *,
        input_ids: _I64Array2,
        labels: _I64Array2,
        loss_mask: _BoolArray2,
        token_mask: _BoolArray2,
        position_ids: _I64Array2,
        attention_mask: _BoolArray2,
        lengths: _I64Array,
    ) -> PaddedLayout: ...
    @property
    def input_ids(self) -> _I64Array: ...
    @property
    def labels(self) -> _I64Array: ...
    @property
    def loss_mask(self) -> _BoolArray: ...
    @property
    def token_mask(self) -> _BoolArray: ...
    @property
    def position_ids(self) -> _I64Array: ...
    @property
    def attention_mask(self) -> _BoolArray: ...
    @property
    def lengths(self) -> _I64Array: ...

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

class _SampleColumns(_typing.TypedDict):
    """The samples of a build call, one list per field."""

    names: list[str]
    tokens: list[_I64Array]
    masks: list[numpy.ndarray[Any, Any] | None]
    message_lengths: list[_typing.Sequence[int] | None]
    message_roles: list[list[str] | None]

def build_pack(samples: _SampleColumns, options: BatchOptions) -> ThdLayout:
    """Build one pack. samples: a dict of parallel lists, names, tokens, masks, message_lengths
    and message_roles (masks are read in precomputed mode, the messages otherwise)."""

def build_padded(samples: _SampleColumns, options: BatchOptions) -> PaddedLayout:
    """Build padded rows, one per sample (arguments as build_pack; pad_to_length is the width of
    every row)."""

def check_pack(layout: ThdLayout, *, pad_token_id: int, ignore_index: int) -> None:
    """Check a THD layout: every field against the others, pad_token_id and ignore_index."""

def concat_packs(layouts: list[ThdLayout], options: BatchOptions) -> ThdLayout:
    """Several THD layouts as one micro-batch; each is checked against options (its
    pad_token_id, ignore_index and padding multiple), whose pad_to_length is the total."""

def check_padded(layout: PaddedLayout, *, pad_token_id: int, ignore_index: int) -> None:
    """Check padded rows: every field against the others, pad_token_id and ignore_index."""

# --- gather ---

def gather_threads() -> int: ...
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
