"""``liverl lineage FEEDBACK_ID``: one feedback event's path to a served model, each step with its time; and the
feedback -> served latency over every trained feedback event (the demo summary).

Where each fact lives (durable stores only; nothing here reads Redis or a topic):

- the feedback id, its time, the sample it became, the learner step that trained it and that step's time: the
  learner's ledger (``learner.ledger``: ``trained`` lines carry ``feedback`` and ``at``);
- which versions hold that step: a candidate is the learner's weights at its ``learner_step`` (registry), and those
  weights carry every step since the learner last (re)started from a version (the ledger's ``rebase`` lines: a fresh
  start, a rebase onto stable after starving, a rollback), plus whatever that version carried. A feedback trained
  into a refused candidate is therefore in every later candidate of the same learner lineage, and in none after a
  rebase onto a version that does not hold it. The registry's ``parent`` is only the version a delta is coded
  against (stable at the time), not the training lineage;
- the gate's verdicts: registry ``gate_results``; the canary's start and the promotion: the audit log
  (``canary_start``, the first ``promote`` of a version);
- served: the registry's ``served`` table, the time each node first resumed serving a version after a verified
  swap. Requests admitted from then on (and, with a step-level pause, those in flight) are served by it, so under
  load that moment is the first request it serves, to the swap's resume. A canary node serves a share of users:
  ``served`` counts it (the feedback reached a served model), ``promoted`` is when it went to every user.

The feedback time is the product's own ``FeedbackEvent.ts``, so feedback -> served spans the whole pipeline: the
SDK, ingest's join, the learner's batch, the candidate's cadence, the gate (offline checks and the canary) and the
swap. The ledger is local to the learner (``<state_dir>/learner``): run this where the learner runs, as
``liverl audit``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class TrainedFeedback:
    """One trained feedback event as the ledger has it. ``segment``: which learner lineage trained it (a new one
    starts at every fresh start or rebase)."""

    feedback_id: str
    sample_id: str
    ts_feedback: float
    step: int
    trained_at: float | None
    segment: int


@dataclass(frozen=True)
class Segment:
    """A stretch of the learner's updates on one line of weights: from ``start_step`` on, starting from version
    ``base`` (None: unknown, the ledger's beginning or a ledger written before lineage was recorded)."""

    start_step: int
    base: int | None
    at: float | None


@dataclass
class LedgerView:
    segments: list[Segment] = field(default_factory=lambda: [Segment(0, None, None)])
    step_segment: dict[int, int] = field(default_factory=dict)
    step_at: dict[int, float] = field(default_factory=dict)
    feedback: dict[str, TrainedFeedback] = field(default_factory=dict)
    lines: int = 0
    unreadable: int = 0
    of_unit: list[TrainedFeedback] = field(default_factory=list)  # read_ledger(unit=...): that user's samples
    without_units: int = 0  # trained lines that do not say whose samples they trained (older ledgers)


def _ledger_lines(path: Path) -> Iterator[dict | None]:
    """Every line of the ledger (the rolled-over file first); None for a line that does not parse (a line being
    written while we read, or torn by a crash)."""
    for p in (path.with_name(path.name + ".1"), path):
        if not p.exists():
            continue
        with open(p, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    got = json.loads(line)
                except ValueError:
                    yield None
                    continue
                yield got if isinstance(got, dict) else None


def read_ledger(path: Path, want: str | None = None, unit: str | None = None) -> LedgerView:
    """The ledger's segments and steps, and its trained feedback events (all, or only ``want``). ``unit``: only that
    user's samples are kept, in ``of_unit`` (and no feedback events)."""
    view = LedgerView()
    for line in _ledger_lines(Path(path)):
        view.lines += 1
        if line is None:
            view.unreadable += 1
            continue
        if "rebase" in line:
            rb = line["rebase"]
            view.segments.append(Segment(int(rb["step"]), int(rb["onto"]), rb.get("at")))
            continue
        if "trained" not in line:
            continue
        step, seg = int(line["step"]), len(view.segments) - 1
        view.step_segment[step] = seg
        if line.get("at") is not None:
            view.step_at[step] = float(line["at"])
        if unit is not None:
            units = line.get("units")
            if units is None:
                view.without_units += 1
                continue
            fbs = line.get("feedback") or [("", 0.0)] * len(units)
            for (_, _, sid), (fid, ts), u in zip(line["trained"], fbs, units, strict=False):
                if u == unit:
                    view.of_unit.append(TrainedFeedback(fid, sid, float(ts), step, line.get("at"), seg))
            continue
        for (_, _, sid), (fid, ts) in zip(line["trained"], line.get("feedback") or (), strict=False):
            if want is None or fid == want:
                view.feedback[fid] = TrainedFeedback(fid, sid, float(ts), step, line.get("at"), seg)
    return view


@dataclass
class RegistryView:
    """What the registry says of every version, read once: rows, gate results, canary starts, first promotions,
    and first-served times."""

    versions: dict[int, Any]
    gates: dict[int, list[Any]]
    canary_at: dict[int, float]
    promoted_at: dict[int, float]
    served: dict[int, tuple[float, str]]

    @classmethod
    def load(cls, registry) -> RegistryView:
        versions = {int(v.version): v for v in registry.list()}
        gates: dict[int, list] = {}
        for g in registry.gate_results():
            gates.setdefault(int(g.version), []).append(g)
        canary_at: dict[int, float] = {}
        promoted_at: dict[int, float] = {}
        for e in registry.audit():
            if e.version is None:
                continue
            if e.action == "canary_start":
                canary_at.setdefault(int(e.version), float(e.at))
            elif e.action == "promote":
                promoted_at.setdefault(int(e.version), float(e.at))
        for v, row in versions.items():  # a registry whose audit log was trimmed: the row's own time
            if row.promoted_at is not None and v != 0:
                promoted_at.setdefault(v, float(row.promoted_at))
        served: dict[int, tuple[float, str]] = {}
        for s in registry.served():  # earliest first
            served.setdefault(int(s.version), (float(s.first_at), s.node))
        return cls(versions, gates, canary_at, promoted_at, served)


class Lineages:
    """Which versions hold which learner steps: ``content[v]`` maps each segment to the last step of it that
    version ``v``'s weights carry (its own segment up to its learner step, and its base's content, recursively)."""

    def __init__(self, ledger: LedgerView, reg: RegistryView):
        self.ledger, self.reg = ledger, reg
        self.segment_of: dict[int, int] = {}
        for v, row in reg.versions.items():
            if row.learner_step is not None and int(row.learner_step) in ledger.step_segment:
                self.segment_of[v] = ledger.step_segment[int(row.learner_step)]
        self.content: dict[int, dict[int, int]] = {}
        for v in sorted(reg.versions):
            self._content(v)
        self._cache: dict[tuple[int, int], list[int]] = {}

    def _content(self, v: int, depth: int = 0) -> dict[int, int]:
        if v in self.content:
            return self.content[v]
        out: dict[int, int] = {}
        seg = self.segment_of.get(v)
        if seg is not None and depth < 10_000:
            base = self.ledger.segments[seg].base
            if base is not None and base != v and base in self.reg.versions:
                out.update(self._content(base, depth + 1))
            out[seg] = max(out.get(seg, -1), int(self.reg.versions[v].learner_step))
        self.content[v] = out
        return out

    def holding(self, fb: TrainedFeedback) -> list[int]:
        """The versions whose weights were trained on ``fb``, oldest first."""
        key = (fb.segment, fb.step)
        if key not in self._cache:
            self._cache[key] = sorted(v for v, c in self.content.items() if c.get(fb.segment, -1) >= fb.step)
        return self._cache[key]

    def first_promoted(self, fb: TrainedFeedback) -> tuple[int, float] | None:
        got = [(self.reg.promoted_at[v], v) for v in self.holding(fb) if v in self.reg.promoted_at]
        return (min(got)[1], min(got)[0]) if got else None

    def first_served(self, fb: TrainedFeedback) -> tuple[int, str, float] | None:
        got = [(self.reg.served[v], v) for v in self.holding(fb) if v in self.reg.served]
        if not got:
            return None
        (at, node), v = min(got)
        return v, node, at

    def dropped_by(self, fb: TrainedFeedback) -> Segment | None:
        """The first later (re)start whose weights do not hold ``fb``: where its lineage was thrown away."""
        for seg in self.ledger.segments[fb.segment + 1 :]:
            if seg.base is None or self.content.get(seg.base, {}).get(fb.segment, -1) < fb.step:
                return seg
        return None


# -- one feedback event's path ---------------------------------------------------------------------------------------


def trace(feedback_id: str, ledger_file: Path, registry) -> dict[str, Any]:
    """The path of one feedback event: rows of (stage, what, time), plus the headline times. ``ValueError`` for a
    feedback id the ledger does not show as trained."""
    led, fb = _trained(feedback_id, Path(ledger_file))
    reg = RegistryView.load(registry)
    lin = Lineages(led, reg)
    rows: list[tuple[str, str, float | None]] = [
        ("feedback", f"{fb.feedback_id}", fb.ts_feedback),
        ("sample", f"{fb.sample_id} (trained; sample id = its generation id)", None),
        ("learner step", f"step {fb.step}", fb.trained_at),
    ]
    holding = lin.holding(fb)
    promoted = lin.first_promoted(fb)
    served = lin.first_served(fb)
    end = promoted[0] if promoted else None
    rows += _version_rows(reg, holding, end)
    ends = _end_rows(lin, reg, fb, promoted, served)
    rows += sorted(ends, key=lambda r: float("inf") if r[2] is None else r[2])
    return {
        "feedback_id": fb.feedback_id,
        "sample_id": fb.sample_id,
        "ts_feedback": fb.ts_feedback,
        "step": fb.step,
        "trained_at": fb.trained_at,
        "versions": holding,
        "candidate": holding[0] if holding else None,
        "promoted": None if promoted is None else {"version": promoted[0], "at": promoted[1]},
        "served": None if served is None else {"version": served[0], "node": served[1], "at": served[2]},
        "feedback_to_served_s": None if served is None else served[2] - fb.ts_feedback,
        "feedback_to_promoted_s": None if promoted is None else promoted[1] - fb.ts_feedback,
        "rows": [{"stage": s, "what": w, "at": t} for s, w, t in rows],
    }


def _trained(feedback_id: str, ledger_file: Path) -> tuple[LedgerView, TrainedFeedback]:
    """The ledger (read for ``feedback_id``) and the event's training; ``ValueError`` if the ledger does not show it
    as trained."""
    if not feedback_id or not isinstance(feedback_id, str):
        raise ValueError("a feedback id is a non-empty string (the FeedbackEvent.feedback_id the product sent)")
    led = read_ledger(ledger_file, want=feedback_id)
    fb = led.feedback.get(feedback_id)
    if fb is None:
        where = (
            ledger_file if ledger_file.exists() else f"{ledger_file} (no such file: is this the learner's state dir?)"
        )
        raise ValueError(
            f"feedback {feedback_id!r} is not in the learner's ledger {where} as trained: it may be unknown, "
            "held out for the gate, refused by the learner, still on its way, or from before the ledger "
            "rolled over; `liverl audit` says where each feedback event went"
        )
    return led, fb


def _version_rows(reg: RegistryView, holding: list[int], end: int | None) -> list[tuple[str, str, float | None]]:
    """The versions holding the event, oldest first up to ``end`` (the first promoted), each with its gate checks
    and canary start in time order."""
    rows: list[tuple[str, str, float | None]] = []
    for i, v in enumerate(holding):
        row = reg.versions[v]
        label = "candidate" if i == 0 else "descendant"
        rows.append(
            (
                label,
                f"v{v} (learner step {row.learner_step}) {row.status}"
                + (f": {row.status_reason}" if row.status_reason and row.status != "stable" else ""),
                row.created_at,
            )
        )
        steps = []
        for g in reg.gates.get(v, []):
            val = (
                "" if g.value is None else f" {g.value:.4g}" + ("" if g.threshold is None else f" vs {g.threshold:.4g}")
            )
            steps.append(
                (
                    "  gate",
                    f"v{v} {g.check} {'pass' if g.passed else 'FAIL'}{val}"
                    + (f" ({g.detail[:90]})" if g.detail else ""),
                    g.at,
                )
            )
        if v in reg.canary_at:
            steps.append(("  canary", f"v{v} canary started", reg.canary_at[v]))
        rows += sorted(steps, key=lambda r: r[2])
        if v == end:
            break
    if not holding:
        rows.append(("candidate", "none yet: no version holds this step (the learner has not emitted one since)", None))
    return rows


def _end_rows(
    lin: Lineages,
    reg: RegistryView,
    fb: TrainedFeedback,
    promoted: tuple[int, float] | None,
    served: tuple[int, str, float] | None,
) -> list[tuple[str, str, float | None]]:
    """Where the event ended: its first promotion (or why none), and the first node to serve it."""
    ends: list[tuple[str, str, float | None]] = []
    if promoted:
        ends.append(("promoted", f"v{promoted[0]} (to every node)", promoted[1]))
    else:
        dropped = lin.dropped_by(fb)
        ends.append(
            (
                "promoted",
                "not promoted"
                + (
                    f": the learner restarted from v{dropped.base} at step {dropped.start_step}, "
                    "which does not hold it (its lineage was refused)"
                    if dropped
                    else ": no version holding it has been promoted yet"
                ),
                None,
            )
        )
    if served:
        on_canary = served[0] not in reg.promoted_at or served[2] < reg.promoted_at[served[0]]
        ends.append(
            (
                "served",
                f"v{served[0]} on {served[1]}{' (canary)' if on_canary else ''}: the first node to "
                "serve a version holding it",
                served[2],
            )
        )
    else:
        ends.append(("served", "not served yet", None))
    return ends


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"


def print_trace(tr: dict[str, Any]) -> None:
    t0 = tr["ts_feedback"]
    width = max(len(r["what"]) for r in tr["rows"])
    width = min(width, 110)
    print(f"{'stage':<13}  {'what':<{width}}  {'time':<23}  after feedback")
    for r in tr["rows"]:
        at = r["at"]
        print(
            f"{r['stage']:<13}  {r['what'][:width]:<{width}}  {'' if at is None else _clock(at):<23}  "
            + ("" if at is None else f"{at - t0:+.1f} s")
        )
    for name, key in (
        ("feedback -> served", "feedback_to_served_s"),
        ("feedback -> promoted", "feedback_to_promoted_s"),
    ):
        print(f"{name:<21} " + ("-" if tr[key] is None else f"{tr[key]:.1f} s"))


# -- every trained feedback event: the latency distribution ----------------------------------------------------------


def _quantiles(xs: list[float]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {"n": len(xs)}
    for q in QUANTILES:
        out[f"p{q}"] = round(float(np.percentile(xs, q)), 2) if xs else None
    return out


def latency_summary(ledger_file: Path, registry, since: float | None = None) -> dict[str, Any]:
    """Feedback -> served (first node serving a version that holds it, canary nodes included) and feedback ->
    promoted, in seconds, over every feedback event the ledger shows trained (given at or after ``since``), with the
    counts of those not served (still in no candidate, in refused or pending ones, or thrown away by a rebase)."""
    led = read_ledger(Path(ledger_file))
    reg = RegistryView.load(registry)
    lin = Lineages(led, reg)
    served_s, promoted_s = [], []
    counts = {"trained": 0, "in_a_candidate": 0, "served": 0, "promoted": 0, "dropped_by_rebase": 0}
    for fb in led.feedback.values():
        if since is not None and fb.ts_feedback < since:
            continue
        counts["trained"] += 1
        if not lin.holding(fb):
            continue
        counts["in_a_candidate"] += 1
        s, p = lin.first_served(fb), lin.first_promoted(fb)
        if s is not None:
            counts["served"] += 1
            served_s.append(s[2] - fb.ts_feedback)
        if p is not None:
            counts["promoted"] += 1
            promoted_s.append(p[1] - fb.ts_feedback)
        elif s is None and lin.dropped_by(fb) is not None:
            counts["dropped_by_rebase"] += 1
    return {
        **counts,
        "feedback_to_served_s": _quantiles(served_s),
        "feedback_to_promoted_s": _quantiles(promoted_s),
        "ledger_lines": led.lines,
        "ledger_unreadable_lines": led.unreadable,
    }
