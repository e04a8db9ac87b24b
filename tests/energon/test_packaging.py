"""What the project ships around the Energon integration: released dependencies only (no git or
path pins) with committed lock files, the audio extra, and generic example configs that every
load and build an encoder."""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import pytest
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.errors import EnergonConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "configs"


def _pyproject() -> dict[str, Any]:
    import tomllib  # Python >= 3.11

    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text()))


def _requirements(pyproject: dict[str, Any]) -> list[str]:
    project = pyproject["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    for group in pyproject.get("dependency-groups", {}).values():
        reqs += [r for r in group if isinstance(r, str)]
    reqs += pyproject.get("build-system", {}).get("requires", [])
    return reqs


def test_dependencies_are_released_versions_with_committed_locks() -> None:
    reqs = _requirements(_pyproject())
    assert any(r.startswith("megatron-energon") for r in reqs)
    bad = [r for r in reqs if re.search(r"(@|git\+|https?://|file:|\.\./)", r)]
    assert bad == [], f"unreleased (git/url/path) dependencies: {bad}"
    for cargo in [ROOT / "Cargo.toml", *ROOT.glob("rust/*/Cargo.toml")]:
        text = cargo.read_text()
        assert not re.search(r"\bgit\s*=", text), f"git dependency in {cargo}"
        assert not re.search(r"\bbranch\s*=|\brev\s*=", text), f"branch/rev pin in {cargo}"
    assert (ROOT / "Cargo.lock").is_file()


def test_audio_extra_is_declared() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    names = collections.Counter(re.split(r"[<>=!~ \[]", r)[0] for r in extras["audio"])
    assert names["librosa"] == 1 and names["soxr"] == 1


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_generic(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"(^|[\s:'\"])(/|~/|[A-Za-z]:\\)[\w.-]+/", text, re.M), "machine path"
    assert not re.search(r"(?i)\b(debug|run_name|wandb|token|secret|password)\b\s*:", text)
    PackingEncoderConfig.from_yaml(path)


def test_every_shipped_config_loads_and_retired_fields_name_replacements(
    tokenizer: Any,
) -> None:
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert paths
    for path in paths:
        PackingTaskEncoder(
            PackingEncoderConfig.from_yaml(path), tokenizer=tokenizer, processor={"patch_size": 16}
        )
    with pytest.raises(EnergonConfigError, match="'max_seq_length' was retired; use capacity"):
        PackingEncoderConfig.from_dict({"max_seq_length": 4096})
