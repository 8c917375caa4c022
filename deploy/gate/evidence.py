"""The gate's evidence checks on a candidate whose delta is sound: (b) drift, (c) collapse, (d) the product's
suite and (e) the off-policy estimate on held-out feedback (``deploy.gate.gate`` says what each check asks).

``EvidenceChecks`` is a part of ``deploy.gate.gate.Gate``: it reads the gate's config, registry, evaluator, held-out
tail and metrics, and records every check with ``Gate._record``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import prometheus_client as prom

from core.config import LiverlConfig
from deploy.gate import mismatch as logprob_mismatch
from deploy.gate.offpolicy import compare, merge_heldout
from deploy.gate.tail import HeldoutSample
from deploy.gate.waiting import OffpolicyLook, arrival_rate
from deploy.registry.registry import Registry, Version


def paired_sign_test(candidate: list[float], stable: list[float]) -> tuple[int, int, float]:
    """(cases worse, cases better, one-sided p) for "the candidate is worse on the suite", pairing each case's grade
    under both versions: the exact sign test on the cases whose grade changed (McNemar's exact test when grades are
    pass/fail). Unchanged cases carry no evidence either way."""
    if len(candidate) != len(stable):
        raise ValueError(f"{len(candidate)} candidate grades against {len(stable)} stable grades")
    worse = sum(c < s for c, s in zip(candidate, stable, strict=True))
    better = sum(c > s for c, s in zip(candidate, stable, strict=True))
    n = worse + better
    p = sum(math.comb(n, k) for k in range(worse, n + 1)) / 2**n if n else 1.0
    return worse, better, p


class Evaluator(Protocol):
    """What the gate asks of a policy (see ``learner.evaluate.PolicyEvaluator``)."""

    def drift(self, candidate: Mapping[str, Any], stable: Mapping[str, Any]) -> dict | None:
        """``{"kl", "entropy", "tokens", ...}`` on the current probes, or None when there are none yet."""

    def suite_score(self, weights: Mapping[str, Any]) -> dict | None:
        """``{"name", "score", "grades", ...}`` on the product's evaluation suite (``grades``: each completion's, in
        case order; optional, without it the drop alone decides), or None without one."""

    def sequence_logprobs(self, weights: Mapping[str, Any], probes: list) -> list[float]:
        """log pi(completion | prompt) of each probe (``prompt_ids``, ``completion_ids``) under ``weights``."""


STABLE_SUITES_KEPT = 8
"""How many stable versions' suite scores the gate remembers (a rollback to one of them costs no evaluation)."""


class EvidenceChecks:
    """Checks (b)-(e) of ``deploy.gate.gate.Gate``, and the stable version's suite score they compare with."""

    # the gate's state the checks read, set by ``Gate.__init__``
    cfg: LiverlConfig
    registry: Registry
    evaluator: Evaluator
    heldout: Callable[[], list[HeldoutSample]] | None
    _stable_suite: dict[tuple[int, str], dict | None]
    _score: prom.Gauge
    _eval_s: prom.Histogram
    _record: Callable[[int, str, float | None, float | None, bool, str], bool]
    offpolicy_look: OffpolicyLook | None  # the last off-policy check's figures (None: not run)

    def stable_suite(self, stable: Version) -> dict | None:
        """The stable version's suite score, computed once per (version, checksum) and recorded for it."""
        key = (stable.version, stable.checksum)
        if key not in self._stable_suite:
            score = self.evaluator.suite_score(self.registry.materialize(stable.version))
            if score is not None:
                shown = {k: v for k, v in score.items() if k != "grades"}
                self.registry.record_gate(
                    stable.version,
                    "suite",
                    score["score"],
                    None,
                    True,
                    "reference score of the stable version " + json.dumps(shown, sort_keys=True),
                )
            self._stable_suite[key] = score
            while len(self._stable_suite) > STABLE_SUITES_KEPT:  # the oldest first: one per promotion, kept bounded
                del self._stable_suite[next(iter(self._stable_suite))]
        return self._stable_suite[key]

    def _evidence(self, row: Version, stable: Version, state: Mapping[str, Any]) -> dict[str, bool]:
        """Checks (b)-(d); each lands in gate_results with its value, threshold and reason."""
        checks: dict[str, bool] = {}
        g = self.cfg.gate
        t0 = time.perf_counter()
        drift = self.evaluator.drift(state, self.registry.materialize(stable.version))
        if drift is None:
            checks["drift"] = self._record(
                row.version,
                "drift",
                None,
                g.max_kl,
                False,
                "no logged generations to measure drift on yet; retried with the next candidate",
            )
        else:
            kl, ent = drift["kl"], drift["entropy"]
            self._score.labels("kl").set(kl)
            self._score.labels("entropy").set(ent)
            checks["drift"] = self._record(
                row.version,
                "drift",
                kl,
                g.max_kl,
                kl <= g.max_kl,
                f"KL(v{row.version} || stable v{stable.version}) {kl:.4f} nats/token vs max {g.max_kl} "
                f"on {drift['tokens']} tokens of {drift['probes']} logged generations",
            )
            checks["collapse"] = self._record(
                row.version,
                "collapse",
                ent,
                g.min_entropy,
                ent >= g.min_entropy,
                f"entropy {ent:.4f} nats/token (stable {drift.get('stable_entropy', float('nan')):.4f}) vs floor "
                f"{g.min_entropy}",
            )
        ok, value, why = logprob_mismatch.check(
            self.cfg, row.version, self.registry.mismatch(row.version).get(row.version)
        )
        checks["mismatch"] = self._record(row.version, "mismatch", value, g.max_logprob_mismatch, ok, why)
        self.offpolicy_look = None
        heldout = self.heldout() if self.heldout is not None and g.heldout_samples else []
        if heldout or (self.heldout is not None and g.heldout_samples and self.cfg.ingest.heldout_share > 0):
            # a held-out stream with nothing usable in it yet is no evidence: deferred like a thin one
            look = self.offpolicy_look = self._offpolicy(row, stable, state, heldout)
            checks["offpolicy"] = look.verdict != "refuse"
            if look.verdict == "defer":  # not judged off-policy: a canary, or with none the wait, must decide
                checks["needs_canary"] = True
        ref = self.stable_suite(stable)
        if ref is not None:
            score = self.evaluator.suite_score(state)
            assert score is not None  # the evaluator scored stable on its suite, so it has one
            self._score.labels("suite").set(score["score"])
            checks["suite"] = self._suite(row, stable, score, ref)
        self._eval_s.observe(time.perf_counter() - t0)
        return checks

    def _suite(self, row: Version, stable: Version, score: dict, ref: dict) -> bool:
        g = self.cfg.gate
        floor = ref["score"] - g.max_regression
        text = (
            f"suite {score['name']!r} {score['score']:.4f} vs stable v{stable.version} {ref['score']:.4f} "
            f"(max regression {g.max_regression}, {score['completions']} completions)"
        )
        dropped = score["score"] < floor
        if (
            dropped
            and score.get("grades") is not None
            and ref.get("grades") is not None
            and len(score["grades"]) == len(ref["grades"])
        ):
            worse, better, p = paired_sign_test(score["grades"], ref["grades"])
            shown = p < g.suite_alpha
            text += (
                f"; paired: {worse} cases worse, {better} better, sign test p {p:.3g} "
                f"{'<' if shown else '>='} suite_alpha {g.suite_alpha}"
                + ("" if shown else ": the drop is within what the cases that flipped either way explain")
            )
            dropped = shown
        return self._record(row.version, "suite", score["score"], floor, not dropped, text)

    def _offpolicy(
        self, row: Version, stable: Version, state: Mapping[str, Any], records: list[HeldoutSample]
    ) -> OffpolicyLook:
        """Check (e), recorded: "refuse" (the paired test shows the candidate's reward below stable's by more than
        ``gate.offpolicy_margin``), "defer" (an effective sample size under ``gate.offpolicy_min_ess``, or no
        held-out sample whose revert horizon has closed: not judged here, a canary or the wait decides) or "pass"
        (``deploy.gate.offpolicy.compare``), with the figures the wait reads (``deploy.gate.waiting``). The samples
        are the held-out stream's records merged by generation (a revert replaces its accept's reward) and censored
        at ``gate.revert_horizon_s`` (``merge_heldout``)."""
        g = self.cfg.gate
        now = time.time()
        cutoff = now - g.revert_horizon_s
        merged, young = merge_heldout(records, cutoff)
        heldout = merged[-g.heldout_samples :]
        rate = arrival_rate(records, now)
        full = sum(h.judged_at <= cutoff for h in records) >= g.heldout_samples
        slice_text = (
            f"{len(heldout)} held-out samples ({sum(h.kind == 'revert' for h in heldout)} reverted; {young} "
            f"judged less than gate.revert_horizon_s {g.revert_horizon_s:g} s ago left out)"
        )
        if not heldout:
            self._record(
                row.version,
                "offpolicy",
                0.0,
                g.offpolicy_min_ess,
                True,
                f"off-policy v{row.version}: defer: deferred to the canary: no usable {slice_text}",
            )
            return OffpolicyLook("defer", 0.0, 0, full, rate)
        lp_cand = self.evaluator.sequence_logprobs(state, heldout)
        lp_stable = self.evaluator.sequence_logprobs(self.registry.materialize(stable.version), heldout)
        c = compare(
            lp_cand,
            lp_stable,
            [h.behaviour_logprob for h in heldout],
            [h.reward for h in heldout],
            margin=g.offpolicy_margin,
            min_ess=g.offpolicy_min_ess,
            clip=g.offpolicy_clip,
        )
        self._score.labels("offpolicy").set(c.candidate.value)
        self._score.labels("offpolicy_difference").set(c.difference)
        self._score.labels("offpolicy_ess").set(c.candidate.ess)
        self._score.labels("offpolicy_ess_unclipped").set(c.candidate.ess_unclipped)
        reason = (
            f"off-policy reward v{row.version} {c.candidate.value:.3f} [{c.candidate.lower:.3f}, "
            f"{c.candidate.upper:.3f}] vs stable v{stable.version} {c.stable.value:.3f} on {slice_text}, "
            f"ESS {c.candidate.ess:.0f} clipped, {c.candidate.ess_unclipped:.0f} unclipped (stable "
            f"{c.stable.ess:.0f}, {c.stable.ess_unclipped:.0f}): {c.verdict}: {c.reason}"
        )
        if c.verdict == "defer":
            self._record(row.version, "offpolicy", c.ess, g.offpolicy_min_ess, True, reason)
        else:
            self._record(row.version, "offpolicy", c.upper, -g.offpolicy_margin, c.verdict == "pass", reason)
        sizes = (
            ("candidate", c.candidate.ess),
            ("candidate unclipped", c.candidate.ess_unclipped),
            ("stable", c.stable.ess),
            ("stable unclipped", c.stable.ess_unclipped),
        )
        low = ", ".join(f"{name} {ess:.0f}" for name, ess in sizes if ess < g.offpolicy_min_ess)
        return OffpolicyLook(c.verdict, c.ess, len(heldout), full, rate, low)

    def usable_heldout(self) -> int:
        """How many held-out samples the off-policy check would use now (no model run: the wait's cadence)."""
        g = self.cfg.gate
        if self.heldout is None or not g.heldout_samples:
            return 0
        merged, _ = merge_heldout(self.heldout(), time.time() - g.revert_horizon_s)
        return min(len(merged), g.heldout_samples)

    def _too_early(self) -> str | None:
        """Why no candidate can be judged yet, or None. Before any held-out feedback has had its whole revert horizon
        (``gate.revert_horizon_s``), no judgement could count a revert: the learner has trained on accepts its users
        may still undo, and neither the off-policy check nor a canary has anything final to read. That is a
        deployment's first minute or so: in the demo the candidates of its first 75 s were bait, rewarded for accepts
        reverted later, and each was canaried for 100-200 s before the revert rate showed it. It applies only with a
        held-out stream that has records (``gate.heldout_samples`` > 0): without one there is nothing to wait for."""
        g = self.cfg.gate
        if g.integrity_only or self.heldout is None or not g.heldout_samples or g.revert_horizon_s <= 0:
            return None

        usable, young = merge_heldout(self.heldout(), time.time() - g.revert_horizon_s)
        if usable or not young:
            return None
        return (
            f"too early: none of the {young} held-out judgements is older than gate.revert_horizon_s "
            f"{g.revert_horizon_s:g} s, so no evidence could include a revert yet; the newest candidate is judged "
            "once one is"
        )
