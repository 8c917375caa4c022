"""The learner: the policy-gradient update, its candidates, checkpoints and load shedding."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config.base import Section


class LearnerConfig(Section):
    lr: float = Field(
        default=1e-6,
        gt=0,
        description="AdamW learning rate. The default is for a real LLM fine-tuned by policy "
        "gradient (1e-6, as configs/production.example.toml); the demo's 0.25M-parameter policy trains at 3e-4 "
        "(liverl.demo.run.DEMO_PROFILE), a rate that moves a real model off its distribution within a few updates.",
    )
    batch_size: int = Field(default=64, ge=1, description="Samples per policy-gradient update.")
    micro_epochs: int = Field(default=1, ge=1, description="Passes over each batch.")
    tis_cap: float = Field(default=2.0, description="Truncated importance sampling cap C on pi/mu per token.")
    kl_coef: float = Field(default=0.05, description="Weight of the KL penalty to the anchor (learner.kl_reference).")
    entropy_floor: float = Field(
        default=0.1,
        ge=0,
        description="The learner's entropy floor (mean nats per completion token of its batch): under it, the loss "
        "pushes the entropy back up (learner.loss, weight entropy_coef); above it, nothing. It must be above "
        "gate.min_entropy (0.05 by default; the config refuses it otherwise), the floor under which the gate refuses "
        "a candidate as collapsed: in hour-long demo runs, lineages past ~85% kept acceptance fell under the gate's "
        "floor within minutes and every candidate was refused for minutes on end. 0: off.",
    )
    entropy_coef: float = Field(
        default=0.1,
        ge=0,
        description="Weight of the entropy floor's hinge in the loss (learner.entropy_floor). 0: off.",
    )
    floor_for_candidate: bool = Field(
        default=False,
        description="With learner.candidate_ema: hold the entropy floor for the averaged candidate, not for the "
        "weights of the last update. An average is sharper than the weights it averages (the demo's seventh hour: "
        "batches at the floor, 0.09-0.10 nats a token; candidates 0.058-0.073 on the same generations, the gate "
        "refusing under 0.05). At each candidate the learner measures both on its last batch (it always does and logs "
        "it) and, with this on, raises the floor of its next updates by their ratio (1-4x). Off by default: in the "
        "demo's loop (scripts/plateau_sim.py, 4 seeds) no candidate fell under the gate's floor either way, and it "
        "changed nothing beyond the seeds' spread (70 promotions against 71, final acceptance 0.915 against 0.924).",
    )
    fast_forward: bool = Field(
        default=True,
        description="Run Qwen3-MoE models through the learner's own forward (learner/fastpath.py) in one process: "
        "transformers' maths with fewer operator calls (the attention mask and rotary tables once per batch, no "
        "module machinery, the last layer only where the loss reads it). liverl bench learn, demo model: 1.71x the "
        "plain loop at batch 64 against 1.29x through transformers' forward. Other families and FSDP2-sharded "
        "weights always use transformers' forward. false: transformers' forward everywhere.",
    )
    compile: bool = Field(
        default=False,
        description="With learner.fast_forward: run that forward (and so its backward) under torch.compile, which "
        "fuses its elementwise chains into generated kernels. The first update compiles (measured: 1-2 minutes on a "
        "2-core machine; inductor caches the result on disk: later starts load it in 10-20 s); liverl bench learn "
        "--compile, demo model at batch 16: 1.55x the plain loop against 1.48x eager. Off by default: "
        "that stall falls on a learner that has just started, and every process that trains compiles once.",
    )
    routing_replay: Literal["rollout", "off"] = Field(
        default="off",
        description="MoE models: 'rollout' replays the experts the server's router chose (a sample's "
        "routed_experts, core.routing) in the learner's forward, the policy's and the KL reference's: each token's "
        "top-k experts are the server's, their gate weights the family's normalisation of the learner's router "
        "logits at those experts, so the router still learns through them (the R3 paper's Rollout Routing Replay). "
        "A hard top-k otherwise sends some tokens to other experts than the server's wherever the two kernels round "
        "differently, and their log-probs differ between sampler and trainer. A sample without routing trains on "
        "the learner's own (counted: routing_replay_missing). 'off': the learner's own routing always. Ignored for "
        "dense models; phimoe's routing (sparsemixer) is not replayed. Off by default: its effect on the demo's kept "
        "lift is not measured yet; serving.record_routing puts the routing on the records.",
    )
    mismatch_measure: Literal["both", "trained", "off"] = Field(
        default="both",
        description="Measure the sampler/trainer mismatch of each version on the samples trained on (mean "
        "|logp_learner - logp_behaviour| and the k3 KL estimate per token, learner.mismatch) and report it to the "
        "registry, where liverl versions, the on-call page and the gate (gate.max_logprob_mismatch) read it. "
        "'trained': from the forward the loss runs (no extra cost), under the routing it trains with; 'both': for an "
        "MoE model whose samples carry routing, also one no-grad forward under the other routing (the learner's own "
        "or the server's replayed), so both are known whatever learner.routing_replay is (liverl bench logprobs "
        "measures its cost); 'off': not measured. Under several ranks each rank measures its share and the leader "
        "reports its own (a sample of the batch).",
    )
    mismatch_report_s: float = Field(
        default=30.0,
        gt=0,
        description="How often the learner adds its mismatch measurements to the registry (and at each candidate).",
    )
    candidate_every_steps: int = Field(
        default=10, ge=1, description="Emit a candidate version every this many updates."
    )
    candidate_ema: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Emit as each candidate the exponential moving average of the learner's weights over its recent "
        "updates, with this decay per update (0.97: about the last 33 updates), not the weights of its last update; "
        "the learner itself trains on unaveraged. One iterate of a noisy policy gradient is a random draw around where "
        "the lineage stands: in the demo's learning loop (scripts/plateau_sim.py, 3 seeds of 2,900 updates) the "
        "suite refused 30 unaveraged candidates, 6.2 points of acceptance under stable on average, 21 of them within "
        "20 updates of a promotion, and runs of refusals of 500-625 s came at the plateau; averaged (0.9 or 0.97), no "
        "run passed 300 s and the last stable version was 3-6 points better. Costs one more fp32 copy of the weights "
        "(sharded like them) and is checkpointed with them. 0: off (the production default: a real model's rate, "
        "1e-6, moves an iterate far less; the demo sets 0.97).",
    )
    max_staleness: int = Field(
        default=8,
        ge=0,
        description="Drop samples whose policy is more than this many candidates' worth of updates "
        "(max_staleness x candidate_every_steps learner steps) behind the learner's weights.",
    )
    rebase_after_refusals: int = Field(
        default=5,
        ge=0,
        description="Rebase onto the stable version when the gate refused this many of the learner's "
        "newest candidates in a row on their evidence (drift, collapse, suite, off-policy, canary; supersessions do "
        "not count): a lineage the gate keeps refusing does not recover by training further. 0: never.",
    )
    lr_backoff: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="At each rebase after refused candidates (rebase_after_refusals), the learning rate is "
        "multiplied by this, down to min_lr_scale x lr; each promotion of a candidate divides it back, up to lr. "
        "The rebased lineage then moves in smaller steps, the ones the gate can accept (a 60-minute demo run: every "
        "rebased lineage at the full rate was refused again within minutes, on the product's suite or the entropy "
        "floor). 1: never back off.",
    )
    min_lr_scale: float = Field(
        default=0.125,
        gt=0,
        le=1,
        description="The lowest learning rate the back-off (lr_backoff) goes to, as a fraction of lr.",
    )
    max_backlog_s: float = Field(
        default=600.0,
        ge=0,
        description="Load shedding: a sample that ingest joined more than this long before the learner reaches it "
        "(its ts_joined, by ingest's clock: not the product's feedback time) is skipped (refused as 'shed': "
        "counted, in the ledger and `liverl audit`) so a learner that cannot keep up trains the newest feedback "
        "instead of falling further behind; it says so in its log. 0: never shed.",
    )
    max_batch_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="Train on a partial batch once its oldest sample has waited this long, so a "
        "lull in traffic does not hold samples back (and `liverl audit` sees them trained).",
    )
    max_batch_tokens: int = Field(
        default=65536,
        ge=1,
        description="Cap on a batch's padded size (samples x longest sequence): a batch is cut "
        "short rather than run out of memory on long contexts.",
    )
    checkpoint_every_steps: int = Field(
        default=1,
        ge=1,
        description="Checkpoint (weights, optimizer, offsets, ledger) every this many updates, or "
        "sooner (checkpoint_every_s, a candidate, a rebase, idle, a clean stop). Offsets are committed only with a "
        "checkpoint: a crash retrains the updates since the last one from the same weights. 1: after every update "
        "(the demo's model); raise it where a checkpoint costs more than an update (sharded models under torchrun).",
    )
    checkpoint_every_s: float = Field(
        default=60.0, gt=0, description="Checkpoint at least this often while training (see checkpoint_every_steps)."
    )
    dedupe_window: int = Field(
        default=100_000,
        ge=1,
        description="How many recently trained sample ids the learner keeps in memory (and "
        "checkpoints): a fast first check. Older ids are still refused as duplicates through the durable store "
        "(learner.dedupe_horizon_h), however late a replay comes.",
    )
    dedupe_horizon_h: float = Field(
        default=168.0,
        gt=0,
        description="How long the learner's durable store of trained sample ids "
        "(<prefix>.trained-ids.sqlite beside the checkpoint) keeps an id. Must exceed how long ingest can re-emit a "
        "sample (its judged entries live 24 h).",
    )
    ledger_max_mb: int = Field(
        default=256,
        ge=1,
        description="Size at which the learner's ledger (every sample's fate, for liverl audit) "
        "rolls over; one previous file is kept.",
    )
    lease_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="TTL of the learner's lease in Redis (one learner per deployment): a learner "
        "that stops renewing it (killed, cut off) is replaced after this; a restart from the same state folder takes "
        "it over at once.",
    )
    lease_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a starting learner waits for another holder of the lease to go "
        "before it gives up, naming the holder.",
    )
    kl_reference: Literal["stable", "base"] = Field(
        default="stable",
        description="KL anchor: 'stable' (the version being served, moved on each promotion) or 'base' (version 0).",
    )
    kl_estimator: Literal["full", "k3"] = Field(
        default="full",
        description="KL to the anchor (learner.kl_reference): 'full' (exact over the vocabulary, per position) or "
        "'k3' (sampled tokens).",
    )
