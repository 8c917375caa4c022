"""``liverl versions``' second table: each version's sampler/trainer mismatch, as the learner measured it."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def mismatch_table(reg: Any, versions: list[int]) -> Table | None:
    """Each listed version's sampler/trainer mismatch as the learner measured it on the generations it served
    (``Registry.mismatch``): tokens, mean |Δ logp| and KL (k3) per token, own routing and replayed; None when no
    version has one."""
    measured = reg.mismatch()
    rows = [(v, measured[v]) for v in versions if v in measured]
    if not rows:
        return None
    t = Table(title="sampler/trainer mismatch per version (learner vs served log-probs, per token)")
    for col in ("version", "tokens own", "|Δlogp| own", "KL own", "tokens replayed", "|Δlogp| replayed", "KL replayed"):
        t.add_column(col, justify="right")

    def num(x):
        return "-" if x is None else f"{x:.4f}"

    for v, m in rows:
        t.add_row(
            f"v{v}",
            f"{m['own_tokens']:,}",
            num(m["own_abs"]),
            num(m["own_kl"]),
            f"{m['replay_tokens']:,}",
            num(m["replay_abs"]),
            num(m["replay_kl"]),
        )
    return t
