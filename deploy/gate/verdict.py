"""What the gate decided about one candidate in one step (``deploy.gate.gate.Gate.step``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verdict:
    version: int
    verdict: str  # promoted | rejected | superseded | deferred | canary | aborted
    reason: str
    checks: dict[str, bool] = field(default_factory=dict)
