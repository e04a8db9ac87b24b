"""``BatchOptions``: how a batch is built, declared once and checked once.

One frozen value holds the mask mode, the trained roles, the padding and the label fill;
``pack_samples``, ``pad_samples``, ``micro_batch`` and the Energon encoder all read it, and it
crosses into the Rust core as one native value. The builders still take the options as keyword
arguments; those build a ``BatchOptions`` (``resolve_options``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from mmpack import _native
from mmpack._coerce import I64_MAX, I64_MIN, count_int, option_int, role_list
from mmpack.errors import BatchOptionError, BatchOptionTypeError, InvalidLengthError

__all__ = ["BatchOptionKeywords", "BatchOptions", "resolve_options"]

LOSS_MASK_MODES = (None, "precomputed")


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """How a batch is built; every value is checked when the options are made
    (``BatchOptionError`` naming the option, ``BatchOptionTypeError`` for a wrong type).

    ``loss_mask_mode``: ``None`` derives each sample's mask from its message lengths and roles
    (roles in ``train_roles`` are trained on); ``"precomputed"`` uses the sample's own
    ``loss_mask``. ``pad_token_id``: the token of the padding (a token id, ``>= 0``).
    ``pad_to_multiple_of`` / ``cp_size``: every sample is padded to a multiple of
    ``pad_to_multiple_of`` and, when ``cp_size > 1``, of ``2 * cp_size`` (context
    parallelism). ``ignore_index``: the label of every untrained position (it must not be a
    token id of the batch, checked per batch). ``pad_to_length``: the total length of a pack
    or micro-batch (the width of every padded row), a multiple of the padding multiple;
    ``None``: as short as the samples allow.

    ``padded_length(n)`` is the positions a sample of ``n`` tokens takes in a batch built with
    these options; the Energon encoder plans its packs and checks oversize samples with it.
    """

    loss_mask_mode: str | None = None
    train_roles: Sequence[str] = ("assistant",)  # kept as a tuple
    pad_token_id: int = 0
    pad_to_multiple_of: int = 1
    ignore_index: int = -100
    cp_size: int = 1
    pad_to_length: int | None = None

    def __post_init__(self) -> None:
        if self.loss_mask_mode not in LOSS_MASK_MODES:
            raise BatchOptionError(
                f"invalid loss_mask_mode: {self.loss_mask_mode!r} (expected None or 'precomputed')"
            )
        try:
            roles = self.train_roles
            if isinstance(roles, Mapping):
                # iterating {"assistant": True, "user": False} would train on both
                raise BatchOptionTypeError(
                    "invalid train_roles: a mapping; give the names of the roles to train on "
                    f"(a sequence such as ('assistant',)), got {roles!r}"
                )
            if type(roles) is not tuple or not all(type(r) is str for r in roles):
                roles = tuple(role_list(roles, "train_roles"))
            ints = {
                "pad_token_id": _int_option(self.pad_token_id, "pad_token_id", I64_MIN),
                "pad_to_multiple_of": _int_option(self.pad_to_multiple_of, "pad_to_multiple_of", 1),
                "ignore_index": _int_option(self.ignore_index, "ignore_index", I64_MIN),
                "cp_size": _int_option(self.cp_size, "cp_size", 1),
            }
            length = self.pad_to_length
            if length is not None:
                length = _int_option(length, "pad_to_length", 1)
        except BatchOptionError:
            raise
        except TypeError as exc:  # a wrong type, named by the message
            raise BatchOptionTypeError(str(exc)) from None
        object.__setattr__(self, "train_roles", roles)
        for name, value in ints.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "pad_to_length", length)
        # The core's own checks (a negative pad_token_id, the padding multiple, pad_to_length
        # against it), here rather than at the first batch.
        native = _native.BatchOptions(
            precomputed=self.loss_mask_mode == "precomputed",
            train_roles=list(roles),
            pad_to_length=length,
            **ints,
        )
        # Not a dataclass field: asdict/astuple/replace see the options alone.
        object.__setattr__(self, "_native", native)

    def __reduce__(self) -> tuple[Any, ...]:
        # The native value does not pickle; the options rebuild it (the encoder holding them
        # crosses into data-loader workers).
        # (every field of the value's own class, so a subclass keeps its additions)
        return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    @property
    def native(self) -> _native.BatchOptions:
        """The options as the native builders read them (one ``_native.BatchOptions``)."""
        native: _native.BatchOptions = self.__dict__["_native"]
        return native

    @property
    def padding_multiple(self) -> int:
        """The multiple every sample is padded to: ``pad_to_multiple_of`` and, when
        ``cp_size > 1``, the least common multiple of that and ``2 * cp_size`` (each sequence
        splits into ``2 * cp_size`` equal chunks for context parallelism)."""
        if self.cp_size == 1:
            return self.pad_to_multiple_of
        return math.lcm(self.pad_to_multiple_of, 2 * self.cp_size)

    def padded_length(self, length: int) -> int:
        """The positions a sample of ``length`` tokens takes in a pack (or a padded row) built
        with these options: ``length`` rounded up to ``padding_multiple``, as the builders pad
        it (``pad_to_length`` aside, which only the last sample absorbs). A pack of samples
        whose padded lengths sum to at most ``C`` fits ``pad_to_length=C``.
        ``InvalidLengthError`` for a negative length, ``TypeError`` for a non-integer."""
        n = count_int(length, "length", error=InvalidLengthError, minimum=0)
        multiple = self.padding_multiple
        return -(-n // multiple) * multiple

    @property
    def precomputed(self) -> bool:
        """Whether each sample's own loss mask is used."""
        return self.loss_mask_mode == "precomputed"

    def replace(self, **changes: Any) -> BatchOptions:
        """A copy with ``changes`` (checked like any new options)."""
        return dataclasses.replace(self, **changes)

    def keywords(self) -> dict[str, Any]:
        """The options that differ from the defaults, as keyword arguments of the builders
        (``pack_samples(samples, **options.keywords())`` builds with these options)."""
        return {
            name: getattr(self, name)
            for name in OPTION_NAMES
            if getattr(self, name) != getattr(_DEFAULTS, name)
        }


def _int_option(value: Any, name: str, minimum: int) -> int:
    """An int option in ``[minimum, 2**63 - 1]`` (``option_int``, with a fast path for a plain
    ``int``: options are made per batch)."""
    if type(value) is int and minimum <= value <= I64_MAX:
        return value
    return option_int(value, name, error=BatchOptionError, minimum=minimum)


#: The option names, in declaration order.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(BatchOptions))

_OPTION_SET = frozenset(OPTION_NAMES)
_DEFAULTS = BatchOptions()


class BatchOptionKeywords(TypedDict, total=False):
    """The options as the builders' keyword arguments (types only; ``BatchOptions`` is the
    declaration, and a test keeps the two equal)."""

    loss_mask_mode: str | None
    train_roles: Sequence[str]
    pad_token_id: int
    pad_to_multiple_of: int
    ignore_index: int
    cp_size: int
    pad_to_length: int | None


def resolve_options(
    options: BatchOptions | None, keywords: Mapping[str, Any], *, caller: str
) -> BatchOptions:
    """The options of one call: ``options``, or ones built from the keyword arguments.

    Both at once are accepted only when every keyword repeats what ``options`` holds;
    otherwise ``BatchOptionTypeError`` naming the keywords that contradict it. An unknown
    keyword is a ``TypeError`` naming it.
    """
    if not _OPTION_SET.issuperset(keywords):
        unknown = [name for name in keywords if name not in _OPTION_SET]
        raise TypeError(f"{caller}() got unexpected keyword arguments: {', '.join(unknown)}")
    if options is None:
        return _from_keywords(keywords) if keywords else _DEFAULTS
    if not isinstance(options, BatchOptions):
        raise BatchOptionTypeError(f"options must be a BatchOptions, got {type(options).__name__}")
    if keywords:
        merged = options.replace(**keywords)
        conflicts = [
            f"{name}={getattr(merged, name)!r} (options: {getattr(options, name)!r})"
            for name in keywords
            if getattr(merged, name) != getattr(options, name)
        ]
        if conflicts:
            raise BatchOptionTypeError(
                f"{caller}() got options= and keyword arguments that contradict them: "
                f"{', '.join(conflicts)}; pass the options one way"
            )
    return options


#: Options already made from keyword arguments, by their exact values and types (so that
#: ``True`` never stands for ``1``): a builder called per batch with the same keywords checks
#: them once.
_MADE: dict[tuple[Any, ...], BatchOptions] = {}
_MADE_LIMIT = 64


def _from_keywords(keywords: Mapping[str, Any]) -> BatchOptions:
    key = _cache_key(keywords)
    if key is None:
        return BatchOptions(**keywords)
    made = _MADE.get(key)
    if made is None:
        made = BatchOptions(**keywords)
        if len(_MADE) >= _MADE_LIMIT:
            _MADE.clear()
        _MADE[key] = made
    return made


def _cache_key(keywords: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The keywords as a key of exact types, or ``None`` for values not worth keying (anything
    but ``None``, ``int``, ``str`` and sequences of ``str``)."""
    key: list[Any] = []
    for name, value in keywords.items():
        if value is None or type(value) is int or type(value) is str:
            key.append((name, type(value), value))
        elif type(value) in (list, tuple) and all(type(r) is str for r in value):
            key.append((name, tuple, tuple(value)))
        else:
            return None
    return tuple(sorted(key, key=lambda item: item[0]))
