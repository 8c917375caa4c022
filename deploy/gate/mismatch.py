"""The sampler/trainer mismatch bound: a version whose served log-probs the learner does not reproduce is refused.

The learner measures, per version, how far its log-probs of the tokens that version sampled are from the sampler's
(``learner.mismatch``; ``Registry.mismatch``): mean ``|logp_learner - logp_sampler|`` per token and the k3 KL estimate,
with the learner's own MoE routing and with the server's replayed. A large gap means the importance ratios of that
version's samples measure the serving stack (kernels, a quantised or corrupt weight, a routing the learner cannot
replay), not the policy, and every update built on them is off. The bound applies to the routing the learner trains
with (``learner.routing_replay``: ``replay`` when it replays and the version's samples carried routing, else
``own``), once ``gate.mismatch_min_tokens`` tokens are measured.

What can be measured, and when: only generations a version served. A canary serves its users for minutes before it
is promoted, so the canary is aborted when its mismatch passes the bound (``CanaryController.watch``); a candidate
judged before it served anything (one node, no canary) has no measurement: its check records "not measured" and
passes.

What the measurement holds besides the serving stack's gap: the learner recomputes a version's tokens with its weights
as they are when it trains on them, minutes of updates (and, with ``learner.candidate_ema``, the average's lag) away
from the weights that served them. In the default demo that movement alone measured 0.19-0.53 nats a token per
version over 10 minutes, while ``liverl bench logprobs`` measures 0.00-0.05 at the served weights and a stack serving
other weights measures 4.67 (``tests/serving/test_gateway_routing.py``). A bound under the movement aborts good canaries
at random (at 0.25 it aborted four of the demo's six); the default, 1.0, sits above the movement and far below other
weights, so it catches a stack that serves the wrong weights or broken kernels, not a small kernel difference. A
measurement at the version's own weights, on the generations it served, would tell the two apart.
"""

from __future__ import annotations

from core.config import LiverlConfig


def measured(cfg: LiverlConfig, means: dict | None) -> tuple[str, int, float | None, float | None]:
    """(routing, tokens, mean |Δ logp|, KL) of a version's ``Registry.mismatch`` row under the routing the learner
    trains with."""
    if means is None:
        return "own", 0, None, None
    mode = "replay" if cfg.learner.routing_replay == "rollout" and means.get("replay_tokens") else "own"
    return mode, int(means[f"{mode}_tokens"] or 0), means[f"{mode}_abs"], means[f"{mode}_kl"]


def check(cfg: LiverlConfig, version: int, means: dict | None) -> tuple[bool, float | None, str]:
    """(passed, the value bounded, why) for ``version`` whose ``Registry.mismatch`` row is ``means`` (None: none)."""
    bound, need = cfg.gate.max_logprob_mismatch, cfg.gate.mismatch_min_tokens
    mode, n, value, kl = measured(cfg, means)
    if value is None or n < need:
        return (
            True,
            value,
            (
                f"v{version} not measured: {n} tokens of its generations recomputed by the learner, "
                f"gate.mismatch_min_tokens {need}"
            ),
        )
    what = (
        f"sampler/trainer mismatch of v{version}: mean |logp_learner - logp_sampler| {value:.4f} nats/token "
        f"(KL {kl:.4f}) on {n} tokens it served, {mode} routing"
    )
    if value > bound:
        return (
            False,
            value,
            (
                f"{what} > gate.max_logprob_mismatch {bound:g}: the learner does not reproduce what this version "
                "served (serving kernels, weights or routing), so its samples' importance ratios are not the policy's"
            ),
        )
    return True, value, f"{what} <= gate.max_logprob_mismatch {bound:g}"
