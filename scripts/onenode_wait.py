"""Measure the one-node path: how long (seconds, judged events) a one-node ``liverl up`` takes to promote a candidate
on the off-policy evidence the gate waits for (``deploy.gate.waiting``).

It starts ``liverl up`` (one node, the built-in demo policy, the demo product's rewards and suite) as a user does,
plays the demo product's simulated users against its gateway with feedback over HTTP (``liverl.demo.live``), and
reads the registry every 2 s: each candidate, each look of the wait (ESS, samples), each promotion and refusal, with
the judged events and seconds since the users started. It stops after ``--promotions`` promotions or ``--seconds``.

    PYTHONPATH=. python scripts/onenode_wait.py --seconds 900 --out onenode.json
    PYTHONPATH=. python scripts/onenode_wait.py --set INGEST__HELDOUT_SHARE=0.2 --out onenode-20.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.config import load_config  # noqa: E402
from deploy.registry.registry import open_registry  # noqa: E402
from liverl.demo.live import HttpFeedback, Users, start_up, stop_up  # noqa: E402

PRODUCT = "liverl.demo.product:PRODUCT"
PORTS = ("BROKER__EMBEDDED_PORT", "REDIS__EMBEDDED_PORT", "SERVING__GATEWAY_PORT", "SERVING__VLLM_PORT")
PORTS += ("SERVING__AGENT_PORT", "INGEST__WEB_PORT", "GATE__METRICS_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up_env(prefix: str, settings: dict[str, str]) -> dict[str, str]:
    """This process's environment, every port of the pipeline free, its own prefix, no downloads, ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL__")}
    env.update({f"LIVERL__{p}": str(free_port()) for p in PORTS})
    env.update({"LIVERL__TOPICS__PREFIX": prefix, "HF_HUB_OFFLINE": "1"})
    if os.environ.get("LIVERL_TEST_MODEL_CACHE"):
        env["LIVERL__MODEL__CACHE_DIR"] = os.environ["LIVERL_TEST_MODEL_CACHE"]
    env.update({f"LIVERL__{k}": v for k, v in settings.items()})
    return env


def figures(detail: str) -> dict:
    """ESS and samples of a wait's look, from its recorded reason."""
    m = re.search(r"ESS (\d+) of the (\S+) needed.*? on (\d+) held-out samples", detail or "")
    return {"ess": int(m.group(1)), "samples": int(m.group(3))} if m else {}


def watch(cfg, users: Users, t0: float, seen: dict, out: dict) -> None:
    """One read of the registry: what happened since the last one, stamped with seconds and judged events."""
    reg = open_registry(cfg)
    try:
        now, events = time.time() - t0, users.judged()
        for v in reg.list(limit=200):
            if v.version == 0:
                continue
            key = (v.version, v.status)
            if key not in seen:
                seen[key] = True
                out["statuses"].append(
                    {
                        "t": round(now, 1),
                        "events": events,
                        "version": v.version,
                        "status": v.status,
                        "reason": v.status_reason,
                    }
                )
            for g in reg.gate_results(v.version):
                if g.id in seen:
                    continue
                seen[g.id] = True
                if g.check in ("offpolicy_wait", "offpolicy"):
                    out["looks"].append(
                        {
                            "t": round(g.at - t0, 1),
                            "events": events,
                            "version": v.version,
                            "check": g.check,
                            "passed": g.passed,
                            "value": g.value,
                            **figures(g.detail),
                            "detail": g.detail,
                        }
                    )
    finally:
        reg.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=900.0, help="longest run of the users")
    ap.add_argument("--promotions", type=int, default=1, help="stop after this many promotions by the gate")
    ap.add_argument("--concurrency", type=int, default=8, help="simulated users at once")
    ap.add_argument("--think", type=float, default=0.0, help="each user's mean pause between requests (s)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION__FIELD=VALUE", help="config (env)")
    ap.add_argument("--state-dir", default=None, help="folder for the run's state and log (default: a new temp one)")
    ap.add_argument("--out", default="onenode.json")
    args = ap.parse_args()
    settings = {"LEARNER__LR": "3e-4", **dict(s.split("=", 1) for s in args.set)}
    run = Path(args.state_dir or tempfile.mkdtemp(prefix="onenode-"))
    state, log = run / "state", run / "up.log"
    run.mkdir(parents=True, exist_ok=True)
    env = up_env(f"onenode{os.getpid()}", settings)
    cfg = load_config(env=env, state_dir=str(state))
    t_start = time.time()
    proc = start_up(["--state-dir", str(state), "--product", PRODUCT], env, log)
    out: dict = {"settings": settings, "ready_s": round(time.time() - t_start, 1), "statuses": [], "looks": []}
    gw = f"http://{cfg.serving.host}:{cfg.serving.gateway_port}"
    sdk = HttpFeedback(gw, (state / "keys" / "feedback.key").read_text().strip())
    users = Users(gw, sdk, concurrency=args.concurrency, think_s=args.think).start()
    t0, seen = time.time(), {}
    try:
        while time.time() - t0 < args.seconds:
            time.sleep(2.0)
            watch(cfg, users, t0, seen, out)
            promoted = [s for s in out["statuses"] if s["status"] == "stable"]
            print(
                f"{time.time() - t0:6.0f} s  {users.judged():6d} judged  {len(out['looks'])} looks  "
                f"{len(promoted)} promoted",
                flush=True,
            )
            if len(promoted) >= args.promotions:
                break
    finally:
        users.stop()
        sdk.close()
        out["seconds"] = round(time.time() - t0, 1)
        out["judged"] = users.judged()
        out["feedback_http"] = {"sent": sdk.sent, "failed": sdk.failed, "last_error": sdk.last_error}
        out["users"] = users.stats.snapshot()
        out["rc"] = stop_up(proc)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}; up's log and state: {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
