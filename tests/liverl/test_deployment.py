"""One deployment, one state dir, one Redis namespace: the demo, then `liverl up --model OTHER` in the same
folder or with a new state dir on the same Redis, must stop with a clear error before anything starts or any key is
touched; `--fresh` never deletes another deployment's keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import redis as redis_lib

from core.config import load_config
from liverl.stack.deployment import DeploymentError, bind, check_model, claim, claim_key, made_before_ids

REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture
def prefix():
    p = f"dep{uuid.uuid4().hex[:10]}"
    yield p
    r = redis_lib.Redis.from_url(REDIS)
    for k in r.scan_iter(f"{p}:*", count=1000):
        r.delete(k)
    r.close()


def _cfg(tmp_path, name: str, prefix: str):
    return load_config(
        env={},
        state_dir=str(tmp_path / name),
        topics__prefix=prefix,
        redis__url=REDIS,
        broker__bootstrap="127.0.0.1:1",
        model__cache_dir=str(tmp_path / "models"),
    )


def _registry_of(cfg, model_dir) -> None:
    """A state dir whose registry was made from ``model_dir`` (what `up` and the demo leave)."""
    import torch

    from deploy.registry.registry import open_registry

    reg = open_registry(cfg)
    try:
        reg.init_base({"w": torch.zeros(4)}, str(model_dir))
    finally:
        reg.close()


def _model(tmp_path, name: str):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}))
    return d


def test_a_state_dir_of_another_model_is_refused_unless_fresh(tmp_path, prefix):
    cfg = _cfg(tmp_path, "state", prefix)
    demo_model, mine = _model(tmp_path, "demo-model"), _model(tmp_path, "my-moe")
    _registry_of(cfg, demo_model)
    check_model(cfg, demo_model, fresh=False)  # the same model: its own state dir
    with pytest.raises(DeploymentError) as e:
        check_model(cfg, mine, fresh=False)
    msg = str(e.value)
    assert str(demo_model) in msg and str(mine) in msg and "--fresh" in msg and "--state-dir" in msg
    check_model(cfg, mine, fresh=True)  # --fresh starts over in it
    check_model(_cfg(tmp_path, "new-state", prefix), mine, fresh=False)  # a new state dir has no registry


def test_up_with_another_model_in_the_demo_folder_says_what_to_do_and_starts_nothing(tmp_path, prefix):
    """The README's own path: the demo, then `liverl up --model ./my-moe` in the same folder. Before: a torch
    size-mismatch traceback from the learner, and vLLM processes left running."""
    cfg = _cfg(tmp_path, "state", prefix)
    _registry_of(cfg, _model(tmp_path, "demo-model"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update({"LIVERL__TOPICS__PREFIX": prefix, "LIVERL__REDIS__URL": REDIS, "HF_HUB_OFFLINE": "1"})
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "liverl.cli",
            "up",
            "--model",
            str(_model(tmp_path, "my-moe")),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "liverl: error: the state dir" in r.stderr and "--fresh" in r.stderr and "--state-dir" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "state" / "logs").exists()  # nothing was started


def test_two_deployments_on_one_redis_and_fresh_leaves_the_other_ones_keys(tmp_path, prefix):
    from liverl.stack.up import Pipeline

    r = redis_lib.Redis.from_url(REDIS)
    try:
        first = _cfg(tmp_path, "demo-state", prefix)
        model = _model(tmp_path, "m")
        me = bind(first, r, model, fresh=False)
        claim(first, r, me, model)
        r.hset(f"{prefix}:live:{{0}}", "events", 10_579)  # the first deployment's live counters
        assert bind(first, r, model, fresh=False) == me  # a restart of the same deployment: its own namespace

        second = _cfg(tmp_path, "new-state", prefix)
        with pytest.raises(DeploymentError) as e:
            bind(second, r, model, fresh=False)
        msg = str(e.value)
        assert me.id in msg and str(first.state_path) in msg and str(second.state_path) in msg
        assert "topics.prefix" in msg
        with pytest.raises(DeploymentError):  # `up --fresh` with the new state dir: refused before any reset
            with Pipeline(second, model, fresh=True):
                pass
        assert r.hget(f"{prefix}:live:{{0}}", "events") == b"10579"  # the first deployment's keys are all there
        assert json.loads(r.get(claim_key(prefix)))["id"] == me.id
        other = load_config(
            env={},
            state_dir=str(tmp_path / "new-state"),
            topics__prefix=f"{prefix}x",
            redis__url=REDIS,
            broker__bootstrap="127.0.0.1:1",
        )
        claim(other, r, bind(other, r, model, fresh=False), model)  # with its own prefix it starts
        r.delete(claim_key(f"{prefix}x"))
    finally:
        r.close()


def test_unclaimed_keys_are_refused_from_a_new_state_dir_and_adopted_by_the_state_dir_that_made_them(tmp_path, prefix):
    r = redis_lib.Redis.from_url(REDIS)
    try:
        r.set(f"{prefix}:desired", b"an announcement from before deployment ids")
        model = _model(tmp_path, "m")
        with pytest.raises(DeploymentError, match="no deployment claims"):
            bind(_cfg(tmp_path, "new-state", prefix), r, model, fresh=True)
        old = _cfg(tmp_path, "old-state", prefix)
        _registry_of(old, model)  # a state dir from before deployment ids: its registry is there
        assert made_before_ids(old)  # (`up --fresh` asks this before it removes the registry)
        me = bind(old, r, model, fresh=False)
        claim(old, r, me, model)
        assert json.loads(r.get(claim_key(prefix)))["state_dir"] == str(old.state_path)
        assert not made_before_ids(old)  # it has its deployment file now
    finally:
        r.close()


def _recorded(cfg, model):
    """A state dir as `up` leaves it: its registry, and its deployment recorded in it."""
    from liverl.stack.deployment import identity, record

    _registry_of(cfg, model)
    me = identity(cfg)
    record(cfg, me, model)
    return me


def test_a_standalone_process_checks_its_registrys_deployment_against_the_redis_claim(tmp_path, prefix):
    """A pipeline process on another machine shares only the registry and Redis with the rest: it reads the
    deployment from the registry and refuses a prefix another deployment claims (before: no check at all outside
    `up`, so a second deployment's `liverl gate` read and wrote the first one's rollout plan and desired version)."""
    from liverl.stack.deployment import check_process, record, registry_deployment

    r = redis_lib.Redis.from_url(REDIS)
    try:
        assert check_process(_cfg(tmp_path, "no-registry", prefix), r, "gate") is None  # nothing recorded to check
        assert r.get(claim_key(prefix)) is None
        mine = _cfg(tmp_path, "mine", prefix)
        me = _recorded(mine, _model(tmp_path, "m"))
        assert registry_deployment(mine).id == me.id
        assert check_process(mine, r, "gate").id == me.id  # an unclaimed prefix is claimed for its deployment
        assert json.loads(r.get(claim_key(prefix)))["id"] == me.id
        assert check_process(mine, r, "serve").id == me.id  # its own claim: starts

        theirs = _cfg(tmp_path, "theirs", prefix)
        them = _recorded(theirs, _model(tmp_path, "other"))
        with pytest.raises(DeploymentError) as e:
            check_process(theirs, r, "ingest")
        msg = str(e.value)
        assert me.id in msg and them.id in msg and "liverl ingest" in msg and "topics.prefix" in msg
        with pytest.raises(DeploymentError, match="belongs to"):  # one registry, one deployment
            record(theirs, me)
        with pytest.raises(DeploymentError, match="registry"):  # `up` on a registry.url another deployment uses
            bind(
                load_config(
                    env={},
                    state_dir=str(tmp_path / "third"),
                    topics__prefix=f"{prefix}y",
                    redis__url=REDIS,
                    registry__url=theirs.registry_url,
                ),
                r,
                tmp_path,
                fresh=False,
            )
    finally:
        r.close()


def test_liverl_ingest_on_another_deployments_prefix_exits_with_the_reason_and_starts_nothing(tmp_path, prefix):
    r = redis_lib.Redis.from_url(REDIS)
    try:
        r.set(claim_key(prefix), json.dumps({"id": "0123456789ab", "state_dir": "/elsewhere", "model": None}))
    finally:
        r.close()
    cfg = _cfg(tmp_path, "state", prefix)
    me = _recorded(cfg, _model(tmp_path, "m"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        {
            "LIVERL__TOPICS__PREFIX": prefix,
            "LIVERL__REDIS__URL": REDIS,
            "LIVERL__STATE_DIR": str(cfg.state_path),
            "LIVERL__BROKER__BOOTSTRAP": "127.0.0.1:1",
        }
    )
    p = subprocess.run(
        [sys.executable, "-m", "liverl.cli", "ingest"], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "liverl ingest" in p.stderr and "0123456789ab" in p.stderr and me.id in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr


def test_liverl_ingest_whose_redis_does_not_answer_exits_for_a_restart_not_as_refused(tmp_path, prefix):
    """The check of the deployment's Redis namespace, before the worker starts: a Redis that does not answer is a
    service to wait for (exit 75, EX_TEMPFAIL: the supervisor starts it again), not a refusal (exit 1)."""
    from core.services import EXIT_TEMPFAIL
    from tests.conftest import free_port

    cfg = _cfg(tmp_path, "state", prefix)
    _recorded(cfg, _model(tmp_path, "m"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        {
            "LIVERL__TOPICS__PREFIX": prefix,
            "LIVERL__REDIS__URL": f"redis://127.0.0.1:{free_port()}/0",
            "LIVERL__STATE_DIR": str(cfg.state_path),
            "LIVERL__BROKER__BOOTSTRAP": "127.0.0.1:1",
        }
    )
    p = subprocess.run(
        [sys.executable, "-m", "liverl.cli", "ingest"], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == EXIT_TEMPFAIL, p.stderr[-3000:]
    assert "cannot check the deployment's Redis namespace" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_liverl_ingest_whose_registry_database_does_not_answer_exits_for_a_restart_not_as_refused(tmp_path, prefix):
    """The registry's database restarting while a process starts (a host loss of the database): a service to wait
    for (exit 75), with one line naming it, not a traceback and exit 1."""
    from core.services import EXIT_TEMPFAIL
    from tests.conftest import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        {
            "LIVERL__TOPICS__PREFIX": prefix,
            "LIVERL__REDIS__URL": REDIS,
            "LIVERL__REGISTRY__URL": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres",
            "LIVERL__STATE_DIR": str(tmp_path / "state"),
            "LIVERL__BROKER__BOOTSTRAP": "127.0.0.1:1",
        }
    )
    p = subprocess.run(
        [sys.executable, "-m", "liverl.cli", "ingest"], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == EXIT_TEMPFAIL, p.stderr[-3000:]
    assert "cannot read the deployment's registry" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_an_operator_command_on_another_deployments_prefix_refuses_naming_both_and_the_prefix_that_works(
    tmp_path, prefix
):
    """`liverl status` with one deployment's state dir and a prefix another deployment claims would print one's
    versions beside the other's fleet: it refuses, names both, and names the prefix its own deployment claims; run
    with that prefix, it works."""
    other = f"{prefix}b"
    cfg = _cfg(tmp_path, "state", prefix)
    me = _recorded(cfg, _model(tmp_path, "m"))
    r = redis_lib.Redis.from_url(REDIS)
    try:
        r.set(claim_key(prefix), json.dumps({"id": "0123456789ab", "state_dir": "/elsewhere", "model": None}))
        r.set(claim_key(other), json.dumps({"id": me.id, "state_dir": str(cfg.state_path), "model": None}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
        env.update({"LIVERL__REDIS__URL": REDIS, "LIVERL__STATE_DIR": str(cfg.state_path)})

        def status(p: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "liverl.cli", "status"],
                capture_output=True,
                text=True,
                timeout=120,
                env=env | {"LIVERL__TOPICS__PREFIX": p},
            )

        refused = status(prefix)
        assert refused.returncode == 1, refused.stderr[-3000:]
        err = refused.stderr
        assert "0123456789ab" in err and me.id in err and f"LIVERL__TOPICS__PREFIX={other}" in err, err[-3000:]
        assert "Traceback" not in err
        works = status(other)  # the advice, followed
        assert works.returncode == 0, works.stderr[-3000:]
    finally:
        r.delete(claim_key(other))
        r.close()


def test_a_learner_whose_redis_stops_answering_exits_for_a_restart_with_no_traceback(tmp_path):
    """Redis (or the broker) gone longer than the clients retry, mid-run: the learner exits 75 (EX_TEMPFAIL) with one
    line naming the error, so its supervisor starts it again from its last checkpoint. The learner's loop itself is
    replaced by one that meets the error its Redis client raises after a long cut (the real loop needs a model and a
    broker; what is tested here is how the process ends)."""
    from core.services import EXIT_TEMPFAIL

    code = (
        "import sys, redis\n"
        "import learner.trainer as t\n"
        "from liverl import cli, process_cli\n"
        "def cut(*a, **k):\n"
        "    raise redis.exceptions.ConnectionError('Error 110 connecting to 10.0.0.3:6379. Connection timed out.')\n"
        "t.run_learner = cut\n"
        "process_cli.check_bound = lambda *a: None\n"
        "process_cli.model_dir_for = lambda cfg: None\n"
        "sys.exit(cli.main(['learn']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env["LIVERL__STATE_DIR"] = str(tmp_path / "state")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == EXIT_TEMPFAIL, p.stderr[-3000:]
    assert "the learner lost a service it needs (ConnectionError" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
