"""The sampler/trainer mismatch bound (``deploy.gate.mismatch``, ``gate.max_logprob_mismatch``): the registry keeps
what the learner adds per version, and a version whose served log-probs the learner does not reproduce is refused
with a reason that says so, under the routing the learner trains with, once enough tokens are measured."""

from __future__ import annotations

import pytest

from core.config import load_config
from deploy.gate import mismatch
from deploy.registry.blobstore import LocalBlobStore
from deploy.registry.registry import Registry
from tests.deploy.conftest import perturb, tiny_model


@pytest.fixture
def reg(tmp_path):
    r = Registry(f"sqlite:///{tmp_path / 'reg.db'}", LocalBlobStore(tmp_path / "blobs"))
    base = tiny_model()
    r.init_base(base, "/m")
    r.add_candidate(perturb(base, 0.05), parent=0)
    yield r
    r.close()


def test_the_registry_adds_each_versions_sums_and_leaves_out_unknown_versions(reg):
    assert reg.add_mismatch({1: {"own_tokens": 100, "own_abs": 2.0, "own_kl": 0.5}, 7: {"own_tokens": 3}}) == [1]
    reg.add_mismatch({1: {"own_tokens": 100, "own_abs": 4.0, "own_kl": 0.5, "replay_tokens": 50, "replay_abs": 0.5}})
    got = reg.mismatch()
    assert list(got) == [1]
    assert got[1]["own_tokens"] == 200 and got[1]["own_abs"] == pytest.approx(0.03)
    assert got[1]["own_kl"] == pytest.approx(0.005) and got[1]["replay_abs"] == pytest.approx(0.01)
    assert got[1]["replay_kl"] == 0.0
    with pytest.raises(ValueError, match="unknown fields"):
        reg.add_mismatch({1: {"status": 1}})


def test_a_version_past_the_bound_is_refused_with_its_reason_and_one_under_it_passes(reg, tmp_path):
    cfg = load_config(env={}, state_dir=str(tmp_path), gate__mismatch_min_tokens=100)
    bound = cfg.gate.max_logprob_mismatch
    assert mismatch.check(cfg, 1, None)[0]  # nothing served yet: not measured, passes
    reg.add_mismatch({1: {"own_tokens": 99, "own_abs": 99 * 5 * bound}})
    ok, _, why = mismatch.check(cfg, 1, reg.mismatch(1)[1])
    assert ok and "not measured" in why  # under gate.mismatch_min_tokens
    reg.add_mismatch({1: {"own_tokens": 1, "own_abs": 5 * bound}})
    ok, value, why = mismatch.check(cfg, 1, reg.mismatch(1)[1])
    assert not ok and value == pytest.approx(5 * bound)
    assert "gate.max_logprob_mismatch" in why and "own routing" in why and "v1" in why
    # the learner replays the server's routing, and with it the version's log-probs are reproduced: it passes
    reg.add_mismatch({1: {"replay_tokens": 100, "replay_abs": 100 * bound / 10}})
    replaying = load_config(env={}, state_dir=str(tmp_path), gate__mismatch_min_tokens=100,
                            learner__routing_replay="rollout")  # fmt: skip
    ok, value, why = mismatch.check(replaying, 1, reg.mismatch(1)[1])
    assert ok and value == pytest.approx(bound / 10) and "replay routing" in why
