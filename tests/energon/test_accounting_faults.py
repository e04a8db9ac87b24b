"""Nothing lost end to end: the Energon demo dataset with injected faults, read
by the real Energon loader with 0 and 2 workers. Samples in = packed + skipped by reason +
failed by reason, exactly (the failure reasons are counted across worker processes), and the
demo's accounting line says "balanced".

Faults come from two places:

* the dataset writer (`mmpack_dev.synthetic`): corrupt images and bad JSON (generic format),
  missing media files and bad JSON (fragments format), conversations ending on a user turn,
  nothing trainable, longer than the capacity;
* a `PackingTaskEncoder` subclass that picks good samples by key and breaks them: a loss mask
  one value short (``LossMaskError``), the answer turn removed (odd turn structure), only a
  system turn left (no turns), padded past the capacity (oversize), an exception raised while
  encoding (a worker raising mid-epoch), while decoding media, and while building a pack (which
  fails every member of that pack).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from typing import Any

import numpy as np
import pytest
from megatron.energon import get_loader, get_train_dataset, stateless
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack_dev.demos.sft import RunResult, _accounting
from mmpack_dev.synthetic import PATCH_SIZE, write_synthetic_dataset

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

CAPACITY = 384
N_SAMPLES = 150
#: injected fault -> the sample's fate ("skip:<reason>" or "fail:<exception type>")
INJECTED = {
    "wrong_mask_length": "fail:LossMaskError",
    "odd_turns": "skip:ends_on_user_turn",
    "no_turns": "skip:no_turns",
    "oversize": "skip:oversize",
    "raise_in_encode": "fail:InjectedFault",
    "raise_in_decode": "fail:InjectedFault",
    "raise_in_pack": "fail:InjectedFault",
}
FAULTS = tuple(INJECTED)


class InjectedFault(RuntimeError):
    """What the faulty encoder raises (a worker failing mid-epoch)."""


class FaultyEncoder(PackingTaskEncoder):
    """Breaks the samples named in ``faults`` (key -> fault) in the stage the fault names."""

    faults: dict[str, str]  # set before the loader starts

    @stateless
    def preencode_sample(self, sample: Any) -> Any:
        # turn faults change the cooked conversation itself, which the policy checks read
        fault = self.faults.get(sample.__key__)
        if fault == "odd_turns":
            turns = list(sample.turns)
            while turns and turns[-1].role == "assistant":
                turns.pop()
            sample = dataclasses.replace(sample, turns=turns)
        elif fault == "no_turns":
            turns = [t for t in sample.turns if t.role == "system"]
            sample = dataclasses.replace(sample, turns=turns)
        return super().preencode_sample(sample)

    def encode_conversation(self, conversation: Any) -> Any:
        fault = self.faults.get(conversation.__key__)
        if fault == "raise_in_encode":
            raise InjectedFault(f"injected fault while encoding {conversation.__key__}")
        encoded = super().encode_conversation(conversation)
        if fault == "wrong_mask_length":
            return dataclasses.replace(encoded, loss_mask=encoded.loss_mask[:-1])
        if fault == "oversize":
            extra = CAPACITY + 1 - encoded.num_tokens
            return dataclasses.replace(
                encoded,
                token_ids=np.concatenate([encoded.token_ids, np.full(extra, 9, np.int64)]),
                loss_mask=np.concatenate([encoded.loss_mask, np.ones(extra, np.int8)]),
            )
        return encoded

    def decode_media(self, sample: Any) -> dict[str, Any]:
        if self.faults.get(sample.__key__) == "raise_in_decode":
            raise InjectedFault(f"injected fault while decoding {sample.__key__}")
        return super().decode_media(sample)

    @stateless
    def pack_selected_samples(self, samples: list[Any]) -> Any:
        for s in samples:
            if self.faults.get(s.__key__) == "raise_in_pack":
                raise InjectedFault(f"injected fault while packing {s.__key__}")
        return super().pack_selected_samples(samples)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("energon-faults"),
        N_SAMPLES,
        seed=3,
        shards_per_format=2,
        capacity=CAPACITY,
        mean_words=15,
        broken_every=12,
        skip_every=9,
        media_pool=6,
    )


def _plan(dataset: Any) -> dict[str, str]:
    """Good samples to break: the faults in turn over every 5th good key (both formats)."""
    good = sorted(dataset.keys_with("ok"))
    chosen = good[2::5][: 2 * len(FAULTS)]
    return {key: FAULTS[i % len(FAULTS)] for i, key in enumerate(chosen)}


def _run(dataset: Any, tokenizer: Any, workers: int) -> tuple[list[str], FaultyEncoder]:
    encoder = FaultyEncoder(
        PackingEncoderConfig(
            capacity=CAPACITY,
            packing_buffer_size=16,
            loss_mask_mode="precomputed",
            max_items_per_bin=4,  # a failed pack names all its members (up to 4) in its log
            algorithm="first_fit_decreasing",
        ),
        tokenizer=tokenizer,
        processor={"patch_size": PATCH_SIZE},
    )
    encoder.faults = _plan(dataset)
    loader = get_loader(
        get_train_dataset(
            str(dataset.metadataset),
            worker_config=make_worker_config(encoder, num_workers=workers),
            batch_size=1,
            packing_buffer_size=16,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=encoder,
            repeat=False,
        ),
        watchdog_timeout_seconds=None,
    )
    delivered = [k for batch in loader for k in batch.sample_keys]
    return delivered, encoder


@pytest.fixture(scope="module")
def runs(dataset: Any, tokenizer: Any) -> dict[int, tuple[list[str], FaultyEncoder]]:
    return {workers: _run(dataset, tokenizer, workers) for workers in (0, 2)}


def _failed_keys(failures: list[str]) -> dict[str, str]:
    """Per failed sample key, the exception type (from the error handler's log lines)."""
    out: dict[str, str] = {}
    for line in failures:
        match = re.match(r"(.*?): (\w+): ", line)
        assert match is not None, line
        head, kind = match.groups()
        for key in head.strip("[]").split(", "):
            assert key not in out, f"{key} reported as failed twice"
            out[key] = kind
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_in_equal_packed_plus_skipped_plus_failed(
    dataset: Any, runs: Any, workers: int
) -> None:
    delivered, encoder = runs[workers]
    stats = encoder.stats.snapshot()
    plan = encoder.faults
    assert set(plan.values()) == set(FAULTS), "every fault kind was injected"
    counts = collections.Counter(delivered)
    assert not counts or max(counts.values()) == 1, "a sample was packed twice"
    assert stats["seen"] == dataset.num_samples
    assert len(delivered) + stats["skipped_total"] + stats["failed"] == dataset.num_samples

    # skipped, by reason: the writer's policy samples + the injected ones, exactly
    want_skips = collections.Counter(
        v.split(":", 1)[1] for v in dataset.expected.values() if v.startswith("skip:")
    )
    want_skips.update(INJECTED[f].split(":", 1)[1] for f in plan.values() if f in INJECTED)
    want_skips = collections.Counter({k: v for k, v in want_skips.items() if k in stats["skipped"]})
    assert {k: v for k, v in stats["skipped"].items() if v} == dict(+want_skips)

    # nothing good went missing except the members of the pack that was made to fail
    broken = dataset.keys_with("broken:")
    failed_injected = {k for k, f in plan.items() if INJECTED[f].startswith("fail:")}
    skipped_injected = set(plan) - failed_injected
    good = dataset.keys_with("ok") - set(plan)
    assert set(delivered) <= good
    mates = good - set(delivered)
    failed_packs = sum(1 for f in plan.values() if f == "raise_in_pack")
    assert len(mates) <= 3 * failed_packs, "only the failed packs' (<= 3) mates may be lost"
    assert stats["failed"] == len(broken) + len(failed_injected) + len(mates)
    assert not (set(delivered) & (broken | set(plan)))
    assert stats["skipped_total"] == sum(want_skips.values())
    assert len(skipped_injected) == sum(1 for f in plan.values() if INJECTED[f].startswith("skip"))

    # failed, by reason, counted across the workers: the wrong mask fails alone with its own
    # error; a failed pack's mates (and a broken sample that was in it) fail with the pack's
    # injected fault, so a writer-broken sample is a SampleFormatError or an InjectedFault
    by_reason = stats["failed_by_reason"]
    assert sum(by_reason.values()) == stats["failed"]
    assert set(by_reason) <= {"SampleFormatError", "LossMaskError", "InjectedFault"}, by_reason
    injected = collections.Counter(INJECTED[f].split(":", 1)[1] for f in plan.values())
    assert by_reason.get("LossMaskError", 0) == injected["LossMaskError"]
    assert by_reason.get("InjectedFault", 0) >= injected["InjectedFault"] + len(mates)
    assert by_reason.get("SampleFormatError", 0) <= len(broken)
    assert by_reason.get("SampleFormatError", 0) + by_reason.get("InjectedFault", 0) == (
        len(broken) + injected["InjectedFault"] + len(mates)
    )


def test_failed_by_reason_and_the_report_says_balanced(dataset: Any, runs: Any) -> None:
    """With 0 workers the error handler's log names every failed sample and its exception:
    failed by reason is exact, and the demo's accounting line reads "balanced"."""
    delivered, encoder = runs[0]
    stats = encoder.stats.snapshot()
    plan = encoder.faults
    failed_kind = _failed_keys(encoder.stats.failures)
    assert len(failed_kind) == stats["failed"]
    # the writer's broken samples fail with the error of their fault
    writer_fail = {
        "broken:json": "SampleFormatError",
        "broken:missing_media": "SampleFormatError",
        "broken:corrupt_image": "SampleFormatError",
    }
    for key, fate in dataset.expected.items():
        if fate.startswith("broken:"):
            assert key in failed_kind, f"{key} ({fate}) was not reported as failed"
            assert failed_kind[key] in {writer_fail[fate], "InjectedFault"}, (key, fate)
    for key, fault in plan.items():
        want = INJECTED[fault]
        if want.startswith("fail:"):
            assert failed_kind.get(key) == want.split(":", 1)[1], (key, fault)
        else:
            assert key not in failed_kind
    # per reason, the shared counters equal the per-sample log
    reasons = collections.Counter(failed_kind.values())
    assert stats["failed_by_reason"] == dict(reasons)

    # the demo's own accounting line, with the injected fates folded into what is expected
    expected = dict(dataset.expected)
    for key, fault in plan.items():
        expected[key] = INJECTED[fault].replace("fail:", "broken:")
    for key in failed_kind:
        if expected[key] == "ok":  # a member of the pack that was made to fail
            expected[key] = "broken:pack_mate"
    ds = dataclasses.replace(dataset, expected=expected)
    ok, line = _accounting(
        ds, RunResult("faults", samples=len(delivered), stats=stats, keys=delivered)
    )
    print(line, dict(reasons))
    assert ok, line
    assert f"samples in {N_SAMPLES} = packed {len(delivered)} + skipped " in line
    failed_part = ", ".join(f"{k} {v}" for k, v in stats["failed_by_reason"].items())
    assert f"+ failed {stats['failed']} ({failed_part})" in line
    assert "balanced" in line


def test_writer_injects_every_source_fault(dataset: Any) -> None:
    fates = collections.Counter(dataset.expected.values())
    for fate in (
        "broken:json",
        "broken:corrupt_image",
        "broken:missing_media",
        "skip:ends_on_user_turn",
        "skip:empty_trainable_mask",
        "skip:oversize",
    ):
        assert fates[fate] > 0, fate


def test_worker_count_does_not_change_the_accounting(runs: Any) -> None:
    (d0, e0), (d2, e2) = runs[0], runs[2]
    s0, s2 = e0.stats.snapshot(), e2.stats.snapshot()
    for field in ("seen", "skipped_total"):
        assert s0[field] == s2[field], field
    assert s0["skipped"] == s2["skipped"]
    assert s0["failed_by_reason"]["LossMaskError"] == s2["failed_by_reason"]["LossMaskError"]
    # which good samples share a pack with a failing one depends on the per-worker buffers;
    # everything else is delivered by both runs
    assert len(d0) + s0["failed"] == len(d2) + s2["failed"]


def test_failure_reasons_are_shared_across_forked_workers() -> None:
    """Counts from forked processes reach the parent by reason; past the slot table's size the
    rest are counted under "<other>", so the total stays exact."""
    import multiprocessing

    from mmpack.energon.stats import FAILURE_SLOTS, LoaderStats

    stats = LoaderStats()
    stats.fail("ParentError")

    def worker(i: int) -> None:
        stats.fail("SharedError", 2)
        stats.fail(f"Own{i}Error")

    procs = [multiprocessing.get_context("fork").Process(target=worker, args=(i,)) for i in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    by_reason = stats.snapshot()["failed_by_reason"]
    assert by_reason == {"ParentError": 1, "SharedError": 4, "Own0Error": 1, "Own1Error": 1}
    for i in range(FAILURE_SLOTS):
        stats.fail(f"Extra{i}Error")
    snap = stats.snapshot()
    assert len(snap["failed_by_reason"]) == FAILURE_SLOTS
    free = FAILURE_SLOTS - 1 - 4  # named slots left after the 4 reasons above
    assert snap["failed_by_reason"]["<other>"] == FAILURE_SLOTS - free
    assert snap["failed"] == 7 + FAILURE_SLOTS
    stats.reset()
    assert stats.snapshot()["failed_by_reason"] == {}


def test_failure_details_are_bounded_and_the_counts_stay_exact() -> None:
    from mmpack.energon.stats import FAILURE_DETAILS, LoaderStats

    stats = LoaderStats()
    handler = stats.error_handler()
    logging.getLogger("mmpack.energon").disabled = True
    try:
        for i in range(FAILURE_DETAILS + 50):
            handler(ValueError(f"bad {i}"), {"__key__": f"s{i}"})
    finally:
        logging.getLogger("mmpack.energon").disabled = False
    assert len(stats.failures) == FAILURE_DETAILS and stats.failures[0] == "s0: ValueError: bad 0"
    assert stats.snapshot()["failed_by_reason"] == {"ValueError": FAILURE_DETAILS + 50}
