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
from `mmpack.energon.policy.seeded` (or ``stateless_with_tolerance(restore_seeds=True)``), seeded
from the loader's state at every call (``select_samples_to_pack`` derives the packer's seed from
it). Energon's own ``@stateless(restore_seeds=True)`` keeps the worker seed of its first call in
the process, so one earlier loader (a dry run, a validation loader) would change every pack.
The only mutable state is statistics (`LoaderStats`), the per-worker consecutive-skip guard and
the keys of the samples restored from a checkpoint and not yet packed (to name the
checkpoint when they no longer fit), none of which changes what is produced. A sample restored
from a checkpoint that this encoder's policy refuses, or a pack planned before the save that no
longer fits ``capacity``, means the checkpoint was saved with another config: the job stops
with an error that says so.

Accounting (`mmpack.energon.stats`): samples are counted ``packed`` when their batch is built
(``batch``), so a batch that fails counts its samples only as failed, and with
``batch_drop_last`` the last short batch of each worker is dropped by the encoder itself and
counted under ``dropped`` (Energon would drop it without a trace). The encoder's datasets count
failures whatever ``WorkerConfig`` the loader gets (`mmpack.energon.loader.counting_failures`),
and nothing Energon redoes to restore a checkpoint is counted.

Failures (`mmpack.energon.policy`): Energon's failure tolerance is set per instance from the
config (finite; 0 is rejected). Policy skips raise ``SkipSample`` and are counted per reason;
``max_consecutive_skips`` skips in a row stop the job with a `FatalSampleError` that explains why.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from megatron.energon import DefaultTaskEncoder, SkipSample, stateless

from mmpack import PackedTensor
from mmpack.batch import EncodedSample, PackedBatch, pack_samples
from mmpack.batch.padded import PaddedBatch, pad_samples
from mmpack.energon.accounted_datasets import AccountedDatasets
from mmpack.energon.config import PackingEncoderConfig
from mmpack.energon.conversation_encoder import (
    BUILTIN_ENCODERS,
    ConversationEncoder,
    build_conversation_encoder,
)
from mmpack.energon.cookers import default_cookers
from mmpack.energon.decoders import BuiltinDecoder, MediaDecoder, PackMedia
from mmpack.energon.loader import checked_on_restore, refused_on_restore
from mmpack.energon.markup import tokenize
from mmpack.energon.packing_checks import (
    check_buffer_lengths,
    check_capacity,
    check_ignore_index,
    check_pack_length,
    packs_of,
    probe_batch_options,
    probe_packer,
)
from mmpack.energon.policy import (
    OTHER_HOOKS,
    RESTORED_HOOKS,
    ConsecutiveSkipGuard,
    check_conversation,
    check_hooks,
    check_sample,
    seeded,
)
from mmpack.energon.samples import Conversation, EncodedConversation, SftBatch, SftPack
from mmpack.energon.stats import LoaderStats
from mmpack.energon.validation import check_chat_template, resolve_processor
from mmpack.errors import EnergonConfigError
from mmpack.packing import pack

__all__ = ["PackingTaskEncoder"]


class PackingTaskEncoder(
    AccountedDatasets, DefaultTaskEncoder[Conversation, EncodedConversation, SftPack, SftBatch]
):
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
    RESTORED_HOOKS: ClassVar[tuple[str, ...]] = RESTORED_HOOKS
    #: Hooks that only need a finite failure tolerance.
    OTHER_HOOKS: ClassVar[tuple[str, ...]] = OTHER_HOOKS

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
        self.model_processor, self.media_settings = resolve_processor(
            processor, cfg.modalities, media_capacity=cfg.media_capacity
        )
        if self.model_processor is not None and tokenizer is None:
            tokenizer = processor.tokenizer
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
        probe_packer(self.plan_packs, self.packer_name, media=cfg.media_capacity is not None)
        check_ignore_index(cfg.ignore_index, self.tokenizer)
        self.batch_options = probe_batch_options(cfg)
        check_capacity(cfg, self.batch_options)
        check_hooks(
            self,
            restored_hooks=self.RESTORED_HOOKS,
            other_hooks=self.OTHER_HOOKS,
            default_tolerance=cfg.failure_tolerance,
        )
        self.stats = LoaderStats()
        self._skip_guard = ConsecutiveSkipGuard(self.stats, cfg.max_consecutive_skips)
        # per process: keys of samples re-created from a checkpoint and not yet packed
        self._restored_keys: set[str] = set()
        # media decoded for the pack (or padded batch) being built: decoded once per pack
        self._pack_media = PackMedia(cfg.modalities, by_content=cfg.media_identity == "content")

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
        `FatalSampleError` when ``max_consecutive_skips`` samples in a row were skipped, and
        `EnergonConfigError` for a sample Energon re-creates from a loader checkpoint (it passed
        the policy of the encoder that saved it: that encoder's config differs)."""
        if self.stats.is_restoring:
            raise refused_on_restore(sample, reason, detail, capacity=self.config.capacity)
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

    # Deterministic, so plain @stateless: an override that adds randomness (augmentation) must
    # be `mmpack.energon.policy.seeded` (not free: about 1 ms per sample in a CPU worker).
    @stateless
    def preencode_sample(self, sample: Conversation) -> EncodedConversation:
        with checked_on_restore(self.stats, sample, capacity=self.config.capacity):
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
        if self.stats.is_restoring:
            self._restored_keys.add(encoded.__key__)
        return encoded

    @seeded  # from (worker seed, call index), not Energon's seed cache: see `policy.seeded`
    def select_samples_to_pack(
        self, samples: list[EncodedConversation]
    ) -> list[list[EncodedConversation]]:
        # padded as the builder pads them: a pack's padded total fits the capacity
        lengths = np.fromiter(
            (self.pack_length(s) for s in samples), dtype=np.int64, count=len(samples)
        )
        check_buffer_lengths(samples, lengths, self.config.capacity)
        media = None
        if self.config.media_capacity is not None:
            media = np.fromiter(
                (s.media_units for s in samples), dtype=np.int64, count=len(samples)
            )
        with self.stats.timed("select_ns"):
            packing = self.plan_packs(lengths, media, seed=random.getrandbits(63))
        return packs_of(samples, packing)

    @stateless
    def postencode_sample(self, sample: EncodedConversation) -> EncodedConversation:
        """Decode the media of one selected sample (the only place media is decoded)."""
        return sample.with_decoded_media(self.decode_media(sample))

    def decode_media(self, sample: EncodedConversation) -> dict[str, Any]:
        """One `PackedTensor` row per output key of each configured modality, decoded by the
        decoder chosen at construction (`mmpack.energon.decoders.decode_media`): an item
        referenced twice, in this sample or in another member of its pack, is read, decoded
        and stored once; raises `MediaTokenCountError` when an item takes another number of
        tokens than the sample was encoded with."""
        decoded, n_decoded = self._pack_media.decode(
            self.media_decoder, sample, packed_tensor_type=self.packed_tensor_type
        )
        if n_decoded:
            self.stats.add("decoded", n_decoded)
        return decoded

    def to_encoded_sample(self, sample: EncodedConversation) -> EncodedSample:
        """The `mmpack.batch.EncodedSample` of one (decoded) conversation."""
        return sample.batch_sample(precomputed=self.config.loss_mask_mode == "precomputed")

    @stateless
    def pack_selected_samples(self, samples: list[EncodedConversation]) -> SftPack:
        # the pack's members are decoded: the next pack starts with no shared media
        self._pack_media.clear()
        if not samples:
            # Energon calls this with [] when postencode failed for every member (each failure
            # was already counted by the error handler): nothing to pack.
            self.stats.add("empty_pack")
            raise SkipSample("empty pack: every member failed in postencode_sample")
        restored = [s.__key__ for s in samples if s.__key__ in self._restored_keys]
        self._restored_keys.difference_update(restored)
        with self.stats.timed("build_ns"):
            packed = self.build_pack(samples)
        check_pack_length(self, packed, samples, restored=restored)
        # counted as packed when their batch is built (`batch`)
        return SftPack.of(samples, packed, self.config.capacity)

    @stateless
    def batch(self, samples: list[Any]) -> SftBatch:
        # without packing the members of a padded batch share the cache instead of a pack's
        self._pack_media.clear()
        if samples and isinstance(samples[0], SftPack):
            batch = SftBatch.of_packs(samples)
            self.stats.add("packed", len(batch.sample_keys))
            self.stats.add("packs", len(samples))
            self.stats.batched(samples)
            return batch
        with self.stats.timed("build_ns"):
            padded = self.build_padded(samples)
        self.stats.add("padded", len(samples))
        self.stats.batched(samples)
        return SftBatch.of_padded(samples, padded)
