"""How a packing task encoder's Energon datasets are built so that its accounting holds: failures
are counted in the encoder's ``stats`` whatever ``WorkerConfig`` the loader gets (a plain one
too, as Megatron-LM builds its own: `mmpack.energon.loader.counting_failures`), nothing is counted
while Energon re-creates samples to restore a checkpoint (`mmpack.energon.loader.mute_restores`),
and with ``batch_drop_last`` each worker's last short batch is dropped by the encoder itself and
counted under ``dropped``, where Energon would drop it without a trace."""

from __future__ import annotations

from typing import Any

from megatron.energon import DefaultTaskEncoder, SkipSample
from megatron.energon.task_encoder.base import get_failure_tolerance, get_stateless
from megatron.energon.wrappers import BatchDataset, MapDataset

from mmpack.energon.loader import counting_failures, mute_restores
from mmpack.energon.samples import SftBatch, SftPack

__all__ = ["AccountedDatasets"]


class AccountedDatasets(DefaultTaskEncoder):
    """Energon's dataset builders, wired to ``self.stats`` (a `LoaderStats`)."""

    stats: Any

    def build_train_datasets(self, *, worker_config: Any, **kwargs: Any) -> Any:
        """Energon's train datasets, with failures counted in `stats` whatever
        ``worker_config`` is (a plain ``WorkerConfig`` too:
        `mmpack.energon.loader.counting_failures`) and nothing counted while Energon
        restores."""
        with counting_failures(worker_config, self.stats):
            dataset = super().build_train_datasets(worker_config=worker_config, **kwargs)
        mute_restores(dataset, self.stats)
        return dataset

    def build_val_datasets(self, *, worker_config: Any, **kwargs: Any) -> Any:
        """Energon's val datasets, wired as `build_train_datasets`."""
        with counting_failures(worker_config, self.stats):
            dataset = super().build_val_datasets(worker_config=worker_config, **kwargs)
        mute_restores(dataset, self.stats)
        return dataset

    def build_batch(
        self,
        dataset: Any,
        *,
        batch_size: int | None,
        batch_drop_last: bool = False,
        packing_buffer_size: int | None = None,
        worker_config: Any,
    ) -> Any:
        """Energon's packing and batching; with ``batch_drop_last`` the encoder drops each
        worker's last short batch itself, counting its samples as dropped (``dropped``:
        ``batch_drop_last``), where Energon would drop it without a trace. The batches are the
        same. (A ``batch_group_criterion`` override keeps Energon's grouping, which drops
        uncounted.)"""
        if (
            batch_size is None
            or not batch_drop_last
            or self._is_overridden(self.batch_group_criterion)
        ):
            return super().build_batch(
                dataset,
                batch_size=batch_size,
                batch_drop_last=batch_drop_last,
                packing_buffer_size=packing_buffer_size,
                worker_config=worker_config,
            )
        packs = super().build_batch(
            dataset,
            batch_size=None,
            packing_buffer_size=packing_buffer_size,
            worker_config=worker_config,
        )
        tolerance = self.__default_failure_tolerance__
        batches: Any = BatchDataset(
            packs,
            batch_size=batch_size,
            batcher=_DropShortBatch(self, batch_size),
            batcher_stateless=get_stateless(self.batch),
            drop_last=False,  # the batcher drops the short batch, counting it
            worker_config=worker_config,
            failure_tolerance=get_failure_tolerance(self.batch, tolerance),
        )
        if self._is_overridden(self.encode_batch):
            batches = MapDataset(
                batches,
                self.encode_batch,
                worker_config=worker_config,
                stateless_map_fn=get_stateless(self.encode_batch),
                failure_tolerance=get_failure_tolerance(self.encode_batch, tolerance),
            )
        return batches


class _DropShortBatch:
    """The batcher of ``batch_drop_last``: `PackingTaskEncoder.batch` for full batches; the one
    short batch of a worker (its last) is counted as dropped and skipped, as Energon's
    ``drop_last`` skips it."""

    def __init__(self, encoder: Any, batch_size: int) -> None:
        self.encoder = encoder
        self.batch_size = batch_size
        # how Energon names the batcher in its configs and logs
        self.__module__ = type(encoder).__module__
        self.__qualname__ = f"{type(encoder).__qualname__}.batch"

    def __repr__(self) -> str:
        return f"{self.encoder.batch!r} (dropping a worker's last short batch)"

    def __call__(self, samples: list[Any]) -> SftBatch:
        if len(samples) < self.batch_size:
            members = sum(len(s.sample_keys) if isinstance(s, SftPack) else 1 for s in samples)
            self.encoder.stats.drop("batch_drop_last", members)
            raise SkipSample(f"batch_drop_last: the last {len(samples)} of {self.batch_size}")
        return self.encoder.batch(samples)
