#!/usr/bin/env python3
"""Run NeMo-RL's own unit tests with NeMo-RL's PackedTensor and with mmpack's, and compare.

Run A is plain NeMo-RL. Run B loads ``mmpack_plugin`` (this directory), which calls
``mmpack.compat.nemo_rl.install()`` before any NeMo-RL conftest or test module is imported, and
reaches the Ray workers the tests start through ``worker_site/sitecustomize.py``, so NeMo-RL's
code and its tests use ``mmpack.PackedTensor`` everywhere. Every selected test file runs in its
own pytest process both ways; the junit reports are compared test by test.

This directory is not named ``nemo_rl``: with ``tests/`` on ``sys.path`` (as in mmpack's own
suite) it would be found as the ``nemo_rl`` package. Nothing here is collected by that suite.

Usage (NeMo-RL needs Python >= 3.12; the venv is created if missing and reused otherwise)::

    git clone https://github.com/NVIDIA-NeMo/RL nemo-rl
    python3 tests/nemo_rl_fidelity/run_fidelity.py --nemo-rl nemo-rl --venv .venv-nemo-rl \\
        --out fidelity-out

Options worth knowing:

* ``--python PY``: the interpreter that creates the venv (default: the first of python3.13 and
  python3.12 on PATH);
* ``--mmpack-wheel WHEEL``: install a prebuilt mmpack wheel instead of building this checkout
  with ``pip install <repo root>`` (which needs a Rust toolchain); the package is abi3, so a
  wheel built by any supported CPython installs on 3.12/3.13 (``maturin build --release``);
* ``--no-install``: use the venv as it is (no pip at all);
* ``--accelerate``: run B with ``install(accelerate=True)`` (NeMo-RL's hot ``BatchedDataDict``
  methods replaced by mmpack's as well);
* ``--placement {groups,nemo_rl}`` (with ``--accelerate``): run B with
  ``install(accelerate=True, placement=...)``, in the test process and in the processes it
  starts (``MMPACK_NEMO_RL_PLACEMENT``); without it, mmpack's default placement, through the
  plain call, which an mmpack older than the option also takes;
* ``--files F [F ...]``: test files relative to the checkout, instead of the default selection
  (every file under tests/unit that mentions PackedTensor, plus ``EXTRA_FILES``);
* ``--file-timeout`` / ``--test-timeout``: seconds per pytest process / per test;
* ``--recheck N``: rerun, both ways, the tests that passed in A only and the files whose run
  did not complete (timeout, Ray losing its cluster), so that a machine too busy for one run
  does not count as a difference (default 1; 0 turns it off).

NeMo-RL is used from its checkout through PYTHONPATH, never pip-installed (its dependencies
include CUDA-only packages). Its unit-test conftest starts Ray and writes result files and test
assets next to itself, so the tracked files of the checkout are copied to ``OUT/nemo-rl`` and
the tests run there: the checkout is only read. Each pytest process gets a Ray cluster of its
own (``ray start`` with a private ``RAY_TMPDIR``, named by ``RAY_ADDRESS``), not one it finds
on the machine.

``requirements.txt`` (this directory) lists the light dependencies the tests import on a CPU
machine; an already installed torch is pinned while installing them. Tests that need a GPU, the
Hugging Face hub, or an extra that cannot be installed here (vLLM, Megatron, ...) fail or skip
the same way in both runs and are reported as not passing either way, grouped by reason;
NeMo-RL's conftest drops the tests marked for such extras, counted as deselected.

Output in ``OUT``: ``A/`` and ``B/`` (one junit XML and one log per file; ``*-recheck/`` for
reruns) and ``summary.json``. Exit status: 1 when some test passes in A and not in B (again on
the recheck), unless it is in ``ALLOWLIST`` (test id -> why the difference is expected); 2 on
a setup error; 3 when some file has no complete report in a run; 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
REQUIREMENTS = HERE / "requirements.txt"

# Beyond `git grep -l PackedTensor -- tests/unit`: files whose code under test builds or moves
# PackedTensors without naming the class (multimodal collation, payload shapes, packing).
EXTRA_FILES = (
    "tests/unit/data/packing/test_algorithms.py",
    "tests/unit/data/test_multimodal_image_encoding.py",
    "tests/unit/data_plane/test_correctness.py",
    "tests/unit/data_plane/test_preshard_extras.py",
    "tests/unit/environments/test_nemo_gym_image_placeholders.py",
    "tests/unit/experience/test_initial_gym_image_payload_shapes.py",
    "tests/unit/models/megatron/test_media_mask_packing.py",
)

# Tests that pass with NeMo-RL's class and are expected not to with mmpack's, each with why.
# Only checks of the class's identity belong here (``type(x) is ...``, ``__module__``, ...);
# any behavioural difference is a bug to fix, not an entry.
ALLOWLIST: dict[str, str] = {}

RUNS = ("A", "B")  # A: NeMo-RL's PackedTensor; B: mmpack's (-p mmpack_plugin)
OUTCOMES = ("passed", "failed", "error", "skipped")
MESSAGE_HEAD = 300


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkout = Path(args.nemo_rl).resolve()
    if not (checkout / "nemo_rl" / "data" / "multimodal_utils.py").is_file():
        print(f"error: {checkout} is not a NeMo-RL checkout", file=sys.stderr)
        return 2
    try:
        python = _venv(Path(args.venv).resolve(), args.python)
        if not args.no_install:
            _install(python, args.mmpack_wheel)
        versions = _versions(python)
        files = args.files or _default_files(checkout)
        source = _copy_checkout(checkout, out / "nemo-rl")
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    files = [f for f in files if (source / f).is_file()]
    print(f"{len(files)} test files; {versions}", flush=True)

    runs: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        started = time.monotonic()
        runs[name] = {
            file: _run_pytest(name, python, source, file, [file], out / name, args, (i, files))
            for i, file in enumerate(files, 1)
        }
        print(f"run {name}: {time.monotonic() - started:.0f}s", flush=True)
    seconds = {name: sum(r["seconds"] for r in runs[name].values()) for name in RUNS}
    rechecks = _recheck(runs, python, source, files, out, args)

    report = _compare(runs, rechecks, files)
    report["meta"] = {
        "nemo_rl_checkout": str(checkout),
        "nemo_rl_commit": _git(checkout, "rev-parse", "HEAD"),
        "venv_python": str(python),
        "mmpack_source": args.mmpack_wheel or str(REPO_ROOT),
        "accelerate": args.accelerate,
        "placement": args.placement,
        **versions,
        "files": files,
        "run_seconds": {name: round(value, 1) for name, value in seconds.items()},
        "command": [sys.executable, *sys.argv],
    }
    _print_report(report)
    (out / "summary.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"\nsummary: {out / 'summary.json'}")
    if report["regressions"]:
        return 1
    return 3 if report["incomplete_files"] else 0


class SetupError(Exception):
    pass


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nemo-rl", required=True, help="a NeMo-RL checkout")
    parser.add_argument("--venv", required=True, help="side venv to create or reuse")
    parser.add_argument("--python", help="interpreter for a new venv (Python >= 3.12)")
    parser.add_argument("--out", required=True, help="directory for junit XMLs and summary.json")
    parser.add_argument("--mmpack-wheel", help="install this mmpack wheel instead of the repo")
    parser.add_argument("--no-install", action="store_true", help="use the venv as it is")
    parser.add_argument(
        "--accelerate",
        action="store_true",
        help="run B with install(accelerate=True): mmpack's BatchedDataDict methods too",
    )
    parser.add_argument(
        "--placement",
        choices=("groups", "nemo_rl"),
        help="with --accelerate: run B with install(accelerate=True, placement=PLACEMENT)",
    )
    parser.add_argument("--files", nargs="+", help="test files, relative to the checkout")
    parser.add_argument("--file-timeout", type=int, default=1800, help="seconds per file")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds per test")
    parser.add_argument(
        "--recheck",
        type=int,
        default=1,
        help="rerun differences and incomplete files both ways (0: no)",
    )
    args = parser.parse_args(argv)
    if args.placement and not args.accelerate:
        parser.error("--placement needs --accelerate (it chooses mmpack's shard_by_batch_size)")
    return args


# --- environment --------------------------------------------------------------------------


def _venv(venv: Path, python: str | None) -> Path:
    venv_python = venv / "bin" / "python"
    if not venv_python.exists():
        base = python or next(
            (p for p in (shutil.which("python3.13"), shutil.which("python3.12")) if p), None
        )
        if base is None:
            raise SetupError("no python3.13 or python3.12 on PATH; pass --python")
        print(f"creating venv {venv} with {base}", flush=True)
        _check(_sh([base, "-m", "venv", str(venv)]), "creating the venv")
    version = _sh(
        [str(venv_python), "-c", "import sys; print(*sys.version_info[:2])"], capture=True
    )
    major, minor = (int(v) for v in version.stdout.split())
    if (major, minor) < (3, 12):
        raise SetupError(f"{venv_python} is Python {major}.{minor}; NeMo-RL needs >= 3.12")
    return venv_python


def _install(python: Path, wheel: str | None) -> None:
    pip = [str(python), "-m", "pip", "install", "-q"]
    # A CUDA-specific torch already in the venv must not be swapped for PyPI's.
    torch = _sh(
        [str(python), "-c", "import torch; print(torch.__version__.split('+')[0])"],
        capture=True,
    )
    constraints: list[str] = []
    if torch.returncode == 0:
        pin = python.parent.parent / "fidelity-constraints.txt"
        pin.write_text(f"torch=={torch.stdout.strip()}\n")
        constraints = ["-c", str(pin)]
    print("installing requirements", flush=True)
    _check(_sh([*pip, *constraints, "-r", str(REQUIREMENTS)]), "installing requirements")
    if wheel:
        print(f"installing {wheel}", flush=True)
        # Same version number as an earlier build: reinstall, or pip keeps the old one.
        _check(_sh([*pip, "--force-reinstall", "--no-deps", wheel]), "installing the wheel")
    else:
        print(f"building and installing mmpack from {REPO_ROOT}", flush=True)
        _check(_sh([*pip, *constraints, str(REPO_ROOT)]), "installing mmpack")


def _versions(python: Path) -> dict[str, str]:
    code = (
        "import json, sys, importlib.metadata as m\n"
        "v = {'python': sys.version.split()[0]}\n"
        "for d in ('torch', 'transformers', 'ray', 'pytest', 'mmpack'):\n"
        "    try: v[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: v[d] = 'missing'\n"
        "print(json.dumps(v))\n"
    )
    result = _sh([str(python), "-c", code], capture=True)
    _check(result, "reading package versions")
    versions = json.loads(result.stdout)
    if versions["mmpack"] == "missing":
        raise SetupError("mmpack is not installed in the venv")
    return versions


def _default_files(checkout: Path) -> list[str]:
    grep = _git(checkout, "grep", "-l", "PackedTensor", "--", "tests/unit")
    found = {line for line in grep.splitlines() if line.endswith(".py")}
    found.update(f for f in EXTRA_FILES if (checkout / f).is_file())
    return sorted(f for f in found if Path(f).name.startswith("test_"))


def _copy_checkout(checkout: Path, dest: Path) -> Path:
    tracked = _git(checkout, "ls-files", "-z").split("\0")
    if dest.exists():
        shutil.rmtree(dest)
    for rel in filter(None, tracked):
        src = checkout / rel
        if src.is_file() and not src.is_symlink():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


def _git(checkout: Path, *args: str) -> str:
    result = _sh(["git", "-C", str(checkout), *args], capture=True)
    _check(result, f"git {args[0]} in {checkout}")
    return result.stdout.strip("\n")


def _sh(cmd: list[str], capture: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=capture, text=True, check=False)


def _check(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if result.stderr else ""
        raise SetupError(f"{what} failed (exit {result.returncode}) {detail}")


# --- running ------------------------------------------------------------------------------


def _run_pytest(
    name: str,
    python: Path,
    source: Path,
    file: str,
    targets: list[str],
    out: Path,
    args: argparse.Namespace,
    progress: tuple[int, list[str]],
) -> dict[str, Any]:
    """One pytest process over ``targets`` (a file, or node ids in it) for run ``name``."""
    out.mkdir(parents=True, exist_ok=True)
    slug = file.replace("/", "__").removesuffix(".py")
    xml, log = out / f"{slug}.xml", out / f"{slug}.log"
    xml.unlink(missing_ok=True)
    plugin = name == "B"
    cmd = [
        str(python),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *(["-p", "mmpack_plugin"] if plugin else []),
        # NeMo-RL's addopts carry -x, which would stop a file at its first failure.
        "-o",
        "addopts=",
        "-rfEs",
        f"--timeout={args.test_timeout}",
        f"--junitxml={xml}",
        *targets,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(source), *([str(HERE)] if plugin else [])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if plugin and args.accelerate:
        env["MMPACK_NEMO_RL_ACCELERATE"] = "1"
        if args.placement:
            env["MMPACK_NEMO_RL_PLACEMENT"] = args.placement
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # NeMo-RL's init_ray attaches to whatever Ray cluster it finds on the machine
    # (address="auto" falls back to any running GCS), and Ray's state API used by its memory
    # tracker refuses to choose when there are several. Each pytest process gets a cluster of its
    # own, named by RAY_ADDRESS, with its files in a private directory, so that other Ray users
    # on the machine neither host these tests nor break them.
    ray_tmp = tempfile.mkdtemp(prefix="fidray")
    env["RAY_TMPDIR"] = ray_tmp
    # Ray's token auth, with a token of this cluster's own rather than the user's saved one
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    t0 = time.monotonic()
    try:
        with _ray_cluster(python, env, log.with_suffix(".ray.log")) as address:
            env["RAY_ADDRESS"] = address
            rc, timed_out = _run_file(cmd, source, env, log, args.file_timeout)
    except SetupError as exc:  # no cluster: this file has no result in this run
        log.write_text(f"{exc}\n")
        rc, timed_out = -1, False
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    seconds = time.monotonic() - t0
    # No report, or a process that ended neither with pytest's statuses nor by our timeout
    # (Ray's driver exits hard when it loses its cluster): the results cannot be compared.
    complete = xml.exists() and not timed_out and rc in (0, 1, 5)
    tests = _parse_junit(xml, file) if xml.exists() else {}
    deselected = 0
    if complete and targets == [file]:
        # NeMo-RL's conftest drops the tests marked for extras (mcore, vllm, automodel, ...)
        # from the collection without reporting them as deselected: count them here.
        collected = re.findall(r"collected (\d+) items?", log.read_text())
        deselected = max(0, int(collected[0]) - len(tests)) if collected else 0
    counts = Counter(t["outcome"] for t in tests.values())
    summary = " ".join(f"{k}={counts[k]}" for k in OUTCOMES if counts[k]) or "no tests"
    if deselected:
        summary += f" deselected={deselected}"
    status = "TIMEOUT" if timed_out else f"rc={rc}" + ("" if complete else " INCOMPLETE")
    index, files = progress
    print(f"[{name} {index}/{len(files)}] {file}: {summary} ({status}, {seconds:.0f}s)", flush=True)
    return {
        "targets": targets,
        "rc": rc,
        "timed_out": timed_out,
        "complete": complete,
        "deselected": deselected,
        "seconds": round(seconds, 1),
        "tests": tests,
        "log": str(log),
    }


def _recheck(
    runs: dict[str, dict[str, Any]],
    python: Path,
    source: Path,
    files: list[str],
    out: Path,
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Run again, both ways, what the first runs cannot settle: files that did not complete
    and tests that passed in A only. On a busy machine a timeout or an out-of-memory kill can
    land in either run; a difference counts only if it shows again."""
    rechecks: dict[str, dict[str, Any]] = {name: {} for name in RUNS}
    if args.recheck <= 0:
        return rechecks
    todo: dict[str, list[str]] = {}
    for file in files:
        a, b = runs["A"][file], runs["B"][file]
        if not (a["complete"] and b["complete"]):
            todo[file] = [file]
            continue
        ids = [
            t
            for t, result in a["tests"].items()
            if result["outcome"] == "passed"
            and b["tests"].get(t, {}).get("outcome") != "passed"
            and t not in ALLOWLIST
        ]
        if ids:
            # node ids, unless one is a collection error (it names no test): then the file
            collection_error = any(a["tests"][t].get("collection") for t in ids)
            todo[file] = [file] if collection_error else ids
    if not todo:
        return rechecks
    print(f"\nrechecking {len(todo)} file(s) both ways", flush=True)
    for name in RUNS:
        for i, (file, targets) in enumerate(todo.items(), 1):
            rechecks[name][file] = _run_pytest(
                name, python, source, file, targets, out / f"{name}-recheck", args, (i, list(todo))
            )
    return rechecks


@contextlib.contextmanager
def _ray_cluster(python: Path, env: dict[str, str], log: Path) -> Iterator[str]:
    """A single-node Ray cluster for one pytest process; yields its address."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [
        str(python.parent / "ray"),
        "start",
        "--head",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--block",
    ]
    with log.open("w") as sink:
        # Own session, as for pytest: stopping the group stops every Ray process of this cluster.
        proc = subprocess.Popen(
            cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 180
            # the address as the cluster names it (the node's IP, not necessarily loopback)
            while not (found := re.search(r"--address='([^']+)'", log.read_text())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SetupError(f"ray start did not come up; see {log}")
                time.sleep(0.5)
            yield found.group(1)
        finally:
            # A throwaway cluster: no graceful drain, the whole group goes at once.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run_file(
    cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: int
) -> tuple[int, bool]:
    with log.open("w") as sink:
        sink.write(" ".join(cmd) + "\n\n")
        sink.flush()
        # Own session: on a timeout the whole group (Ray's workers included) is killed.
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            sink.write(f"\n[killed after {timeout}s]\n")
            return proc.returncode, True
        except BaseException:
            # Interrupted: the group is in its own session, so it would outlive us.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def _parse_junit(xml: Path, file: str) -> dict[str, dict[str, Any]]:
    module = file.removesuffix(".py").replace("/", ".")
    tests: dict[str, dict[str, Any]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if classname == module:
            test_id = f"{file}::{name}"
        elif classname.startswith(module + "."):
            test_id = f"{file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
        else:  # a collection error names the module, not a test
            test_id = f"{file}::{classname + '.' if classname else ''}{name}"
        entry: dict[str, Any] = {}
        if not classname.startswith(module):
            entry["collection"] = True
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "failed" if tag == "failure" else tag
                message = _message(element)
                break
        tests[test_id] = {"outcome": outcome, "message": message, **entry}
    return tests


def _message(element: ET.Element) -> str:
    text = element.get("message") or ""
    # a module-level skip's message is only "collection skipped"; the reason is in the text,
    # as the repr of (path, line, "Skipped: ...")
    if not text.strip() or text == "collection skipped":
        lines = [line for line in (element.text or "").splitlines() if line.strip()]
        text = lines[-1] if lines else ""
        if "Skipped: " in text:
            text = text[text.index("Skipped: ") :]
            text = text[:-2] if text.endswith(("')", '")')) else text
    return " ".join(text.split())[:MESSAGE_HEAD]


# --- comparing ----------------------------------------------------------------------------


def _compare(
    runs: dict[str, dict[str, Any]], rechecks: dict[str, dict[str, Any]], files: list[str]
) -> dict[str, Any]:
    per_file: dict[str, Any] = {}
    tests: dict[str, dict[str, Any]] = {}
    regressions, unconfirmed, allowed, improvements, not_passing = [], [], [], [], []
    incomplete: list[dict[str, Any]] = []
    for file in files:
        results = {name: runs[name][file] for name in RUNS}
        again = {name: rechecks[name].get(file) for name in RUNS}
        whole_file_rerun = all(r is not None and r["targets"] == [file] for r in again.values())
        if whole_file_rerun and all(r["complete"] for r in again.values()):
            # the first runs did not complete: the recheck is the comparison
            results = {name: again[name] for name in RUNS}
            again = {name: None for name in RUNS}
        if not all(r["complete"] for r in results.values()):
            incomplete.append(
                {
                    "file": file,
                    **{
                        name: "timed out" if r["timed_out"] else f"exit {r['rc']}, no report"
                        for name, r in results.items()
                        if not r["complete"]
                    },
                }
            )
        per_file[file] = {
            name: {
                **{k: 0 for k in OUTCOMES},
                **Counter(t["outcome"] for t in r["tests"].values()),
                "deselected": r["deselected"],
                "rc": r["rc"],
                "timed_out": r["timed_out"],
                "complete": r["complete"],
                "seconds": r["seconds"],
            }
            for name, r in results.items()
        }
        a, b = results["A"]["tests"], results["B"]["tests"]
        for test_id in sorted(set(a) | set(b)):
            ta = a.get(test_id, _MISSING)
            tb = b.get(test_id, _MISSING)
            tests[test_id] = {"A": ta, "B": tb}
            entry: dict[str, Any] = {"test": test_id, "A": ta["outcome"], "B": tb["outcome"]}
            if ta["outcome"] == "passed" and tb["outcome"] != "passed":
                entry["message"] = tb["message"]
                if test_id in ALLOWLIST:
                    allowed.append({**entry, "reason": ALLOWLIST[test_id]})
                    continue
                ra = again["A"]["tests"].get(test_id) if again["A"] else None
                rb = again["B"]["tests"].get(test_id) if again["B"] else None
                if ra is not None and rb is not None:
                    entry["recheck"] = {"A": ra["outcome"], "B": rb["outcome"]}
                    tests[test_id]["recheck"] = {"A": ra, "B": rb}
                    if not (ra["outcome"] == "passed" and rb["outcome"] != "passed"):
                        unconfirmed.append(entry)
                        continue
                    entry["message"] = rb["message"]
                regressions.append(entry)
            elif tb["outcome"] == "passed" and ta["outcome"] != "passed":
                improvements.append({**entry, "message": ta["message"]})
            elif ta["outcome"] != "passed":
                not_passing.append({**entry, "message": ta["message"]})
    totals = {
        name: {k: sum(per_file[f][name][k] for f in files) for k in (*OUTCOMES, "deselected")}
        for name in RUNS
    }
    reasons = Counter(_reason(e["message"]) for e in not_passing)
    return {
        "per_file": per_file,
        "totals": totals,
        "regressions": regressions,
        "not_reproduced": unconfirmed,
        "allowlisted": allowed,
        "pass_only_in_B": improvements,
        "not_passing_either_way": not_passing,
        "not_passing_reasons": dict(reasons.most_common()),
        "incomplete_files": incomplete,
        "tests": tests,
    }


_MISSING = {"outcome": "missing", "message": ""}


def _reason(message: str) -> str:
    # Group by the exception line, without the per-test detail after it.
    return message.split(" - ")[0][:120] if message else "(no message)"


def _print_report(report: dict[str, Any]) -> None:
    per_file = report["per_file"]
    width = max([len(f) for f in per_file] + [10])
    head = "  ".join(
        f"{run}:{'pass':>5} {'fail':>5} {'skip':>5} {'err':>4} {'desel':>5}" for run in "AB"
    )
    print(f"\n{'file':<{width}}  {head}")

    def row(c: dict[str, int]) -> str:
        return (
            f"  {c['passed']:>5} {c['failed']:>5} {c['skipped']:>5} {c['error']:>4}"
            f" {c['deselected']:>5}"
        )

    for file, runs in per_file.items():
        cells = "  ".join(row(runs[r]) + ("!" if runs[r]["timed_out"] else "") for r in "AB")
        print(f"{file:<{width}}  {cells}")
    totals = report["totals"]
    print(f"{'total':<{width}}  {'  '.join(row(totals[r]) for r in 'AB')}")
    sections = (
        ("passes in A, not in B", report["regressions"]),
        ("passed in A, not in B, but not again on a recheck", report["not_reproduced"]),
        ("passes in A, not in B (allowlisted)", report["allowlisted"]),
        ("passes in B, not in A", report["pass_only_in_B"]),
    )
    for title, entries in sections:
        print(f"\n{title}: {len(entries)}")
        for e in entries:
            print(f"  {e['test']}  [{e['A']} -> {e['B']}]")
            if e.get("recheck"):
                print(f"      recheck: A {e['recheck']['A']}, B {e['recheck']['B']}")
            if e.get("reason"):
                print(f"      reason: {e['reason']}")
            if e.get("message"):
                print(f"      {e['message']}")
    print(f"\nnot passing either way: {len(report['not_passing_either_way'])}, by reason:")
    for reason, count in report["not_passing_reasons"].items():
        print(f"  {count:>4}  {reason}")
    if report["incomplete_files"]:
        print("\nfiles without a complete report (not compared):")
        for entry in report["incomplete_files"]:
            detail = ", ".join(f"{k}: {v}" for k, v in entry.items() if k != "file")
            print(f"  {entry['file']}  ({detail})")


if __name__ == "__main__":
    sys.exit(main())
