"""The learner and the gate open sealed samples (``core.shred``) only with a fresh look-up of their users' keys: a
sample of a user forgotten after ingest joined it is refused ``forgotten`` right before its step (in the ledger, so
every sample is trained or refused exactly once), and the gate's held-out tail drops it."""

from __future__ import annotations

import time

import pytest

from core.config import load_config
from core.schemas import SamplingParams, TrainingSample
from core.shred import UserKeys, seal
from deploy.gate.tail import GenerationTail, parse_heldout
from deploy.registry.regdb import RegistryDB
from learner.admission import Admission
from learner.checkpoint import LearnerState
from learner.ledger import Ledger
from learner.seen import SeenIds

A, B = "a1a1a1a1a1a1a1a1", "b2b2b2b2b2b2b2b2"
KEK = bytes(range(32))


class _Trainer:
    def refusal(self, s: TrainingSample) -> str | None:
        assert s.sealed is None and s.prompt_token_ids  # it only ever sees opened samples
        return None


def sample(keys: UserKeys, unit: str | None, n: int) -> TrainingSample:
    text = {"prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5], "routed_experts": None, "edited_text": None}
    if unit:
        fields = {"sealed": seal(keys.key_for(unit), unit, text), "unit": unit, "prompt_token_ids": []}
        fields["completion_token_ids"] = []
    else:
        fields = {**text, "unit": None}
    return TrainingSample(
        sample_id=f"g{n}",
        generation_id=f"g{n}",
        feedback_id=f"f{n}",
        policy_version=0,
        kind="accept",
        reward=1.0,
        behaviour_logprobs=[-0.5, -0.5],
        sampling=SamplingParams(temperature=1.0, max_tokens=8),
        ts_generation=time.time(),
        ts_feedback=time.time(),
        ts_joined=time.time(),
        **fields,
    )


@pytest.fixture
def keys(tmp_path):
    db = RegistryDB(f"sqlite:///{tmp_path / 'registry.db'}")
    k = UserKeys(db, KEK)
    yield k
    k.close()
    db.close()


def test_a_sample_joined_before_its_user_is_forgotten_is_refused_before_its_step(keys, tmp_path):
    lcfg = load_config(env={}, learner__batch_size=3, learner__max_backlog_s=0).learner
    ledger = Ledger(tmp_path / "ledger.jsonl", max_bytes=1 << 20)
    state = LearnerState()
    adm = Admission(lcfg, "t.samples", state, _Trainer(), ledger, SeenIds(tmp_path / "seen.db", 3600.0))
    adm.user_keys = keys
    records = [sample(keys, A, 0), sample(keys, B, 1), sample(keys, None, 2)]
    for off, s in enumerate(records):
        adm.queue.append((0, off, s.to_bytes(), (time.time(), time.time())))
    adm.classify()
    assert [s.prompt_token_ids for _, _, s in adm.pending] == [[1, 2, 3]] * 3  # opened in memory
    assert keys.destroy(A)  # A is forgotten after the join, before the step
    batch, gone = adm.still_known(adm.take_batch())
    assert [s.unit for _, _, s in batch] == [B, None] and [(p, o, s.unit) for p, o, s in gone] == [(0, 0, A)]
    assert state.counters["dropped:forgotten"] == 1
    adm.advance(batch + gone)
    assert state.offsets[0] == 3
    ledger.flush(1)
    assert [line["refused"] for line in Ledger.read(tmp_path / "ledger.jsonl")] == [[[0, 0, "g0", "forgotten"]]]

    late = sample(keys, B, 3)  # admitted after the forget: refused on reading
    keys.destroy(B)
    adm.queue.append((0, 3, late.to_bytes(), (time.time(), time.time())))
    adm.classify()
    assert not adm.pending and state.counters["dropped:forgotten"] == 2


def test_the_gates_held_out_tail_opens_at_each_read_and_drops_a_forgotten_users_samples(keys):
    tail = GenerationTail("127.0.0.1:1", "t.heldout", 10, parse=parse_heldout, keys=keys)  # (never started)
    for n, unit in enumerate((A, B, None)):
        tail._add(sample(keys, unit, n).to_bytes())
    assert all(h.sealed is None and h.prompt_ids == (1, 2, 3) for h in tail())
    assert all(h.sealed is not None for h in tail._recent if h.unit)  # kept sealed between reads
    keys.destroy(A)
    assert [h.unit for h in tail()] == [B, None] and tail.forgotten == 1
    assert [h.unit for h in tail._recent] == [B, None]
