"""What the canary benches share: an exact binomial bound on a rate over simulated canaries, and their lists of
populations or activities on the command line."""

from __future__ import annotations

import math


def binomial_upper(k: int, n: int, level: float = 0.95) -> float:
    """Exact (Clopper-Pearson) one-sided upper confidence bound of a binomial rate, ``k`` of ``n``."""
    if k >= n:
        return 1.0

    def cdf(p: float) -> float:  # P(X <= k)
        logs = [
            math.lgamma(n + 1)
            - math.lgamma(i + 1)
            - math.lgamma(n - i + 1)
            + i * math.log(p)
            + (n - i) * math.log1p(-p)
            for i in range(k + 1)
        ]
        top = max(logs)
        return math.exp(top) * sum(math.exp(v - top) for v in logs)

    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 1 - level else (lo, mid)
    return hi


def split_list(text: str) -> list[str]:
    """``segments,beta(2,2)`` -> ['segments', 'beta(2,2)']: commas inside parentheses belong to the Beta."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [p for p in (*out, cur.strip()) if p]
