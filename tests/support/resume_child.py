"""Energon loader jobs for the resume tests, each run in a process in which no loader ran before.

`ChildServer` (the test side) starts ``python -m support.resume_child``, which imports torch,
Energon, transformers and mmpack and builds Qwen2-VL's processor (the real tokenizer), and
nothing else; then, for each job, it forks a process that runs the job and exits. A job's
process has run no Energon hook, no task encoder and no loader before it starts, as a
restarted training job's has not, and does not pay the imports and the tokenizer's conversion
(seconds on a two-core machine) again.

A job (`Job`) builds a `FailingEncoder` and a savable loader over a blended dataset, then:

* with ``dry_run``, first takes one batch from another loader (0 workers) in the same process,
  as a sanity check or a validation loader would;
* with ``restore``, restores a saved state (`mmpack.energon.restore_loader_state`);
* takes ``steps`` batches, saving the loader state before batch ``i`` for each ``i`` in
  ``save_at`` (``0``: before the first batch, what a checkpoint at step 0 holds);
* after the ``k``-th batch, for each ``k`` in ``settle``, waits until the workers have built
  every batch the loader asked them for (its ``prefetch_factor`` per worker ahead of the
  trainer: the encoder's ``packed`` and ``packs`` counts reach the given values, which the
  batch builder adds last) and records the encoder's counters then: those of the first
  ``k + prefetch`` batches of the stream, whatever the timing.

The result (`run_job`'s pickle): the batches, each as its sample keys and `batch_digest`
(every THD field, media tensors, their rows and provenance), the saved states' paths, the
counters per settle point and what the saved states held in their packing buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_TESTS = Path(__file__).resolve().parents[1]
_DEV = _TESTS.parent / "dev"
_CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(_TESTS), str(_DEV), os.environ.get("PYTHONPATH")) if p
    ),
}
#: How long one job may take before it is killed (its whole process group).
JOB_TIMEOUT = 240.0
#: How long a settle point may wait for the workers.
SETTLE_TIMEOUT = 60.0

CAPACITY = 512
BUFFER = 8  # samples per packing buffer (per worker): a pack holds 1 to 5 of them
BATCH = 2  # packs per batch
SHUFFLE = 4
PREFETCH = 2  # batches per worker the loader asks for ahead of the trainer


@dataclasses.dataclass
class Job:
    blend: str
    out: str
    mode: str  # "roles" (loss masks from roles) or "precomputed" (the chat template's masks)
    steps: int
    workers: int = 2
    checkpoint: str = "every_batch"  # or "default" (Energon's 60 s: restores replay)
    save_at: tuple[int, ...] = ()
    #: k -> (packed, packs): the counts once every batch asked for after the k-th is built
    settle: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    restore: str | None = None
    dry_run: bool = False
    fail_decode: frozenset[str] = frozenset()
    fail_pack: frozenset[str] = frozenset()


class ChildServer:
    """The test side: ``with ChildServer(tmp) as server: result = server.run(job)``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = Path(tmp)
        self.log = self.tmp / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.jobs = 0

    def __enter__(self) -> ChildServer:
        self.tmp.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "support.resume_child"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, **_CHILD_ENV},
                cwd=str(_TESTS),
            )
        line = self._reply(120.0)
        if line != "ready":
            raise RuntimeError(f"the job server did not start ({line!r}): {self._log_tail()}")
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def run(self, job: Job) -> dict[str, Any]:
        """Run `job` in a fresh process; its result, or `RuntimeError` with the job's log."""
        assert self.proc is not None and self.proc.stdin is not None
        self.jobs += 1
        spec = self.tmp / f"job{self.jobs}.pkl"
        spec.write_bytes(pickle.dumps(job))
        self.proc.stdin.write(f"{spec}\n".encode())
        self.proc.stdin.flush()
        reply = self._reply(JOB_TIMEOUT + 30)
        out = Path(job.out)
        result = pickle.loads(out.read_bytes()) if out.exists() else None
        if reply != "done 0" or result is None or "error" in result:
            error = result.get("error") if isinstance(result, dict) else None
            log = Path(f"{job.out}.log")
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"job {spec.name} failed ({reply}): {error}\n--- log:\n{tail}")
        return result

    def _reply(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return f"no reply in {timeout:.0f} s"
        return self.proc.stdout.readline().decode().strip() or "the server exited"

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


# ------------------------------------------------------------------------------ the child


def _processor() -> Any:
    from support.processors import qwen_vl_processor

    return qwen_vl_processor("qwen2_vl")


def _encoder_class() -> type[Any]:
    from megatron.energon import stateless
    from mmpack.energon import PackingTaskEncoder

    class InjectedFault(RuntimeError):
        """What `FailingEncoder` raises."""

    class FailingEncoder(PackingTaskEncoder):
        """Fails where the dataset's own faults (bad JSON, a corrupt image, a missing media
        file) do not reach: decoding a selected sample's media (the member is dropped from its
        planned pack) and building a pack (the whole pack is dropped)."""

        fail_decode: frozenset[str] = frozenset()
        fail_pack: frozenset[str] = frozenset()

        def decode_media(self, sample: Any) -> dict[str, Any]:
            if sample.__key__ in self.fail_decode:
                raise InjectedFault(f"injected fault while decoding {sample.__key__}")
            return super().decode_media(sample)

        @stateless
        def pack_selected_samples(self, samples: list[Any]) -> Any:
            for s in samples:
                if s.__key__ in self.fail_pack:
                    raise InjectedFault(f"injected fault while packing {s.__key__}")
            return super().pack_selected_samples(samples)

    return FailingEncoder


def _loader(
    job: Job, processor: Any, cls: type[Any], workers: int, savable: bool
) -> tuple[Any, Any]:
    """The encoder and its loader (savable, or Energon's plain one)."""
    from megatron.energon import get_loader, get_savable_loader, get_train_dataset
    from mmpack.energon import PackingEncoderConfig, make_worker_config

    config = PackingEncoderConfig(
        capacity=CAPACITY,
        packing_buffer_size=BUFFER,
        batch_size=BATCH,
        algorithm="first_fit_shuffle",  # the one algorithm that draws on the packer's seed
        loss_mask_mode=None if job.mode == "roles" else "precomputed",
    )
    encoder = cls(config, processor=processor)
    encoder.fail_decode = job.fail_decode
    encoder.fail_pack = job.fail_pack
    dataset = get_train_dataset(
        job.blend,
        worker_config=make_worker_config(encoder, num_workers=workers),
        batch_size=BATCH,
        packing_buffer_size=BUFFER,
        shuffle_buffer_size=SHUFFLE,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=True,
    )
    if not savable:
        return encoder, get_loader(dataset, watchdog_timeout_seconds=None)
    every = {"checkpoint_every_sec": 0, "checkpoint_every_min_n_samples": 1}
    loader = get_savable_loader(
        dataset,
        prefetch_factor=PREFETCH,
        watchdog_timeout_seconds=None,
        **(every if job.checkpoint == "every_batch" else {}),
    )
    return encoder, loader


def _packing_buffers(state: Any) -> list[list[int]]:
    """The group sizes each worker's packing buffer held at the save (``_pre_packing_lengths``
    of Energon's ``PackingDataset`` state): the groups planned and not yet packed."""
    found: list[list[int]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "_pre_packing_lengths":
                    found.append(list(v))
                else:
                    walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    walk(state)
    return found


def _settle(encoder: Any, packed: int, packs: int) -> dict[str, Any]:
    """The encoder's counters once they reach `packed` and `packs` (``settled``: exactly)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        snap = encoder.stats.snapshot()
        reached = snap["packed"] >= packed and snap["packs"] >= packs
        if reached or time.monotonic() > deadline:
            snap["settled"] = (snap["packed"], snap["packs"]) == (packed, packs)
            return snap
        time.sleep(0.005)


def run_job(job: Job, processor: Any) -> dict[str, Any]:
    import torch
    from mmpack.energon import restore_loader_state
    from mmpack_dev.energon_testing import batch_digest

    cls = _encoder_class()
    if job.dry_run:
        _, dry = _loader(job, processor, cls, 0, savable=False)
        next(iter(dry))
        del dry
    encoder, loader = _loader(job, processor, cls, job.workers, savable=True)
    if job.restore is not None:
        restore_loader_state(loader, torch.load(job.restore, weights_only=False))
    states: dict[int, str] = {}
    buffers: dict[int, list[list[int]]] = {}
    stats: dict[int, dict[str, Any]] = {}
    batches: list[Any] = []

    def save(step: int) -> None:
        state = loader.save_state_rank()
        path = f"{job.out}.state{step}"
        torch.save(state, path)
        states[step] = path
        buffers[step] = _packing_buffers(state)

    if 0 in job.save_at:
        # before the loader starts: once `iter` started the workers, `save_state_rank` waits
        # for them to answer, which they do only from their first batch on
        save(0)
    it = iter(loader)
    for step in range(1, job.steps + 1):
        batch = next(it)
        batches.append((tuple(batch.sample_keys), batch_digest(batch)))
        if step in job.save_at:
            save(step)
        if step in job.settle:
            stats[step] = _settle(encoder, *job.settle[step])
    return {"batches": batches, "states": states, "buffers": buffers, "stats": stats}


def _serve_one(spec: str, processor: Any) -> int:
    job: Job = pickle.loads(Path(spec).read_bytes())
    pid = os.fork()
    if pid == 0:  # the job's process: its own group, so that a hung job dies with its workers
        code = 1
        try:
            os.setpgid(0, 0)
            log = os.open(f"{job.out}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            try:
                result = run_job(job, processor)
                code = 0
            except BaseException:
                result = {"error": traceback.format_exc()}
            Path(job.out).write_bytes(pickle.dumps(result))
        finally:
            os._exit(code)
    deadline = time.monotonic() + JOB_TIMEOUT
    code = -signal.SIGKILL
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.02)
    # the job's loader workers outlive its `os._exit` (and a hung job): end its whole group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if code == -signal.SIGKILL:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return code


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    import megatron.energon  # noqa: F401
    import mmpack.energon  # noqa: F401
    import mmpack_dev.energon_testing  # noqa: F401
    import torch

    torch.set_num_threads(1)
    processor = _processor()
    out = sys.stdout
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        spec = line.strip()
        if spec:
            print(f"done {_serve_one(spec, processor)}", file=out, flush=True)
    os._exit(0)  # nothing to clean up: skip seconds of interpreter teardown


if __name__ == "__main__":
    main()
