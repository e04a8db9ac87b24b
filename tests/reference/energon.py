"""A packing task encoder written the plain way, on Megatron-Energon's own base class
(``megatron.energon.DefaultTaskEncoder``) and its packing hooks (``select_samples_to_pack``,
``pack_selected_samples``): the oracle of the loader tests and the other side of
``mmpack_dev demo sft --compare-with reference.energon:ReferencePackingTaskEncoder`` (``make
demo`` passes it). It imports nothing from mmpack.

What it implements, from the data contract of the two source formats (`mmpack.energon.cookers`
describes them) and the markup (`mmpack.energon.markup`):

* cookers for both formats (subflavor ``mmpack_format``: ``generic`` messages with a media
  manifest, ``fragments`` turns with per-fragment ``trainable`` flags and a media store);
  media stays undecoded bytes (or an unread store key) until its sample is selected for a pack;
* the markup: ``<|role|>`` + parts + ``<|end|>`` per message, an image expanding to one
  ``<image>`` token per patch (``round(side / patch)`` per side, at least 1), text tokenized by
  the tokenizer's own call; loss masks from the fragments' flags (``"precomputed"``) or from
  roles (``None``), built with `reference.masks`;
* the policy: skips counted per reason (no turns, ends on a turn that is not trained on, nothing
  trainable, longer than ``capacity`` once padded), ``max_consecutive_skips`` in a row stop the
  job, media of an undeclared kind stops it (or is skipped);
* NeMo-RL's packers (`reference.packing`) on the samples' padded lengths;
* images decoded to float32 patches ``[n_patches, patch * patch * 3]`` (EXIF orientation
  applied, resized to the patch grid when needed), each item decoded once per pack (items are
  the same when their source is: dataset, shard, sample and member, or media store and key; or
  their bytes under ``media_identity: content``), and checked to take the tokens the sample was
  encoded with;
* THD packs built by `reference.batch` (media joined with NeMo-RL's ``PackedTensor``,
  `reference.packed_tensor`), ``batch_size`` packs per batch (padded rows without packing).

Settings come from a config object or mapping with `PackingEncoderConfig`'s field names (read
as plain attributes or keys); what the reference does not implement (mmpack's own packing
algorithms, ``max_items_per_bin``, ``media_capacity``, chat templates, model processors, audio
and video) is refused at construction with an `EnergonConfigError` (`reference.errors`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import multiprocessing
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from megatron.energon import (
    Batch,
    Cooker,
    DefaultTaskEncoder,
    Sample,
    SkipSample,
    basic_sample_keys,
    edataclass,
    stateless,
)
from megatron.energon.errors import FatalSampleError

from reference import batch as ref_batch
from reference import masks as ref_masks
from reference.errors import (
    EnergonConfigError,
    MediaTokenCountError,
    SampleFormatError,
    TooManySkippedError,
    UndeclaredModalityError,
)
from reference.packed_tensor import PackedTensor
from reference.packing import PackingAlgorithm, get_packer

__all__ = [
    "LoaderCounts",
    "ReferenceBatch",
    "ReferencePack",
    "ReferencePackingTaskEncoder",
    "Settings",
    "reference_pack",
]

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_TOKEN = "<|end|>"
IMAGE_TOKEN = "<image>"
MEDIA_TOKENS = ("<image>", "<audio>", "<video>")
PLACEHOLDERS = {"<image>": "image", "<audio>": "audio", "<video>": "video"}
_PLACEHOLDER_RE = re.compile("(" + "|".join(re.escape(p) for p in PLACEHOLDERS) + ")")
FORMAT_SUBFLAVOR = "mmpack_format"
#: the batch key of decoded images
PIXEL_VALUES = "pixel_values"
SKIP_REASONS = (
    "ends_on_user_turn",
    "empty_trainable_mask",
    "no_turns",
    "oversize",
    "media_over_budget",
    "undeclared_modality",
)
ALIASES = {"ffd": "first_fit_decreasing", "mffd": "modified_first_fit_decreasing"}
_QUARTER_TURNS = {5, 6, 7, 8}


# ---------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings the reference reads (`PackingEncoderConfig`'s names and defaults, except
    the algorithm: the reference runs NeMo-RL's packers only)."""

    capacity: int = 2048
    packing_buffer_size: int = 64
    algorithm: str = "first_fit_decreasing"
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

    @classmethod
    def read(cls, config: Any) -> Settings:
        """The settings of `config`: None (the defaults), a mapping, or an object with the
        fields as attributes."""
        values = {}
        for field in dataclasses.fields(cls):
            if config is None:
                continue
            if isinstance(config, Mapping):
                if field.name in config:
                    values[field.name] = config[field.name]
            elif hasattr(config, field.name):
                values[field.name] = getattr(config, field.name)
        for name in ("train_roles", "modalities"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)

    @property
    def padding_multiple(self) -> int:
        """Every sample is padded to a multiple of this (``2 * cp_size`` too under context
        parallelism)."""
        if self.cp_size > 1:
            return math.lcm(self.pad_to_multiple_of, 2 * self.cp_size)
        return self.pad_to_multiple_of

    def pack_length(self, num_tokens: int) -> int:
        """The positions a sample of `num_tokens` tokens takes in a pack, padding included."""
        multiple = self.padding_multiple
        return -(-num_tokens // multiple) * multiple

    def batch_options(self) -> dict[str, Any]:
        return {
            "loss_mask_mode": self.loss_mask_mode,
            "train_roles": self.train_roles,
            "pad_token_id": self.pad_token_id,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "ignore_index": self.ignore_index,
            "cp_size": self.cp_size,
        }


def _algorithm(algorithm: Any) -> str:
    name = getattr(algorithm, "value", algorithm)
    key = str(name).lower()
    key = ALIASES.get(key, key)
    supported = [a.value for a in PackingAlgorithm]
    if key not in supported:
        raise EnergonConfigError(
            f"the reference packer runs only NeMo-RL's packing algorithms "
            f"({', '.join(supported)}); algorithm {algorithm!r} is not one of them"
        )
    return key


def reference_pack(lengths: Sequence[int], capacity: int, *, algorithm: str) -> list[list[int]]:
    """The bins (sample indices, in bin order) of NeMo-RL's packer `algorithm` for `lengths`."""
    return get_packer(_algorithm(algorithm), capacity).pack([int(n) for n in lengths])


# ---------------------------------------------------------------------------------- counters


class LoaderCounts:
    """Counters shared by the loader's forked workers and read by the main process: samples
    seen, encoded, packed, skipped per reason, failed per exception type name, media decoded,
    and the time spent in the packer and the batch builder."""

    FIELDS = (
        "seen",
        "encoded",
        "packed",
        "packs",
        "decoded",
        "empty_pack",
        "padded",
        "select_ns",
        "build_ns",
        *(f"skipped:{r}" for r in SKIP_REASONS),
    )
    #: distinct failure reasons counted apart (names of up to 64 bytes)
    SLOTS = 16
    NAME_BYTES = 64

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._values = ctx.Array("q", len(self.FIELDS) + self.SLOTS, lock=True)
        self._names = ctx.RawArray("c", self.SLOTS * self.NAME_BYTES)

    def add(self, name: str, amount: int = 1) -> None:
        index = self.FIELDS.index(name)
        with self._values.get_lock():
            self._values[index] += amount

    def fail(self, reason: str, amount: int) -> None:
        key = reason.encode()[: self.NAME_BYTES]
        with self._values.get_lock():
            for slot in range(self.SLOTS):
                at = slot * self.NAME_BYTES
                name = self._names.raw[at : at + self.NAME_BYTES].rstrip(b"\0")
                if not name:
                    self._names[at : at + len(key)] = key
                if not name or name == key or slot == self.SLOTS - 1:
                    self._values[len(self.FIELDS) + slot] += amount
                    return

    def snapshot(self) -> dict[str, Any]:
        """``seen``, ``encoded``, ``packed``, ``packs``, ``decoded``, ``empty_pack``,
        ``padded``, ``select_ns``, ``build_ns``; ``skipped`` (reason -> count) and
        ``skipped_total``; ``failed_by_reason`` (exception type name -> count) and
        ``failed``."""
        with self._values.get_lock():
            values = list(self._values[:])
            names = self._names.raw
        n = len(self.FIELDS)
        out: dict[str, Any] = {
            name: values[i] for i, name in enumerate(self.FIELDS) if ":" not in name
        }
        out["skipped"] = {r: values[self.FIELDS.index(f"skipped:{r}")] for r in SKIP_REASONS}
        out["skipped_total"] = sum(out["skipped"].values())
        failed = {}
        for slot in range(self.SLOTS):
            at = slot * self.NAME_BYTES
            name = names[at : at + self.NAME_BYTES].rstrip(b"\0").decode()
            if values[n + slot]:
                failed[name] = values[n + slot]
        out["failed_by_reason"] = failed
        out["failed"] = sum(failed.values())
        return out

    def error_handler(
        self, inner: Callable[[Exception, Any, Any], None] | None = None
    ) -> Callable[[Exception, Any, Any], None]:
        """An Energon ``global_error_handler`` that counts the samples of what failed (a pack
        or batch counts its members) by exception type, then calls `inner`."""

        def handler(err: Exception, sample: Any, sources: Any = None) -> None:
            self.fail(type(err).__name__, _count_samples(sample))
            if inner is not None:
                inner(err, sample, sources)

        return handler


def _count_samples(sample: Any) -> int:
    if isinstance(sample, (list, tuple)):
        return sum(_count_samples(s) for s in sample)
    keys = getattr(sample, "sample_keys", None)
    return len(keys) if isinstance(keys, list) else 1


# ---------------------------------------------------------------------------------- samples


@dataclasses.dataclass
class MediaItem:
    """An undecoded media item: bytes carried by the sample, or a key into a media store."""

    kind: str
    key: str
    sample_key: str
    source: tuple[str, ...]
    meta: dict[str, Any]
    data: bytes | None = None
    store: Any = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        try:
            data, _ = self.store[self.key]
        except Exception as err:
            raise SampleFormatError(
                f"sample {self.sample_key!r}: media {self.key!r} is not in the media store "
                f"({type(err).__name__}: {err})"
            ) from err
        return bytes(data)


@dataclasses.dataclass(frozen=True)
class Part:
    text: str | None = None
    trainable: bool | None = None
    media: MediaItem | None = None


@edataclass
class Conversation(Sample):
    """A cooked conversation: ``turns`` is a list of ``(role, [Part, ...])``."""

    source_format: str
    turns: list[Any]


@edataclass
class EncodedConversation(Sample):
    token_ids: list[int]
    loss_mask: Any  # torch.bool [n] ("precomputed") or None
    message_lengths: list[int] | None
    message_roles: list[str] | None
    media: list[MediaItem]
    media_tokens: list[int]
    trainable_tokens: int
    decoded_media: dict[str, PackedTensor] | None = None


@edataclass
class ReferencePack(Sample):
    """One packed sequence (`reference.batch.PackedBatch`)."""

    packed: Any
    sample_keys: list[str]
    num_tokens: int
    capacity: int


@edataclass
class ReferenceBatch(Batch):
    """What the trainer receives: ``batch_size`` packs, or padded rows without packing."""

    sample_keys: list[str]
    num_tokens: int
    token_slots: int
    packs: list[Any] | None = None
    padded: Any = None


# ---------------------------------------------------------------------------------- cookers


def _json(raw: dict[str, Any]) -> dict[str, Any]:
    key = raw.get("__key__", "?")
    try:
        obj = json.loads(raw["json"])
    except (KeyError, TypeError, ValueError) as err:
        raise SampleFormatError(f"sample {key!r}: no valid 'json' part ({err})") from err
    if not isinstance(obj, dict):
        raise SampleFormatError(f"sample {key!r}: the 'json' part is not an object")
    return obj


@stateless
def cook_generic(raw: dict[str, Any], **_aux: Any) -> Conversation:
    """``messages[]`` with placeholders taking the media manifest's entries in order."""
    key = str(raw["__key__"])
    obj = _json(raw)
    manifest = obj.get("media", [])
    dataset = ""
    for info in raw.get("__sources__") or ():
        if getattr(info, "dataset_path", None) is not None:
            dataset = str(info.dataset_path)
            break
    shard = str(raw.get("__shard__", ""))
    used = 0
    turns = []
    for message in obj["messages"]:
        parts = []
        for piece in _PLACEHOLDER_RE.split(message.get("content", "")):
            if not piece:
                continue
            if piece not in PLACEHOLDERS:
                parts.append(Part(text=piece))
                continue
            if used >= len(manifest):
                raise SampleFormatError(f"sample {key!r}: more placeholders than media entries")
            entry = manifest[used]
            used += 1
            data = raw.get(entry["name"])
            if not isinstance(data, (bytes, bytearray)):
                raise SampleFormatError(f"sample {key!r}: no part {entry['name']!r}")
            item = MediaItem(
                kind=PLACEHOLDERS[piece],
                key=entry["name"],
                sample_key=key,
                source=("webdataset", dataset, shard, key, entry["name"]),
                meta=dict(entry),
                data=bytes(data),
            )
            parts.append(Part(media=item))
        turns.append((message["role"], parts))
    return Conversation(**basic_sample_keys(raw), source_format="generic", turns=turns)


@stateless
def cook_fragments(raw: dict[str, Any], *, media: Any = None, **_aux: Any) -> Conversation:
    """``conversation[].fragments[]``: text with ``trainable``, or a key of the media store."""
    key = str(raw["__key__"])
    obj = _json(raw)
    turns = []
    for turn in obj["conversation"]:
        parts = []
        for frag in turn["fragments"]:
            if "media" in frag:
                if media is None:
                    raise SampleFormatError(f"sample {key!r}: media but no media store")
                item = MediaItem(
                    kind=frag.get("kind", "image"),
                    key=frag["media"],
                    sample_key=key,
                    source=("media-store", str(media.get_path()), frag["media"]),
                    meta=dict(frag),
                    store=media,
                )
                parts.append(Part(media=item))
            else:
                parts.append(Part(text=frag["text"], trainable=bool(frag.get("trainable", False))))
        turns.append((turn["role"], parts))
    return Conversation(**basic_sample_keys(raw), source_format="fragments", turns=turns)


# ---------------------------------------------------------------------------------- images


def _grid(pixels: int, patch: int) -> int:
    return max(1, round(pixels / patch))


def _image_size(item: MediaItem) -> tuple[int, int]:
    width, height = item.meta.get("width"), item.meta.get("height")
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (width, height)):
        return width, height
    from PIL import Image

    try:
        with Image.open(io.BytesIO(item.read())) as img:
            width, height = img.size
            turned = img.getexif().get(0x0112, 1) in _QUARTER_TURNS
    except SampleFormatError:
        raise
    except Exception as err:
        raise SampleFormatError(f"sample {item.sample_key!r}: bad image {item.key!r}") from err
    return (height, width) if turned else (width, height)


def _image_patches(data: bytes, patch: int, item: MediaItem) -> torch.Tensor:
    from PIL import Image, ImageOps

    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = ImageOps.exif_transpose(img).convert("RGB")
    except Exception as err:
        raise SampleFormatError(
            f"sample {item.sample_key!r}: image {item.key!r} cannot be decoded ({err})"
        ) from err
    gw, gh = _grid(rgb.width, patch), _grid(rgb.height, patch)
    if rgb.size != (gw * patch, gh * patch):
        rgb = rgb.resize((gw * patch, gh * patch))
    pixels = np.asarray(rgb, dtype=np.uint8)
    grid = pixels.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 1, 3, 4)
    patches = grid.reshape(gh * gw, patch * patch * 3).astype(np.float32) / np.float32(255)
    return torch.from_numpy(patches)


# ---------------------------------------------------------------------------------- encoder


class ReferencePackingTaskEncoder(
    DefaultTaskEncoder[Conversation, EncodedConversation, ReferencePack, ReferenceBatch]
):
    """The plain packing task encoder of the module docstring.

    Args:
        config: the settings (`Settings.read`: None, a mapping, or an object such as a
            `PackingEncoderConfig`).
        tokenizer: a Hugging Face tokenizer with the markup's special tokens.
        processor: ``{"patch_size": N}`` (or an object with ``patch_size``).
    """

    cookers = (
        Cooker(cook_fragments, has_subflavors={FORMAT_SUBFLAVOR: "fragments"}),
        Cooker(cook_generic),
    )
    decoder = None  # raw bytes: media is decoded here, for packed samples only

    def __init__(self, config: Any = None, *, tokenizer: Any = None, processor: Any = None) -> None:
        super().__init__()
        cfg = self.settings = Settings.read(config)
        self.algorithm = _algorithm(cfg.algorithm)
        if cfg.max_items_per_bin is not None or cfg.media_capacity is not None:
            raise EnergonConfigError(
                "the reference packer (NeMo-RL's algorithms) has no max_items_per_bin or "
                "media_capacity"
            )
        if tuple(cfg.modalities) != ("image",):
            raise EnergonConfigError(
                f"the reference decodes images only; modalities {list(cfg.modalities)}"
            )
        patch = processor.get("patch_size") if isinstance(processor, Mapping) else None
        patch = patch if patch is not None else getattr(processor, "patch_size", None)
        if not isinstance(patch, int) or isinstance(patch, bool) or patch < 1:
            raise EnergonConfigError(
                "the reference makes its own image patches: pass processor={'patch_size': N}"
            )
        self.patch_size = patch
        if tokenizer is None:
            raise EnergonConfigError("the reference needs a tokenizer")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if cfg.conversation_format == "chat_template" or (
            cfg.conversation_format == "auto" and has_template
        ):
            raise EnergonConfigError("the reference encodes mmpack's markup only, no chat template")
        vocab = tokenizer.get_vocab()
        needed = [*ROLE_TOKENS.values(), END_TOKEN, IMAGE_TOKEN]
        missing = [t for t in needed if t not in vocab]
        if missing:
            raise EnergonConfigError(f"the tokenizer lacks the markup's special tokens {missing}")
        self.token_ids = {t: int(vocab[t]) for t in needed}
        self.media_token_ids = {int(vocab[t]) for t in MEDIA_TOKENS if t in vocab}
        self.tokenizer = tokenizer
        unknown = [r for r in cfg.train_roles if r not in ROLE_TOKENS]
        if unknown:
            raise EnergonConfigError(f"train_roles {unknown}: the markup has no such role")
        if cfg.pad_token_id < 0:
            raise EnergonConfigError("pad_token_id must be a token id (>= 0)")
        if 0 <= cfg.ignore_index < len(tokenizer):
            raise EnergonConfigError(f"ignore_index={cfg.ignore_index} is a token id")
        if cfg.capacity % cfg.padding_multiple:
            raise EnergonConfigError(
                f"capacity={cfg.capacity} is not a multiple of {cfg.padding_multiple}"
            )
        self.__default_failure_tolerance__ = cfg.failure_tolerance
        self.stats = LoaderCounts()
        self._skips_in_a_row = 0
        # decoded media of the pack being built: identity -> (tensor, provenance)
        self._pack_media: dict[tuple[str, ...], tuple[torch.Tensor, bytes]] = {}

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """The packs of one buffer: NeMo-RL's packer on the samples' padded lengths."""
        return reference_pack(lengths, self.settings.capacity, algorithm=self.algorithm)

    # ------------------------------------------------------------------ policy

    def _skip(self, sample: Any, reason: str, detail: str) -> SkipSample:
        self.stats.add(f"skipped:{reason}")
        self._skips_in_a_row += 1
        if self._skips_in_a_row >= self.settings.max_consecutive_skips:
            err = TooManySkippedError(
                f"{self._skips_in_a_row} consecutive samples were skipped by policy (last: "
                f"{sample.__key__}: {reason}: {detail})"
            )
            raise FatalSampleError(str(err)) from err
        return SkipSample(f"{reason}: {detail}")

    def _check_conversation(self, conv: Conversation) -> None:
        cfg = self.settings
        for _, parts in conv.turns:
            for part in parts:
                if part.media is not None and part.media.kind not in cfg.modalities:
                    detail = f"{part.media.kind} media {part.media.key!r}"
                    if cfg.on_undeclared_media == "skip":
                        raise self._skip(conv, "undeclared_modality", detail)
                    err = UndeclaredModalityError(f"sample {conv.__key__!r} holds {detail}")
                    raise FatalSampleError(str(err)) from err
        roles = [role for role, _ in conv.turns if role != "system"]
        if not roles:
            raise self._skip(conv, "no_turns", "no user/assistant turns")
        if roles[-1] not in cfg.train_roles:
            raise self._skip(conv, "ends_on_user_turn", f"ends on a {roles[-1]!r} turn")

    def _check_encoded(self, conv: Conversation, encoded: EncodedConversation) -> None:
        cfg = self.settings
        if encoded.trainable_tokens == 0:
            raise self._skip(conv, "empty_trainable_mask", "no token is trainable")
        length = cfg.pack_length(len(encoded.token_ids))
        if length > cfg.capacity:
            detail = f"{length} positions > capacity {cfg.capacity}"
            if cfg.on_oversize == "error":
                raise SampleFormatError(f"sample {conv.__key__!r} is too long: {detail}")
            raise self._skip(conv, "oversize", detail)

    # ------------------------------------------------------------------ encoding

    def _tokens(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def encode_conversation(self, conv: Conversation) -> EncodedConversation:
        """The markup's tokens, spans and mask of one conversation (module docstring)."""
        cfg = self.settings
        texts = [p.text for _, parts in conv.turns for p in parts if p.media is None and p.text]
        encoded_texts = iter(self._tokens(texts))
        tokens: list[int] = []
        frag_lengths: list[int] = []
        frag_flags: list[bool] = []
        message_lengths: list[int] = []
        roles: list[str] = []
        media: list[MediaItem] = []
        media_tokens: list[int] = []
        for role, parts in conv.turns:
            if role not in ROLE_TOKENS:
                raise SampleFormatError(f"sample {conv.__key__!r}: unknown role {role!r}")
            by_role = role in cfg.train_roles
            flags = [p.trainable for p in parts if p.media is None and p.trainable is not None]
            marker = any(flags) if flags else by_role
            start = len(tokens)
            pieces: list[tuple[list[int], bool]] = [([self.token_ids[ROLE_TOKENS[role]]], marker)]
            for part in parts:
                if part.media is not None:
                    width, height = _image_size(part.media)
                    n = _grid(width, self.patch_size) * _grid(height, self.patch_size)
                    pieces.append(([self.token_ids[IMAGE_TOKEN]] * n, by_role and not flags))
                    media.append(part.media)
                    media_tokens.append(n)
                elif part.text:
                    ids = next(encoded_texts)
                    if set(ids) & self.media_token_ids:
                        raise SampleFormatError(
                            f"sample {conv.__key__!r}: text holds a media token"
                        )
                    if ids:
                        pieces.append((ids, by_role if part.trainable is None else part.trainable))
            pieces.append(([self.token_ids[END_TOKEN]], marker))
            for ids, flag in pieces:
                tokens.extend(ids)
                frag_lengths.append(len(ids))
                frag_flags.append(flag)
            message_lengths.append(len(tokens) - start)
            roles.append(role)
        if cfg.loss_mask_mode == "precomputed":
            mask = ref_masks.from_fragments(frag_lengths, frag_flags, num_tokens=len(tokens))
            trainable = int(mask.sum())
        else:
            for role, parts in conv.turns:
                if any(p.trainable not in (None, role in cfg.train_roles) for p in parts):
                    raise SampleFormatError(
                        f"sample {conv.__key__!r}: per-fragment trainable flags differ from "
                        "its roles; use loss_mask_mode='precomputed'"
                    )
            mask = None
            by_roles = ref_masks.from_roles(message_lengths, roles, cfg.train_roles)
            trainable = int(by_roles.sum())
        return EncodedConversation.derive_from(
            conv,
            token_ids=tokens,
            loss_mask=mask,
            message_lengths=None if mask is not None else message_lengths,
            message_roles=None if mask is not None else roles,
            media=media,
            media_tokens=media_tokens,
            trainable_tokens=trainable,
        )

    # ------------------------------------------------------------------ media

    def _identity(self, item: MediaItem) -> tuple[str, ...]:
        if self.settings.media_identity == "content":
            return ("content", item.kind, hashlib.sha256(item.read()).hexdigest())
        return item.source

    def decode(self, sample: EncodedConversation) -> dict[str, PackedTensor]:
        """One ``pixel_values`` row of the sample's images, each item decoded once per pack."""
        rows = []
        for item, encoded in zip(sample.media, sample.media_tokens, strict=True):
            identity = self._identity(item)
            if identity not in self._pack_media:
                value = _image_patches(item.read(), self.patch_size, item)
                provenance = hashlib.blake2b(repr(identity).encode(), digest_size=16).digest()
                self._pack_media[identity] = (value, provenance)
                self.stats.add("decoded")
            value, provenance = self._pack_media[identity]
            if value.shape[0] != encoded:
                raise MediaTokenCountError(
                    f"sample {sample.__key__!r}: image {item.key!r} decodes to "
                    f"{value.shape[0]} patches, encoded with {encoded} tokens"
                )
            rows.append(PackedTensor([value], 0, _segment_provenance=[provenance]))
        if not rows:
            empty = PackedTensor(
                [], 0, _row_offsets=[0, 0], _segment_indices=[], _segment_provenance=[]
            )
            return {PIXEL_VALUES: empty}
        return {PIXEL_VALUES: PackedTensor.merge_segments(rows)}

    def _batch_sample(self, sample: EncodedConversation) -> ref_batch.EncodedSample:
        return ref_batch.EncodedSample(
            sample.__key__,
            sample.token_ids,
            loss_mask=sample.loss_mask,
            message_lengths=sample.message_lengths,
            message_roles=sample.message_roles,
            media=sample.decoded_media,
        )

    # ------------------------------------------------------------------ Energon hooks

    @stateless
    def cook_crude_sample(self, sample: Any, *args: Any, **kwargs: Any) -> Any:
        self.stats.add("seen")
        return super().cook_crude_sample(sample, *args, **kwargs)

    @stateless
    def preencode_sample(self, sample: Conversation) -> EncodedConversation:
        self._check_conversation(sample)
        encoded = self.encode_conversation(sample)
        self._check_encoded(sample, encoded)
        self._skips_in_a_row = 0
        self.stats.add("encoded")
        return encoded

    @stateless(restore_seeds=True)
    def select_samples_to_pack(
        self, samples: list[EncodedConversation]
    ) -> list[list[EncodedConversation]]:
        start = time.perf_counter_ns()
        bins = self.plan([self.settings.pack_length(len(s.token_ids)) for s in samples])
        self.stats.add("select_ns", time.perf_counter_ns() - start)
        return [[samples[i] for i in b] for b in bins]

    @stateless
    def postencode_sample(self, sample: EncodedConversation) -> EncodedConversation:
        return EncodedConversation.derive_from(
            sample,
            token_ids=sample.token_ids,
            loss_mask=sample.loss_mask,
            message_lengths=sample.message_lengths,
            message_roles=sample.message_roles,
            media=sample.media,
            media_tokens=sample.media_tokens,
            trainable_tokens=sample.trainable_tokens,
            decoded_media=self.decode(sample),
        )

    @stateless
    def pack_selected_samples(self, samples: list[EncodedConversation]) -> ReferencePack:
        self._pack_media.clear()
        if not samples:  # every member failed in postencode_sample
            self.stats.add("empty_pack")
            raise SkipSample("empty pack")
        start = time.perf_counter_ns()
        packed = ref_batch.pack_samples(
            [self._batch_sample(s) for s in samples], **self.settings.batch_options()
        )
        self.stats.add("build_ns", time.perf_counter_ns() - start)
        self.stats.add("packed", len(samples))
        self.stats.add("packs")
        keys = [s.__key__ for s in samples]
        return ReferencePack(
            __key__=",".join(keys),
            __restore_key__=(),
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            packed=packed,
            sample_keys=keys,
            num_tokens=sum(len(s.token_ids) for s in samples),
            capacity=self.settings.capacity,
        )

    @stateless
    def batch(self, samples: list[Any]) -> ReferenceBatch:
        self._pack_media.clear()
        sources = tuple(src for s in samples for src in (s.__sources__ or ()))
        if samples and isinstance(samples[0], ReferencePack):
            return ReferenceBatch(
                __key__=[p.__key__ for p in samples],
                __restore_key__=(),
                __sources__=sources,
                sample_keys=[k for p in samples for k in p.sample_keys],
                num_tokens=sum(p.num_tokens for p in samples),
                token_slots=sum(p.capacity for p in samples),
                packs=[p.packed for p in samples],
            )
        start = time.perf_counter_ns()
        padded = ref_batch.pad_samples(
            [self._batch_sample(s) for s in samples], **self.settings.batch_options()
        )
        self.stats.add("build_ns", time.perf_counter_ns() - start)
        self.stats.add("padded", len(samples))
        return ReferenceBatch(
            __key__=[s.__key__ for s in samples],
            __restore_key__=(),
            __sources__=sources,
            sample_keys=[s.__key__ for s in samples],
            num_tokens=sum(len(s.token_ids) for s in samples),
            token_slots=int(padded.input_ids.numel()),
            padded=padded,
        )
