"""The vLLM node never outlives the serving process that started it.

Both mechanisms are exercised on real processes, without starting vLLM (which takes a minute on CPU): a child
started the way ``start_node`` starts the node dies when its parent is killed with SIGKILL, and a node left
running on a port by an earlier process is found through its pidfile and its process group killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from serving.agent.launch import _pgid, _running, kill_stale_node


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _running(pid):
            return True
        time.sleep(0.1)
    return False


def test_the_node_dies_with_its_serving_process_even_on_kill_9(tmp_path):
    parent_code = textwrap.dedent("""
        import subprocess, sys, time
        from serving.agent.launch import _die_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                                 preexec_fn=_die_with_parent)
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    child = int(parent.stdout.readline())
    try:
        assert _running(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(child), "the node outlived its serving process"
    finally:
        for pid in (child,):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_node_left_running_is_killed_before_a_new_one_starts(tmp_path):
    port = 54321
    # stands in for an orphaned `python -m vllm.entrypoints.openai.api_server ... --port 54321`, with an engine
    # process in its group
    code = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "time.sleep(120)"
    )
    orphan = subprocess.Popen(
        [sys.executable, "-c", code, "vllm.entrypoints.openai.api_server", "--port", str(port)], start_new_session=True
    )
    pidfile = tmp_path / f"vllm-{port}.pid"
    try:
        time.sleep(0.5)
        engine = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == orphan.pid]
        assert kill_stale_node(tmp_path / "missing.pid", port) is False
        pidfile.write_text(str(orphan.pid))
        assert kill_stale_node(pidfile, port + 1) is False  # another port's node is not ours to kill
        assert _running(orphan.pid)
        assert kill_stale_node(pidfile, port) is True
        orphan.wait(10)
        assert all(_wait_gone(pid) for pid in engine), "the engine process of the stale node survived"
        # the server died (its parent's death signal) but its engine process (named as vLLM names it) and a
        # helper process (vLLM's resource tracker is plain python) linger in the group: all cleared
        code2 = (
            "import subprocess, sys, time; subprocess.Popen(['bash', '-c', 'exec -a VLLM::EngineCore sleep 120']); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(0.5)"
        )
        leader = subprocess.Popen([sys.executable, "-c", code2], start_new_session=True)
        leader.wait(10)
        lingering = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _pgid(p) == leader.pid]
        assert lingering and all(_running(p) for p in lingering)
        pidfile.write_text(str(leader.pid))
        assert kill_stale_node(pidfile, port) is True
        assert all(_wait_gone(p) for p in lingering)
        # a pid reused by an unrelated process is left alone
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        pidfile.write_text(str(other.pid))
        assert kill_stale_node(pidfile, port) is False and other.poll() is None
        other.kill()
        other.wait()
    finally:
        if orphan.poll() is None:
            os.killpg(orphan.pid, signal.SIGKILL)


def _ppid(pid: int) -> int | None:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_two_nodes_sharing_a_state_dir_and_a_port_keep_their_pid_and_key_files_apart(tmp_path):
    """Nodes on hosts of their own (a network namespace each) may share a state dir and vLLM's port: one node's start
    reads only its own pidfile, so it never kills the other's engine as one it left behind."""
    from core.config import load_config
    from serving.agent.launch import node_file, node_key_path

    a, b = (load_config(env={}, state_dir=str(tmp_path), serving__node_name=n) for n in ("node-a", "node-b"))
    assert a.serving.vllm_port == b.serving.vllm_port
    assert node_file(a, "pid") != node_file(b, "pid")
    assert node_key_path(a) != node_key_path(b)
    assert node_file(a, "pid").parent == tmp_path / "serving"
