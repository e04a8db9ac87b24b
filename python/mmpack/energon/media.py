"""Lazy media handles: media stays undecoded bytes (or an unread key into a media store) until a
selected sample is about to be packed.

A handle knows its kind, an identity (16-byte provenance: the same media key in the same store
gives the same provenance, so `PackedTensor.concat` deduplicates it), and enough metadata to
count its tokens (image width/height, audio duration) without decoding. Reads and decodes are
logged per process in `MEDIA_LOG`, which is what the tests use to prove that nothing is decoded
that is not used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
from typing import Any

import numpy as np

from mmpack.errors import SampleFormatError

__all__ = ["MEDIA_KEYS", "MEDIA_LOG", "MediaHandle", "MediaLog", "MediaSettings", "provenance_of"]

#: media kind -> key of its values in `EncodedConversation.decoded_media` and `PackedBatch.media`
MEDIA_KEYS = {"image": "pixel_values", "audio": "audio_values"}


@dataclasses.dataclass
class MediaLog:
    """Per-process record of media reads and decodes (by media identity string)."""

    reads: list[str] = dataclasses.field(default_factory=list)
    decodes: list[str] = dataclasses.field(default_factory=list)

    def clear(self) -> None:
        self.reads.clear()
        self.decodes.clear()


MEDIA_LOG = MediaLog()


@dataclasses.dataclass(frozen=True)
class MediaSettings:
    """Processor settings the media kinds need (resolved and checked at construction)."""

    image_patch_size: int | None = None
    audio_sampling_rate: int | None = None
    audio_hop_length: int | None = None
    audio_downsample_factor: int | None = None


def provenance_of(identity: str) -> bytes:
    """16-byte provenance id of a media identity string (deterministic across processes)."""
    return hashlib.blake2b(identity.encode("utf-8"), digest_size=16).digest()


class MediaHandle:
    """An undecoded media item: raw bytes carried by the sample, or a key into a media store
    (an Energon `FileStore`, read only when needed)."""

    __slots__ = ("_data", "_store", "identity", "key", "kind", "meta", "provenance", "sample_key")

    def __init__(
        self,
        *,
        kind: str,
        key: str,
        identity: str,
        sample_key: str,
        data: bytes | None = None,
        store: Any = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if (data is None) == (store is None):
            raise SampleFormatError(
                f"sample {sample_key!r}: media {key!r} needs exactly one of bytes or a store"
            )
        self.kind = kind
        self.key = key
        self.identity = identity
        self.sample_key = sample_key
        self.provenance = provenance_of(identity)
        self._data = data
        self._store = store
        self.meta = dict(meta or {})

    def __repr__(self) -> str:
        where = "inline" if self._data is not None else "store"
        return f"MediaHandle({self.kind}, {self.identity!r}, {where})"

    def read(self) -> bytes:
        """The raw bytes (reads the media store on first use)."""
        if self._data is None:
            try:
                data, _source = self._store[self.key]
            except Exception as err:
                raise SampleFormatError(
                    f"sample {self.sample_key!r}: media key {self.key!r} not found in the media "
                    f"store {_store_path(self._store)} ({type(err).__name__}: {err})"
                ) from err
            if not isinstance(data, (bytes, bytearray)):
                raise SampleFormatError(
                    f"sample {self.sample_key!r}: media store returned {type(data).__name__} for "
                    f"{self.key!r}; construct the task encoder with decoder=None (raw bytes)"
                )
            MEDIA_LOG.reads.append(self.identity)
            self._data = bytes(data)
        return self._data

    # -- sizes without decoding -------------------------------------------------------------

    def image_size(self) -> tuple[int, int]:
        """(width, height) from the metadata, else from the image header (no pixel decode)."""
        width, height = self.meta.get("width"), self.meta.get("height")
        if isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0:
            return width, height
        from PIL import Image

        try:
            with Image.open(io.BytesIO(self.read())) as img:  # parses the header only
                return int(img.size[0]), int(img.size[1])
        except Exception as err:
            raise SampleFormatError(
                f"sample {self.sample_key!r}: image {self.key!r} has no valid size "
                f"({type(err).__name__}: {err})"
            ) from err

    def num_tokens(self, settings: MediaSettings) -> int:
        """Tokens (placeholder expansions) this media item takes in the sequence."""
        if self.kind == "image":
            patch = _require(settings.image_patch_size, "image_patch_size")
            width, height = self.image_size()
            return _patch_grid(width, patch) * _patch_grid(height, patch)
        if self.kind == "audio":
            rate = _require(settings.audio_sampling_rate, "audio_sampling_rate")
            hop = _require(settings.audio_hop_length, "audio_hop_length")
            down = _require(settings.audio_downsample_factor, "audio_downsample_factor")
            duration = self.meta.get("duration")
            if not isinstance(duration, (int, float)) or duration <= 0:
                raise SampleFormatError(
                    f"sample {self.sample_key!r}: audio {self.key!r} needs a positive 'duration' "
                    "(seconds) in its metadata"
                )
            frames = math.ceil(duration * rate / hop)
            return max(1, math.ceil(frames / down))
        raise SampleFormatError(f"sample {self.sample_key!r}: unknown media kind {self.kind!r}")

    # -- decoding (only for samples that are packed) ----------------------------------------

    def decode(self, settings: MediaSettings) -> Any:
        """Decode to the model input tensor: image -> float32 patches ``[n_patches, p*p*3]``;
        audio -> float32 waveform resampled to the configured rate."""
        import torch

        data = self.read()
        MEDIA_LOG.decodes.append(self.identity)
        if self.kind == "image":
            patch = _require(settings.image_patch_size, "image_patch_size")
            return torch.from_numpy(_image_patches(data, patch, self))
        if self.kind == "audio":
            rate = _require(settings.audio_sampling_rate, "audio_sampling_rate")
            import librosa

            wave, _sr = librosa.load(io.BytesIO(data), sr=rate, mono=True)
            return torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
        raise SampleFormatError(f"sample {self.sample_key!r}: unknown media kind {self.kind!r}")


def _store_path(store: Any) -> str:
    try:
        return str(store.get_path())
    except Exception:
        return type(store).__name__


def _require(value: int | None, name: str) -> int:
    if value is None:
        raise SampleFormatError(f"processor setting {name} is not configured")
    return value


def _patch_grid(pixels: int, patch: int) -> int:
    return max(1, round(pixels / patch))


def _image_patches(data: bytes, patch: int, handle: MediaHandle) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
            gw, gh = _patch_grid(rgb.size[0], patch), _patch_grid(rgb.size[1], patch)
            if (rgb.size[0], rgb.size[1]) != (gw * patch, gh * patch):
                rgb = rgb.resize((gw * patch, gh * patch))
            arr = np.asarray(rgb, dtype=np.uint8)
    except Exception as err:
        raise SampleFormatError(
            f"sample {handle.sample_key!r}: image {handle.key!r} cannot be decoded "
            f"({type(err).__name__}: {err})"
        ) from err
    grid = arr.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 1, 3, 4)
    return grid.reshape(gh * gw, patch * patch * 3).astype(np.float32) / np.float32(255.0)
