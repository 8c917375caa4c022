"""The learner's ledger: every sample record it consumed, trained at a step or refused with a reason.

Torch-free, so ``liverl audit`` reads it without loading the learner.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from core.config import LiverlConfig

log = logging.getLogger("liverl.learner")


def checkpoint_path_for(cfg: LiverlConfig) -> Path:
    """Where the learner of this deployment keeps its checkpoint (one learner per topic prefix)."""
    return cfg.state_path / "learner" / f"{cfg.topics.prefix}.ckpt"


def ledger_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.stem + ".ledger.jsonl")


class Ledger:
    """The learner's account of every sample record it consumed: trained at a step, or refused with a reason.

    An append-only JSON-lines file beside the checkpoint, one line per update (``trained``: partition, offset,
    sample id; ``feedback``: each one's feedback id and time; ``units``: each one's user, ``core.fleet.unit_id``, or
    null; ``at``: the step's time), per checkpoint's worth of
    refusals (``refused``: partition, offset, sample id or null, reason), and one per fresh start or rebase
    (``rebase``: step, the version the weights restart from).
    Lines are buffered and written, fsynced, just before the checkpoint that makes them true, tagged with that
    checkpoint's ``seq``; on restart the lines past the loaded checkpoint's seq are cut off, so the ledger says
    exactly what the checkpointed weights were trained on. ``liverl audit`` reads it to prove that no sample was
    trained twice. Bounded: past ``max_bytes`` the file rolls over to ``<name>.1`` (one previous file is kept).
    """

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self._buf: list[dict] = []

    @property
    def buffered(self) -> bool:
        """Lines about samples wait to be written (a ``rebase`` line alone waits for the next checkpoint)."""
        return any("rebase" not in line for line in self._buf)

    def trained(
        self,
        step: int,
        records: list[tuple[int, int, str]],
        feedback: list[tuple[str, float]] | None = None,
        units: list[str | None] | None = None,
    ) -> None:
        """Step ``step`` trained ``records`` (partition, offset, sample id); ``feedback``: each record's feedback id
        and feedback time, in the same order (``liverl lineage``); ``units``: each record's user (its unit id, None
        without one), in the same order (``liverl forget``: which versions trained on a user). The line carries the
        step's time (``at``)."""
        line: dict = {"step": step, "at": round(time.time(), 3), "trained": records}
        if feedback is not None:
            line["feedback"] = feedback
        if units is not None:
            line["units"] = units
        self._buf.append(line)

    def rebased(self, step: int, onto: int) -> None:
        """From step ``step`` on, the weights start again from version ``onto`` (a fresh start or a rebase): what
        was trained in this lineage since the previous such line is in no later version (``liverl lineage``)."""
        self._buf.append({"rebase": {"step": step, "onto": onto, "at": round(time.time(), 3)}})

    def refused(self, partition: int, offset: int, sample_id: str | None, reason: str) -> None:
        if self._buf and "refused" in self._buf[-1]:
            self._buf[-1]["refused"].append((partition, offset, sample_id, reason))
        else:
            self._buf.append({"refused": [(partition, offset, sample_id, reason)]})

    def flush(self, seq: int) -> None:
        if not self._buf:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > self.max_bytes:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps({"seq": seq, **line}, separators=(",", ":")) + "\n" for line in self._buf))
            f.flush()
            os.fsync(f.fileno())
        self._buf.clear()

    def truncate_after(self, seq: int) -> None:
        """Drop the lines of checkpoints that never landed (seq > ``seq``), and anything still buffered."""
        self._buf.clear()
        if not self.path.exists():
            return
        keep, cut = [], 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    ok = json.loads(line)["seq"] <= seq
                except (ValueError, KeyError, TypeError):  # a line torn by the crash
                    ok = False
                if ok:
                    keep.append(line)
                else:
                    cut += 1
        if cut:
            log.info("learner: ledger: cut %d line(s) past checkpoint seq %d", cut, seq)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(keep), encoding="utf-8")
            os.replace(tmp, self.path)

    @staticmethod
    def read(path: Path) -> Iterator[dict]:
        """Every line of the ledger (the rolled-over file first), as dicts."""
        for p in (path.with_name(path.name + ".1"), path):
            if p.exists():
                with open(p, encoding="utf-8") as f:
                    for line in f:
                        if line.strip():
                            yield json.loads(line)
