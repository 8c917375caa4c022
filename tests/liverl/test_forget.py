"""``liverl forget``: a user's key and per-user sums go, the report names exactly the versions whose ledger lines hold
their samples, other users are untouched, and an erasure killed with SIGKILL at any step is finished by ``--resume``.

The deployment is a real registry (SQLite in the test's state dir, migrated as every process migrates it), the real
``core.shred.UserKeys``, the session's Redis and a ledger written by the real ``learner.ledger.Ledger``:

    step 1 trains bob        -> v1 (promoted)
    step 2 trains alice      -> v2 (promoted: stable)
    step 3 trains carol      -> v3 (candidate)
    rebase onto v1 at step 3; step 4 trains dave -> v4 (candidate): v1's content and step 4, not alice

so alice is in v2 and v3 (not v1, not v4), and the offer for her is v1.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from core import erasures, fleet, keys
from learner.ledger import Ledger, checkpoint_path_for, ledger_path
from liverl.ops.admin import cmd_operator, open_registry
from liverl.ops.forget import Runner, user_sums
from liverl.ops.forget_cmd import cmd_forget, cmd_report, cmd_status, user_keys
from tests.deploy.conftest import perturb, tiny_model

USERS = ("alice", "bob", "carol", "dave")
BUCKETS = (1000, 1001, 1002)


def unit(user: str) -> str:
    u = fleet.unit_id(user)
    assert u is not None
    return u


def _quiet(fn, *args, **kw) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = fn(*args, **kw)
    return rc, buf.getvalue()


@pytest.fixture
def token(cfg):
    from core.shred import ensure_kek
    from liverl.stack.supervisor import ensure_keys

    ensure_keys(cfg)  # the audit key and the announcement pair, as `liverl up` makes them
    ensure_kek(cfg)
    rc, out = _quiet(cmd_operator, cfg, "add", "root", "admin", "test set-up", None)
    assert rc == 0
    return re.search(r"(lvr_\S+)", out).group(1)


@pytest.fixture
def deployment(cfg, rds, token):
    """The registry and ledger of the module docstring, a data key per user, and per-user sums for each user on v1
    and v2 in three buckets."""
    reg = open_registry(cfg)
    base = tiny_model()
    reg.init_base(base, "m")
    led = Ledger(ledger_path(checkpoint_path_for(cfg)), max_bytes=1 << 20)
    led.rebased(0, 0)

    def train(step: int, user: str) -> None:
        led.trained(step, [(0, step, f"g-{user}-{step}")], feedback=[(f"f-{user}", 1.0)], units=[unit(user)])
        led.flush(seq=step)

    def cand(step: int, seed: int, parent: int) -> int:
        return int(reg.add_candidate(perturb(base, 0.05, seed=seed), parent=parent, learner_step=step).version)

    train(1, "bob")
    v1 = cand(1, 1, 0)
    reg.promote(v1, actor="gate", reason="passed")
    train(2, "alice")
    v2 = cand(2, 2, v1)
    reg.promote(v2, actor="gate", reason="passed")
    train(3, "carol")
    v3 = cand(3, 3, v2)
    led.rebased(3, v1)
    led.flush(seq=4)
    train(4, "dave")
    v4 = cand(4, 4, v2)
    assert (v1, v2, v3, v4) == (1, 2, 3, 4)
    ks = user_keys(cfg, reg)
    for u in USERS:
        ks.key_for(unit(u))
    p = cfg.topics.prefix
    for v in (1, 2):
        for b in BUCKETS:
            fields = {f"{unit(u)}|{f}": 1 for u in USERS for f in ("e", "a", "t")}
            fields.update({"*|e": 4, "*|a": 4, "*|h3": 2})
            rds.hset(keys.units(p, v, b), mapping=fields)
    reg.close()
    return cfg


def _sums(rds, cfg) -> dict[str, dict[str, str]]:
    return {k: rds.hgetall(k) for k in rds.scan_iter(match=keys.units_pattern(cfg.topics.prefix), count=1000)}


def _erasures(cfg, user: str) -> list[erasures.Erasure]:
    reg = open_registry(cfg)
    try:
        with reg.engine.connect() as c:
            return erasures.of_unit(c, unit(user))
    finally:
        reg.close()


def _audit(cfg) -> list:
    reg = open_registry(cfg)
    try:
        return reg.audit()
    finally:
        reg.close()


def _known(cfg, user: str) -> bool:
    reg = open_registry(cfg)
    try:
        return user_keys(cfg, reg).known(unit(user))
    finally:
        reg.close()


def test_report_lists_exactly_the_versions_whose_ledger_holds_the_users_samples(deployment, capsys):
    cfg = deployment
    expect = {"alice": [2, 3], "bob": [1, 2, 3, 4], "carol": [3], "dave": [4], "erin": []}
    for user, versions in expect.items():
        assert cmd_report(cfg, user, as_json=True) == 0
        got = json.loads(capsys.readouterr().out)
        assert [v["version"] for v in got["versions"]] == versions, user
        assert got["unit"] == unit(user)
    assert cmd_report(cfg, "alice", as_json=True) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stable"] == 2 and got["stable_trained_on_them"] and got["offer"] == 1
    assert got["samples"] == 1 and got["steps"] == [2]
    assert not got["learner_holds"]  # the learner rebased onto v1, which never trained on her
    assert cmd_report(cfg, "bob", as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["learner_holds"]  # v1, its base now, trained on him
    assert cmd_report(cfg, "alice") == 0  # the table
    out = capsys.readouterr().out
    assert "v2" in out and "v3" in out and "v4" not in out.split("stable v2")[0]


def test_forget_destroys_the_key_and_sums_of_that_user_only_and_is_audited(deployment, rds, token):
    cfg = deployment
    before = _sums(rds, cfg)
    rc, out = _quiet(cmd_forget, cfg, "alice", "account deleted", token)
    assert rc == 0, out
    assert not _known(cfg, "alice")
    assert all(_known(cfg, u) for u in ("bob", "carol", "dave"))
    after = _sums(rds, cfg)
    assert set(after) == set(before)  # no key deleted: the aggregates and the other users stay
    a = unit("alice")
    for k, fields in before.items():
        assert after[k] == {f: n for f, n in fields.items() if not f.startswith(f"{a}|")}
    [e] = _erasures(cfg, "alice")
    assert e.state == "done" and e.source == "cli" and e.requested_by == "root"
    assert e.report["key"]["destroyed"] is True
    assert e.report["sums"]["fields"] == 3 * len(BUCKETS) * 2 and e.report["sums"]["keys_changed"] == 6
    assert [v["version"] for v in e.report["lineage"]["versions"]] == [2, 3]
    assert e.report["offer"]["offer"] == 1 and e.report["offer"]["policy"] == "report"
    stable = [x for x in _audit(cfg) if x.action in ("rollback", "promote")]
    assert stable[-1].version == 2  # policy report: nothing changed what is served
    actions = [(x.actor, x.action) for x in _audit(cfg) if x.action.startswith("forget")]
    assert actions == [("root", "forget"), ("root", "forget_done")]
    assert cmd_status(cfg, e.id, follow=True, timeout_s=5) == 0


def test_an_unknown_user_changes_nothing_and_the_attempt_is_audited(deployment, rds, token):
    cfg = deployment
    before = _sums(rds, cfg)
    rc, out = _quiet(cmd_forget, cfg, "nobody@example.com", "asked", token)
    assert rc == 0 and "unknown user" in out
    assert _sums(rds, cfg) == before
    assert _erasures(cfg, "nobody@example.com") == []
    assert all(_known(cfg, u) for u in USERS)
    [entry] = [x for x in _audit(cfg) if x.action.startswith("forget")]
    assert entry.action == "forget_nothing" and entry.actor == "root" and unit("nobody@example.com") in entry.reason


def test_a_second_forget_is_a_no_op_and_audited(deployment, rds, token):
    cfg = deployment
    assert _quiet(cmd_forget, cfg, "alice", "first", token)[0] == 0
    sums = _sums(rds, cfg)
    rc, out = _quiet(cmd_forget, cfg, "alice", "again", token)
    assert rc == 0 and "already forgotten" in out
    assert len(_erasures(cfg, "alice")) == 1 and _sums(rds, cfg) == sums
    assert [x.action for x in _audit(cfg) if x.action.startswith("forget")] == [
        "forget",
        "forget_done",
        "forget_nothing",
    ]


def test_forget_needs_an_operator_token_and_a_reason(deployment, capsys):
    cfg = deployment
    assert cmd_forget(cfg, "alice", "why", token=None) == 1
    assert cmd_forget(cfg, "alice", " ", token="x") == 1
    assert _known(cfg, "alice") and _erasures(cfg, "alice") == []


def test_policy_rollback_rolls_back_through_the_registry_and_leaves_the_announcement_to_the_gate(
    deployment, rds, token
):
    cfg = deployment
    cfg.forget.policy = "rollback"
    desired = rds.get(keys.desired(cfg.topics.prefix))
    assert _quiet(cmd_forget, cfg, "alice", "erase", token)[0] == 0
    reg = open_registry(cfg)
    try:
        assert reg.stable().version == 1
        assert reg.get(3).status == "rejected"  # a candidate holding her
        assert reg.get(4).status == "candidate"  # dave's lineage does not hold her
    finally:
        reg.close()
    [e] = _erasures(cfg, "alice")
    assert "rolled back from v2 to v1" in e.report["offer"]["actions"]
    assert rds.get(keys.desired(cfg.topics.prefix)) == desired  # the gate signs and announces it, not the verb


KILLER = """
import os, signal, sys
from core.config import load_config
import liverl.ops.forget as f
from core import fleet
from liverl.ops.admin import open_registry, open_redis
from liverl.ops.forget import user_keys
cfg = load_config(env={{}}, state_dir={state!r}, redis__url={redis!r}, topics__prefix={prefix!r},
                  forget__policy="rollback")
point = {point!r}
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
reg, r = open_registry(cfg), open_redis(cfg)
ks = user_keys(cfg, reg)
if point == "after_key":
    real = ks.destroy
    ks.destroy = lambda u: (real(u), die())
elif point == "mid_sums":
    real_sums = f.user_sums
    def half(redis, prefix, unit, count, delete=False):
        keys_ = sorted(redis.scan_iter(match=prefix + ":units:*"))[:2]
        for k in keys_:
            redis.hdel(k, *f._unit_fields(unit))
        die()
    f.user_sums = half
elif point == "after_rollback":
    real_rb = reg.rollback
    reg.rollback = lambda **kw: (real_rb(**kw), die())
run = f.Runner(cfg, reg, r, ks, "root")
e = run.request(fleet.unit_id("alice"), "root", "killed mid-way")
print(e.id, flush=True)
run.run(e)
sys.exit(3)
"""


@pytest.mark.parametrize("point", ["after_key", "mid_sums", "after_rollback"])
def test_an_erasure_killed_at_any_step_is_finished_by_resume(deployment, rds, token, point):
    cfg = deployment
    a = unit("alice")
    code = KILLER.format(state=str(cfg.state_dir), redis=cfg.redis.url, prefix=cfg.topics.prefix, point=point)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    eid = proc.stdout.split()[0]
    [e] = _erasures(cfg, "alice")
    assert e.id == eid and e.state != "done"
    cfg.forget.policy = "rollback"
    rc, out = _quiet(cmd_forget, cfg, None, None, token, resume=True)
    assert rc == 0 and f"resumed erasure {eid}" in out
    [e] = _erasures(cfg, "alice")
    assert e.state == "done"
    assert not _known(cfg, "alice") and _known(cfg, "bob")
    assert not any(f.startswith(f"{a}|") for fields in _sums(rds, cfg).values() for f in fields)
    assert all(f"{unit('bob')}|e" in fields for fields in _sums(rds, cfg).values())
    rollbacks = [x for x in _audit(cfg) if x.action == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].version == 1  # once, whoever made it
    assert [x.action for x in _audit(cfg) if x.action.startswith("forget")] == ["forget", "forget_done"]


def test_sums_pass_reads_only_the_per_user_keys_and_writes_only_that_users_fields(deployment, rds):
    cfg = deployment
    p = cfg.topics.prefix
    rds.set(f"{p}:learner:hold", "1")  # another key of the prefix: never scanned into, never written
    rds.set(keys.units(p, 9, 1), "not a hash")  # a key of another type where a hash belongs: skipped
    got = user_sums(rds, p, unit("carol"), count=2, delete=True)
    assert got.keys_scanned == 2 * len(BUCKETS) + 1 and got.keys_changed == 2 * len(BUCKETS) and got.fields == 18
    assert rds.get(f"{p}:learner:hold") == "1" and rds.get(keys.units(p, 9, 1)) == "not a hash"
    again = user_sums(rds, p, unit("carol"), count=2, delete=True)
    assert again.fields == 0 and again.keys_changed == 0


def test_an_api_request_waits_for_the_ledger_where_there_is_none(deployment, rds):
    """The gate's runner where the learner's ledger is not: the key and sums go, the erasure waits with the reason."""
    cfg = deployment
    reg, r = open_registry(cfg), rds
    try:
        with reg.db.tx() as s:
            e = erasures.insert(s.connection(), unit("bob"), "product", "api request", "api")
        run = Runner(cfg, reg, r, user_keys(cfg, reg), "gate", ledger_file=cfg.state_path / "elsewhere.jsonl")
        [e] = run.run_unfinished()
        assert e.state == "sums_deleted" and "learner's ledger" in e.report["waiting"]
        assert not user_keys(cfg, reg).known(unit("bob"))
        [e] = Runner(cfg, reg, r, user_keys(cfg, reg), "root").run_unfinished()
        assert e.done and [v["version"] for v in e.report["lineage"]["versions"]] == [1, 2, 3, 4]
        assert "waiting" not in e.report
    finally:
        reg.close()
    actions = [(x.actor, x.action) for x in _audit(cfg) if x.action.startswith("forget")]
    assert actions == [("gate", "forget"), ("root", "forget_done")]


def test_the_gates_chore_runs_the_products_erasures(deployment, rds):
    """What ``liverl gate`` runs after each step (``forget.run_in_gate``): the product's request, audited by it."""
    from types import SimpleNamespace

    from liverl.ops.forget import gate_chore

    cfg = deployment
    reg = open_registry(cfg)
    try:
        gate = SimpleNamespace(cfg=cfg, registry=reg, redis=rds)
        gate_chore(gate)  # nothing to run: one query
        with reg.db.tx() as s:
            e = erasures.insert(s.connection(), unit("carol"), "product", "account deleted", "api")
        gate_chore(gate)
        with reg.engine.connect() as c:
            e = erasures.get(c, e.id)
    finally:
        reg.close()
    assert e.done and [v["version"] for v in e.report["lineage"]["versions"]] == [3]
    assert not _known(cfg, "carol") and _known(cfg, "alice")
    actions = [(x.actor, x.action) for x in _audit(cfg) if x.action.startswith("forget")]
    assert actions == [("gate", "forget"), ("gate", "forget_done")]
