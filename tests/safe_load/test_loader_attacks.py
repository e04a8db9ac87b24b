"""The restricted loader's memory bound against payloads written by hand, one per attack class
(``support.loader_attacks``): each is refused with its typed error, in a child process under a
hard memory limit, and the peak memory of the load (resident set and traced) stays within its
``max_bytes`` plus the fixed overhead of ``support.loader_child``."""

from __future__ import annotations

import pytest
from mmpack.compat import nemo_rl as compat
from support.loader_attacks import attacks
from support.loader_child import Case, run_payloads, violations

ATTACKS = attacks()


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_is_refused_with_its_typed_error(name: str) -> None:
    attack = ATTACKS[name]
    with pytest.raises(attack.error):
        compat.loads(attack.payload, max_bytes=attack.max_bytes)


def test_attacks_stay_within_their_bound_in_a_child() -> None:
    cases = [Case(name, a.payload, a.max_bytes) for name, a in ATTACKS.items()]
    results = run_payloads(cases, timeout=240)
    report = [
        f"{r.name}: {r.size} B, limit {r.limit >> 10} KiB, {r.outcome}, "
        f"peak RSS +{r.rss >> 10} KiB, traced {r.traced >> 10} KiB"
        for r in results
    ]
    print("\n".join(report))
    assert not violations(results), violations(results)
    for r in results:
        assert r.outcome == ATTACKS[r.name].error.__name__, r
