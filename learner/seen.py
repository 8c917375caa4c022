"""Every sample id the learner trained, durable: a replay is refused however late it comes.

Why not only the offsets: ingest is at-least-once, and a sample it emits again lands at a NEW offset, ahead of the
learner's watermark; the in-memory window of recent ids (``learner.dedupe_window``) forgets an id after that many
samples. This store does not: a SQLite table beside the checkpoint, one row per trained id, written in the same
order as the ledger (just before the checkpoint that makes the update durable, tagged with its seq) and cut back
to the loaded checkpoint's seq on restart, so it says exactly what the checkpointed weights were trained on.

Bounded by time, not by count: ids trained longer ago than ``learner.dedupe_horizon_h`` go (ingest cannot re-emit
a sample after it has forgotten the generation: its judged entries live 24 h). About 100 bytes per id:
1M samples a day for a week is under 1 GB.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path


def seen_path(checkpoint: Path) -> Path:
    return Path(checkpoint).with_name(Path(checkpoint).stem + ".trained-ids.sqlite")


class SeenIds:
    """The durable set of trained sample ids (rank 0's; torch-free)."""

    def __init__(self, path: Path, horizon_s: float):
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.path, self.horizon_s = Path(path), horizon_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS trained (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, ts REAL NOT NULL)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS trained_ts ON trained (ts)")
        self._db.execute("CREATE INDEX IF NOT EXISTS trained_seq ON trained (seq)")
        self._buf: list[tuple[str, float]] = []

    def __contains__(self, sample_id: str) -> bool:
        if any(sid == sample_id for sid, _ in self._buf):
            return True
        return self._db.execute("SELECT 1 FROM trained WHERE id = ?", (sample_id,)).fetchone() is not None

    def add(self, ids_ts: Iterable[tuple[str, float]]) -> None:
        """Trained in an update not yet checkpointed: held until ``flush``."""
        self._buf.extend(ids_ts)

    def flush(self, seq: int) -> None:
        """Make the held ids durable under checkpoint ``seq`` (before that checkpoint is written); drop old ones."""
        with self._tx():
            self._db.executemany(
                "INSERT OR REPLACE INTO trained (id, seq, ts) VALUES (?, ?, ?)",
                [(sid, seq, float(ts)) for sid, ts in self._buf],
            )
            self._db.execute("DELETE FROM trained WHERE ts < ?", (time.time() - self.horizon_s,))
        self._buf.clear()

    def truncate_after(self, seq: int) -> None:
        """Forget what checkpoints that never landed (seq > ``seq``) held, and anything still held."""
        self._buf.clear()
        with self._tx():
            self._db.execute("DELETE FROM trained WHERE seq > ?", (seq,))

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM trained").fetchone()[0]) + len(self._buf)

    def close(self) -> None:
        self._db.close()

    def _tx(self):
        db = self._db

        class _Tx:
            def __enter__(self):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, exc_type, *_):
                db.execute("ROLLBACK" if exc_type else "COMMIT")

        return _Tx()
