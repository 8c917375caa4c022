"""The gate: the offline checks a candidate passes, and the canary that decides its promotion."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config.base import Section


class GateConfig(Section):
    max_kl: float = Field(
        default=0.5,
        gt=0,
        description="Refuse a candidate whose mean per-token KL from the stable version, on recent "
        "logged generations, exceeds this (nats/token): one release moves the policy only so far.",
    )
    max_logprob_mismatch: float = Field(
        default=1.0,
        gt=0,
        description="Refuse a version whose served log-probs the learner does not reproduce: mean "
        "|logp_learner - logp_sampler| per token (nats) on the generations it served, as the learner measures it "
        "(learner.mismatch_measure; under the routing it trains with, learner.routing_replay). Checked on a "
        "canary (aborted when it passes this) and on a candidate with a measurement. The learner measures with its "
        "weights as they are when it trains, so its own movement since the version adds to the serving stack's "
        "gap: the default demo's versions measured 0.19-0.53 in 10 minutes, where liverl bench logprobs measures "
        "0.00-0.05 at the served weights and other weights measure 4.67. The bound catches a stack that serves "
        "other weights or broken kernels, not a small kernel difference (deploy/gate/mismatch.py).",
    )
    mismatch_min_tokens: int = Field(
        default=2000,
        ge=1,
        description="Tokens of a version's generations the learner must have recomputed before "
        "gate.max_logprob_mismatch applies to it.",
    )
    min_entropy: float = Field(
        default=0.05,
        ge=0,
        description="Refuse a candidate whose mean per-token entropy (nats) on recent logged "
        "generations is below this: a collapsed policy.",
    )
    max_regression: float = Field(
        default=0.02,
        ge=0,
        description="With a product evaluation suite: refuse a candidate whose mean grade drops "
        "more than this below the stable version's, when the drop is also significant (suite_alpha).",
    )
    suite_alpha: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="The suite check pairs each case's grade under the candidate with the "
        "stable version's and refuses only a drop the paired sign test (McNemar's, for pass/fail grades) shows at "
        "this level: a few cases flipping either way on a small suite is noise, not a regression. 1: refuse on the "
        "drop alone.",
    )
    probe_generations: int = Field(
        default=256, ge=1, description="How many recent logged generations the drift and collapse checks use."
    )
    poll_s: float = Field(default=1.0, gt=0, description="How often the gate looks for new candidates.")
    heldout_samples: int = Field(
        default=512, ge=0, description="How many of the newest held-out samples the off-policy check reads (0: off)."
    )
    offpolicy_margin: float = Field(
        default=0.02,
        ge=0,
        description="A candidate whose estimated reward (the product's, reverts included) the "
        "paired test on the same held-out samples shows below stable's by more than this (one-sided, alpha 0.025) is "
        "refused. In the product's reward units (default rewards: an accept is worth 1 more than a reject).",
    )
    offpolicy_min_ess: float = Field(
        default=50.0,
        ge=1,
        description="Below this effective sample size (the candidate's or stable's, clipped or "
        "unclipped) the off-policy check defers: recorded, and the candidate may be promoted only through a canary "
        "(it moved too far from the logged behaviour to be judged off-policy).",
    )
    offpolicy_clip: float = Field(default=10.0, gt=1, description="Cap on each importance weight.")
    offpolicy_wait_s: float = Field(
        default=3600.0,
        ge=0,
        description="With no canary to run (one configured node, or canary_share 0): a candidate whose "
        "off-policy evidence is too thin (effective sample size under offpolicy_min_ess) is kept pending and judged "
        "again as held-out feedback accumulates (deploy.gate.waiting), saying how much more it waits for; it is "
        "refused when this long has passed since its first look, or at once when the held-out window "
        "(heldout_samples) is full and still too thin. Newer candidates wait behind it. 0: refused at once.",
    )
    canary_share: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description="Share of users (a fixed hash bucket each, sticky) a candidate that "
        "passed the offline checks is shown on the canary nodes before it is promoted. 0, or fewer than 2 serving "
        "nodes in rotation: no canary, the gate promotes at once.",
    )
    canary_nodes: int = Field(
        default=1,
        ge=1,
        description="How many serving nodes serve the canary (at least one node always stays on the stable version).",
    )
    canary_deadline_s: float = Field(
        default=1800.0,
        gt=0,
        description="A canary still undecided after this is aborted (with canary_max_events set: the cap in time).",
    )
    canary_max_events: int | None = Field(
        default=None,
        ge=1,
        description="The canary's evidence budget: a canary still undecided once its own arm has this "
        "many judged events (whose revert horizon has closed) is aborted, as at canary_deadline_s, which stays the cap "
        "in time. A deadline in seconds alone gives a canary on a quiet day a fraction of the evidence it gets on a "
        "busy one, so its power follows the traffic; a budget in events does not. Fixed at the rollout's start. None: "
        "the deadline in seconds only.",
    )
    canary_futility_z: float | None = Field(
        default=1.5,
        ge=0,
        description="With an evidence budget (canary_max_events): a canary whose success metric or a required "
        "guardrail could not be shown within the budget even this many standard errors better than estimated "
        "is aborted as futile once a quarter of the budget is spent (deploy.gate.sequential.futile), instead of "
        "spending the rest. It never promotes, so the false-promotion rate cannot rise; at 1.5, in `liverl bench "
        "canary --budget 6000` (2,000 and 5,000 users), it cost 1.0-1.3 points of promotions of a candidate as good as "
        "stable and cut the events spent on one 3 points worse by 29-31%. Fixed at the rollout's start. None: no "
        "futility stop.",
    )
    canary_alpha: float = Field(
        default=0.05,
        gt=0,
        lt=1,
        description="Error rate of the canary's decisions across its success metric and guardrails, however often "
        "the always-valid tests (mSPRT; deploy.gate.sequential) are peeked at: a false promotion stays at or below it "
        "(every pass side at this level, split with the deadline's readout by canary_readout_share), and so does a "
        "false abort (each of the m tests' harm side at alpha / m). deploy.gate.sequential_readout states the "
        "arithmetic; every verdict names the levels.",
    )
    canary_readout_share: float = Field(
        default=0.3,
        ge=0.0,
        lt=1.0,
        description="A canary still undecided at its deadline (canary_deadline_s or canary_max_events) is decided by "
        "one fixed-horizon one-sided test of each pass side still open, on the last look's estimate, variance and "
        "degrees of freedom, at canary_alpha times this share; the sequential tests get the rest (a union bound keeps "
        "a false promotion at canary_alpha). It promotes when the success metric and every required guardrail pass, "
        "sequentially or there; otherwise the canary aborts as before. 0: no readout. Fixed at the rollout's start. "
        "In `liverl bench canary --stats` (1,000 sticky users, 1,800 s deadline, success metric and two guardrails) "
        "0.3 raised the promotions of a candidate 1 point better from 29-31% to 50-51% and of one 1.5 points better "
        "from 64-66% to 84-85%, cost 8-9% more events to promote one 3 points better (the mixture's tau), and kept "
        "A/A false promotions at 1.8-2.0%; it is the largest share measured (0.1, 0.2, 0.3, 0.5) that keeps that cost "
        "within 10% (0.5: 16-18%).",
    )
    canary_tau: float = Field(default=0.03, gt=0, description="Effect size the test is tuned for (acceptance points).")
    canary_min_events: int = Field(default=100, ge=1, description="Judged events each arm needs before any decision.")
    canary_warmup_s: float = Field(
        default=3.0,
        ge=0.0,
        description="A canary's evidence counts from the first whole 10 s bucket that starts this long "
        "after every canary node first served the candidate (the registry's served times). Answers the stable version "
        "served the canary's users just before (the router learns of a rollout within a second) are judged in the "
        "next seconds and would count for stable: raise it to the time your users take to judge an answer.",
    )
    canary_late_s: float = Field(
        default=300.0,
        ge=0.0,
        description="How long after a 10 s bucket's revert horizon (its settle, for the edit rate, length and latency) "
        "the gate still reads it again at each look: judgements count in the bucket of the user's judgement time, so "
        "an ingest worker that runs behind writes them there late, and what it counts later than this is never read. "
        "Raise it to the longest backlog ingest may run (each look reads every bucket still inside it, both arms).",
    )
    stable_arm_grace_s: float = Field(
        default=3.0,
        ge=0.0,
        description="A rollout whose stable arm has no node in rotation (every node the canary does not name lost, "
        "cut off or unhealthy) for this long is aborted, so the canary's nodes go back to stable: the routers hold "
        "the stable arm's users (serving.router_hold_s) rather than send them to the unproven candidate, and the "
        "abort is what lets them be served. The nodes' heartbeats expire 10 s after a node goes silent, so the "
        "users of a lost node wait about that long plus this plus a swap.",
    )
    canary_min_s: float = Field(
        default=0.0,
        ge=0,
        description="Shortest canary: no promotion before it has run this long, and evidence that "
        "it passes counts only from then on (a harm shown earlier still aborts). Set it above the time your "
        "follow-up feedback (reverts) takes to arrive, or the revert-rate guardrail passes on reverts not yet sent.",
    )
    canary_margin: float = Field(
        default=0.0,
        ge=0.0,
        description="0: promote only when live acceptance is shown better than stable's; > 0: "
        "when shown not worse by more than this (non-inferiority).",
    )
    guardrail_margin: float = Field(
        default=0.02,
        ge=0.0,
        description="Guardrails (the edit rate, the revert rate) must be shown not worse than stable's "
        "by more than this before a promotion; a guardrail shown worse aborts the canary.",
    )
    guardrail_tolerance: float = Field(
        default=0.10,
        ge=0.0,
        description="Response length guardrail: the canary's mean completion length must be "
        "shown no more than this share above stable's (0.10: 10% longer) before a promotion; it aborts only when shown "
        "more than this above it.",
    )
    latency_tolerance: float = Field(
        default=0.25,
        ge=0.0,
        description="Latency guardrail, as guardrail_tolerance for the mean serving latency "
        "(timed by the gateway). Wider: the canary and stable arms run on different nodes, so node load shows in it "
        "as much as the version does.",
    )
    latency_guardrail: Literal["non_inferior", "harm"] = Field(
        default="non_inferior",
        description="'non_inferior': a promotion waits until the canary's latency is shown no more "
        "than latency_tolerance above stable's; 'harm': latency only stops a canary it shows slower by more than that, "
        "and a promotion does not wait for it. A weight delta cannot change the compute per token, only how many "
        "tokens an answer takes (the response length guardrail, non-inferior either way), so the arms' latency "
        "differs by node more than by version; where nodes share their hardware (the demo: two vLLM engines on "
        "the same cores, whose load they trade), its batch means are too noisy to show non-inferiority in a canary's "
        "life.",
    )
    latency_at_equal_length: bool = Field(
        default=True,
        description="The latency guardrails (mean and quantile) compare the arms at equal answer length: each "
        "bucket's latency difference is regressed on the arms' difference in mean answer length, and the intercept is "
        "tested (deploy.gate.sequential_batches.batch_means). Users stay on their arm, so one heavy user with long "
        "answers makes its arm slower in every bucket; a delta changes how many tokens an answer takes (the response "
        "length guardrail), not the compute per token. False: the plain paired batch means. Fixed at a rollout's "
        "start.",
    )
    canary_user_cap: float | None = Field(
        default=0.99,
        gt=0.5,
        le=1.0,
        description="Heavy users' weight in the user-unit tests: a user with more events than this quantile of the "
        "users' events (both arms pooled, at each look; and of their events before the rollout for CUPED's "
        "covariate) counts as that many, their rate unchanged (deploy.gate.sequential_units.cap_users), as "
        "experimentation platforms cap or winsorize heavy users. The estimate is then of the users' rates weighed by "
        "their capped activity; with a few users sending a fifth of the traffic, the tests otherwise rest on those "
        "few. None or 1.0: no cap. Fixed at a rollout's start.",
    )
    latency_quantile: float | None = Field(
        default=0.9,
        gt=0.0,
        lt=1.0,
        description="A latency quantile guardrail (deploy.gate.sequential_quantile): each arm's quantile per 10 s "
        "bucket, read from the latency histogram ingest keeps per version and bucket, and the paired per-bucket "
        "differences tested by batch means, within latency_quantile_tolerance of stable's pre-rollout quantile. A mean "
        "hides a slow tail; this does not. None: off.",
    )
    latency_quantile_tolerance: float = Field(
        default=0.25,
        ge=0.0,
        description="The latency quantile guardrail's tolerance, a share of stable's quantile before the rollout "
        "(fixed at the start): shown slower by more than it aborts; with latency_quantile_guardrail 'non_inferior', "
        "shown within it before a promotion.",
    )
    latency_quantile_guardrail: Literal["non_inferior", "harm"] = Field(
        default="harm",
        description="'harm': the latency quantile only stops a canary it shows slower by more than its tolerance, and "
        "a promotion does not wait for it: the mean latency's guardrail is the one a promotion waits for, and the "
        "quantile's job is the slow tail a mean hides (in `liverl bench canary --stats`, 12% of requests 3 times "
        "slower: shown worse by the p90 in 76-77% of canaries, by the mean in 6-7%). 'non_inferior': a promotion also "
        "waits until it is shown within the tolerance.",
    )
    canary_unit: Literal["user", "request"] = Field(
        default="user",
        description="The canary's unit of randomisation and of analysis. 'user': each user (the "
        "request's stickiness key, deploy.gate.sequential) stays on one arm for the whole rollout and the test treats "
        "the user as the unit (delta-method variance of per-user sums, CUPED); 'request': each request is drawn into "
        "an arm afresh and the test treats each judged event as the unit.",
    )
    revert_horizon_s: float = Field(
        default=60.0,
        ge=0.0,
        description="How long after its judgement a generation can still be reverted (the "
        "product's follow-up window). The canary counts a generation only once this much time has passed since its "
        "judgement, so every metric that involves reverts (kept acceptance, the revert rate) is censored fairly.",
    )
    cuped: bool = Field(
        default=True,
        description="Variance reduction (CUPED, Deng et al. 2013) with each user's kept acceptance "
        "under stable in the cuped_lookback_s before the rollout as the covariate.",
    )
    cuped_guardrails: bool = Field(
        default=True,
        description="With cuped, the same variance reduction on the user-unit guardrails (edit rate, revert rate, "
        "response length), each with the user's own rate of that metric over cuped_lookback_s as its covariate.",
    )
    cuped_lookback_s: float = Field(
        default=1800.0, ge=0.0, description="The pre-rollout window CUPED reads each user's covariate from."
    )
    srm_alpha: float = Field(
        default=0.001,
        gt=0,
        lt=1,
        description="Sample-ratio mismatch: a canary whose arms' user or event counts are "
        "shown (always-valid test at this level) not to match the configured share stops with reason 'srm': the "
        "assignment or the logging is broken, and no metric of it can be trusted.",
    )
    integrity_only: bool = Field(
        default=False,
        description="Judge candidates on integrity alone (the delta yields its checksum) and promote "
        "every one that passes at once: no drift, collapse, suite or off-policy check, no canary. For comparison runs "
        "that show what the evidence is worth (liverl demo --integrity-only); never in production.",
    )
    metrics_port: int = Field(
        default=6067,
        ge=0,
        description="Port of the gate's Prometheus /metrics (liverl_gate_*) on serving.host; 0: off.",
    )
