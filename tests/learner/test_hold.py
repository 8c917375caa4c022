"""An operator's hold on the learner's candidates stands on the audit log, not on the Redis flag alone: deleting the
flag does not let candidates flow again; the operator's audited release does."""

from __future__ import annotations

from core import keys
from learner.candidates import Candidates
from liverl.ops.admin import cmd_hold, open_registry
from liverl.stack.supervisor import ensure_keys
from tests.deploy.conftest import tiny_model


def test_a_hold_is_lifted_by_an_audited_release_and_not_by_deleting_the_flag(cfg, rds):
    ensure_keys(cfg)
    reg = open_registry(cfg)
    try:
        reg.init_base(tiny_model(), "/m")
        token = reg.add_operator("alice", "operator", by="test", reason="set-up")
        learner = Candidates(cfg, None, None, reg, rds, None, None)
        assert not learner.frozen()

        assert cmd_hold(cfg, hold=True, reason="looking at the reverts", token=token) == 0
        assert learner.frozen() and reg.held().actor == "alice"
        rds.delete(keys.learner_hold(cfg.topics.prefix))  # whoever can write Redis lifts the flag
        assert learner.frozen()  # the audited hold stands

        assert cmd_hold(cfg, hold=False, reason="reverts are fine", token=token) == 0
        assert not learner.frozen() and reg.held() is None
        rds.set(keys.learner_hold(cfg.topics.prefix), "1")  # the flag alone still holds (a demo, a chaos run)
        assert learner.frozen()
    finally:
        reg.close()
