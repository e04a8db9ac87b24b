"""`PackingTaskEncoder`: an Energon task encoder that packs with `mmpack.packing` and builds THD
batches with `mmpack.batch.pack_samples`.

Pipeline per worker (Energon 7.4): cooker (lazy `Conversation`) -> ``preencode_sample`` (checks
that read no media: undeclared modalities, turn structure; then the conversation encoder chosen
at construction (`mmpack.energon.conversation_encoder`) makes tokens and validated mask inputs,
and the policy reads its counts; users override `encode_conversation`) ->
``select_samples_to_pack`` (every buffered sample lands in exactly one pack, planned on its
padded length, `PackingTaskEncoder.pack_length`, so no pack exceeds ``capacity``) ->
``postencode_sample`` (decodes the media of that selected sample only, through the decoder chosen
at construction (`mmpack.energon.decoders`), and checks that each item takes the tokens it was
encoded with) -> ``pack_selected_samples`` (one `PackedBatch`) -> ``batch``.

Checkpointing: every hook Energon re-runs on restore is ``@stateless``; randomness may only come
from ``@stateless(restore_seeds=True)`` (``select_samples_to_pack`` derives the packer's seed from
it). The only mutable state is statistics (`LoaderStats`) and the per-worker consecutive-skip
guard, neither of which changes what is produced.

Failures (`mmpack.energon.policy`): Energon's failure tolerance is set per instance from the
config (finite; 0 is rejected). Policy skips raise ``SkipSample`` and are counted per reason;
``max_consecutive_skips`` skips in a row stop the job with a `FatalSampleError` that explains why.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from megatron.energon import DefaultTaskEncoder, SkipSample, stateless
from megatron.energon.errors import FatalSampleError

from mmpack import PackedTensor
from mmpack.batch import EncodedSample, PackedBatch, pack_samples
from mmpack.batch.fields import THD_MAX_LENGTH
from mmpack.batch.options import BatchOptions
from mmpack.batch.padded import PaddedBatch, pad_samples
from mmpack.energon.config import PackingEncoderConfig
from mmpack.energon.conversation_encoder import (
    BUILTIN_ENCODERS,
    ConversationEncoder,
    build_conversation_encoder,
)
from mmpack.energon.cookers import default_cookers
from mmpack.energon.decoders import BuiltinDecoder, MediaDecoder, decode_media
from mmpack.energon.markup import tokenize
from mmpack.energon.media import MediaSettings
from mmpack.energon.policy import (
    ConsecutiveSkipGuard,
    check_conversation,
    check_hooks,
    check_sample,
)
from mmpack.energon.processors import ModelProcessor, is_model_processor
from mmpack.energon.samples import Conversation, EncodedConversation, SftBatch, SftPack
from mmpack.energon.stats import LoaderStats
from mmpack.energon.validation import (
    check_chat_template,
    check_model_processor,
    check_optional_dependencies,
    resolve_media_settings,
)
from mmpack.errors import BatchOptionError, EnergonConfigError, IndexOverflowError
from mmpack.packing import pack

__all__ = ["PackingTaskEncoder"]


class PackingTaskEncoder(DefaultTaskEncoder[Conversation, EncodedConversation, SftPack, SftBatch]):
    """Packing task encoder for multimodal SFT. Subclass and override `encode_conversation` to
    change how a conversation becomes tokens; everything else (packing, masks, media, failure
    handling, checkpoint rules) is shared.

    Args:
        config: `PackingEncoderConfig` (defaults if omitted).
        tokenizer: a Hugging Face (fast) tokenizer. With a chat template, conversations are
            rendered by it; without one, mmpack's markup needs the special tokens
            ``<|system|> <|user|> <|assistant|> <|end|>`` and one media token per configured
            modality (``<image>``, ``<audio>``) (``conversation_format``). Defaults to the
            model processor's tokenizer.
        processor: the model's Hugging Face processor (``transformers.ProcessorMixin``), called
            for real on the media (`mmpack.energon.processors`); or an object or mapping with
            the settings of mmpack's own patchifier (image: ``patch_size``; audio:
            ``sampling_rate``, ``hop_length``, ``downsample_factor``). Checked at
            construction.

    The packer (`plan_packs`), the pack builder (`build_pack`) and the class of media values
    (`packed_tensor_type`) are mmpack's; a subclass may replace them with implementations of the
    same interfaces, for example to run the pipeline side by side with another implementation.
    """

    cookers = default_cookers()
    #: Raw bytes reach the cookers: decoding is ours and lazy (Energon's default decoder would
    #: decode every image part of every sample up front).
    decoder = None
    #: The class of the media values (``PackedTensor``'s constructor, ``merge_segments`` and
    #: ``concat``).
    packed_tensor_type: ClassVar[Any] = PackedTensor
    #: How errors name the packer behind `plan_packs`.
    packer_name: ClassVar[str] = "mmpack.packing.pack"

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

    def __init__(
        self,
        config: PackingEncoderConfig | None = None,
        *,
        tokenizer: Any = None,
        processor: Any = None,
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
        #: the model's Hugging Face processor, called for real on the media (None: a mapping
        #: of settings for mmpack's own patchifier)
        self.model_processor = ModelProcessor(processor) if is_model_processor(processor) else None
        if self.model_processor is not None:
            check_model_processor(self.model_processor, cfg.modalities)
            if cfg.media_capacity is not None:
                self.model_processor.require_unit_rule()
            self.media_settings = MediaSettings()
            if tokenizer is None:
                tokenizer = processor.tokenizer
        else:
            self.media_settings = resolve_media_settings(processor, cfg.modalities)
            check_optional_dependencies(cfg.modalities)
        #: decodes the media of the selected samples (`postencode_sample`)
        self.media_decoder: MediaDecoder = (
            self.model_processor
            if self.model_processor is not None
            else BuiltinDecoder(self.media_settings)
        )
        self.tokenizer = tokenizer
        #: turns conversations into tokens: chosen here, never per sample (None without a
        #: tokenizer: a subclass overrides `encode_conversation`)
        self.conversation_encoder: ConversationEncoder | None = build_conversation_encoder(
            cfg,
            tokenizer,
            model_processor=self.model_processor,
            media_settings=self.media_settings,
            tokenize=self.tokenize,
        )
        # what an overriding encode_conversation returns may have been edited after the
        # conversation encoder validated it, so it is validated again (so is the output of any
        # conversation encoder other than the built-in ones, checked per sample: a subclass may
        # swap `conversation_encoder` after construction)
        self._override_encodes = (
            type(self).encode_conversation is not PackingTaskEncoder.encode_conversation
        )
        if self.conversation_format == "chat_template":
            check_chat_template(self.encode_conversation, cfg.modalities)
        self._probe_packer()
        self._check_ignore_index()
        self.batch_options = self._probe_batch_options()
        self._check_capacity()
        check_hooks(
            self,
            restored_hooks=self.RESTORED_HOOKS,
            other_hooks=self.OTHER_HOOKS,
            default_tolerance=cfg.failure_tolerance,
        )
        self.stats = LoaderStats()
        self._skip_guard = ConsecutiveSkipGuard(self.stats, cfg.max_consecutive_skips)
        # media decoded for the pack (or padded batch) being built, by provenance: Energon
        # post-encodes every member of a pack, then packs them, so an item shared inside a
        # pack is decoded once (a cache of equal values: it changes nothing that is produced)
        self._pack_media: dict[bytes, Any] = {}

    def _probe_packer(self) -> None:
        """Fail at construction (not in a worker) if the packing options are invalid."""
        cfg = self.config
        try:
            self.plan_packs(
                np.array([1], dtype=np.int64),
                None if cfg.media_capacity is None else np.array([0], dtype=np.int64),
                seed=0,
            )
        except EnergonConfigError:
            raise
        except Exception as err:
            raise EnergonConfigError(
                f"packing options rejected by {self.packer_name}: {type(err).__name__}: {err}"
            ) from err

    def _probe_batch_options(self) -> BatchOptions:
        """The config's batch options, made once; fail at construction (not in a worker) if
        they are invalid (a negative ``pad_token_id``, an ``ignore_index`` equal to it): one
        padding token through the batch builder."""
        probe = EncodedSample("probe", [self.config.pad_token_id], loss_mask=[1])
        try:
            options = self.config.batch_options()
            pack_samples([probe], options.replace(loss_mask_mode="precomputed"))
        except (BatchOptionError, IndexOverflowError) as err:  # overflow: padding past int32
            raise EnergonConfigError(f"batch options rejected by pack_samples: {err}") from err
        return options

    def _check_capacity(self) -> None:
        """Refuse a ``capacity`` that no pack can have: every sample is padded to the padding
        multiple, so a pack's length is a multiple of it, and so must the fixed length of a
        micro-batch be (``pad_to_length=capacity * batch_size``), which ``cu_seqlens`` (int32)
        must hold."""
        capacity = self.config.capacity
        batch_size = self.config.batch_size
        if capacity * batch_size > THD_MAX_LENGTH:
            raise EnergonConfigError(
                f"capacity * batch_size = {capacity} * {batch_size} = {capacity * batch_size} "
                f"positions: a micro-batch (pad_to_length=capacity * batch_size) holds at most "
                f"2**31 - 1 = {THD_MAX_LENGTH} (cu_seqlens are int32)"
            )
        multiple = self.batch_options.padding_multiple
        if capacity % multiple:
            below = capacity - capacity % multiple
            above = below + multiple
            hint = f"{below} or {above}" if below else str(above)
            raise EnergonConfigError(
                f"capacity={capacity} is not a multiple of {multiple}, the padding multiple of "
                f"pad_to_multiple_of={self.config.pad_to_multiple_of} and "
                f"cp_size={self.config.cp_size}: every sample is padded to a multiple of "
                f"{multiple}, so a pack's length is one; use {hint}"
            )

    def _check_ignore_index(self) -> None:
        """Refuse an ``ignore_index`` that is a token id of the tokenizer: labels of that token
        would be ignored by the loss (caught here, not only by the batch that first holds it)."""
        if self.tokenizer is None:
            return
        vocab_size = len(self.tokenizer)
        if 0 <= self.config.ignore_index < vocab_size:
            raise EnergonConfigError(
                f"ignore_index={self.config.ignore_index} is a valid token id of the tokenizer "
                f"(vocabulary size {vocab_size}), so labels of that token would be ignored by "
                "the loss; use a negative value such as -100"
            )

    @property
    def conversation_format(self) -> str:
        """``"chat_template"`` or ``"markup"``: the format of the conversation encoder (the
        configured value when there is no tokenizer)."""
        if self.conversation_encoder is None:
            return self.config.conversation_format
        return self.conversation_encoder.format

    def dataset_options(self) -> dict[str, int]:
        """The packing options of ``get_train_dataset`` / ``get_val_dataset`` that must match
        this encoder's config: ``get_train_dataset(path, **encoder.dataset_options(), ...)``."""
        return {
            "batch_size": self.config.batch_size,
            "packing_buffer_size": self.config.packing_buffer_size,
        }

    # ------------------------------------------------------------------ user override points

    def encode_conversation(self, conversation: Conversation) -> EncodedConversation:
        """Tokens, per-message lengths/roles and (in ``"precomputed"`` mode) the loss mask of one
        conversation, validated, with its trainable tokens counted: by the conversation encoder
        chosen at construction (`mmpack.energon.chat_template.ChatTemplateEncoder` or
        `mmpack.energon.markup.MarkupEncoder`, per ``conversation_format``). Media stays lazy:
        only its token count is used here."""
        if self.conversation_encoder is None:
            raise EnergonConfigError(
                "PackingTaskEncoder needs a tokenizer (or a subclass that overrides "
                "encode_conversation)"
            )
        return self.conversation_encoder.encode(conversation)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (one batched call)."""
        return tokenize(self.tokenizer, texts)

    def _skip(self, sample: Any, reason: str, detail: str) -> SkipSample:
        """Count a policy skip of `sample` and return the ``SkipSample`` to raise; raises
        `FatalSampleError` when ``max_consecutive_skips`` samples in a row were skipped."""
        return self._skip_guard.skip(sample, reason, detail)

    def check_conversation(self, conversation: Conversation) -> None:
        """Checks before encoding, which read no media: media of an undeclared kind stops the
        job (or is skipped, ``on_undeclared_media: skip``); no turns / ending on a user turn
        raise `SkipSample` (counted per reason)."""
        check_conversation(self.config, conversation, self._skip)

    def check_policy(self, conversation: Conversation, encoded: EncodedConversation) -> None:
        """Raise `SkipSample` (counted per reason) for samples that are bad by policy, or
        `SampleFormatError` for ones too big under ``on_oversize="error"`` (a sample is too
        long when its `pack_length` exceeds ``capacity``); reads the counts of `encoded` (never
        rebuilds its mask). Override to add rules; call ``self._skip(sample, reason,
        detail)``."""
        check_sample(
            self.config, conversation, encoded, self._skip, pack_length=self.pack_length(encoded)
        )

    def pack_length(self, sample: EncodedConversation) -> int:
        """The positions `sample` takes in a pack: its tokens padded as the batch builder pads
        them (`mmpack.batch.BatchOptions.padded_length` of ``batch_options``). Packs are
        planned on it and the oversize check reads it, so no pack exceeds ``capacity``."""
        return self.batch_options.padded_length(sample.num_tokens)

    def plan_packs(self, lengths: np.ndarray, media: np.ndarray | None, *, seed: int) -> Any:
        """The packing of one buffer: `mmpack.packing.pack` of the samples' `lengths` (their
        `pack_length`, padding included) and `media` units with the config's options. Returns
        an object with ``bin_offsets`` and ``item_indices`` (a `mmpack.packing.Packing`)."""
        cfg = self.config
        return pack(
            lengths,
            cfg.capacity,
            algorithm=cfg.algorithm,
            max_items_per_bin=cfg.max_items_per_bin,
            media=media,
            media_capacity=cfg.media_capacity,
            seed=seed,
        )

    def pack_options(self) -> dict[str, Any]:
        """``batch_options`` as keyword arguments of `mmpack.batch.pack_samples` (and of
        `mmpack.batch.padded.pad_samples`): those that differ from the defaults."""
        return self.batch_options.keywords()

    def build_pack(self, samples: Sequence[EncodedConversation]) -> PackedBatch:
        """`PackedBatch` of decoded samples (`mmpack.batch.pack_samples`)."""
        return pack_samples([self.to_encoded_sample(s) for s in samples], self.batch_options)

    def build_padded(self, samples: Sequence[EncodedConversation]) -> PaddedBatch:
        """Rows padded to the longest sample, rounded up to the padding multiple (the
        no-packing path; `mmpack.batch.padded.pad_samples`)."""
        return pad_samples([self.to_encoded_sample(s) for s in samples], self.batch_options)

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
        self.check_conversation(sample)
        encoded = self.encode_conversation(sample)
        if self._override_encodes or type(self.conversation_encoder) not in BUILTIN_ENCODERS:
            encoded = encoded.revalidated(
                self.config.train_roles,
                precomputed=self.config.loss_mask_mode == "precomputed",
            )
        self.check_policy(sample, encoded)
        self._skip_guard.passed()
        self.stats.add("encoded")
        return encoded

    @stateless(restore_seeds=True)
    def select_samples_to_pack(
        self, samples: list[EncodedConversation]
    ) -> list[list[EncodedConversation]]:
        # padded as the builder pads them: a pack's padded total fits the capacity
        lengths = np.fromiter(
            (self.pack_length(s) for s in samples), dtype=np.int64, count=len(samples)
        )
        self._check_oversize_reached_packing(samples, lengths)
        media = None
        if self.config.media_capacity is not None:
            media = np.fromiter(
                (s.media_units for s in samples), dtype=np.int64, count=len(samples)
            )
        # seeded by Energon from (worker seed, call index): restorable
        seed = random.getrandbits(63)
        start = time.perf_counter_ns()
        packing = self.plan_packs(lengths, media, seed=seed)
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
            trainable_tokens=sample.trainable_tokens,
            media_tokens=sample.media_tokens,
            decoded_media=decoded,
        )

    def decode_media(self, sample: EncodedConversation) -> dict[str, Any]:
        """One `PackedTensor` row per output key of each configured modality, decoded by the
        decoder chosen at construction (`mmpack.energon.decoders.decode_media`): an item
        referenced twice, in this sample or in another member of its pack, is read, decoded
        and stored once; raises `MediaTokenCountError` when an item takes another number of
        tokens than the sample was encoded with."""
        decoded, n_decoded = decode_media(
            self.media_decoder,
            sample.__key__,
            sample.media,
            sample.media_tokens,
            modalities=self.config.modalities,
            packed_tensor_type=self.packed_tensor_type,
            by_content=self.config.media_identity == "content",
            decoded=self._pack_media,
        )
        if n_decoded:
            self.stats.add("decoded", n_decoded)
        return decoded

    def to_encoded_sample(self, sample: EncodedConversation) -> EncodedSample:
        """The `mmpack.batch.EncodedSample` of one (decoded) conversation."""
        precomputed = self.config.loss_mask_mode == "precomputed"
        return EncodedSample(
            sample.__key__,
            sample.token_ids,
            loss_mask=sample.loss_mask if precomputed else None,
            message_lengths=None if precomputed else sample.message_lengths,
            message_roles=None if precomputed else sample.message_roles,
            media=sample.decoded_media,
        )

    @stateless
    def pack_selected_samples(self, samples: list[EncodedConversation]) -> SftPack:
        # the pack's members are decoded: the next pack starts with no shared media
        self._pack_media.clear()
        if not samples:
            # Energon calls this with [] when postencode failed for every member (each failure
            # was already counted by the error handler): nothing to pack.
            self.stats.add("empty_pack")
            raise SkipSample("empty pack: every member failed in postencode_sample")
        start = time.perf_counter_ns()
        packed = self.build_pack(samples)
        self.stats.add("build_ns", time.perf_counter_ns() - start)
        keys = [s.__key__ for s in samples]
        self._check_pack_length(packed, samples, keys)
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

    def _check_oversize_reached_packing(
        self, samples: Sequence[EncodedConversation], lengths: np.ndarray
    ) -> None:
        """Stop the job on a sample longer than ``capacity`` in the packing buffer: the
        oversize check of `check_policy` was bypassed (an override that does not call
        ``super().check_policy``), and the packer would fail the whole buffer, good samples
        with it, every time such a sample comes. Fatal: no buffer would be safe."""
        over = np.flatnonzero(lengths > self.config.capacity)
        if not over.size:
            return
        i = int(over[0])
        err = EnergonConfigError(
            f"sample {samples[i].__key__!r} reached packing with pack_length "
            f"{int(lengths[i])} > capacity {self.config.capacity}: check_policy must refuse "
            f"such samples (an override must call super().check_policy)"
        )
        raise FatalSampleError(str(err)) from err

    def _check_pack_length(
        self, packed: Any, samples: Sequence[EncodedConversation], keys: list[str]
    ) -> None:
        """Stop the job on a pack longer than ``capacity``: `pack_length`, `plan_packs` and
        `build_pack` disagree (a subclass), and ``micro_batch(pad_to_length=capacity *
        batch_size)`` would fail on it. Fatal: every buffer would fail the same way."""
        length = len(packed.input_ids)
        capacity = self.config.capacity
        if length <= capacity:
            return
        planned = sum(self.pack_length(s) for s in samples)
        err = EnergonConfigError(
            f"{type(self).__name__} built a pack of {length} positions from samples "
            f"{keys} (planned: {planned}), over capacity {capacity}: pack_length must be the "
            f"positions build_pack gives each sample (padding included), and plan_packs must "
            f"keep each pack's pack_length total within the capacity"
        )
        raise FatalSampleError(str(err)) from err

    @stateless
    def batch(self, samples: list[Any]) -> SftBatch:
        # without packing the members of a padded batch share the cache instead of a pack's
        self._pack_media.clear()
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
            token_slots=int(padded.input_ids.numel()),
            padded=padded,
        )
