"""A synthetic multimodal SFT dataset in both source formats, written as real WebDataset shards and
prepared with Energon, plus a tiny word-level tokenizer built in code (nothing is downloaded).

Used by `make demo` and the tests. Every sample's fate is known in advance (`expected`):
``"ok"``, ``"skip:<reason>"`` or ``"broken:<where>"``.

The building blocks are public for datasets made to measure: `write_webdataset` (samples given
as parts, written as shards and prepared), `write_metadataset` (a blend of prepared datasets,
with subflavors and media stores), `png_bytes`, `mp4_bytes` and `wav_bytes` (real media files).
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import wave
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SyntheticDataset",
    "build_tokenizer",
    "mp4_bytes",
    "png_bytes",
    "wav_bytes",
    "write_metadataset",
    "write_synthetic_dataset",
    "write_webdataset",
]

_SYLLABLES = [
    "ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "do",
    "xa", "fe", "gu", "ha", "jo", "ly", "mo", "ni", "qu", "ze",
]  # fmt: skip
WORDS = [a + b for a in _SYLLABLES for b in _SYLLABLES]  # 400 words
SPECIAL_TOKENS = [
    "<pad>",
    "<unk>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<image>",
    "<audio>",
]
PATCH_SIZE = 16
IMAGE_SIDES = (32, 48, 64, 96)


def build_tokenizer() -> Any:
    """A word-level `transformers.PreTrainedTokenizerFast` over the synthetic vocabulary."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *WORDS])}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )


@dataclasses.dataclass
class SyntheticDataset:
    root: Path
    metadataset: Path
    #: sample key -> "ok" | "skip:<reason>" | "broken:<where>"
    expected: dict[str, str]
    formats: tuple[str, ...]
    media_store_items: int
    #: sample key -> the kinds of media it holds ("image", "video", "audio"), for samples with any
    media_kinds: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.expected)

    def keys_with(self, prefix: str) -> set[str]:
        return {k for k, v in self.expected.items() if v.startswith(prefix)}


def _png(rng: np.random.Generator, width: int, height: int) -> bytes:
    from PIL import Image

    base = rng.integers(0, 256, size=(1, 1, 3), dtype=np.uint8)
    noise = rng.integers(0, 32, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(base + noise).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def png_bytes(width: int, height: int, *, seed: int = 0) -> bytes:
    """A PNG of `width` x `height` pixels whose content depends on `seed`."""
    return _png(np.random.default_rng(seed), width, height)


def mp4_bytes(frames: int, width: int, height: int, *, fps: int = 4, seed: int = 0) -> bytes:
    """An MP4 (MPEG-4 part 2) clip of `frames` frames of `width` x `height` noise at `fps` frames
    per second, written with PyAV, whose content depends on `seed`."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def wav_bytes(seconds: float, rate: int = 16000, *, freq: float = 440.0) -> bytes:
    """A mono 16-bit PCM WAV file: a sine of `freq` Hz, ``round(seconds * rate)`` frames."""
    frames = round(seconds * rate)
    t = np.arange(frames, dtype=np.float64) / rate
    pcm = (0.4 * 32767 * np.sin(2 * np.pi * freq * t)).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def write_webdataset(
    path: str | Path,
    samples: Sequence[tuple[str, Sequence[tuple[str, bytes]]]],
    *,
    shards: int = 1,
) -> Path:
    """Write `samples` (``(key, [(suffix, bytes), ...])``, stored as ``<key>.<suffix>``) in
    order over `shards` tar shards ``shard-0000.tar`` ... under `path`, and prepare them as an
    Energon ``CrudeWebdataset`` (train split only)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = []
    for shard in range(shards):
        name = f"shard-{shard:04d}.tar"
        names.append(name)
        lo, hi = shard * len(samples) // shards, (shard + 1) * len(samples) // shards
        with tarfile.open(path / name, "w") as tar:
            for key, parts in samples[lo:hi]:
                for suffix, data in parts:
                    _put(tar, f"{key}.{suffix}", data)
    _prepare(path, names)
    return path


def _prepare(path: Path, shard_names: list[str]) -> None:
    from megatron.energon.flavors import BaseWebdatasetFactory

    BaseWebdatasetFactory.prepare_dataset(
        path,
        shard_names,
        split_parts_ratio=[("train", 1.0), ("val", 0.0), ("test", 0.0)],
        shuffle_seed=None,
        workers=1,
    )
    (path / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    )


def write_metadataset(path: str | Path, entries: Sequence[Mapping[str, Any]]) -> Path:
    """Write a ``MetadatasetV2`` at `path` blending `entries` (``blend_epochized``). Each entry
    has ``path`` (a prepared dataset, relative to the metadataset's folder or absolute) and
    optionally ``subflavors`` (a mapping, e.g. ``{"mmpack_format": "fragments"}``),
    ``repetitions`` (default 1) and ``media`` (a media store folder, the ``aux: media`` of the
    fragments format)."""
    lines = [
        "__module__: megatron.energon",
        "__class__: MetadatasetV2",
        "splits:",
        "  train:",
        "    blend_epochized:",
    ]
    for entry in entries:
        lines += [
            f"      - repetitions: {int(entry.get('repetitions', 1))}",
            f"        path: {entry['path']}",
        ]
        subflavors = entry.get("subflavors")
        if subflavors:
            inner = ", ".join(f"{k}: {v}" for k, v in subflavors.items())
            lines.append(f"        subflavors: {{{inner}}}")
        if entry.get("media") is not None:
            lines += ["        aux:", f"          media: filesystem://{entry['media']}"]
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path


def _text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=max(1, n_words)))


def _n_words(rng: np.random.Generator, mean: float) -> int:
    return int(np.clip(rng.lognormal(np.log(mean), 0.7), 2, 20 * mean))


def _put(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _fate(rng: np.random.Generator, i: int, broken_every: int, skip_every: int) -> str:
    if broken_every and i % broken_every == broken_every // 2:
        return "broken"
    if skip_every and i % skip_every == skip_every // 3:
        return "skip"
    return "ok"


def write_synthetic_dataset(
    root: str | Path,
    num_samples: int = 4000,
    *,
    seed: int = 0,
    formats: Sequence[str] = ("generic", "fragments"),
    shards_per_format: int = 4,
    image_fraction: float = 0.35,
    mean_words: float = 40.0,
    broken_every: int = 150,
    skip_every: int = 60,
    capacity: int = 2048,
    media_pool: int = 12,
    all_fates: str | None = None,
    video_every: int = 0,
    audio_every: int = 0,
    max_exchanges: int = 3,
) -> SyntheticDataset:
    """Write ``num_samples`` conversations (split over `formats`) under `root`, prepare them with
    Energon and write ``root/metadataset.yaml`` (a ``blend_epochized`` of the formats, one
    repetition each; the fragments entry gets ``aux: {media: filesystem://media}``).

    One sample in `broken_every` is broken (bad JSON, a corrupt image, a missing media key),
    one in `skip_every` is skippable by policy (ends on a user turn, nothing trainable, longer
    than `capacity`). ``all_fates="broken"`` / ``"skip"`` makes every sample so.

    Each conversation has 1 to `max_exchanges` user/assistant exchanges (after an optional
    system turn). With `video_every` / `audio_every`, one good sample of the generic format in
    that many also opens its first user turn with a short MP4 clip / WAV clip (``<video>`` /
    ``<audio>``).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    formats = tuple(formats)
    for fmt in formats:
        if fmt not in ("generic", "fragments"):
            raise ValueError(f"unknown format {fmt!r}")
    expected: dict[str, str] = {}

    pool_sizes: list[tuple[int, int]] = []
    if "fragments" in formats:
        (root / "media").mkdir(exist_ok=True)
        for m in range(media_pool):
            w, h = (int(x) for x in rng.choice(IMAGE_SIDES, size=2))
            pool_sizes.append((w, h))
            (root / "media" / f"img_{m:04d}.png").write_bytes(_png(rng, w, h))

    per_format = [num_samples // len(formats)] * len(formats)
    per_format[0] += num_samples - sum(per_format)
    counter = 0
    fate_counts: dict[str, int] = {}
    media_kinds: dict[str, tuple[str, ...]] = {}
    for fmt, count in zip(formats, per_format, strict=True):
        fdir = root / fmt
        fdir.mkdir(exist_ok=True)
        shard_names = []
        for shard in range(shards_per_format):
            name = f"shard-{shard:04d}.tar"
            shard_names.append(name)
            lo = shard * count // shards_per_format
            hi = (shard + 1) * count // shards_per_format
            with tarfile.open(fdir / name, "w") as tar:
                for i in range(lo, hi):
                    key = f"{fmt[:4]}{i:07d}"
                    fate = all_fates or _fate(rng, counter, broken_every, skip_every)
                    counter += 1
                    variant = fate_counts.get(fate, 0)
                    fate_counts[fate] = variant + 1
                    if fmt == "generic":
                        clips = _clips(fate, counter - 1, video_every, audio_every)
                        files, outcome, kinds = _generic_sample(
                            rng,
                            key,
                            fate,
                            image_fraction,
                            mean_words,
                            capacity,
                            variant,
                            clips,
                            max_exchanges,
                        )
                    else:
                        files, outcome, kinds = _fragments_sample(
                            rng,
                            key,
                            fate,
                            image_fraction,
                            mean_words,
                            capacity,
                            pool_sizes,
                            variant,
                            max_exchanges,
                        )
                    expected[key] = outcome
                    if kinds:
                        media_kinds[key] = kinds
                    for suffix, data in files:
                        _put(tar, f"{key}.{suffix}", data)
        _prepare(fdir, shard_names)

    metadataset = write_metadataset(
        root / "metadataset.yaml",
        [
            {
                "path": fmt,
                "subflavors": {"mmpack_format": fmt},
                "media": "media" if fmt == "fragments" else None,
            }
            for fmt in formats
        ],
    )
    return SyntheticDataset(
        root, metadataset, expected, formats, len(pool_sizes), media_kinds=media_kinds
    )


def _clips(fate: str, counter: int, video_every: int, audio_every: int) -> tuple[str, ...]:
    """The clip kinds a generic sample opens with (good samples only, so a broken sample's
    first manifest entry stays the image it corrupts)."""
    if fate != "ok":
        return ()
    clips = []
    if video_every and counter % video_every == video_every // 4:
        clips.append("video")
    if audio_every and counter % audio_every == audio_every // 3:
        clips.append("audio")
    return tuple(clips)


def _turn_plan(
    rng: np.random.Generator, mean_words: float, max_exchanges: int = 3
) -> list[tuple[str, int]]:
    plan: list[tuple[str, int]] = []
    if rng.random() < 0.3:
        plan.append(("system", _n_words(rng, mean_words / 3)))
    for _ in range(int(rng.integers(1, max_exchanges + 1))):
        plan.append(("user", _n_words(rng, mean_words)))
        plan.append(("assistant", _n_words(rng, mean_words)))
    return plan


def _skip_kind(counter: int) -> str:
    return ("ends_on_user_turn", "empty_trainable_mask", "oversize")[counter % 3]


def _generic_sample(
    rng: np.random.Generator,
    key: str,
    fate: str,
    image_fraction: float,
    mean_words: float,
    capacity: int,
    counter: int,
    clips: tuple[str, ...] = (),
    max_exchanges: int = 3,
) -> tuple[list[tuple[str, bytes]], str, tuple[str, ...]]:
    plan = _turn_plan(rng, mean_words, max_exchanges)
    outcome = "ok"
    if fate == "skip":
        reason = _skip_kind(counter)
        # roles mode derives the mask from roles, so "nothing trainable" means "no assistant turn"
        if reason in ("ends_on_user_turn", "empty_trainable_mask"):
            reason = "ends_on_user_turn"
            plan.append(("user", _n_words(rng, mean_words)))
        else:
            plan.append(("assistant", capacity + 10))
        outcome = f"skip:{reason}"
    files: list[tuple[str, bytes]] = []
    manifest = []
    messages = []
    n_images = int(rng.integers(1, 3)) if rng.random() < image_fraction else 0
    for m, (role, words) in enumerate(plan):
        content = _text(rng, words)
        if role == "user" and n_images and m <= 1:
            content = "<image> " * n_images + content
            for j in range(n_images):
                w, h = (int(x) for x in rng.choice(IMAGE_SIDES, size=2))
                manifest.append({"name": f"img{j}.png", "kind": "image", "width": w, "height": h})
                files.append((f"img{j}.png", _png(rng, w, h)))
            n_images = 0
        if role == "user" and clips and m <= 1:
            content = "".join(f"<{kind}> " for kind in clips) + content
            manifest[:0] = [_clip(kind, counter, files) for kind in clips]
            clips = ()
        messages.append({"role": role, "content": content})
    if manifest and rng.random() < 0.5:
        # an extra manifest entry no placeholder uses: must never be decoded
        manifest.append({"name": "unused.png", "kind": "image", "width": 32, "height": 32})
        files.append(("unused.png", _png(rng, 32, 32)))
    body = json.dumps({"messages": messages, "media": manifest}).encode()
    if fate == "broken":
        if manifest and counter % 2:
            files = [(n, b"\x89PNG broken" if n == manifest[0]["name"] else d) for n, d in files]
            outcome = "broken:corrupt_image"
        else:
            body = body[: len(body) // 2]
            outcome = "broken:json"
    files.insert(0, ("json", body))
    kinds = tuple(dict.fromkeys(e["kind"] for e in manifest if e["name"] != "unused.png"))
    return files, outcome, kinds


def _clip(kind: str, counter: int, files: list[tuple[str, bytes]]) -> dict[str, Any]:
    """A clip of `kind` (seeded by `counter`, drawing nothing from the dataset's generator):
    appended to `files`, its manifest entry returned."""
    if kind == "video":
        files.append(("clip.mp4", mp4_bytes(4, 64, 48, seed=counter)))
        return {"name": "clip.mp4", "kind": "video"}
    files.append(("clip.wav", wav_bytes(0.5, freq=220.0 + 10 * (counter % 20))))
    return {"name": "clip.wav", "kind": "audio", "duration": 0.5}


def _fragments_sample(
    rng: np.random.Generator,
    key: str,
    fate: str,
    image_fraction: float,
    mean_words: float,
    capacity: int,
    pool_sizes: list[tuple[int, int]],
    counter: int,
    max_exchanges: int = 3,
) -> tuple[list[tuple[str, bytes]], str, tuple[str, ...]]:
    plan = _turn_plan(rng, mean_words, max_exchanges)
    outcome = "ok"
    reason = ""
    if fate == "skip":
        reason = _skip_kind(counter)
        if reason == "ends_on_user_turn":
            plan.append(("user", _n_words(rng, mean_words)))
        elif reason == "oversize":
            plan.append(("assistant", capacity + 10))
        outcome = f"skip:{reason}"
    conversation = []
    n_images = int(rng.integers(1, 3)) if rng.random() < image_fraction else 0
    missing_media = fate == "broken" and counter % 2 == 1
    for m, (role, words) in enumerate(plan):
        fragments: list[dict[str, Any]] = []
        if role == "user" and (n_images or missing_media) and m <= 1:
            for _ in range(max(n_images, 1)):
                idx = int(rng.integers(0, len(pool_sizes))) if pool_sizes else 0
                w, h = pool_sizes[idx] if pool_sizes else (32, 32)
                fragments.append(
                    {"media": f"img_{idx:04d}.png", "kind": "image", "width": w, "height": h}
                )
            if missing_media:
                fragments[0]["media"] = "does_not_exist.png"
            n_images = 0
        if role == "assistant" and words > 8 and rng.random() < 0.5:
            # a reasoning prefix that is not trained on, then the trained answer
            cut = words // 3
            fragments.append({"text": _text(rng, cut), "trainable": False})
            fragments.append(
                {"text": _text(rng, words - cut), "trainable": reason != "empty_trainable_mask"}
            )
        else:
            trainable = role == "assistant" and reason != "empty_trainable_mask"
            fragments.append({"text": _text(rng, words), "trainable": trainable})
        conversation.append({"role": role, "fragments": fragments})
    body = json.dumps({"conversation": conversation}).encode()
    if fate == "broken":
        if missing_media:
            outcome = "broken:missing_media"
        else:
            body = b"{" + body
            outcome = "broken:json"
    kinds = ("image",) if any("media" in f for t in conversation for f in t["fragments"]) else ()
    return [("json", body)], outcome, kinds
