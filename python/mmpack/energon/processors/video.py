"""Video frames as transformers' ``load_video(path, backend="pyav")`` reads them: every frame of
the file and the ``VideoMetadata`` (frame rate, frame indices, duration) that time-dependent
processor outputs and fps-based frame sampling read."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import numpy as np

__all__ = ["VideoFrames", "all_frames_metadata", "video_frames"]


@dataclasses.dataclass(frozen=True)
class VideoFrames:
    """A decoded video: its frames (``uint8 [frames, height, width, 3]``) and their
    ``transformers.video_utils.VideoMetadata`` (frame rate, frame indices, duration)."""

    frames: np.ndarray
    metadata: Any


def video_frames(data: bytes) -> VideoFrames:
    """Every frame of the video in `data` and its metadata, as transformers'
    ``load_video(path, backend="pyav")`` reads a file (``read_video_pyav``: the stream's frame
    count and average rate; all frames)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        declared = int(stream.frames)
        rate = stream.average_rate
        fps = float(rate) if rate else 0.0
        height, width = int(stream.height), int(stream.width)
        frames = []
        for i, frame in enumerate(container.decode(video=0)):
            if declared and i >= declared:
                break
            frames.append(frame.to_ndarray(format="rgb24"))
    if not frames:
        raise ValueError("the video has no frames")
    metadata = all_frames_metadata(declared or len(frames), fps, width, height)
    return VideoFrames(np.stack(frames), metadata)


def all_frames_metadata(total: int, fps: float, width: int, height: int) -> Any:
    """``VideoMetadata`` of a pyav read of every frame (``read_video_pyav``'s fields)."""
    from transformers.video_utils import VideoMetadata

    fields: dict[str, Any] = {
        "total_num_frames": total,
        "fps": fps or None,
        "width": width,
        "height": height,
        "duration": total / fps if fps else 0.0,
        "video_backend": "pyav",
        "frames_indices": np.arange(total, dtype=int),  # load_video samples every frame
    }
    return VideoMetadata(**fields)
