"""The startup probe: one small synthetic item per media kind through the real processor. It
learns what replaces the kind's placeholder (`Expansion`: a prefix, a run of placeholder tokens,
a suffix, and the output keys), and checks that what mmpack counts before decoding (tokens,
video frames, media units, row shapes) agrees with the processor's real output, so a processor
mmpack cannot predict is refused before any sample is read."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from mmpack.energon.processors.calling import call_processor
from mmpack.energon.processors.families import PADDED_KEYS
from mmpack.energon.processors.video import VideoFrames, all_frames_metadata
from mmpack.errors import ModalityConfigError

if TYPE_CHECKING:
    from mmpack.energon.processors.model import ModelProcessor

__all__ = ["Expansion", "Probe", "check_probe", "run_probe"]


@dataclasses.dataclass(frozen=True)
class Expansion:
    """What the processor puts in place of one placeholder of a kind: `prefix`, a run of
    `token_id`, `suffix`; and the output `keys` of an item of that kind."""

    prefix: tuple[int, ...]
    token_id: int
    suffix: tuple[int, ...]
    keys: tuple[str, ...]

    def ids(self, count: int) -> list[int]:
        return [*self.prefix, *([self.token_id] * count), *self.suffix]


@dataclasses.dataclass(frozen=True)
class Probe:
    """One probe item of `kind` through the processor: its `size` (as `count_for_size` takes
    it), the `expansion` learned, the placeholder tokens it took and its output `values`."""

    kind: str
    size: tuple[int, ...]
    expansion: Expansion
    tokens: int
    values: dict[str, Any]


def run_probe(bridge: ModelProcessor, kind: str) -> Probe:
    """Process a probe item of `kind` and learn its placeholder expansion; raises
    `ModalityConfigError` when the processor fails on it or does not replace the placeholder
    by one run of placeholder tokens."""
    item, size = _probe_item(kind, bridge.component(kind))
    ids, values = _call(bridge, kind, item)
    token_id = bridge.placeholder_id(kind)
    where = [i for i, t in enumerate(ids) if t == token_id]
    if not where or where != list(range(where[0], where[-1] + 1)):
        raise ModalityConfigError(
            f"the processor {bridge.name} does not replace the {kind} placeholder by one "
            f"run of placeholder tokens (got {ids[:16]}...); mmpack cannot predict its "
            "expansion before decoding"
        )
    expansion = Expansion(
        tuple(ids[: where[0]]), token_id, tuple(ids[where[-1] + 1 :]), tuple(values)
    )
    return Probe(kind, size, expansion, len(where), values)


def check_probe(bridge: ModelProcessor, probe: Probe) -> None:
    """Check mmpack's counts before decoding against `probe`'s real output: a video's frame
    count, the token count, an image's row shapes, the media units. Raises
    `ModalityConfigError`."""
    kind, size = probe.kind, probe.size
    if kind == "video":
        _check_frame_count(bridge, probe.expansion.token_id)
    predicted = bridge.count_for_size(kind, size)
    if predicted != probe.tokens:
        raise ModalityConfigError(
            f"the processor {bridge.name}'s token count for a {kind} of size {size} is "
            f"{predicted}, but processing it gave {probe.tokens} placeholder tokens"
        )
    if kind == "image":
        _check_concatenable(bridge, kind, probe.values)
    rule = bridge.unit_rule
    if rule is not None:
        units = rule.before(bridge, kind, size, predicted)
        rows = rule.after(bridge, kind, probe.values)
        if units != rows:
            raise ModalityConfigError(
                f"the processor {bridge.name}'s media units for a {kind} of size {size} "
                f"are {units}, but its output holds {rows} rows for the {kind} tower"
            )


def _call(bridge: ModelProcessor, kind: str, item: Any) -> tuple[list[int], dict[str, Any]]:
    try:
        return call_processor(bridge.processor, kind, item, bridge.call_kwargs)
    except Exception as err:
        raise ModalityConfigError(
            f"the processor {bridge.name} failed on a probe {kind} ({type(err).__name__}: {err})"
        ) from err


def _check_frame_count(bridge: ModelProcessor, token_id: int) -> None:
    """Refuse (`ModalityConfigError`) a video processor that keeps another number of frames
    than the file holds (frame sampling: ``do_sample_frames`` with ``fps`` or
    ``num_frames``): tokens are counted before decoding from the container's frame count,
    so every video would fail its count check after decoding. A long probe clip shows it
    where the short one can hide it (sampling clamped to its ``min_frames``)."""
    frames, height, width = 48, 40, 60
    pixels = np.zeros((frames, height, width, 3), dtype=np.uint8)
    clip = VideoFrames(pixels, all_frames_metadata(frames, 4.0, width, height))
    ids, _ = _call(bridge, "video", clip)
    real = sum(1 for t in ids if t == token_id)
    predicted = bridge.count_for_size("video", (frames, height, width))
    if predicted != real:
        raise ModalityConfigError(
            f"the processor {bridge.name} gives {real} placeholder tokens for a probe video "
            f"of {frames} frames, but its count from the frame count is {predicted}: it "
            "samples frames (do_sample_frames, fps, num_frames in its videos_kwargs), which "
            "mmpack cannot count before decoding. Sample the frames when writing the "
            "dataset, or call the processor with do_sample_frames=False"
        )


def _check_concatenable(bridge: ModelProcessor, kind: str, values: dict[str, Any]) -> None:
    """Refuse (`ModalityConfigError`) a processor whose rows of one key differ beyond the
    leading dimension between a small wide image and a large square one (any-resolution
    tilings give them different tile counts), unless `PADDED_KEYS` pads that key: such
    rows cannot be concatenated into a pack, and would fail in the training loop at the
    first pack holding two of them."""
    other, _ = _probe_item(kind, bridge.component(kind), image_size=(448, 448))
    _, others = _call(bridge, kind, other)
    padded = bridge.padded_keys(kind)
    for key, value in values.items():
        a, b = getattr(value, "shape", None), getattr(others.get(key), "shape", None)
        if a is None or b is None or key in padded:
            continue
        if tuple(a[1:]) != tuple(b[1:]):
            raise ModalityConfigError(
                f"the processor {bridge.name} gives {kind} {key!r} rows of shape "
                f"{tuple(a[1:])} for one item and {tuple(b[1:])} for another, so a pack "
                "of several cannot be concatenated, and mmpack has no padding rule for "
                f"it (PADDED_KEYS knows {sorted(PADDED_KEYS)}). Use a processor whose "
                "per-item rows share their shape"
            )


def _probe_item(
    kind: str, component: Any, *, image_size: tuple[int, int] = (40, 60)
) -> tuple[Any, tuple[int, ...]]:
    """A small synthetic item of `kind` and its size as `count_for_size` takes it (an image
    of `image_size`, (height, width))."""
    rng = np.random.default_rng(0)
    if kind == "image":
        from PIL import Image

        height, width = image_size
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        return Image.fromarray(pixels), (height, width)
    if kind == "video":
        frames, height, width = 4, 40, 60
        pixels = rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
        metadata = all_frames_metadata(frames, 4.0, width, height)
        return VideoFrames(pixels, metadata), (frames, height, width)
    rate = int(getattr(component, "sampling_rate", 16000))
    samples = rate // 2
    wave = (0.1 * np.sin(np.arange(samples) * 0.05)).astype(np.float32)
    return wave, (samples,)
