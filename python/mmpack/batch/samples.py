"""``EncodedSample``: one tokenized sample, as every batch builder takes it."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpack.packed.value import PackedTensor

__all__ = ["EncodedSample"]


@dataclasses.dataclass
class EncodedSample:
    """One tokenized sample, ready to pack.

    ``token_ids``: 1-D integer ids (numpy array, torch tensor or sequence). ``loss_mask``: one
    0/1 value per token, aligned with ``token_ids`` (1: the token is trained on), used when
    ``loss_mask_mode="precomputed"``; it becomes the batch's ``token_mask``, and the batch's
    ``loss_mask`` is it shifted onto ``labels``. ``message_lengths`` and ``message_roles``:
    per-message token counts (summing to the token count) and role names, used when the mask
    is derived from roles (``loss_mask_mode=None``). ``media``: per key, a ``PackedTensor`` of
    this sample's media (for example ``pixel_values``).
    """

    sample_id: Hashable
    token_ids: Any
    loss_mask: Any = None
    message_lengths: Any = None
    message_roles: Sequence[str] | None = None
    media: dict[str, PackedTensor] | None = None
