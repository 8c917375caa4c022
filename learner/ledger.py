"""The learner's ledger: every sample record it consumed, trained at a step or refused with a reason.

Torch-free, so ``liverl audit`` reads it without loading the learner.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from liverl.core.config import LiverlConfig

log = logging.getLogger("liverl.learner")


def checkpoint_path_for(cfg: LiverlConfig) -> Path:
    """Where the learner of this deployment keeps its checkpoint (one learner per topic prefix)."""
    return cfg.state_path / "learner" / f"{cfg.topics.prefix}.ckpt"


def ledger_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.stem + ".ledger.jsonl")


class Ledger:
    """The learner's account of every sample record it consumed: trained at a step, or refused with a reason.

    An append-only JSON-lines file beside the checkpoint, one line per update (``trained``: partition, offset,
    sample id) or per checkpoint's worth of refusals (``refused``: partition, offset, sample id or null, reason).
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
        return bool(self._buf)

    def trained(self, step: int, records: list[tuple[int, int, str]]) -> None:
        self._buf.append({"step": step, "trained": records})

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
