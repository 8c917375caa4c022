"""Child processes, one way everywhere: start with a log file in a session of its own, wait for its port,
stop its whole process group (SIGTERM, then SIGKILL), read the end of its log.

Used by the embedded stack (broker, Redis), the supervisor (``liverl up`` / ``liverl demo``) and the serving
node launcher. Torch-free.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from core.services import LiverlError, port_open

log = logging.getLogger("liverl.procs")


class ProcessError(LiverlError):
    """A child process exited or did not listen in time."""


def spawn(cmd: Sequence[str], log_path: str | os.PathLike, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` with stdout and stderr appended to ``log_path``, in a new session (its own process group,
    so ``stop`` reaches everything it starts), told SIGTERM when this process dies, even by kill -9 (so it stops
    what it started in turn). The parent keeps no descriptor of the log."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=True,
            preexec_fn=_term_with_parent,
        )


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def become_subreaper() -> bool:
    """Make this process the "child subreaper" of everything it starts (Linux PR_SET_CHILD_SUBREAPER): a
    grandchild whose parent dies (a vLLM engine core whose server was killed) is re-parented here instead of to
    init, so ``orphans`` finds it. True where the kernel supports it."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER = 36
    except OSError:
        return False


def descendants() -> set[int]:
    """The pids of every live process below this one."""
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def kill_descendants(keep: set[int], timeout: float = 10.0) -> list[str]:
    """SIGTERM, then after ``timeout`` SIGKILL, every process below this one that is not in ``keep`` (what was
    running before the caller started its own), and reap those that already exited. Returns a description of each one
    it had to stop (not the exited ones)."""
    me = psutil.Process()
    try:
        left = [p for p in me.children(recursive=True) if p.pid not in keep]
    except psutil.Error:
        return []
    names = []
    for p in left:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:  # exited already (a vLLM engine core its server killed), reaped
                continue  # here as their subreaper below: not one left running
            names.append(f"{p.pid} {p.name()}")
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return names


def wait_port(host: str, port: int, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Return once ``host:port`` accepts connections; ``ProcessError`` if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        if proc is not None and proc.poll() is not None:
            raise ProcessError(f"{what} exited with code {proc.returncode} before listening on {host}:{port}")
        time.sleep(0.1)
    raise ProcessError(f"{what} did not listen on {host}:{port} within {timeout:.0f} s")


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(procs: Sequence[tuple[str, subprocess.Popen]], timeout: float = 20.0) -> None:
    """SIGTERM every still-running process group, wait up to ``timeout`` in all, then SIGKILL what is left."""
    for _, p in procs:
        if p.poll() is None:
            signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for name, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop on SIGTERM; killing it", name)
            signal_group(p, signal.SIGKILL)
            p.wait()


def tail(path: str | os.PathLike, n_bytes: int = 6000) -> str:
    """The last ``n_bytes`` of a log file, decoded leniently ("(no log)" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
