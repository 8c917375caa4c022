"""How the admin verbs' tables write a cell: an age, a size, a share, an acceptance."""

from __future__ import annotations

import time


def age(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def acceptance(c: dict[str, int] | None) -> str:
    if not c or not c.get("events"):
        return "-"
    return f"{c.get('accept', 0) / c['events']:.1%} of {c['events']}"
