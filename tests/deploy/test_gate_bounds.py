"""What the gate keeps in memory stays bounded over a long run: stand-ins for the registry and the evaluator."""

from __future__ import annotations

from types import SimpleNamespace

from deploy.gate.evidence import STABLE_SUITES_KEPT, EvidenceChecks


class _Registry:
    def __init__(self):
        self.recorded: list[tuple] = []

    def materialize(self, version: int) -> dict:
        return {"version": version}

    def record_gate(self, *row) -> None:
        self.recorded.append(row)


class _Evaluator:
    def __init__(self):
        self.calls = 0

    def suite_score(self, weights) -> dict:
        self.calls += 1
        return {"name": "suite", "score": 0.5 + weights["version"] / 1000}


def test_the_stable_suite_scores_kept_are_the_newest_few_whatever_the_promotions():
    """A promotion a minute for days: the gate remembers the suite scores of the last ``STABLE_SUITES_KEPT`` stable
    versions only; the newest is scored once, and a rollback to a forgotten one scores it again."""
    checks = EvidenceChecks()
    checks.registry, checks.evaluator, checks._stable_suite = _Registry(), _Evaluator(), {}
    stables = [SimpleNamespace(version=v, checksum=f"{v:064x}") for v in range(1000)]
    for st in stables:
        assert checks.stable_suite(st)["score"] == 0.5 + st.version / 1000
    assert len(checks._stable_suite) == STABLE_SUITES_KEPT and checks.evaluator.calls == 1000
    checks.stable_suite(stables[-1])
    assert checks.evaluator.calls == 1000  # remembered
    checks.stable_suite(stables[0])
    assert checks.evaluator.calls == 1001 and len(checks._stable_suite) == STABLE_SUITES_KEPT
