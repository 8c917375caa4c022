"""What ``liverl up`` and ``liverl demo`` hand their children: the whole config, keys included."""

from __future__ import annotations

import pytest

from core.config import load_config
from deploy.registry.signing import generate_keypair
from liverl.stack.stack import Stack
from liverl.stack.supervisor import SECTIONS, child_env, ensure_keys


def _stack(tmp_path) -> Stack:  # the addresses a started stack reports (no process is started here)
    return Stack(
        bootstrap="127.0.0.1:19999",
        redis_url="redis://127.0.0.1:6379/0",
        registry_url=f"sqlite:///{tmp_path / 'registry.db'}",
        blob_dir=str(tmp_path / "blobs"),
    )


def test_a_child_keeps_the_configured_keys_and_every_section(tmp_path):
    """child_env keeps ``security``, so configured keys never become "no signing, no verification"."""
    private, public = generate_keypair(tmp_path / "etc-liverl")
    cfg = load_config(
        env={},
        state_dir=str(tmp_path / "state"),
        security__signing_key=str(private),
        security__verify_key=str(public),
        security__announce_ttl_s=120.0,
    )
    env = child_env(cfg, _stack(tmp_path), tmp_path / "model")
    child = load_config(env=env)
    assert child.security == cfg.security
    assert (child.security.signing_key, child.security.verify_key) == (str(private), str(public))
    assert "security" in SECTIONS
    for section in SECTIONS:  # nothing else is dropped either (the stack's addresses are the child's own)
        if section not in ("broker", "redis", "registry", "model"):
            assert getattr(child, section) == getattr(cfg, section), section


def test_ensure_keys_makes_a_pair_once_and_refuses_a_configured_key_that_is_not_there(tmp_path):
    cfg = load_config(env={}, state_dir=str(tmp_path / "state"))
    ensure_keys(cfg)
    pair = [cfg.state_path / "keys" / name for name in ("announce.key", "announce.pub")]
    made = [p.read_bytes() for p in pair]
    ensure_keys(cfg)  # a restart keeps the pair
    assert [p.read_bytes() for p in pair] == made
    missing = load_config(env={}, state_dir=str(tmp_path / "other"), security__verify_key=str(tmp_path / "no.pub"))
    with pytest.raises(ValueError, match="security.verify_key .* is not a file"):
        ensure_keys(missing)


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _exiting_supervisor(tmp_path, clock, **kw):
    """A supervisor of one real child that exits with code 3 at once (``python -c``), on a clock the test moves."""
    import sys

    from core import procs
    from liverl.stack.supervisor import Child, Supervisor

    def spawn(role, env, log_dir):
        log = log_dir / f"{role}.log"
        return Child(role, procs.spawn([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log), log)

    return Supervisor({}, tmp_path / "logs", roles=("ingest",), clock=clock, spawn=spawn, **kw).start()


def _exit_now(sup) -> None:
    for c in sup.children:
        c.proc.wait(30)


def test_a_child_that_exits_now_and_then_is_restarted_every_time(tmp_path):
    """The restart budget counts exits within a window, not over a child's whole life: four exits an hour apart (each
    after running an hour) are four restarts, at once, and the pipeline stays up."""
    clock = _Clock()
    sup = _exiting_supervisor(tmp_path, clock, max_restarts=3, window_s=600.0, healthy_after_s=30.0)
    try:
        for n in range(1, 6):
            clock.now += 3600  # it ran an hour
            _exit_now(sup)
            assert sup.check() is None
            assert sup.restarts["ingest"] == n  # restarted at once: no back-off after a healthy run
    finally:
        sup.stop()


def test_a_crash_loop_backs_off_then_gives_up_with_a_clear_message(tmp_path):
    clock = _Clock()
    sup = _exiting_supervisor(tmp_path, clock, max_restarts=3, window_s=600.0, healthy_after_s=30.0, backoff_max_s=30.0)
    try:
        waits = []
        for _ in range(3):
            _exit_now(sup)
            before = sup.restarts.get("ingest", 0)
            assert sup.check() is None
            assert sup.restarts.get("ingest", 0) == before  # not yet: it backs off
            waited = 0.0
            while sup.restarts.get("ingest", 0) == before:
                clock.now += 0.5
                waited += 0.5
                assert sup.check() is None
            waits.append(waited)
        assert waits == [1.0, 2.0, 4.0]  # doubling
        _exit_now(sup)
        failure = sup.check()
        assert failure is not None
        assert "ingest exited with code 3 4 times within 600 s" in failure and "supervisor.restarts" in failure
        assert "boom" in failure  # its last log lines
    finally:
        sup.stop()


def test_the_budget_counts_exits_in_the_window_only(tmp_path):
    """Three quick exits, then a quiet 20 minutes, then three more: never more than three in any 10 minutes."""
    clock = _Clock()
    sup = _exiting_supervisor(tmp_path, clock, max_restarts=3, window_s=600.0, healthy_after_s=0.0)
    try:
        for _burst in range(2):
            for _ in range(3):
                _exit_now(sup)
                assert sup.check() is None
                clock.now += 1
            clock.now += 1200
        _exit_now(sup)
        assert sup.check() is None  # the 7th exit overall, the 1st in its window
    finally:
        sup.stop()


def test_supervisor_settings_come_from_the_config(tmp_path):
    from liverl.stack.supervisor import Supervisor

    cfg = load_config(
        env={"LIVERL__SUPERVISOR__RESTARTS": "9", "LIVERL__SUPERVISOR__RESTART_WINDOW_S": "60"},
        state_dir=str(tmp_path / "state"),
    )
    sup = Supervisor.from_config(cfg, {}, tmp_path, ("ingest",))
    assert (sup.max_restarts, sup.window_s, sup.backoff_max_s) == (9, 60.0, 30.0)
    with pytest.raises(ValueError):
        load_config(env={"LIVERL__SUPERVISOR__RESTARTS": "-1"})


_ORPHAN_SCRIPT = r"""
import json, os, signal, subprocess, sys, time
from pathlib import Path
from core import procs
from liverl.stack.up import Pipeline

log = Path(sys.argv[1])
procs.become_subreaper()
pipe = Pipeline.__new__(Pipeline)  # only its exit path: nothing of the pipeline started
pipe.supervisor = pipe.redis = pipe.stack = None
pipe._before = procs.descendants()
# a "vLLM server" in its own session whose "engine core" is in a session of its own, as a node's engine can be
server = procs.spawn([sys.executable, "-c", "import subprocess, sys, time; "
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
                      "start_new_session=True); print('engine', p.pid, flush=True); time.sleep(600)"], log)
deadline = time.monotonic() + 60
while "engine" not in log.read_text():
    assert time.monotonic() < deadline, log.read_text()
    time.sleep(0.05)
engine = int(log.read_text().split()[-1])
server.send_signal(signal.SIGKILL)  # the server dies first: its engine is orphaned
server.wait()
time.sleep(0.5)
ppid = int(Path(f"/proc/{engine}/stat").read_text().rsplit(")", 1)[1].split()[1])
pipe.__exit__(None, None, None)
print(json.dumps({"engine": engine, "ppid": ppid, "me": os.getpid()}))
"""


def test_an_engine_orphaned_by_its_server_does_not_outlive_the_pipeline(tmp_path):
    """No vLLM EngineCore or Worker outlives a failed `up` with parent 1: the pipeline's process is the subreaper of
    everything below it, so an engine whose server died comes to it, and its exit stops it."""
    import json
    import subprocess
    import sys

    import psutil

    r = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(tmp_path / "server.log")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ppid"] == out["me"]  # re-parented to the pipeline's process, not to init
    alive = psutil.pid_exists(out["engine"]) and psutil.Process(out["engine"]).status() != psutil.STATUS_ZOMBIE
    if alive:
        psutil.Process(out["engine"]).kill()
    assert not alive, "the orphaned engine outlived the pipeline"


def test_a_supervised_child_is_stopped_when_the_supervisor_is_killed_9(tmp_path):
    """kill -9 of `up` itself: its children (each in a session of its own, so a terminal's Ctrl-C does not reach them
    twice) are told SIGTERM by the kernel (PR_SET_PDEATHSIG), and stop what they started in turn."""
    import subprocess
    import sys
    import time

    import psutil

    script = (
        "import sys, time; from core import procs; "
        "c = procs.spawn([sys.executable, '-c', 'import time; time.sleep(600)'], sys.argv[1]); "
        "print(c.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.kill()
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            psutil.Process(child).kill()
            raise AssertionError("the child outlived its supervisor's kill -9")
        time.sleep(0.1)
