"""The demo's live progress display: a rich table on a terminal, a plain line every 10 s otherwise."""

from __future__ import annotations

import sys
import time

from rich.live import Live
from rich.table import Table

from core.config import LiverlConfig
from liverl.demo.report import feedback_sent, rate


class LiveView:
    """The live progress display: rich when on a terminal (or asked), plain lines every 10 s otherwise."""

    def __init__(self, cfg: LiverlConfig, live: bool):
        self.cfg = cfg
        self.live = live and sys.stdout.isatty()
        self._rich = None
        self._last_line = 0.0
        self._last = (time.time(), 0)
        self._rate = 0.0

    def __enter__(self):
        if self.live:
            self._rich = Live(refresh_per_second=2, transient=False)
            self._rich.__enter__()
        return self

    def __exit__(self, *exc):
        if self._rich is not None:
            self._rich.__exit__(*exc)

    def update(self, elapsed, stats, served, live, ingest, learner, registry, froze) -> None:
        now = time.time()
        sent = feedback_sent(stats)
        t_prev, n_prev = self._last
        if now - t_prev >= 2.0:
            self._rate = (sent - n_prev) / (now - t_prev)
            self._last = (now, sent)
        rows = []
        try:
            versions = registry.list()
        except Exception:  # noqa: BLE001 - a busy SQLite read only delays the display
            versions = []
        by_v = {v.version: v for v in versions}
        # the base, every version users have judged (latest few), and the newest candidate
        judged = sorted(v for v, c in live.items() if c.get("events"))
        shown = {0, *judged[-6:], *([max(by_v)] if by_v else []), *([served] if served is not None else [])}
        for v in sorted(shown):
            row = by_v.get(v)
            acc = rate(live.get(v))
            rows.append((v, row.status if row else "?", live.get(v, {}).get("events", 0), acc))
        if self._rich is not None:
            t = Table(
                title=f"liverl demo  {elapsed:5.0f}/{self.cfg.demo.duration_s:.0f} s"
                + ("  (learner frozen: measuring the last version)" if froze else "")
            )
            for col in ("version", "status", "live events", "live acceptance"):
                t.add_column(col, justify="right")
            for v, st, ev, acc in rows:
                mark = " <- served" if v == served else ""
                t.add_row(f"v{v}{mark}", st, str(ev), "-" if acc is None else f"{acc:.1%}")
            t.caption = (
                f"feedback {self._rate:6.1f}/s  sent {sent}  requests {stats.requests}  errors {stats.errors}  "
                f"samples out {ingest.get('samples_out', 0)}  trained {learner.get('samples_trained', 0)}  "
                f"step {learner.get('step', 0)}  dead letters "
                f"{sum(int(v) for k, v in ingest.items() if k.startswith('dlq:'))}"
            )
            self._rich.update(t)
        elif now - self._last_line >= 10.0:
            self._last_line = now
            acc = ", ".join(f"v{v}={'-' if a is None else f'{a:.0%}'}({ev})" for v, _, ev, a in rows)
            print(
                f"[{elapsed:4.0f}s] served v{served}  feedback {self._rate:.0f}/s (sent {sent})  "
                f"trained {learner.get('samples_trained', 0)}  live acceptance: {acc}",
                flush=True,
            )
