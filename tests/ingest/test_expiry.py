"""When early feedback gives up on its generation: after the TTL, but not while generations lag behind, and not
because this worker was down or stalled."""

from __future__ import annotations

from ingest.pending import PENDING_HARD_LIMIT_X, PendingIndex

TTL = 150.0


def _ingest(clock: dict[int, float], gen_next: dict[int, int] | None = None, resumed: float = 0.0) -> PendingIndex:
    index = PendingIndex()
    index.clock.update(clock)
    index.next_offset.update(gen_next or {})
    index.resumed = resumed
    return index


def test_not_before_the_ttl():
    ing = _ingest({0: 10_000.0})
    assert ing.waited(t=1000.0, kts=1000.0, part=0, now=1000.0 + TTL - 1, ttl=TTL) is None


def test_after_the_ttl_when_generations_have_moved_past_the_feedback():
    ing = _ingest({0: 1000.0 + TTL})
    assert ing.waited(t=1000.0, kts=1000.0, part=0, now=1000.0 + TTL, ttl=TTL) == "clock"


def test_otherwise_only_once_the_generations_partition_is_read_to_its_end():
    ing = _ingest({0: 1000.0 + TTL / 2}, gen_next={0: 41})
    assert ing.waited(t=1000.0, kts=1000.0, part=0, now=1000.0 + 5 * TTL, ttl=TTL) == "caught_up"
    assert not ing.caught_up(0, {0: 42})  # one generation record not read yet: keep waiting
    assert not ing.caught_up(0, {})  # the worker could not read the partition's end: keep waiting
    ing = _ingest({0: 1000.0 + TTL / 2}, gen_next={0: 42})
    assert ing.caught_up(0, {0: 42})


def test_a_restart_or_stall_gives_waiting_feedback_a_whole_ttl_again():
    # Pending since t=1000; this worker resumed at 1100 (a restart): the TTL counts from 1100.
    ing = _ingest({}, resumed=1100.0)
    assert ing.waited(t=1000.0, kts=1000.0, part=0, now=1000.0 + TTL + 50, ttl=TTL) is None
    assert ing.waited(t=1000.0, kts=1000.0, part=0, now=1100.0 + TTL, ttl=TTL) == "caught_up"


def test_hard_limit_bounds_memory_even_when_lagging():
    limit = max(PENDING_HARD_LIMIT_X * TTL, 600.0)
    ing = _ingest({0: 0.0})
    assert ing.waited(t=1000.0, kts=1000.0, part=0, now=1000.0 + limit, ttl=TTL) == "hard"
