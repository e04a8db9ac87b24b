"""`PackingTaskEncoder`: an Energon task encoder that packs with `mmpack.packing` and builds THD
batches with `mmpack.batch.pack_samples`.

Pipeline per worker (Energon 7.4): cooker (lazy `Conversation`) -> ``preencode_sample`` (tokens,
mask inputs, policy checks; users override `encode_conversation`) -> ``select_samples_to_pack``
(every buffered sample lands in exactly one pack) -> ``postencode_sample`` (decodes the media of
that selected sample only) -> ``pack_selected_samples`` (one `PackedBatch`) -> ``batch``.

Checkpointing: every hook Energon re-runs on restore is ``@stateless``; randomness may only come
from ``@stateless(restore_seeds=True)`` (``select_samples_to_pack`` derives the packer's seed from
it). The only mutable state is statistics (`LoaderStats`) and the per-worker consecutive-skip
guard, neither of which changes what is produced.

Failures: Energon's failure tolerance is set per instance from the config (finite; 0 is
rejected). Policy skips raise ``SkipSample`` and are counted per reason; because Energon never
counts skips and hangs silently when every sample is skipped, ``max_consecutive_skips`` skips in a
row stop the job with a `FatalSampleError` that explains why.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from megatron.energon import DefaultTaskEncoder, SkipSample, stateless
from megatron.energon.errors import FatalSampleError
from megatron.energon.task_encoder.base import get_failure_tolerance, get_stateless

from mmpack import masks
from mmpack.energon.config import PackingEncoderConfig
from mmpack.energon.cookers import default_cookers
from mmpack.energon.media import MediaHandle
from mmpack.energon.samples import Conversation, EncodedConversation, SftBatch, SftPack
from mmpack.energon.stats import LoaderStats
from mmpack.energon.validation import check_optional_dependencies, resolve_media_settings
from mmpack.errors import EnergonConfigError, SampleFormatError, TooManySkippedError

__all__ = ["MEDIA_KEYS", "PackingTaskEncoder", "stateless_with_tolerance"]

F = TypeVar("F", bound=Callable[..., Any])

#: media kind -> key in `EncodedSample.media` / `PackedBatch.media`
MEDIA_KEYS = {"image": "pixel_values", "audio": "audio_values"}
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_TOKEN = "<|end|>"
MEDIA_TOKENS = {"image": "<image>", "audio": "<audio>"}


def stateless_with_tolerance(
    *, restore_seeds: bool = False, failure_tolerance: int | None = None
) -> Callable[[F], F]:
    """``@stateless(restore_seeds=..., failure_tolerance=...)`` that keeps the tolerance.

    Energon 7.4's ``stateless`` returns its ``restore_seeds`` wrapper before it records
    ``failure_tolerance``, so ``@stateless(restore_seeds=True, failure_tolerance=N)`` silently
    uses the class default instead of N. This applies the tolerance to the inner function first
    (``functools.wraps`` copies the attribute onto the seeding wrapper).
    """
    if failure_tolerance is not None and (
        isinstance(failure_tolerance, bool)
        or not isinstance(failure_tolerance, int)
        or failure_tolerance < 1
    ):
        raise EnergonConfigError(
            f"failure_tolerance must be a positive integer (0 means 'never stop' in Energon), "
            f"got {failure_tolerance!r}"
        )

    def decorate(fn: F) -> F:
        inner = (
            stateless(fn, failure_tolerance=failure_tolerance)
            if failure_tolerance
            else stateless(fn)
        )
        if restore_seeds:
            return stateless(inner, restore_seeds=True)
        return inner

    return decorate


class PackingTaskEncoder(DefaultTaskEncoder[Conversation, EncodedConversation, SftPack, SftBatch]):
    """Packing task encoder for multimodal SFT. Subclass and override `encode_conversation` to
    change how a conversation becomes tokens; everything else (packing, masks, media, failure
    handling, checkpoint rules) is shared.

    Args:
        config: `PackingEncoderConfig` (defaults if omitted).
        tokenizer: a Hugging Face (fast) tokenizer; the default `encode_conversation` needs the
            special tokens ``<|system|> <|user|> <|assistant|> <|end|>`` and one media token per
            configured modality (``<image>``, ``<audio>``).
        processor: object or mapping with the media settings of the configured modalities
            (image: ``patch_size``; audio: ``sampling_rate``, ``hop_length``,
            ``downsample_factor``), checked at construction.
        backend: ``"native"`` (mmpack's Rust packer and batch builder) or ``"reference"``
            (the plain-Python references; for comparisons).
    """

    cookers = default_cookers()
    #: Raw bytes reach the cookers: decoding is ours and lazy (Energon's default decoder would
    #: decode every image part of every sample up front).
    decoder = None

    def __init__(
        self,
        config: PackingEncoderConfig | None = None,
        *,
        tokenizer: Any = None,
        processor: Any = None,
        backend: str = "native",
    ) -> None:
        super().__init__()
        cfg = config if config is not None else PackingEncoderConfig()
        if not isinstance(cfg, PackingEncoderConfig):
            raise EnergonConfigError(
                f"config must be a PackingEncoderConfig, got {type(cfg).__name__}; use "
                "PackingEncoderConfig.from_dict / from_yaml"
            )
        self.config = cfg
        # Energon reads this for every hook without an explicit tolerance (cooker included).
        self.__default_failure_tolerance__ = cfg.failure_tolerance
        self.media_settings = resolve_media_settings(processor, cfg.modalities)
        check_optional_dependencies(cfg.modalities)
        self.tokenizer = tokenizer
        self._token_ids = self._resolve_special_tokens(tokenizer) if tokenizer is not None else {}
        self.backend = backend
        self._pack, self._build, self._encoded_sample_cls, self._packed_tensor_cls = _backend(
            backend
        )
        self._probe_packer()
        self._check_hooks()
        self.stats = LoaderStats()
        # policy skips since the last sample that passed, per reason (the consecutive-skip guard)
        self._skips_in_a_row: dict[str, int] = {}

    # ------------------------------------------------------------------ construction checks

    def _resolve_special_tokens(self, tokenizer: Any) -> dict[str, int]:
        needed = [*ROLE_TOKENS.values(), END_TOKEN]
        needed += [MEDIA_TOKENS[m] for m in self.config.modalities]
        vocab = tokenizer.get_vocab()
        missing = [t for t in needed if t not in vocab]
        if missing:
            raise EnergonConfigError(
                f"the tokenizer lacks the special tokens {missing} that the default "
                "encode_conversation needs; add them or override encode_conversation"
            )
        return {t: int(vocab[t]) for t in needed}

    #: Hooks Energon re-runs when it restores a checkpoint (must be @stateless, finite tolerance).
    RESTORED_HOOKS = (
        "cook_crude_sample",
        "preencode_sample",
        "postencode_sample",
        "pack_selected_samples",
        "batch",
    )
    #: Hooks that only need a finite failure tolerance.
    OTHER_HOOKS = ("select_samples_to_pack", "encode_batch")

    def _check_hooks(self) -> None:
        """A subclass's hook overrides must stay restorable and keep a finite tolerance: fail
        here, not after a resume (Energon checks statelessness only when restoring) or when a
        broken dataset never stops."""
        problems = []
        for name in (*self.RESTORED_HOOKS, *self.OTHER_HOOKS):
            hook = getattr(self, name)
            if name in self.RESTORED_HOOKS and not get_stateless(hook):
                problems.append(
                    f"{name} is not @stateless (Energon re-runs it on restore; use "
                    "@stateless, or @stateless(restore_seeds=True) if it uses randomness)"
                )
            tolerance = get_failure_tolerance(hook, self.config.failure_tolerance)
            if tolerance <= 0:
                problems.append(
                    f"{name} has failure_tolerance={tolerance}, which Energon reads as 'never stop'"
                )
        if problems:
            raise EnergonConfigError(f"{type(self).__name__}: " + "; ".join(problems))

    def _probe_packer(self) -> None:
        """Fail at construction (not in a worker) if the packing options are invalid."""
        cfg = self.config
        try:
            self._pack(
                np.array([1], dtype=np.int64),
                cfg.capacity,
                algorithm=cfg.algorithm,
                max_items_per_bin=cfg.max_samples_per_pack,
                media=None if cfg.media_budget is None else np.array([0], dtype=np.int64),
                media_capacity=cfg.media_budget,
                seed=0,
            )
        except EnergonConfigError:
            raise
        except Exception as err:
            packer = "mmpack.packing.pack" if self.backend == "native" else "the reference packer"
            raise EnergonConfigError(
                f"packing options rejected by {packer}: {type(err).__name__}: {err}"
            ) from err

    def dataset_options(self) -> dict[str, int]:
        """The packing options of ``get_train_dataset`` / ``get_val_dataset`` that must match
        this encoder's config: ``get_train_dataset(path, **encoder.dataset_options(), ...)``."""
        return {
            "batch_size": self.config.batch_size,
            "packing_buffer_size": self.config.packing_buffer_size,
        }

    # ------------------------------------------------------------------ user override point

    def encode_conversation(self, conversation: Conversation) -> EncodedConversation:
        """Tokens, per-message lengths/roles and (in ``"precomputed"`` mode) the loss mask of one
        conversation. Media stays lazy: only its token count is used here.

        Layout per message: ``<|role|>`` + parts + ``<|end|>``; a media part expands to
        ``num_tokens`` copies of its media token. In ``"precomputed"`` mode a text fragment is
        trainable per its own flag (or per role when it has none), media is not, and the role and
        end markers follow the message (trainable if any of its fragments is).
        """
        if self.tokenizer is None:
            raise EnergonConfigError(
                "PackingTaskEncoder needs a tokenizer (or a subclass that overrides "
                "encode_conversation)"
            )
        cfg = self.config
        ids = self._token_ids
        train_roles = cfg.train_roles
        texts = [p.text for t in conversation.turns for p in t.parts if p.media is None and p.text]
        encoded = self.tokenize(texts) if texts else []
        text_iter = iter(encoded)
        chunks: list[list[int]] = []
        frag_lengths: list[int] = []
        frag_trainable: list[bool] = []
        message_lengths: list[int] = []
        message_roles: list[str] = []
        media: list[MediaHandle] = []
        media_units = 0
        for turn in conversation.turns:
            role_token = ROLE_TOKENS.get(turn.role)
            if role_token is None:
                raise SampleFormatError(
                    f"sample {conversation.__key__!r}: unknown role {turn.role!r} "
                    f"(expected one of {sorted(ROLE_TOKENS)})"
                )
            by_role = turn.role in train_roles
            flags = [p.trainable for p in turn.parts if p.media is None and p.trainable is not None]
            marker_trainable = any(flags) if flags else by_role
            start = len(frag_lengths)
            chunks.append([ids[role_token]])
            frag_lengths.append(1)
            frag_trainable.append(marker_trainable)
            for part in turn.parts:
                if part.media is not None:
                    n = part.media.num_tokens(self.media_settings)
                    chunks.append([ids[MEDIA_TOKENS[part.media.kind]]] * n)
                    frag_lengths.append(n)
                    frag_trainable.append(by_role if not flags else False)
                    media.append(part.media)
                    media_units += n
                elif part.text:
                    toks = next(text_iter)
                    if not toks:
                        continue
                    chunks.append(list(toks))
                    frag_lengths.append(len(toks))
                    frag_trainable.append(by_role if part.trainable is None else part.trainable)
            chunks.append([ids[END_TOKEN]])
            frag_lengths.append(1)
            frag_trainable.append(marker_trainable)
            message_lengths.append(sum(frag_lengths[start:]))
            message_roles.append(turn.role)
        token_ids = np.fromiter((t for c in chunks for t in c), dtype=np.int64)
        loss_mask = None
        if cfg.loss_mask_mode == "precomputed":
            loss_mask = np.repeat(np.array(frag_trainable, dtype=np.int8), frag_lengths)
        else:
            mixed = [
                t
                for t in conversation.turns
                if any(
                    p.trainable is not None and p.trainable != (t.role in train_roles)
                    for p in t.parts
                )
            ]
            if mixed:
                raise SampleFormatError(
                    f"sample {conversation.__key__!r} marks trainable spans per fragment that "
                    "differ from its roles; loss_mask_mode=None would train on the wrong tokens. "
                    "Use loss_mask_mode='precomputed' for this format"
                )
        return EncodedConversation.derive_from(
            conversation,
            token_ids=token_ids,
            loss_mask=loss_mask,
            message_lengths=np.array(message_lengths, dtype=np.int64),
            message_roles=message_roles,
            media=media,
            media_units=media_units,
        )

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (one batched call; a fast tokenizer's
        Rust backend is called directly, skipping the Python wrapper's per-call overhead)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        encode_fast = getattr(backend, "encode_batch_fast", None)
        if encode_fast is not None:
            return [e.ids for e in encode_fast(texts, add_special_tokens=False)]
        return list(self.tokenizer(texts, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ policy

    def _skip(self, sample: Any, reason: str, detail: str) -> SkipSample:
        self.stats.skip(reason)
        self._skips_in_a_row[reason] = self._skips_in_a_row.get(reason, 0) + 1
        consecutive = sum(self._skips_in_a_row.values())
        limit = self.config.max_consecutive_skips
        if consecutive >= limit:
            by_reason = ", ".join(f"{k}: {v}" for k, v in sorted(self._skips_in_a_row.items()))
            err = TooManySkippedError(
                f"{consecutive} consecutive samples were skipped by policy "
                f"({by_reason}; last: {getattr(sample, '__key__', '?')}: {detail}). Energon waits "
                "forever when every sample is skipped, so the job stops here: check the data or "
                f"raise max_consecutive_skips (now {limit})"
            )
            raise FatalSampleError(str(err)) from err
        return SkipSample(f"{reason}: {detail}")

    def check_policy(self, conversation: Conversation, encoded: EncodedConversation) -> None:
        """Raise `SkipSample` (counted per reason) for samples that are bad by policy, or
        `SampleFormatError` / `LossMaskError` for malformed ones (a precomputed mask is validated
        here). Override to add rules; call ``self._skip(sample, reason, detail)``."""
        cfg = self.config
        key = conversation.__key__
        roles = [t.role for t in conversation.turns if t.role != "system"]
        if not roles:
            raise self._skip(
                conversation, "no_turns", "the conversation has no user/assistant turns"
            )
        if roles[-1] not in cfg.train_roles:
            raise self._skip(
                conversation,
                "ends_on_user_turn",
                f"the conversation ends on a {roles[-1]!r} turn, with no answer to train on",
            )
        if encoded.loss_mask is not None:
            # checked here, per sample: a bad mask found by the batch builder would fail the
            # whole pack it was selected into
            masks.validate(encoded.loss_mask, encoded.num_tokens, sample_id=key)
            trainable = int(np.count_nonzero(encoded.loss_mask))
        else:
            roles = encoded.message_roles or []
            trainable = sum(
                int(n)
                for n, r in zip(encoded.message_lengths, roles, strict=True)
                if r in cfg.train_roles
            )
        if trainable == 0:
            raise self._skip(conversation, "empty_trainable_mask", "no token is trainable")
        if encoded.num_tokens > cfg.capacity:
            detail = f"{encoded.num_tokens} tokens > capacity {cfg.capacity}"
            if cfg.on_oversize == "error":
                raise SampleFormatError(
                    f"sample {key!r} is too long: {detail} (on_oversize='error')"
                )
            raise self._skip(conversation, "oversize", detail)
        if cfg.media_budget is not None and encoded.media_units > cfg.media_budget:
            detail = f"{encoded.media_units} media units > media_budget {cfg.media_budget}"
            if cfg.on_oversize == "error":
                raise SampleFormatError(f"sample {key!r} has too much media: {detail}")
            raise self._skip(conversation, "media_over_budget", detail)

    # ------------------------------------------------------------------ Energon hooks

    @stateless
    def cook_crude_sample(self, sample: Any, *args: Any, **kwargs: Any) -> Any:
        self.stats.add("seen")
        return super().cook_crude_sample(sample, *args, **kwargs)

    # Deterministic, so plain @stateless: a subclass that adds randomness (augmentation) must
    # decorate its override with @stateless(restore_seeds=True). (restore_seeds is not free:
    # Energon saves and restores the torch/numpy/python RNG states around every call, about
    # 1 ms per sample in a CPU worker.)
    @stateless
    def preencode_sample(self, sample: Conversation) -> EncodedConversation:
        encoded = self.encode_conversation(sample)
        self.check_policy(sample, encoded)
        self._skips_in_a_row.clear()
        self.stats.add("encoded")
        return encoded

    @stateless(restore_seeds=True)
    def select_samples_to_pack(
        self, samples: list[EncodedConversation]
    ) -> list[list[EncodedConversation]]:
        cfg = self.config
        lengths = np.fromiter((s.num_tokens for s in samples), dtype=np.int64, count=len(samples))
        media = None
        if cfg.media_budget is not None:
            media = np.fromiter(
                (s.media_units for s in samples), dtype=np.int64, count=len(samples)
            )
        # seeded by Energon from (worker seed, call index): restorable
        seed = random.getrandbits(63)
        start = time.perf_counter_ns()
        packing = self._pack(
            lengths,
            cfg.capacity,
            algorithm=cfg.algorithm,
            max_items_per_bin=cfg.max_samples_per_pack,
            media=media,
            media_capacity=cfg.media_budget,
            seed=seed,
        )
        offsets = np.asarray(packing.bin_offsets).tolist()
        items = np.asarray(packing.item_indices).tolist()
        self.stats.add("select_ns", time.perf_counter_ns() - start)
        if len(items) != len(samples) or sorted(items) != list(range(len(samples))):
            raise RuntimeError(
                f"packer returned {len(items)} placements for {len(samples)} samples; every "
                "sample must be in exactly one pack"
            )
        return [[samples[i] for i in items[a:b]] for a, b in itertools.pairwise(offsets)]

    @stateless
    def postencode_sample(self, sample: EncodedConversation) -> EncodedConversation:
        """Decode the media of one selected sample (the only place media is decoded)."""
        decoded = self.decode_media(sample)
        return EncodedConversation.derive_from(
            sample,
            token_ids=sample.token_ids,
            loss_mask=sample.loss_mask,
            message_lengths=sample.message_lengths,
            message_roles=sample.message_roles,
            media=sample.media,
            media_units=sample.media_units,
            decoded_media=decoded,
        )

    def decode_media(self, sample: EncodedConversation) -> dict[str, Any]:
        """One `PackedTensor` row per configured modality (empty row when the sample has none);
        a media item referenced twice is decoded once and shares its provenance."""
        out: dict[str, Any] = {}
        decodes = 0
        for kind in self.config.modalities:
            tensors: list[Any] = []
            provenance: list[bytes] = []
            index_of: dict[bytes, int] = {}
            refs: list[int] = []
            for handle in sample.media:
                if handle.kind != kind:
                    continue
                idx = index_of.get(handle.provenance)
                if idx is None:
                    idx = len(tensors)
                    index_of[handle.provenance] = idx
                    tensors.append(handle.decode(self.media_settings))
                    provenance.append(handle.provenance)
                    decodes += 1
                refs.append(idx)
            out[MEDIA_KEYS[kind]] = self._packed_tensor_cls(
                tensors,
                dim_to_pack=0,
                _row_offsets=[0, len(refs)],
                _segment_indices=refs,
                _segment_provenance=provenance,
            )
        if decodes:
            self.stats.add("decoded", decodes)
        return out

    def to_encoded_sample(self, sample: EncodedConversation) -> Any:
        """The `mmpack.batch.EncodedSample` of one (decoded) conversation."""
        cfg = self.config
        return self._encoded_sample_cls(
            sample.__key__,
            sample.token_ids,
            loss_mask=sample.loss_mask if cfg.loss_mask_mode == "precomputed" else None,
            message_lengths=None if cfg.loss_mask_mode == "precomputed" else sample.message_lengths,
            message_roles=None if cfg.loss_mask_mode == "precomputed" else sample.message_roles,
            media=sample.decoded_media,
        )

    def build_pack(self, samples: Sequence[EncodedConversation]) -> Any:
        """`PackedBatch` of decoded samples (the batch builder of the configured backend)."""
        cfg = self.config
        return self._build(
            [self.to_encoded_sample(s) for s in samples],
            loss_mask_mode=cfg.loss_mask_mode,
            train_roles=cfg.train_roles,
            pad_token_id=cfg.pad_token_id,
            pad_to_multiple_of=cfg.pad_to_multiple_of,
            ignore_index=cfg.ignore_index,
            cp_size=cfg.cp_size,
        )

    @stateless
    def pack_selected_samples(self, samples: list[EncodedConversation]) -> SftPack:
        if not samples:
            # Energon calls this with [] when postencode failed for every member (each failure
            # was already counted by the error handler): nothing to pack.
            self.stats.add("empty_pack")
            raise SkipSample("empty pack: every member failed in postencode_sample")
        start = time.perf_counter_ns()
        packed = self.build_pack(samples)
        self.stats.add("build_ns", time.perf_counter_ns() - start)
        keys = [s.__key__ for s in samples]
        self.stats.add("packed", len(samples))
        self.stats.add("packs")
        return SftPack(
            __key__=",".join(keys),
            __restore_key__=(),
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            packed=packed,
            sample_keys=keys,
            num_tokens=int(sum(s.num_tokens for s in samples)),
            capacity=self.config.capacity,
        )

    @stateless
    def batch(self, samples: list[Any]) -> SftBatch:
        if samples and isinstance(samples[0], SftPack):
            keys = [k for p in samples for k in p.sample_keys]
            return SftBatch(
                __key__=[p.__key__ for p in samples],
                __restore_key__=(),
                __sources__=tuple(src for p in samples for src in (p.__sources__ or ())),
                sample_keys=keys,
                num_tokens=sum(p.num_tokens for p in samples),
                token_slots=sum(p.capacity for p in samples),
                packs=[p.packed for p in samples],
            )
        start = time.perf_counter_ns()
        padded = self.build_padded(samples)
        self.stats.add("build_ns", time.perf_counter_ns() - start)
        self.stats.add("padded", len(samples))
        return SftBatch(
            __key__=[s.__key__ for s in samples],
            __restore_key__=(),
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            sample_keys=[s.__key__ for s in samples],
            num_tokens=sum(s.num_tokens for s in samples),
            token_slots=int(padded["input_ids"].numel()),
            padded=padded,
        )

    def build_padded(self, samples: Sequence[EncodedConversation]) -> dict[str, Any]:
        """Rows padded to the longest sample (the no-packing path)."""
        import torch

        cfg = self.config
        width = max(s.num_tokens for s in samples)
        n = len(samples)
        input_ids = np.full((n, width), cfg.pad_token_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int8)
        for row, s in enumerate(samples):
            input_ids[row, : s.num_tokens] = s.token_ids
            if s.loss_mask is not None:
                mask[row, : s.num_tokens] = s.loss_mask
            else:
                roles = s.message_roles or []
                flags = np.array([r in cfg.train_roles for r in roles], dtype=np.int8)
                mask[row, : s.num_tokens] = np.repeat(flags, s.message_lengths)
        labels = np.full((n, width), cfg.ignore_index, dtype=np.int64)
        shifted = mask[:, 1:].astype(bool)
        labels[:, :-1] = np.where(shifted, input_ids[:, 1:], cfg.ignore_index)
        out: dict[str, Any] = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(mask),
            "attention_mask": torch.from_numpy(input_ids != cfg.pad_token_id),
        }
        media = [s.decoded_media for s in samples if s.decoded_media]
        for key in MEDIA_KEYS.values():
            values = [m[key] for m in media if key in m]
            if values:
                out[key] = self._packed_tensor_cls.concat(values)
        return out


@functools.cache
def _backend(name: str) -> tuple[Any, Any, Any, Any]:
    from mmpack.batch import EncodedSample

    if name == "native":
        from mmpack import PackedTensor
        from mmpack.batch import pack_samples
        from mmpack.packing import pack

        return pack, pack_samples, EncodedSample, PackedTensor
    if name == "reference":
        from mmpack._reference.batch import pack_samples as ref_pack_samples
        from mmpack._reference.packed_tensor import PackedTensor as RefPackedTensor

        return _reference_pack, ref_pack_samples, EncodedSample, RefPackedTensor
    raise EnergonConfigError(f"backend must be 'native' or 'reference', got {name!r}")


@dataclasses.dataclass
class _ReferencePacking:
    bin_offsets: np.ndarray
    item_indices: np.ndarray


def _reference_pack(
    lengths: Any,
    capacity: int,
    *,
    algorithm: str,
    max_items_per_bin: int | None = None,
    media: Any = None,
    media_capacity: int | None = None,
    seed: int = 0,
) -> _ReferencePacking:
    """The plain-Python reference packer (NeMo-RL's algorithms) behind `mmpack.packing.pack`'s
    signature, for side-by-side runs."""
    from mmpack._reference.packing import PackingAlgorithm, get_packer
    from mmpack.packing import _algorithm_name

    supported = [a.value for a in PackingAlgorithm]
    name = _algorithm_name(algorithm)  # an unknown name raises as in mmpack.packing.pack
    if name not in supported:
        raise EnergonConfigError(
            f"backend='reference' runs only NeMo-RL's packing algorithms ({', '.join(supported)}); "
            f"algorithm {algorithm!r} needs backend='native'"
        )
    if max_items_per_bin is not None or media is not None or media_capacity is not None:
        raise EnergonConfigError(
            "the reference packer (NeMo-RL's algorithms) has no max_samples_per_pack or "
            "media_budget; use backend='native' for those"
        )
    bins = get_packer(name, capacity).pack([int(x) for x in lengths])
    offsets = np.cumsum([0, *(len(b) for b in bins)], dtype=np.int64)
    items = np.array([i for b in bins for i in b], dtype=np.int64)
    return _ReferencePacking(offsets, items)
