"""Shared test setup: hypothesis profiles and a guard that fails any test raising a Rust panic."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "fast", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("MMPACK_HYPOTHESIS_PROFILE", "ci"))


def _is_panic(exc: BaseException | None) -> bool:
    while exc is not None:
        if type(exc).__name__ == "PanicException":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    outcome = yield
    excinfo = outcome.excinfo
    if excinfo is not None and _is_panic(excinfo[1]):
        pytest.fail(f"a Rust panic reached Python in {item.nodeid}: {excinfo[1]!r}")


# Energon fixtures shared by the tests/energon suites; imported lazily so that
# tests without Energon never load it.
@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny tokenizer the synthetic dataset writer builds in code (nothing downloaded)."""
    from mmpack_dev.synthetic import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def worker() -> Iterator[Any]:
    """An Energon WorkerConfig for code that needs one outside a running loader."""
    from mmpack_dev.energon_testing import active_worker

    with active_worker() as config:
        yield config


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One small local Ray instance (2 CPUs, a 256 MiB object store) for every Ray test: starting
    Ray costs more than the tests themselves. Imported lazily: tests without Ray never load it."""
    import ray

    ray.init(
        address="local",  # never a cluster that happens to run on this machine
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=256 * 1024 * 1024,
    )
    try:
        yield ray
    finally:
        import gc
        import warnings

        # Ray's shutdown leaves subprocess handles whose finalizers warn about still-running
        # helpers; they are Ray's, and must not fail the last test.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            ray.shutdown()
            gc.collect()


# Qwen2-VL's real tokenizer (Qwen2's byte-level BPE), built offline; the conversion runs once
# per process. Shared by the chat-template suites: a test that changes its tokenizer (a
# template, a padding side) makes its own with `mmpack_dev.qwen_vocab.qwen2_vl_tokenizer()`.
@pytest.fixture(scope="session")
def qwen_tokenizer() -> Any:
    """Qwen2-VL's tokenizer with the model's released chat template (no generation markers)."""
    from mmpack_dev.qwen_vocab import qwen2_vl_tokenizer

    return qwen2_vl_tokenizer()


@pytest.fixture(scope="session")
def qwen_generation_tokenizer() -> Any:
    """Qwen2-VL's tokenizer with the released template, assistant replies in
    ``{% generation %}`` blocks."""
    from mmpack_dev.qwen_vocab import QWEN2_VL_GENERATION_TEMPLATE, qwen2_vl_tokenizer

    return qwen2_vl_tokenizer(QWEN2_VL_GENERATION_TEMPLATE)


@pytest.fixture(scope="session")
def qwen_processor(qwen_tokenizer: Any) -> Any:
    """Qwen2-VL's processor (classes' defaults, a small max_pixels) over the real tokenizer."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=qwen_tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size),
    )
