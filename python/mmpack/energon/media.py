"""Lazy media handles: media stays undecoded bytes (or an unread key into a media store) until a
selected sample is about to be packed.

A handle knows its kind, where it comes from (its source, which gives its provenance), and enough
metadata to count its tokens without decoding: image width/height and audio duration from the
manifest or fragment, else from the file's header (the first bytes only, never the whole file).
After decoding, `decoded_tokens` gives the count the decoded value really takes, which the task
encoder compares with the count the sample was encoded with.

Identity rule. A media item's 16-byte provenance (what `PackedTensor.merge_segments` / ``concat``
deduplicate on) is a hash of where the item really is:

* an item stored inside a WebDataset sample (the generic format): the dataset's own path, as
  Energon reports it (absolute, with its protocol for remote storage), the shard, the sample key
  and the member name;
* an item in a media store (the fragments format): the store's own path (``get_path()``) and
  the key.

Equal sources give equal provenance (a store item referenced by several samples is stored and
decoded once per pack); different sources never do, so datasets or stores written with the same
names (shard names, keys, members) blend without one sample receiving another's media, whatever
subflavors or loader workers read them. With the config's ``media_identity: content``, provenance
is instead a hash of the kind and the item's bytes (hashed when the item is decoded): equal bytes
share one stored segment wherever they come from.

Reads and decodes are logged per process in `MEDIA_LOG` (identities, and byte counts of full
reads and header reads), which is what the tests use to prove that nothing is read or decoded
that is not used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from mmpack.errors import SampleFormatError

__all__ = [
    "MEDIA_KEYS",
    "MEDIA_LOG",
    "MediaHandle",
    "MediaLog",
    "MediaSettings",
    "provenance_of",
    "store_path",
    "store_source",
    "upright_image",
    "upright_size",
    "webdataset_source",
]

#: media kind -> key of its values in `EncodedConversation.decoded_media` and `PackedBatch.media`
MEDIA_KEYS = {"image": "pixel_values", "audio": "audio_values", "video": "pixel_values_videos"}

#: ``ceil(duration * rate)`` tolerates this much float error in a declared duration (a duration
#: written as ``frames / rate`` must give back ``frames``)
_DURATION_EPS = 1e-6


@dataclasses.dataclass
class MediaLog:
    """Per-process record of media reads and decodes (by media identity string).

    ``reads`` / ``bytes_read``: full reads of a media store item (at decode time);
    ``header_reads`` / ``header_bytes``: reads of a store item's first bytes for its size;
    ``decodes``: decoded items (inline or from a store)."""

    reads: list[str] = dataclasses.field(default_factory=list)
    decodes: list[str] = dataclasses.field(default_factory=list)
    header_reads: list[str] = dataclasses.field(default_factory=list)
    bytes_read: int = 0
    header_bytes: int = 0

    def clear(self) -> None:
        self.reads.clear()
        self.decodes.clear()
        self.header_reads.clear()
        self.bytes_read = 0
        self.header_bytes = 0


MEDIA_LOG = MediaLog()


@dataclasses.dataclass(frozen=True)
class MediaSettings:
    """Processor settings the media kinds need (resolved and checked at construction)."""

    image_patch_size: int | None = None
    audio_sampling_rate: int | None = None
    audio_hop_length: int | None = None
    audio_downsample_factor: int | None = None


def provenance_of(*parts: str | bytes) -> bytes:
    """16-byte provenance of a source (or content) given as parts; deterministic across
    processes. Parts are joined with NUL, which no path, shard, key or member name contains, so
    different sources never hash the same string."""
    digest = hashlib.blake2b(digest_size=16)
    for i, part in enumerate(parts):
        if i:
            digest.update(b"\0")
        digest.update(part.encode("utf-8") if isinstance(part, str) else part)
    return digest.digest()


def webdataset_source(dataset: str, shard: str, key: str, member: str) -> tuple[str, ...]:
    """Source of a media item stored as `member` of sample `key` in `shard` of `dataset`."""
    return ("webdataset", dataset, shard, key, member)


def store_source(store_path: str, key: str) -> tuple[str, ...]:
    """Source of the media item `key` of the media store at `store_path`."""
    return ("media-store", store_path, key)


class MediaHandle:
    """An undecoded media item: raw bytes carried by the sample, or a key into a media store
    (an Energon `FileStore`, read only when needed).

    `source`: where the item is (`webdataset_source` / `store_source`); its provenance and
    display `identity` derive from it. (``identity=`` , a free-form name, is the deprecated
    spelling: it names nothing about where the item is, so two cookers can give two different
    items the same one; it will be removed in the next release.)"""

    __slots__ = (
        "_data",
        "_sizes",
        "_store",
        "identity",
        "key",
        "kind",
        "meta",
        "sample_key",
        "source",
    )

    def __init__(
        self,
        *,
        kind: str,
        key: str,
        sample_key: str,
        source: tuple[str, ...] | None = None,
        data: bytes | None = None,
        store: Any = None,
        meta: dict[str, Any] | None = None,
        identity: str | None = None,
    ) -> None:
        if (data is None) == (store is None):
            raise SampleFormatError(
                f"sample {sample_key!r}: media {key!r} needs exactly one of bytes or a store"
            )
        if identity is not None:
            warnings.warn(
                "MediaHandle(identity=...) is deprecated; pass source=webdataset_source(...) or "
                "store_source(...), naming where the item is, so that items from different "
                "datasets or stores never share provenance. identity= will be removed in the "
                "next release",
                DeprecationWarning,
                stacklevel=2,
            )
            if source is None:
                source = ("identity", identity)
        if source is None:
            raise SampleFormatError(
                f"sample {sample_key!r}: media {key!r} needs its source (webdataset_source or "
                "store_source)"
            )
        self.kind = kind
        self.key = key
        self.source = tuple(source)
        self.identity = "/".join(p for p in self.source[1:] if p)
        self.sample_key = sample_key
        self._data = data
        self._store = store
        self.meta = dict(meta or {})
        # sizes read from the header, once per handle (token and unit counts both need them)
        self._sizes: dict[Any, Any] = {}

    def __repr__(self) -> str:
        where = "inline" if self._data is not None else "store"
        return f"MediaHandle({self.kind}, {self.identity!r}, {where})"

    @property
    def provenance(self) -> bytes:
        """Provenance from the item's source (the identity rule of the module docstring)."""
        return provenance_of(*self.source)

    def content_provenance(self) -> bytes:
        """Provenance from the item's kind and bytes (reads a store item in full)."""
        return provenance_of("content", self.kind, self.read())

    def read(self) -> bytes:
        """The raw bytes (reads the media store on first use; only for items being decoded)."""
        if self._data is None:
            data = self._fetch()
            MEDIA_LOG.reads.append(self.identity)
            MEDIA_LOG.bytes_read += len(data)
            self._data = data
        return self._data

    def _fetch(self) -> bytes:
        try:
            data, _source = self._store[self.key]
        except Exception as err:
            raise SampleFormatError(
                f"sample {self.sample_key!r}: media key {self.key!r} not found in the media "
                f"store {store_path(self._store)} ({type(err).__name__}: {err})"
            ) from err
        if not isinstance(data, (bytes, bytearray)):
            raise SampleFormatError(
                f"sample {self.sample_key!r}: media store returned {type(data).__name__} for "
                f"{self.key!r}; construct the task encoder with decoder=None (raw bytes)"
            )
        return bytes(data)

    @contextlib.contextmanager
    def _header(self) -> Iterator[Any]:
        """A file object for reading the item's header: the carried bytes, or a store file
        opened unbuffered, so only the bytes the header parser asks for are read. A store that
        cannot open a stream is read in full, and the bytes are dropped after the header."""
        if self._data is not None:
            yield io.BytesIO(self._data)
            return
        MEDIA_LOG.header_reads.append(self.identity)
        stream = _open_store_file(self._store, self.key)
        if stream is None:
            data = self._fetch()
            MEDIA_LOG.header_bytes += len(data)
            yield io.BytesIO(data)
            return
        counter = _CountingReader(stream)
        try:
            yield counter
        finally:
            MEDIA_LOG.header_bytes += counter.count
            stream.close()

    # -- sizes without decoding -------------------------------------------------------------

    def image_size(self) -> tuple[int, int]:
        """(width, height) from the metadata, else from the image header (no pixel decode)."""
        width, height = self.meta.get("width"), self.meta.get("height")
        if isinstance(width, int) and isinstance(height, int) and _positive(width, height):
            return width, height
        cached: tuple[int, int] | None = self._sizes.get("image")
        if cached is not None:
            return cached
        from PIL import Image

        try:
            with self._header() as stream, Image.open(stream) as img:  # parses the header only
                size = upright_size(img)
                self._sizes["image"] = size
                return size
        except SampleFormatError:
            raise
        except Exception as err:
            raise SampleFormatError(
                f"sample {self.sample_key!r}: image {self.key!r} has no valid size "
                f"({type(err).__name__}: {err})"
            ) from err

    def audio_samples(self, rate: int) -> int:
        """Waveform length at `rate` Hz: from the metadata's ``duration`` (seconds), else from
        the audio header (frames and native rate)."""
        duration = self.meta.get("duration")
        if duration is not None:
            if isinstance(duration, bool) or not isinstance(duration, (int, float)):
                duration = -1
            if duration <= 0 or not math.isfinite(duration):
                raise SampleFormatError(
                    f"sample {self.sample_key!r}: audio {self.key!r} has 'duration' "
                    f"{self.meta.get('duration')!r}; it must be a positive number of seconds"
                )
            return max(1, math.ceil(duration * rate - _DURATION_EPS))
        if "audio" in self._sizes:
            frames, native = self._sizes["audio"]
            return _resampled_length(frames, native, rate)
        import soundfile

        try:
            with self._header() as stream:
                info = soundfile.info(stream)
            frames, native = int(info.frames), int(info.samplerate)
        except SampleFormatError:
            raise
        except Exception as err:
            raise SampleFormatError(
                f"sample {self.sample_key!r}: audio {self.key!r} has no 'duration' and its "
                f"header cannot be read ({type(err).__name__}: {err})"
            ) from err
        if frames <= 0 or native <= 0:
            raise SampleFormatError(
                f"sample {self.sample_key!r}: audio {self.key!r} header gives {frames} frames "
                f"at {native} Hz"
            )
        self._sizes["audio"] = (frames, native)
        return _resampled_length(frames, native, rate)

    def video_shape(self) -> tuple[int, int, int]:
        """(frames, height, width) from the metadata (``frames``, ``width``, ``height``), else
        from the container header (PyAV; no frame is decoded)."""
        declared = [self.meta.get(k) for k in ("frames", "height", "width")]
        sizes = [v for v in declared if isinstance(v, int)]
        if len(sizes) == 3 and _positive(*sizes):
            return sizes[0], sizes[1], sizes[2]
        cached: tuple[int, int, int] | None = self._sizes.get("video")
        if cached is not None:
            return cached
        try:
            import av

            with self._header() as stream, av.open(stream) as container:
                video = container.streams.video[0]
                shape = (int(video.frames), int(video.height), int(video.width))
        except SampleFormatError:
            raise
        except Exception as err:
            raise SampleFormatError(
                f"sample {self.sample_key!r}: video {self.key!r} has no valid size "
                f"({type(err).__name__}: {err})"
            ) from err
        if not _positive(*shape):
            raise SampleFormatError(
                f"sample {self.sample_key!r}: video {self.key!r} header gives {shape[0]} frames "
                f"of {shape[2]}x{shape[1]}; declare 'frames', 'width' and 'height' in its metadata"
            )
        self._sizes["video"] = shape
        return shape

    def num_tokens(self, settings: MediaSettings) -> int:
        """Tokens (placeholder expansions) this media item takes in the sequence, from its
        metadata or header."""
        if self.kind == "image":
            patch = _require(settings.image_patch_size, "image_patch_size")
            width, height = self.image_size()
            return _patch_grid(width, patch) * _patch_grid(height, patch)
        if self.kind == "audio":
            rate = _require(settings.audio_sampling_rate, "audio_sampling_rate")
            return _audio_tokens(self.audio_samples(rate), settings)
        raise SampleFormatError(f"sample {self.sample_key!r}: unknown media kind {self.kind!r}")

    def num_units(self, settings: MediaSettings) -> int:
        """Media units of this item (``media_capacity``'s unit), from its metadata or header:
        an image's patches (one token each), an audio clip's feature frames (one per
        ``hop_length`` samples, before the downsampling that makes its tokens)."""
        if self.kind == "image":
            return self.num_tokens(settings)
        if self.kind == "audio":
            rate = _require(settings.audio_sampling_rate, "audio_sampling_rate")
            hop = _require(settings.audio_hop_length, "audio_hop_length")
            return max(1, math.ceil(self.audio_samples(rate) / hop))
        raise SampleFormatError(f"sample {self.sample_key!r}: unknown media kind {self.kind!r}")

    def decoded_tokens(self, value: Any, settings: MediaSettings) -> int:
        """Tokens the decoded `value` (from `decode`) really takes."""
        if self.kind == "image":
            return int(value.shape[0])
        return _audio_tokens(int(value.shape[0]), settings)

    # -- decoding (only for samples that are packed) ----------------------------------------

    def decode(self, settings: MediaSettings) -> Any:
        """Decode to the model input tensor: image -> float32 patches ``[n_patches, p*p*3]``;
        audio -> float32 mono waveform resampled to the configured rate."""
        import torch

        data = self.read()
        MEDIA_LOG.decodes.append(self.identity)
        if self.kind == "image":
            patch = _require(settings.image_patch_size, "image_patch_size")
            return torch.from_numpy(_image_patches(data, patch, self))
        if self.kind == "audio":
            rate = _require(settings.audio_sampling_rate, "audio_sampling_rate")
            return torch.from_numpy(decode_waveform(data, rate, self))
        raise SampleFormatError(f"sample {self.sample_key!r}: unknown media kind {self.kind!r}")


class _CountingReader(io.RawIOBase):
    """An unbuffered reader that counts the bytes it hands out."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self.count = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.count += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._raw.seek(offset, whence))

    def tell(self) -> int:
        return int(self._raw.tell())


def _open_store_file(store: Any, key: str) -> Any:
    """An unbuffered binary file of `key` in a file-system media store, or None for stores
    that keep items inside other files (tar shards, JSONL)."""
    from megatron.energon.cache.file_store import SystemFileStore

    inner = store
    while not isinstance(inner, SystemFileStore) and hasattr(inner, "_inner"):
        inner = inner._inner  # a decoding wrapper around the store
    if not isinstance(inner, SystemFileStore):
        return None
    from megatron.energon.epathlib import EPath

    path = EPath(key) if inner.base_dir is None else inner.base_dir / key
    try:
        if path.is_local():
            return open(path.local_path(), "rb", buffering=0)  # the caller closes it
        return path.open("rb")
    except OSError:
        return None  # the full read reports the missing key with the sample's name


def store_path(store: Any) -> str:
    """The media store's own path (``get_path()``), which names its items' sources."""
    try:
        return str(store.get_path())
    except Exception as err:
        raise SampleFormatError(
            f"media store {store!r} has no usable get_path() ({type(err).__name__}: {err}); "
            "mmpack names store media by the store's path"
        ) from err


def _positive(*values: int) -> bool:
    return all(not isinstance(v, bool) and v > 0 for v in values)


def _require(value: int | None, name: str) -> int:
    if value is None:
        raise SampleFormatError(f"processor setting {name} is not configured")
    return value


def _patch_grid(pixels: int, patch: int) -> int:
    return max(1, round(pixels / patch))


def _resampled_length(frames: int, native: int, rate: int) -> int:
    """Waveform length after resampling `frames` from `native` Hz to `rate` Hz (exact)."""
    return max(1, -(-frames * rate // native))


def _audio_tokens(samples: int, settings: MediaSettings) -> int:
    hop = _require(settings.audio_hop_length, "audio_hop_length")
    down = _require(settings.audio_downsample_factor, "audio_downsample_factor")
    frames = math.ceil(samples / hop)
    return max(1, math.ceil(frames / down))


#: EXIF orientations that turn the stored image by a quarter turn (width and height swap)
_QUARTER_TURNS = frozenset({5, 6, 7, 8})


def upright_size(img: Any) -> tuple[int, int]:
    """(width, height) of an opened image as displayed: its EXIF orientation applied, as
    transformers' ``load_image`` applies it (``ImageOps.exif_transpose``), from the header only.
    (A PNG's EXIF is read only where it precedes the pixels; one written after them is seen
    at decode, where the count check reports the swapped size.)"""
    width, height = int(img.size[0]), int(img.size[1])
    if img.format == "PNG" and "exif" not in img.info:
        return width, height  # getexif() would decode the pixels to look past them
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:
        return width, height  # unreadable EXIF: decoding reports it with the sample's name
    return (height, width) if orientation in _QUARTER_TURNS else (width, height)


def upright_image(img: Any) -> Any:
    """The opened image with its EXIF orientation applied (``ImageOps.exif_transpose``, as
    ``load_image`` does), its mode and transparency kept."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(img)


def _image_patches(data: bytes, patch: int, handle: MediaHandle) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = upright_image(img).convert("RGB")
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


def decode_waveform(data: bytes, rate: int, handle: MediaHandle) -> np.ndarray:
    """Mono float32 waveform at `rate` Hz, of exactly ``ceil(frames * rate / native)``
    samples (what the header-based token count assumes)."""
    import librosa
    import soundfile

    try:
        try:
            wave, native = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except soundfile.LibsndfileError:
            # a format libsndfile cannot read: librosa's fallback decoders, at the target rate
            wave, _ = librosa.load(io.BytesIO(data), sr=rate, mono=True)
            return np.ascontiguousarray(wave, dtype=np.float32)
        mono = wave.mean(axis=1)
        if int(native) != rate:
            mono = librosa.resample(mono, orig_sr=int(native), target_sr=rate, res_type="soxr_hq")
            size = _resampled_length(int(wave.shape[0]), int(native), rate)
            mono = librosa.util.fix_length(mono, size=size)
    except Exception as err:
        raise SampleFormatError(
            f"sample {handle.sample_key!r}: audio {handle.key!r} cannot be decoded "
            f"({type(err).__name__}: {err})"
        ) from err
    return np.ascontiguousarray(mono, dtype=np.float32)
