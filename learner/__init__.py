"""learner: train the policy on live feedback, exactly once per sample, and offer its weights to the gate as candidates.

Read this page first; each module below holds one idea and says the rest.

Input: ``<prefix>.samples`` (ingest's ``TrainingSample``: the prompt and completion token ids, the log-probs the served
policy sampled them with, the version that served them, the reward, the feedback time). Outputs: candidate versions in
the registry (``deploy/registry/``, a delta from their parent), the checkpoint beside its ledger and its trained ids
in the state folder (``learner/<prefix>.ckpt``), the offsets committed to the group ``<prefix>.learner`` (for lag
tools), the live state in Redis (``<prefix>:learner``) and the ``liverl_learner_*`` metrics.

One batch's path through the loop (``trainer.Learner.run``), its micro-epochs included:

1. **assign**: every partition of the samples topic, read by this learner alone (its lease, ``lease``), each from
   where its checkpoint stands; no consumer group to join.
2. **poll**: records into the admission queue, in offset order per partition.
3. **admit** (``admission.Admission``): each record is accepted into the next batch or refused with a counted reason
   and a ledger line: not a sample, a duplicate, shed (the learner is behind), stale, or failing the trainer's checks.
4. **follow the registry** (``candidates.Candidates``): a rollback, a run of refusals by the gate or a fleet that
   stopped serving this lineage makes the learner rebase onto the stable weights; the KL reference may follow the
   stable version.
5. **update** (``policy_trainer.PolicyTrainer.train_step``): the reference's log-probs once, then ``micro_epochs``
   micro-epochs, each one pass over the batch (forward, ``loss``, backward, global grad-norm clip, AdamW); a failed
   one (non-finite loss or gradient, out of memory) puts the weights and the optimizer back and refuses the batch.
   Then the ledger's line, the trained ids and the watermark move past the batch.
6. **candidate** (``candidates``): every ``candidate_every_steps`` updates the weights (or their average) become a
   candidate in the registry, unless the hold flag is set.
7. **checkpoint, then commit** (``checkpoint``): after a candidate or a rebase, every ``checkpoint_every_steps``
   updates or ``checkpoint_every_s`` seconds, when idle with refusals to record, on a clean stop; then the offsets.
8. **publish**: the live state to Redis, read by ``liverl status`` and the on-call page.

The invariants, and why each holds across a kill -9:

- **Exactly-once training: the offsets live in the checkpoint.** The checkpoint holds the weights, the optimizer and
  the next offset per partition (an exact watermark: samples are taken in offset order, and everything below it was
  trained or refused, ``admission``). The ledger's lines and the trained ids are written, tagged with the
  checkpoint's seq, just before it; the Kafka offsets are committed just after it and only mirror it. Killed before
  the checkpoint, the restart loads the previous one, cuts the ledger and the trained ids back to its seq and seeks
  to its offsets: the updates since are trained again from the same weights, none twice in the lineage that goes on.
  Killed after it and before the commit, the committed offsets lag, but the restart seeks to the checkpoint's.
- **Exactly-once across replays: sample ids.** Ingest is at-least-once; a sample it emits again lands at a new
  offset, past the watermark. A sample id already trained (``seen``, durable, cut back with the ledger) or waiting in
  the batch is refused as a duplicate, however late it comes.
- **Staleness is counted in the learner's own updates.** A sample whose policy is more than ``max_staleness``
  candidates' worth of updates behind the weights it would train is refused as stale; the learner remembers the step
  at which its weights were each version (``checkpoint.LearnerState.version_steps``). Version numbers would mislead:
  the registry numbers every candidate, refused ones included. When nothing but stale samples comes for a while, the
  fleet has stopped serving this lineage and the learner rebases onto the stable version (``candidates``).
- **Off-policy correction.** Every sample carries the log-probs its behaviour policy sampled it with (vLLM, bf16,
  its own kernels, up to ``max_staleness`` candidates old). The update weighs each token by the truncated importance
  ratio against them and masks sequences too far off-policy to trust (``loss``: TIS and masked IS), with a KL penalty
  to a reference policy; staleness bounds how far off-policy a batch can be.
- **One learner.** A lease in Redis (``lease``): a learner that lost it writes no checkpoint, candidate or offset
  commit more (``trainer.LeaseLost``).

Under torchrun the policy is sharded with FSDP2 over the ranks (``dist``): rank 0 is the learner above and every other
rank follows its trainer calls (``ranks``); the checkpoint is a DCP folder committed by a rename.

Modules: ``trainer`` (the poll/commit loop, the process entry point ``run_learner``), ``admission`` (accept or refuse a
record, batches, the watermark, the backlog), ``candidates`` (candidates, rebases, the learning-rate back-off, the KL
reference), ``checkpoint`` (the learner's state, its save and restore), ``policy_trainer`` (weights, optimizer,
baseline, one update; no I/O), ``batch`` (a sample's input check, packing, collation), ``forward`` (which forward a
model runs through, and the completion tokens' log-probs under it), ``average`` (the candidates' weight average),
``loss`` (the estimator), ``fastpath`` (the learner's own forward for Qwen3-MoE), ``model`` (a model folder in and out
of transformers), ``families`` (weight names per architecture), ``dist`` (process group, FSDP2, DCP), ``ranks`` (rank 0
leads, the others follow), ``dist_check`` (the update over N ranks on generated samples), ``ledger`` (every record's
fate), ``seen`` (every trained id), ``lease`` (one learner per deployment), ``metrics`` (Prometheus), ``evaluate`` (the
gate's questions, answered with this package's model code).
"""
