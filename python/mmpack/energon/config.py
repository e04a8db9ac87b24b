"""`PackingEncoderConfig`: the typed settings of `PackingTaskEncoder`.

A config is a frozen dataclass. `from_dict` / `from_yaml` reject unknown fields (suggesting the
closest known name) and retired fields (naming their replacement), so a shipped recipe that stops
matching the code fails loudly at load time instead of training with a silently different setup.

The packing limits use `mmpack.packing.pack`'s names (``max_items_per_bin``, ``media_capacity``).
Their former names (``max_samples_per_pack``, ``media_budget``) are still accepted by the
constructor, `from_dict`, `from_yaml` and `replace`, and readable as attributes, each time with a
`DeprecationWarning` naming the new field; they will be removed in the next release.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mmpack.batch.options import BatchOptions
from mmpack.errors import EnergonConfigError

__all__ = ["KNOWN_ROLES", "RENAMED_FIELDS", "RETIRED_FIELDS", "PackingEncoderConfig"]

LOSS_MASK_MODES = (None, "precomputed")
OVERSIZE_POLICIES = ("skip", "error")
UNDECLARED_MEDIA_POLICIES = ("error", "skip")
MEDIA_IDENTITIES = ("source", "content")
KNOWN_MODALITIES = ("image", "audio", "video")
CONVERSATION_FORMATS = ("auto", "chat_template", "markup")
#: The chat roles ``train_roles`` may name (those of Hugging Face chat messages), so a typo
#: ("asistant", "Assistant") stops the run at construction instead of training on nothing.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")

#: Retired field name -> what to use instead.
RETIRED_FIELDS: dict[str, str] = {
    "max_seq_length": "capacity",
    "seq_length": "capacity",
    "pack_size": "capacity",
    "packing_buffer": "packing_buffer_size",
    "model_family": (
        "subclass PackingTaskEncoder and set loss_mask_mode (None: from roles, "
        "'precomputed': the encoder's mask); the encoder never branches on a model family"
    ),
    "use_precomputed_mask": "loss_mask_mode: precomputed",
}

#: Deprecated field name -> its current name (accepted, with a DeprecationWarning, until the
#: next release).
RENAMED_FIELDS: dict[str, str] = {
    "max_samples_per_pack": "max_items_per_bin",
    "media_budget": "media_capacity",
}

_ZERO_TOLERANCE_HELP = (
    "failure_tolerance must be a positive integer: Energon reads 0 as 'never stop', so an "
    "all-broken dataset would loop forever without yielding a batch (and 0 also disables the stop "
    "in Energon's packing loop). Keep a finite tolerance (Energon's default is 100); to fail fast "
    "while developing, pass WorkerConfig(global_error_handler=reraise_exception) instead"
)


@dataclasses.dataclass(frozen=True)
class PackingEncoderConfig:
    """Settings of a `PackingTaskEncoder`.

    Attributes:
        capacity: positions per pack (the packed sequence length), padding included: each
            sample counts with its padding (`mmpack.batch.BatchOptions.padded_length`:
            ``pad_to_multiple_of``, and ``2 * cp_size`` with context parallelism), so no pack
            is longer and ``SftBatch.micro_batch`` with ``pad_to_length=capacity *
            batch_size`` holds every batch. A multiple of that padding multiple, and
            ``capacity * batch_size`` at most ``2**31 - 1`` (``cu_seqlens`` are int32); both
            checked by the encoder at construction.
        packing_buffer_size: encoded samples each `select_samples_to_pack` call sees (per worker).
        algorithm: an algorithm name of `mmpack.packing.pack`.
        max_items_per_bin: optional cap on samples per pack (``max_items_per_bin`` of
            `mmpack.packing.pack`; formerly ``max_samples_per_pack``).
        media_capacity: optional cap on media units per pack (``media_capacity`` of
            `mmpack.packing.pack`; formerly ``media_budget``). A unit is a row the model's
            vision or audio tower processes: an image or video patch (Qwen2-VL: four patches
            per placeholder token; LLaVA: the crop's patches), an audio feature frame
            (Qwen2-Audio: the 3000 frames of its 30 s window per clip). Placeholder tokens
            count in ``capacity``.
        loss_mask_mode: ``None`` derives the mask from message roles; ``"precomputed"`` uses the
            encoder's own mask (per-fragment ``trainable`` flags) after validation.
        train_roles: roles whose tokens are trained on (both modes); each one of
            `KNOWN_ROLES` (case-sensitive).
        on_oversize: ``"skip"`` (counted, logged) or ``"error"`` (a typed error naming the sample,
            handled by Energon's failure tolerance) for a sample longer than ``capacity`` once
            padded, or with more media than ``media_capacity``.
        failure_tolerance: consecutive failures of one hook (per worker) before Energon stops the
            job. Must be >= 1.
        max_consecutive_skips: consecutive policy skips (per worker) before the encoder stops the
            job with `TooManySkippedError`. Must be >= 1.
        modalities: media kinds the run needs; each is validated against the processor at
            construction.
        on_undeclared_media: what a sample holding media of a kind not in ``modalities`` does:
            ``"error"`` stops the job at the first such sample with an error naming the kind;
            ``"skip"`` skips such samples, counted under ``undeclared_modality``.
        media_identity: what media provenance (deduplication within a pack) derives from:
            ``"source"`` (where the item is: dataset path, shard, key and member, or media
            store path and key) or ``"content"`` (a hash of the item's bytes, so equal bytes
            share one stored segment wherever they come from).
        conversation_format: how a conversation becomes tokens: ``"chat_template"`` (the
            tokenizer's own template, `mmpack.energon.chat_template`), ``"markup"`` (mmpack's
            markup, `mmpack.energon.markup`, for tokenizers built for it) or ``"auto"``:
            the template when the tokenizer has one, else the markup when the tokenizer has
            every markup token, else refused at construction.
        batch_size: packs per batch.
        pad_token_id / pad_to_multiple_of / ignore_index / cp_size: passed to
            `mmpack.batch.pack_samples`.
    """

    capacity: int = 2048
    packing_buffer_size: int = 64
    algorithm: str = "best_fit_decreasing"
    max_items_per_bin: int | None = None
    media_capacity: int | None = None
    loss_mask_mode: str | None = None
    train_roles: tuple[str, ...] = ("assistant",)
    on_oversize: str = "skip"
    failure_tolerance: int = 100
    max_consecutive_skips: int = 1000
    modalities: tuple[str, ...] = ("image",)
    on_undeclared_media: str = "error"
    media_identity: str = "source"
    conversation_format: str = "auto"
    batch_size: int = 1
    pad_token_id: int = 0
    pad_to_multiple_of: int = 1
    ignore_index: int = -100
    cp_size: int = 1

    def batch_options(self) -> BatchOptions:
        """The options of the batch builders (`mmpack.batch.BatchOptions`) this config sets;
        ``BatchOptionError`` for values the builders refuse."""
        return BatchOptions(
            loss_mask_mode=self.loss_mask_mode,
            train_roles=self.train_roles,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            ignore_index=self.ignore_index,
            cp_size=self.cp_size,
        )

    def __post_init__(self) -> None:
        for name in ("train_roles", "modalities"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise EnergonConfigError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        for name in ("capacity", "packing_buffer_size", "batch_size", "pad_to_multiple_of"):
            _positive_int(name, getattr(self, name))
        _positive_int("cp_size", self.cp_size)
        for name in ("max_items_per_bin", "media_capacity"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        for name in ("pad_token_id", "ignore_index"):
            if not _is_int(getattr(self, name)):
                raise EnergonConfigError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.failure_tolerance is None or self.failure_tolerance == 0:
            raise EnergonConfigError(f"{_ZERO_TOLERANCE_HELP}; got {self.failure_tolerance!r}")
        _positive_int("failure_tolerance", self.failure_tolerance)
        if self.max_consecutive_skips is None or self.max_consecutive_skips == 0:
            raise EnergonConfigError(
                "max_consecutive_skips must be a positive integer: Energon hangs silently when "
                f"every sample is skipped, this guard is what stops it; got "
                f"{self.max_consecutive_skips!r}"
            )
        _positive_int("max_consecutive_skips", self.max_consecutive_skips)
        if self.loss_mask_mode not in LOSS_MASK_MODES:
            raise EnergonConfigError(
                f"loss_mask_mode must be None (mask from message roles) or 'precomputed' "
                f"(the encoder's mask), got {self.loss_mask_mode!r}"
            )
        if self.on_oversize not in OVERSIZE_POLICIES:
            raise EnergonConfigError(
                f"on_oversize must be one of {OVERSIZE_POLICIES}, got {self.on_oversize!r}"
            )
        if self.on_undeclared_media not in UNDECLARED_MEDIA_POLICIES:
            raise EnergonConfigError(
                f"on_undeclared_media must be one of {UNDECLARED_MEDIA_POLICIES}, got "
                f"{self.on_undeclared_media!r}"
            )
        if self.media_identity not in MEDIA_IDENTITIES:
            raise EnergonConfigError(
                f"media_identity must be one of {MEDIA_IDENTITIES} (provenance from where the "
                f"item is, or from its bytes), got {self.media_identity!r}"
            )
        if self.conversation_format not in CONVERSATION_FORMATS:
            raise EnergonConfigError(
                f"conversation_format must be one of {CONVERSATION_FORMATS}, got "
                f"{self.conversation_format!r}"
            )
        if not isinstance(self.algorithm, str) or not self.algorithm:
            raise EnergonConfigError(
                f"algorithm must be a packing algorithm name, got {self.algorithm!r}"
            )
        for modality in self.modalities:
            if modality not in KNOWN_MODALITIES:
                raise EnergonConfigError(
                    f"unknown modality {modality!r}; supported: {', '.join(KNOWN_MODALITIES)}"
                )
        if not self.train_roles or not all(isinstance(r, str) for r in self.train_roles):
            raise EnergonConfigError(
                f"train_roles must be a non-empty list of role names, got {self.train_roles!r}"
            )
        for role in self.train_roles:
            if role not in KNOWN_ROLES:
                close = difflib.get_close_matches(role, KNOWN_ROLES, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise EnergonConfigError(
                    f"train_roles: unknown role {role!r}{hint}; roles are case-sensitive, "
                    f"known: {', '.join(KNOWN_ROLES)}"
                )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> PackingEncoderConfig:
        """Build a config from a mapping; unknown or retired keys raise `EnergonConfigError`,
        deprecated names (`RENAMED_FIELDS`) are accepted with a `DeprecationWarning`."""
        if not isinstance(data, Mapping):
            raise EnergonConfigError(
                f"{source}: expected a mapping of fields, got {type(data).__name__}"
            )
        data = _rename_deprecated(data, source, stacklevel=4)
        _reject_unknown_fields(data, source)
        try:
            return cls(**data)
        except EnergonConfigError as err:
            raise EnergonConfigError(f"{source}: {err}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> PackingEncoderConfig:
        """Load a config from a YAML file whose top level holds the config fields."""
        import yaml

        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
        return cls.from_dict(data if data is not None else {}, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["train_roles"] = list(self.train_roles)
        out["modalities"] = list(self.modalities)
        return out

    def replace(self, **changes: Any) -> PackingEncoderConfig:
        """A copy with `changes` applied (unknown or retired names raise, as in `from_dict`)."""
        changes = _rename_deprecated(changes, "", stacklevel=4)
        return self.from_dict({**self.to_dict(), **changes})

    @property
    def max_samples_per_pack(self) -> int | None:
        """Deprecated name of `max_items_per_bin`."""
        _warn_renamed("max_samples_per_pack", "", stacklevel=3)
        return self.max_items_per_bin

    @property
    def media_budget(self) -> int | None:
        """Deprecated name of `media_capacity`."""
        _warn_renamed("media_budget", "", stacklevel=3)
        return self.media_capacity


def _warn_renamed(old: str, source: str, *, stacklevel: int) -> None:
    warnings.warn(
        f"{f'{source}: ' if source else ''}PackingEncoderConfig field {old!r} is deprecated; use "
        f"{RENAMED_FIELDS[old]!r} (the name mmpack.packing.pack uses). The old name will be "
        "removed in the next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _rename_deprecated(data: Mapping[str, Any], source: str, *, stacklevel: int) -> dict[str, Any]:
    """`data` with deprecated field names replaced by their current names (one warning each);
    both names of one field at once is an error."""
    out = dict(data)
    for old, new in RENAMED_FIELDS.items():
        if old not in out:
            continue
        _warn_renamed(old, source, stacklevel=stacklevel)
        if new in data:
            raise EnergonConfigError(
                f"{f'{source}: ' if source else ''}{old!r} is the deprecated name of {new!r}; "
                f"give only {new!r}"
            )
        out[new] = out.pop(old)
    return out


def _reject_unknown_fields(keys: Iterable[Any], source: str) -> None:
    """Raise `EnergonConfigError` for keys that are no field, naming retired fields'
    replacements and suggesting the closest known name for typos."""
    known = PackingEncoderConfig.field_names()
    problems = []
    for key in keys:
        if key in known:
            continue
        if key in RETIRED_FIELDS:
            problems.append(f"field {key!r} was retired; use {RETIRED_FIELDS[key]} instead")
        else:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown field {key!r}{hint}")
    if problems:
        raise EnergonConfigError(
            f"{source}: " + "; ".join(problems) + f". Known fields: {', '.join(known)}"
        )


def _accept_renamed_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Let the dataclass constructor take the deprecated field names as keywords. (Wrapping the
    generated ``__init__`` keeps the old names out of the fields, so they never show up in
    `to_dict`, equality, ``repr`` or ``dataclasses.replace``.)"""

    @functools.wraps(init)
    def __init__(self: PackingEncoderConfig, *args: Any, **kwargs: Any) -> None:
        if any(old in kwargs for old in RENAMED_FIELDS):
            kwargs = _rename_deprecated(kwargs, "", stacklevel=4)
        # a typo'd keyword gets the same typed error and hint as from_dict, not a bare TypeError
        _reject_unknown_fields(kwargs, "PackingEncoderConfig")
        init(self, *args, **kwargs)

    return __init__


PackingEncoderConfig.__init__ = _accept_renamed_keywords(  # type: ignore[method-assign]
    PackingEncoderConfig.__init__
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    # (int64 at most: every size and count crosses into the native core as one)
    if not _is_int(value) or not 1 <= int(value) <= 2**63 - 1:  # type: ignore[call-overload]
        raise EnergonConfigError(f"{name} must be a positive integer in int64, got {value!r}")
