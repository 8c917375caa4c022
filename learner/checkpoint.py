"""The learner's checkpoint: the source of truth for what it trained, read once at start, written after updates.

One checkpoint holds the fp32 weights and the optimizer (the trainer's part) and a ``LearnerState``: the step, the
next offset per partition of the samples topic, the recent trained sample ids, the last emitted version, the
versions' steps, the learning-rate back-off and the counters. In one process it is one file, written to a temp file,
fsynced, moved over the old one with ``os.replace`` and its folder fsynced; under torchrun it is a DCP folder that
every rank writes its shards of and rank 0 commits by a rename, with this state as its ``learner.json``
(``learner.dist``, ``learner.ranks``).

A save writes, in this order (``Checkpoints.save``):

1. the trained ids of the updates since the last checkpoint (``learner.seen``), tagged with the new ``seq``;
2. the ledger's buffered lines (``learner.ledger``), tagged with the same ``seq``;
3. the checkpoint, which carries that ``seq``.

A kill -9 before 3 leaves ids and ledger lines whose seq no checkpoint reached: the restart cuts both back to the
loaded checkpoint's seq (``Checkpoints.restore``), so they say exactly what the checkpointed weights were trained on.
A kill -9 during 3 leaves the previous checkpoint whole (the rename is atomic). The learner commits its Kafka offsets
only after 3, so the committed offsets never run ahead of the checkpoint; on restart it seeks to the checkpoint's
offsets, not the committed ones.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from core.config import LearnerConfig
from learner.dist import CheckpointDir
from learner.ledger import Ledger
from learner.seen import SeenIds

log = logging.getLogger("liverl.learner")

CHECKPOINT_FORMAT = 1
VERSION_STEPS_KEPT = 512  # versions whose learner step the checkpoint remembers


@dataclasses.dataclass
class LearnerState:
    """What the checkpoint holds of the learner besides the trainer's weights and optimizer. One object, shared by the
    loop (``learner.trainer``), its admission policy (``learner.admission``) and its candidate policy
    (``learner.candidates``); a restore fills it in place."""

    step: int = 0  # updates made
    seq: int = 0  # checkpoints written; the ledger's and the seen ids' lines carry the seq that made them durable
    offsets: dict[int, int] = dataclasses.field(default_factory=dict)  # durable watermark: next offset per partition
    trained_ids: dict[str, None] = dataclasses.field(default_factory=dict)  # the last ``dedupe_window``, oldest first
    last_emitted: int = 0  # the version these weights descend from: the last candidate, or the stable rebased onto
    last_candidate: int | None = None  # the last candidate this learner registered
    counters: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    since_candidate: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"reward_sum": 0.0, "samples": 0.0, "steps": 0.0, "loss_sum": 0.0}
    )  # the updates since the last candidate: its metrics
    rollback_seen: int | None = None  # audit id of the last rollback this learner rebased for
    version_steps: dict[int, int] = dataclasses.field(default_factory=dict)  # version -> step the weights were it
    lr_scale_since: float = 0.0  # when the learning rate last backed off or recovered (wall clock)


class Checkpoints:
    """Save and restore a ``LearnerState`` with the trainer's weights and optimizer (see the module doc)."""

    def __init__(
        self,
        path: Path,
        topic: str,
        lcfg: LearnerConfig,
        trainer,
        ledger: Ledger,
        seen: SeenIds,
        ckpts: CheckpointDir | None = None,
    ):
        self.path, self.topic, self.lcfg = Path(path), topic, lcfg
        self.trainer, self.ledger, self.seen, self.ckpts = trainer, ledger, seen, ckpts
        self.saved_step, self.saved_at = 0, time.monotonic()  # the last checkpoint's step and time

    def exists(self) -> bool:
        return self.ckpts.latest() is not None if self.ckpts is not None else self.path.exists()

    def due(self, step: int) -> bool:
        """``checkpoint_every_steps`` updates or ``checkpoint_every_s`` seconds since the last checkpoint."""
        return (
            step - self.saved_step >= self.lcfg.checkpoint_every_steps
            or time.monotonic() - self.saved_at >= self.lcfg.checkpoint_every_s
        )

    def save(self, state: LearnerState) -> None:
        """The seen ids and the ledger's lines first (tagged with the new seq), then the checkpoint."""
        state.seq += 1
        self.seen.flush(state.seq)
        self.ledger.flush(state.seq)
        self.saved_step, self.saved_at = state.step, time.monotonic()
        st = dict(
            format=CHECKPOINT_FORMAT,
            step=state.step,
            offsets=dict(state.offsets),
            seq=state.seq,
            # one JSON string, not a list: torch.save pickles a list item by item through a Python callback
            # (scripts/ckpt_bench.py, 100K ids, the demo model: save 49 -> 15 ms, load 204 -> 10 ms, a quiet machine)
            trained_ids=json.dumps(list(state.trained_ids)),
            last_emitted=state.last_emitted,
            last_candidate=state.last_candidate,
            counters=dict(state.counters),
            since_candidate=dict(state.since_candidate),
            topic=self.topic,
            rollback_seen=state.rollback_seen,
            version_steps=dict(sorted(state.version_steps.items())[-VERSION_STEPS_KEPT:]),
            lr_scale=self.trainer.lr_scale,
            lr_scale_since=state.lr_scale_since,
            floor_lift=self.trainer.floor_lift,
        )
        if self.ckpts is not None:  # every rank writes its shards; rank 0 adds this state as learner.json
            self.trainer.save_checkpoint(state.step, dict(st, baseline=self.trainer.baseline.state_dict()))
            return
        st.update(self.trainer.state())
        self._write(st)

    def _write(self, st: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            torch.save(st, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def restore(self, state: LearnerState) -> bool:
        """Fill ``state``, the weights and the optimizer from the checkpoint, and cut the ledger and the seen ids back
        to its seq. False when there is none: then both are cut back to nothing (a run whose first checkpoint never
        landed) and ``state`` is left as it is."""
        if not self.exists():
            self.ledger.truncate_after(0)
            self.seen.truncate_after(0)
            return False
        if self.ckpts is not None:
            st = self.trainer.load_checkpoint()
            self.trainer.baseline.load_state_dict(st["baseline"])
        else:
            st = torch.load(self.path, map_location="cpu", weights_only=True)
        if st.get("format") != CHECKPOINT_FORMAT or st.get("topic") != self.topic:
            raise ValueError(
                f"checkpoint {self.path} is format {st.get('format')} for topic {st.get('topic')!r}; "
                f"expected format {CHECKPOINT_FORMAT} for {self.topic!r} (move it away to start fresh)"
            )
        if self.ckpts is None:
            self.trainer.load_state(st)
        state.step = self.saved_step = int(st["step"])
        state.offsets = {int(p): int(o) for p, o in st["offsets"].items()}
        state.seq = int(st.get("seq", 0))
        self.ledger.truncate_after(state.seq)
        self.seen.truncate_after(state.seq)
        ids = st["trained_ids"]
        ids = json.loads(ids) if isinstance(ids, str) else ids  # a list of ids is read as well
        state.trained_ids = dict.fromkeys(ids[-self.lcfg.dedupe_window :])
        state.last_emitted = int(st["last_emitted"])
        state.last_candidate = st["last_candidate"]
        state.counters = collections.Counter(st["counters"])
        state.since_candidate = dict(st["since_candidate"])
        state.rollback_seen = st.get("rollback_seen")
        state.version_steps = {int(v): int(n) for v, n in (st.get("version_steps") or {}).items()}
        self.trainer.set_lr_scale(float(st.get("lr_scale", 1.0)))
        state.lr_scale_since = float(st.get("lr_scale_since", 0.0))
        if self.lcfg.floor_for_candidate:  # off: the configured floor, whatever the checkpoint measured
            self.trainer.floor_lift = float(st.get("floor_lift", 1.0))
        log.info(
            "learner: resumed from %s at step %d, %d samples trained, offsets %s, last emitted v%d",
            self.path,
            state.step,
            len(state.trained_ids),
            state.offsets,
            state.last_emitted,
        )
        return True
