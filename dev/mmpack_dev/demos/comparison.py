"""The demos' ``--compare-with MODULE:ATTR`` option: an implementation to run side by side with
mmpack's, imported from outside the package (for example the plain-Python references of the
test suite: ``PYTHONPATH=tests mmpack_dev demo --toy --compare-with
reference.energon:ReferencePackingTaskEncoder``)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["OPTION", "import_comparison"]

OPTION = "--compare-with"


def import_comparison(spec: str) -> Any:
    """The object ``ATTR`` of the importable module ``MODULE`` named by ``spec``
    (``"MODULE:ATTR"``, ``ATTR`` may be dotted). Raises `ImportError` naming the option when
    the module or the attribute cannot be found, `ValueError` when `spec` is malformed."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{OPTION} takes MODULE:ATTR (an importable path), got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"{OPTION} {spec}: cannot import module {module_name!r} ({err}); put the folder "
            "that holds it on PYTHONPATH (make demo passes PYTHONPATH=tests for the references)"
        ) from err
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as err:
            raise ImportError(
                f"{OPTION} {spec}: module {module_name!r} has no attribute {attr!r}"
            ) from err
    return target
