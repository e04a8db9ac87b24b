"""Fixtures shared by the packed suites."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def ray_store_on(ray_session: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The shared Ray instance with the object-store path on for one test module (as it was
    afterwards). The module's helpers travel by value: the workers do not have tests/ on
    their path."""
    from mmpack.packed import ray_store

    ray_session.cloudpickle.register_pickle_by_value(request.module)
    was_on = ray_store.enabled()
    ray_store.enable(True)
    try:
        yield ray_session
    finally:
        ray_store.enable(was_on)


@pytest.fixture
def tiny_segments_in_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of any size through the object store, as large ones go (the suites that use it
    keep their tensors tiny for speed; inline segments have their own tests)."""
    from mmpack.packed.ray_store import writing

    monkeypatch.setattr(writing, "INLINE_BELOW", 0)
