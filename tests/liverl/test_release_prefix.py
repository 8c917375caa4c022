"""A deployment can start over: delete its state dir, and `liverl up --fresh` with the same state dir and prefix is
refused with advice that works (`liverl release-prefix`), which refuses while the old deployment shows signs of life,
and records who released which deployment, and why, where an auditor reads the history. Each refusal's advice is
followed here, as the operator would."""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest
import redis as redis_lib

from core import keys
from core.config import load_config
from liverl.cli import main
from liverl.ops.release import releases
from liverl.stack.deployment import DeploymentError, bind, check_process, claim, claim_key, identity, record
from liverl.stack.releases import ACTION, log_release
from tests.liverl.test_deployment import REDIS, _cfg, _model, _recorded, _registry_of


@pytest.fixture
def prefix():
    p = f"rel{uuid.uuid4().hex[:10]}"
    yield p
    r = redis_lib.Redis.from_url(REDIS)
    for k in r.scan_iter(f"{p}*", count=1000):
        r.delete(k)
    r.close()


@pytest.fixture
def r():
    client = redis_lib.Redis.from_url(REDIS)
    yield client
    client.close()


def _env(prefix: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL")}
    env.update(
        {
            "LIVERL__TOPICS__PREFIX": prefix,
            "LIVERL__REDIS__URL": REDIS,
            "LIVERL__BROKER__BOOTSTRAP": "127.0.0.1:1",
            "HF_HUB_OFFLINE": "1",
            **more,
        }
    )
    return env


def _advised(message: str, reason: str = "its state dir was deleted; starting over") -> list[str]:
    """The `liverl release-prefix ...` line a refusal advises, as argv after `liverl`, with a real reason."""
    m = re.search(r'liverl (release-prefix .*?--reason "\.\.\.")', message)
    assert m, message
    argv = shlex.split(m.group(1))
    assert argv[-2:] == ["--reason", "..."]
    return argv[:-1] + [reason]


def _liverl(env: dict[str, str], *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "liverl.cli", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


def _run(monkeypatch, capsys, prefix: str, argv: list[str], **env: str) -> tuple[int, str]:
    """`liverl ARGV` through the CLI's own entry point, in this process; returns the exit code and what it printed."""
    for k in [k for k in os.environ if k.startswith("LIVERL")]:
        monkeypatch.delenv(k)
    for k, v in {"LIVERL__TOPICS__PREFIX": prefix, "LIVERL__REDIS__URL": REDIS, **env}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


def _first_deployment(tmp_path, prefix: str, r):
    """What `liverl up` leaves in a state dir and in Redis: the deployment, its registry, its claim, some state."""
    cfg = _cfg(tmp_path, "state", prefix)
    model = _model(tmp_path, "m")
    me = bind(cfg, r, model, fresh=False)
    claim(cfg, r, me, model)
    _registry_of(cfg, model)
    record(cfg, me, model)
    r.hset(keys.live(prefix, 3), "events", 10_579)
    r.hset(keys.audit_head(prefix), mapping={"seq": 57, "mac": "ab" * 32, "tag": "cd" * 32})
    r.set(keys.desired(prefix), b"an announcement of v3")
    return cfg, model, me


@pytest.mark.slow  # five `liverl` processes, each importing torch
def test_start_over_in_the_same_state_dir_follows_the_advice_to_the_release_and_up_claims_the_prefix(
    tmp_path, prefix, r
):
    cfg, model, first = _first_deployment(tmp_path, prefix, r)
    state = cfg.state_path
    shutil.rmtree(state)  # the operator deletes the state dir to start over
    env = _env(prefix)
    up = ["up", "--fresh", "--model", str(model), "--state-dir", str(state)]

    refused = _liverl(env, *up)
    assert refused.returncode == 1, refused.stderr[-3000:]
    err = refused.stderr
    assert "Traceback" not in err and first.id in err, err[-3000:]
    assert f"--state-dir {state} " not in err.split("release-prefix")[0]  # no "run with --state-dir <this same path>"
    assert f"--deployment {first.id}" in err and "--state-dir-gone" not in err  # made here: checked here
    new_id = json.loads((state / "deployment.json").read_text())["id"]
    assert new_id != first.id and json.loads(r.get(claim_key(prefix)))["id"] == first.id  # nothing changed

    released = _liverl(env, *_advised(err))  # the advice, as printed
    assert released.returncode == 0, released.stdout + released.stderr
    assert f"{state} now holds deployment {new_id}" in released.stdout
    assert r.get(claim_key(prefix)) is None
    assert r.hget(keys.live(prefix, 3), "events") is None and not r.exists(keys.audit_head(prefix))
    (rec,) = releases(r, prefix)
    assert rec["released"]["id"] == first.id and rec["by"] == getpass.getuser() and not rec["authenticated"]
    assert rec["reason"] == "its state dir was deleted; starting over" and rec["keys_removed"] == 4

    started = subprocess.Popen(
        [sys.executable, "-m", "liverl.cli", *up], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:  # `up` claims the prefix past the check, then waits for a broker this test has none of: stopped there
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and started.poll() is None:
            raw = r.get(claim_key(prefix))
            if raw is not None and json.loads(raw)["id"] == new_id:
                break
            time.sleep(0.2)
        assert started.poll() is None, started.stdout.read().decode()[-3000:]
        assert json.loads(r.get(claim_key(prefix)))["id"] == new_id
    finally:
        started.kill()
        started.wait(30)
        started.stdout.close()
    assert len(releases(r, prefix)) == 1  # --fresh kept the prefix's record of its releases

    _registry_of(cfg, model)  # what `up` does next: its registry, its deployment recorded, the release logged
    record(cfg, identity(cfg), model)
    assert rec["for"] == new_id  # the state dir it was run with holds the deployment that takes the prefix
    assert log_release(cfg, r, identity(cfg))["id"] == rec["id"]
    assert log_release(cfg, r, identity(cfg)) is None  # once per registry
    history = _liverl(env | {"LIVERL__STATE_DIR": str(state), "COLUMNS": "400"}, "history")
    assert history.returncode == 0, history.stderr[-3000:]
    assert ACTION in history.stdout and first.id in history.stdout and rec["id"] in history.stdout, history.stdout


def test_a_deployment_that_beats_or_still_has_its_state_dir_is_not_released_and_the_advice_works(
    tmp_path, prefix, r, monkeypatch, capsys
):
    cfg, model, first = _first_deployment(tmp_path, prefix, r)
    release = ["release-prefix", "--prefix", prefix, "--state-dir", str(tmp_path / "next"), "--reason", "retire it"]

    rc, out = _run(monkeypatch, capsys, prefix, release)
    assert rc == 1 and f"{cfg.state_path} is on this machine and still holds it" in out, out
    assert f"liverl up --fresh --state-dir {cfg.state_path}" in out
    assert bind(cfg, r, model, fresh=True) == first  # the advice: it starts over as itself, on its own prefix
    assert json.loads(r.get(claim_key(prefix)))["id"] == first.id

    shutil.rmtree(cfg.state_path)
    r.set(keys.served(prefix, "node-0"), keys.ServedHeartbeat(version=3, checksum="x").to_json(), ex=30)
    r.set(keys.learner_lease(prefix), b"host:1:abc", px=10_000)
    rc, out = _run(monkeypatch, capsys, prefix, release)
    assert rc == 1 and "serving node node-0 beats" in out and "a learner holds the lease" in out, out
    assert "Nothing was released" in out and "stop its processes" in out
    assert json.loads(r.get(claim_key(prefix)))["id"] == first.id and r.hget(keys.live(prefix, 3), "events")

    r.delete(keys.served(prefix, "node-0"), keys.learner_lease(prefix))  # its processes stopped: the keys expired
    rc, out = _run(monkeypatch, capsys, prefix, [*release[:-2], "--deployment", "0123456789ab", *release[-2:]])
    assert rc == 1 and "is not that deployment's" in out, out  # another id than the one that claims it
    rc, out = _run(monkeypatch, capsys, prefix, [*release, "--dry-run"])
    assert rc == 0 and "would release" in out and r.get(claim_key(prefix)) is not None, out
    rc, out = _run(monkeypatch, capsys, prefix, [*release, "--deployment", first.id, "--as", "alice"])
    assert rc == 0, out
    assert r.get(claim_key(prefix)) is None and releases(r, prefix)[-1]["by"] == "alice"


def test_a_claim_from_another_machine_needs_the_operator_to_say_its_state_dir_is_gone(
    tmp_path, prefix, r, monkeypatch, capsys
):
    gone = {"id": "0123456789ab", "state_dir": "/srv/liverl", "model": None, "host": "build-box-7"}
    r.set(claim_key(prefix), json.dumps(gone))
    cfg, model = _cfg(tmp_path, "state", prefix), _model(tmp_path, "m")
    with pytest.raises(DeploymentError) as e:
        bind(cfg, r, model, fresh=True)
    assert "on build-box-7" in str(e.value) and "--state-dir-gone" in str(e.value)

    rc, out = _run(monkeypatch, capsys, prefix, [a for a in _advised(str(e.value)) if a != "--state-dir-gone"])
    assert rc == 1 and "on build-box-7, not on this machine" in out and "--state-dir-gone" in out, out
    rc, out = _run(monkeypatch, capsys, prefix, _advised(str(e.value)))  # the advice as given
    assert rc == 0, out
    rec = releases(r, prefix)[-1]
    assert rec["released"] == gone and any("--state-dir-gone" in x for x in rec["found"])
    claim(cfg, r, bind(cfg, r, model, fresh=True), model)
    assert json.loads(r.get(claim_key(prefix)))["id"] == identity(cfg).id


def test_unclaimed_keys_and_a_broken_claim_are_released_by_the_advised_command(
    tmp_path, prefix, r, monkeypatch, capsys
):
    cfg, model = _cfg(tmp_path, "state", prefix), _model(tmp_path, "m")
    r.set(keys.desired(prefix), b"an announcement from before deployment ids")
    with pytest.raises(DeploymentError, match="no deployment claims") as e:
        bind(cfg, r, model, fresh=True)
    rc, out = _run(monkeypatch, capsys, prefix, _advised(str(e.value)))
    assert rc == 0 and r.get(keys.desired(prefix)) is None, out
    assert releases(r, prefix)[-1]["released"] is None
    bind(cfg, r, model, fresh=False)  # the record of the release is no stray key

    r.set(claim_key(prefix), b"not json")
    with pytest.raises(DeploymentError, match="not a deployment claim") as e:
        bind(cfg, r, model, fresh=True)
    rc, out = _run(monkeypatch, capsys, prefix, _advised(str(e.value)), LIVERL__STATE_DIR=str(cfg.state_path))
    assert rc == 0 and r.get(claim_key(prefix)) is None, out
    assert releases(r, prefix)[-1]["claim"] == "not json"


def test_with_operators_in_the_registry_an_admin_token_names_who_released_in_its_audit_log(
    tmp_path, prefix, r, monkeypatch, capsys
):
    from deploy.registry.registry import open_registry

    cfg = _cfg(tmp_path, "next", prefix)
    _recorded(cfg, _model(tmp_path, "m"))
    reg = open_registry(cfg)
    try:
        token = reg.add_operator("alice", "admin", by="test", reason="first admin")
        viewer = reg.add_operator("bob", "viewer", by="alice", reason="reads")
    finally:
        reg.close()
    gone = {"id": "0123456789ab", "state_dir": str(tmp_path / "deleted"), "model": None, "host": socket.gethostname()}
    r.set(claim_key(prefix), json.dumps(gone))
    release = ["release-prefix", "--prefix", prefix, "--state-dir", str(cfg.state_path), "--reason", "gone"]

    rc, out = _run(monkeypatch, capsys, prefix, release)
    assert rc == 1 and "LIVERL_TOKEN" in out and r.get(claim_key(prefix)) is not None, out
    add = shlex.split(
        re.search(r"`liverl (operator add NAME --role admin [^`]*)`", out).group(1).replace("NAME", "carol")
    )
    rc, added = _run(monkeypatch, capsys, prefix, add, LIVERL_TOKEN=token, LIVERL__STATE_DIR=str(cfg.state_path))
    assert rc == 0, added  # the advice, run by an admin: carol may release now
    carol = added.split("shown only now:\n", 1)[1].split()[0]
    rc, out = _run(monkeypatch, capsys, prefix, [*release, "--dry-run"], LIVERL_TOKEN=carol)
    assert rc == 0 and "as carol" in out, out
    rc, out = _run(monkeypatch, capsys, prefix, release, LIVERL_TOKEN=viewer)
    assert rc == 1 and "admin" in out, out
    rc, out = _run(monkeypatch, capsys, prefix, [*release, "--as", "mallory"], LIVERL_TOKEN=token)
    assert rc == 1 and "alice" in out, out
    rc, out = _run(monkeypatch, capsys, prefix, release, LIVERL_TOKEN=token)
    assert rc == 0 and r.get(claim_key(prefix)) is None, out
    reg = open_registry(cfg)
    try:
        last = reg.audit()[-1]
    finally:
        reg.close()
    assert (last.actor, last.action) == ("alice", ACTION) and "0123456789ab" in last.reason
    assert releases(r, prefix)[-1]["authenticated"]
    assert log_release(cfg, r, identity(cfg)) is None  # already in this registry's log


def test_a_standalone_process_refused_by_a_gone_deployments_claim_starts_after_the_advised_release(
    tmp_path, prefix, r, monkeypatch, capsys
):
    r.set(claim_key(prefix), json.dumps({"id": "0123456789ab", "state_dir": "/elsewhere", "model": None}))
    cfg = _cfg(tmp_path, "state", prefix)
    me = _recorded(cfg, _model(tmp_path, "m"))
    with pytest.raises(DeploymentError) as e:
        check_process(cfg, r, "ingest")
    assert "release-prefix" in str(e.value)
    rc, out = _run(monkeypatch, capsys, prefix, _advised(str(e.value)), LIVERL__STATE_DIR=str(cfg.state_path))
    assert rc == 0, out
    assert check_process(cfg, r, "ingest").id == me.id


def test_a_state_dir_whose_deployment_file_went_is_told_how_to_restore_it(tmp_path, prefix, r):
    cfg, model, first = _first_deployment(tmp_path, prefix, r)
    (cfg.state_path / "deployment.json").unlink()
    with pytest.raises(DeploymentError) as e:
        bind(cfg, r, model, fresh=False)
    msg = str(e.value)
    assert "--fresh" in msg and f"--state-dir {cfg.state_path}" not in msg, msg
    restore = re.search(r"\((echo .*?deployment\.json)\)", msg).group(1)
    subprocess.run(["sh", "-c", restore], check=True)  # the advice, run as printed
    assert bind(cfg, r, model, fresh=False) == first


def test_another_deployments_prefix_refused_from_a_new_state_dir_says_two_ways_on_and_both_work(tmp_path, prefix, r):
    cfg, model, first = _first_deployment(tmp_path, prefix, r)
    second = _cfg(tmp_path, "second", prefix)
    with pytest.raises(DeploymentError) as e:
        bind(second, r, model, fresh=False)
    msg = str(e.value)
    assert f"Run with --state-dir {cfg.state_path}" in msg and "release-prefix" not in msg, msg  # it is alive here
    assert bind(_cfg(tmp_path, "state", prefix), r, model, fresh=False) == first  # that state dir: that deployment
    own = re.search(r"LIVERL__TOPICS__PREFIX=(\w+)", msg).group(1)
    mine = _cfg(tmp_path, "second", own)
    try:
        claim(mine, r, bind(mine, r, model, fresh=False), model)  # its own prefix: it starts
    finally:
        r.delete(claim_key(own))

    shared = load_config(  # a registry.url the first deployment uses
        env={},
        state_dir=str(tmp_path / "third"),
        topics__prefix=f"{prefix}c",
        redis__url=REDIS,
        registry__url=cfg.registry_url,
    )
    with pytest.raises(DeploymentError) as e:
        bind(shared, r, model, fresh=False)
    assert f"Run with --state-dir {cfg.state_path}" in str(e.value)


def test_an_operator_command_on_a_prefix_its_deployment_does_not_hold_can_follow_either_advice(
    tmp_path, prefix, r, monkeypatch, capsys
):
    a = _cfg(tmp_path, "a", prefix)
    b = _cfg(tmp_path, "b", prefix)
    _recorded(a, _model(tmp_path, "ma"))
    me_b = _recorded(b, _model(tmp_path, "mb"))
    claim(a, r, identity(a))
    r.set(claim_key(f"{prefix}b"), json.dumps({"id": me_b.id, "state_dir": str(b.state_path), "model": None}))

    rc, err = _run(monkeypatch, capsys, prefix, ["status"], LIVERL__STATE_DIR=str(b.state_path))
    assert rc == 1, err[-3000:]
    assert f"LIVERL__TOPICS__PREFIX={prefix}b" in err and f"LIVERL__STATE_DIR={a.state_path}" in err, err[-3000:]
    rc, out = _run(monkeypatch, capsys, f"{prefix}b", ["status"], LIVERL__STATE_DIR=str(b.state_path))
    assert rc == 0, out[-3000:]  # its own prefix
    rc, out = _run(monkeypatch, capsys, prefix, ["status"], LIVERL__STATE_DIR=str(a.state_path))
    assert rc == 0, out[-3000:]  # or the deployment that holds this one


class _Stop(Exception):
    """Raised where `up` would start its processes: everything before it ran for real."""


def test_up_after_the_release_writes_it_into_its_new_registrys_history(cfg, monkeypatch, capsys):
    """The real `liverl up` path up to starting the processes (the session's broker and Redis): the state dir
    deleted, `up --fresh` refused, the advice followed, and `up --fresh` claims the prefix, makes its registry and logs
    the release there."""
    import torch
    from safetensors.torch import save_file

    from deploy.registry.registry import open_registry
    from liverl.stack import up

    prefix, r = cfg.topics.prefix, redis_lib.Redis.from_url(cfg.redis.url)
    model = cfg.state_path.parent / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, str(model / "model.safetensors"))
    try:
        first = bind(cfg, r, model, fresh=False)
        claim(cfg, r, first, model)
        r.hset(keys.live(prefix, 3), "events", 7)
        shutil.rmtree(cfg.state_path)
        with pytest.raises(DeploymentError) as e:
            with up.Pipeline(cfg, model, fresh=True):
                pass
        rc, out = _run(monkeypatch, capsys, prefix, _advised(str(e.value)), LIVERL__REDIS__URL=cfg.redis.url)
        assert rc == 0, out

        def stop(*_a, **_k):
            raise _Stop

        monkeypatch.setattr(up.Supervisor, "from_config", stop)
        with pytest.raises(_Stop):
            with up.Pipeline(cfg, model, fresh=True):
                pass
        me = identity(cfg)
        assert me.id != first.id and json.loads(r.get(claim_key(prefix)))["id"] == me.id
        reg = open_registry(cfg)
        try:
            (entry,) = [a for a in reg.audit() if a.action == ACTION]
            assert entry.reason.count(first.id) == 1 and f"for deployment {me.id}" in entry.reason
            assert reg.verify_audit().ok
        finally:
            reg.close()
    finally:
        for k in r.scan_iter(f"{prefix}*", count=1000):
            r.delete(k)
        r.close()


def test_history_shows_a_reason_with_square_brackets_as_written(tmp_path, capsys):
    from deploy.registry.registry import open_registry
    from liverl.ops.admin import cmd_history

    cfg = _cfg(tmp_path, "state", "unused")
    _registry_of(cfg, _model(tmp_path, "m"))
    reg = open_registry(cfg)
    try:
        reg.log_action("[bold]eve[/bold]", "hold", "[ticket 42] users complain")
    finally:
        reg.close()
    assert cmd_history(cfg) == 0
    out = capsys.readouterr().out
    assert "[ticket 42] users complain" in out and "[bold]eve[/bold]" in out, out
