"""mmpack on Megatron-Energon: a packing task encoder, lazy cookers for two source formats,
startup validation, failure handling and a synthetic dataset writer.

Modules: `task_encoder` (`PackingTaskEncoder`, the Energon hooks), `conversation_encoder` (how
a conversation becomes tokens, chosen at construction: `chat_template` or `markup`), `decoders`
(the media-decode loop: built-in decoding or the model's `processors`, a package with one
module per modality), `policy` (skips, consecutive-skip guard, finite failure tolerance),
`packing_checks` (no pack over capacity, every sample in one pack), `config`, `cookers`,
`media`, `samples`, `stats` (every sample counted once: packed, skipped, failed or dropped),
`loader` (worker config, checkpoint restore) and `validation`. Batches are built by `mmpack.batch`
(packs) and `mmpack.batch.padded` (the no-packing rows).

Needs the extra ``mmpack[energon]`` (``megatron-energon`` and ``torch``).

Typical use::

    from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, make_worker_config
    encoder = PackingTaskEncoder(PackingEncoderConfig.from_yaml("sft.yaml"),
                                 tokenizer=tok, processor={"patch_size": 16})
    ds = get_train_dataset(path, worker_config=make_worker_config(encoder, num_workers=2),
                           batch_size=encoder.config.batch_size,
                           packing_buffer_size=encoder.config.packing_buffer_size,
                           task_encoder=encoder, ...)
"""

from __future__ import annotations

try:
    import megatron.energon  # noqa: F401
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"mmpack.energon needs megatron-energon and torch ({err}); install the extra: "
        "pip install 'mmpack[energon]'"
    ) from err

from mmpack.energon.config import (
    KNOWN_ROLES,
    RENAMED_FIELDS,
    RETIRED_FIELDS,
    PackingEncoderConfig,
)
from mmpack.energon.cookers import cook_fragments, cook_generic, default_cookers
from mmpack.energon.loader import (
    loader_state_workers,
    make_worker_config,
    restore_batch,
    restore_loader_state,
    save_loader_state,
)
from mmpack.energon.media import MEDIA_KEYS, MEDIA_LOG, MediaHandle, MediaSettings
from mmpack.energon.policy import stateless_with_tolerance
from mmpack.energon.samples import Conversation, EncodedConversation, Part, SftBatch, SftPack, Turn
from mmpack.energon.stats import DROP_REASONS, SKIP_REASONS, LoaderStats
from mmpack.energon.task_encoder import PackingTaskEncoder
from mmpack.energon.validation import check_optional_dependencies, resolve_media_settings

__all__ = [
    "DROP_REASONS",
    "KNOWN_ROLES",
    "MEDIA_KEYS",
    "MEDIA_LOG",
    "RENAMED_FIELDS",
    "RETIRED_FIELDS",
    "SKIP_REASONS",
    "Conversation",
    "EncodedConversation",
    "LoaderStats",
    "MediaHandle",
    "MediaSettings",
    "PackingEncoderConfig",
    "PackingTaskEncoder",
    "Part",
    "SftBatch",
    "SftPack",
    "Turn",
    "check_optional_dependencies",
    "cook_fragments",
    "cook_generic",
    "default_cookers",
    "loader_state_workers",
    "make_worker_config",
    "resolve_media_settings",
    "restore_batch",
    "restore_loader_state",
    "save_loader_state",
    "stateless_with_tolerance",
]
