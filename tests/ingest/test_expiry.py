"""When early feedback gives up on its generation: after the TTL, but not while generations lag behind."""

from __future__ import annotations

from types import SimpleNamespace

from ingest.app import PENDING_HARD_LIMIT_X, Ingest

TTL = 60.0


def _ingest(clock: dict[int, float], seen: dict[int, float], started: float = 0.0):
    return SimpleNamespace(_gen_clock=clock, _gen_seen=seen, _started=started)


def _pending(t: float, kts: float, partition: int = 0) -> dict:
    return {"t": t, "kts": kts, "f": "fid", "raw": "{}", "src": ["x.feedback", partition, 7, "gid"]}


def test_not_before_the_ttl():
    ing = _ingest({0: 10_000.0}, {0: 0.0})
    assert not Ingest._expired(ing, _pending(t=1000.0, kts=1000.0), now=1000.0 + TTL - 1, ttl=TTL)


def test_after_the_ttl_when_generations_have_moved_past_the_feedback():
    ing = _ingest({0: 1000.0 + TTL}, {0: 1000.0 + TTL})
    assert Ingest._expired(ing, _pending(t=1000.0, kts=1000.0), now=1000.0 + TTL, ttl=TTL)


def test_after_the_ttl_when_the_generations_partition_is_quiet():
    ing = _ingest({}, {0: 900.0})  # nothing newer arrived: caught up, the generation is not coming
    assert Ingest._expired(ing, _pending(t=1000.0, kts=1000.0), now=1000.0 + TTL, ttl=TTL)


def test_not_while_the_generations_partition_lags_behind_the_feedback():
    now = 1000.0 + 5 * TTL
    # Generations keep arriving (a backlog) but their timestamps are still behind the feedback's.
    ing = _ingest({0: 1000.0 + TTL / 2}, {0: now - 0.1})
    assert not Ingest._expired(ing, _pending(t=1000.0, kts=1000.0), now=now, ttl=TTL)
    # The other partition being current does not matter: the generation is co-partitioned with its feedback.
    ing = _ingest({0: 1000.0 + TTL / 2, 1: now}, {0: now - 0.1, 1: now})
    assert not Ingest._expired(ing, _pending(t=1000.0, kts=1000.0), now=now, ttl=TTL)


def test_hard_limit_bounds_memory_even_when_lagging():
    limit = max(PENDING_HARD_LIMIT_X * TTL, 600.0)
    ing = _ingest({0: 0.0}, {0: 1000.0 + limit})
    assert Ingest._expired(ing, _pending(t=1000.0, kts=1000.0), now=1000.0 + limit, ttl=TTL)
