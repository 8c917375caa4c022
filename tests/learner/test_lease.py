"""One learner per deployment: the lease in the real Redis enforces the singleton."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from core import keys
from learner.lease import LearnerLease, LeaseHeld


@pytest.fixture
def r(stack):
    client = redis.Redis.from_url(stack.redis_url)
    yield client
    client.close()


def test_a_second_learner_is_refused_naming_the_holder_and_takes_over_once_it_is_gone(r, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    a = LearnerLease(r, prefix, tmp_path / "a" / "x.lease", ttl_s=2.0)
    b = LearnerLease(r, prefix, tmp_path / "b" / "x.lease", ttl_s=2.0)
    a.acquire(wait_s=0)
    try:
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld, match=a.token):
            b.acquire(wait_s=0.6)
        assert time.monotonic() - t0 >= 0.5  # it waited for the holder first
        time.sleep(2.5)  # longer than the TTL: renewals keep it
        assert r.get(keys.learner_lease(prefix)).decode() == a.token and not a.lost.is_set()
    finally:
        a.release()
    b.acquire(wait_s=1)  # released: free at once
    b.release()
    assert r.get(keys.learner_lease(prefix)) is None


def test_a_restart_from_the_same_state_folder_takes_over_its_killed_predecessors_lease_at_once(r, tmp_path):
    prefix = f"t{uuid.uuid4().hex[:10]}"
    path = tmp_path / "learner" / "x.lease"
    dead = LearnerLease(r, prefix, path, ttl_s=30.0)
    dead.acquire(wait_s=0)
    dead._stop.set()  # killed: it renews nothing and releases nothing; its lease would live 30 s
    t0 = time.monotonic()
    again = LearnerLease(r, prefix, path, ttl_s=30.0)
    again.acquire(wait_s=0)
    assert time.monotonic() - t0 < 1.0
    assert r.get(keys.learner_lease(prefix)).decode() == again.token
    other = LearnerLease(r, prefix, tmp_path / "elsewhere" / "x.lease", ttl_s=30.0)
    with pytest.raises(LeaseHeld):
        other.acquire(wait_s=0)
    again.release()


def test_a_learner_whose_lease_was_taken_is_told_and_writes_nothing_more(r, tmp_path):
    from learner.trainer import Learner, LeaseLost

    prefix = f"t{uuid.uuid4().hex[:10]}"
    lease = LearnerLease(r, prefix, tmp_path / "x.lease", ttl_s=0.6)
    lease.acquire(wait_s=0)
    r.set(keys.learner_lease(prefix), "someone-else")
    assert lease.lost.wait(3.0)
    fake = Learner.__new__(Learner)  # only the fencing check, without a model or a broker
    fake.lease = lease
    for write in ("checkpoint", "offset commit", "candidate"):
        with pytest.raises(LeaseLost, match=write):
            fake._fenced(write)
    lease.release()
    assert r.get(keys.learner_lease(prefix)).decode() == "someone-else"  # not ours: left alone
