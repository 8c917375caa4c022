"""`liverl demo`: `liverl up` plus the demo product's simulated users, for a bounded time.

The demo is a customer, not the core: it runs the same pipeline ``liverl up`` runs, with
``product = "liverl.demo.product:PRODUCT"`` (rewards, the sums evaluation suite, simulated users), and its
users touch only the public interfaces (HTTP to the gateway, feedback through the SDK). It watches the live
counters and writes a summary (JSON) and a plot (PNG) of live acceptance per version.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
from pathlib import Path

from core import fleet, keys
from core.config import LiverlConfig
from core.product import DEMO_PRODUCT, load_product
from deploy.registry.registry import open_registry
from liverl.demo.report import Timeline, build_summary, plot_timeline, print_summary, read_hash, read_live
from liverl.demo.sim import SimStats
from liverl.demo.view import LiveView
from liverl.stack.up import ONE_NODE_PROFILE, Pipeline
from liverl_sdk import FeedbackClient

log = logging.getLogger("liverl.demo")


DEMO_PROFILE: dict[str, dict[str, float | int | str]] = {
    "serving": {"nodes": 2},
    "gate": {
        "canary_share": 0.5,
        "canary_margin": 0.03,
        "guardrail_margin": 0.03,
        "canary_deadline_s": 480.0,
        "canary_max_events": 6000,
        "canary_min_events": 50,
        "revert_horizon_s": 75.0,
        "latency_tolerance": 1.0,
        "latency_guardrail": "harm",
    },
    "learner": {"max_staleness": 40, "lr": 3e-4, "rebase_after_refusals": 2, "candidate_ema": 0.97},
}
"""What ``liverl demo`` changes from the production defaults, where the config file, the environment or a flag did not
set it: two serving nodes behind the router, and canaries sized for a 10-minute run on a laptop's traffic (~50
judged events/s): half the users, 50 events per arm before any decision, non-inferiority within 3 points (kept
acceptance, and the edit and revert rates: see below), a budget
of 6,000 judged events on the canary arm (what a 4-minute canary gathered at ~85 requests/s) capped at 8 minutes,
and a revert horizon of 75 s (the trap's reverts come 30 s after the accept on average: 92% of them within 75 s; a
bucket of judgements is read once its horizon has closed, so the first evidence comes about 90 s into a canary).
The guardrails' margin is 3 points, not the production 2: the demo's reverts are held by a third of its users (the
trap's tempted ones), about 9% of all events, so the revert rate's user-unit standard error at 6,000 events an arm is
0.008, and a better candidate that reverts as often as stable needed the whole budget to be shown within 2 points
(a first canary held the only slot 381 s on a 2-core machine; ``liverl bench canary --decisions --world demo``: median
384 s and 6,015 canary events at 2 points, 235 s and 2,915 at 3). The smallest exploiting version (15 points more
bait to the trap segment) raises the revert rate by 4.7 points (0.5 x 0.15 x 0.7 x 0.9), above the margin, and a
guardrail is shown worse against stable's own rate, not the margin: the same bench aborts it in every canary (65% on
the revert rate shown worse, the rest as futile), the bait in every canary on the revert rate, and promotes neither,
at either margin.
Production canaries (20% of users, 30 minutes) would not decide inside the demo. The learner trains the demo's tiny
policy at lr 3e-4 (the production default, 1e-6, is for a real LLM; the demo policy would barely move in 10
minutes). Latency is tolerated up to twice stable's: both vLLM nodes share two cores with the learner and the gate,
and within one run the canary node's mean latency ranged from 0.6x to 1.25x the stable node's, for versions
answering at the same length (measured: a canary 41% better on kept acceptance was aborted as 25% slower under the
production tolerance), and a promotion does not wait for latency to be shown non-inferior (``gate.latency_guardrail
= "harm"``: it still stops a canary shown slower): the two engines trade the cores' load, so their 10 s latency
means are anti-correlated (-0.72 to -0.90 in a run) and two canaries already shown better waited 75-85 s on latency
alone, their arms at 296 against 293 ms. The learner accepts samples up to 40 candidates' worth of updates (400)
behind its weights, not 8: one gate cycle (evaluation, then a 90-240 s canary) is 150-250 of its updates here, so
with 8 most of the stable arm's samples were dropped as stale and it starved (23,552 of 55,841 trained in one run).
The learner rebases onto stable after 2 candidates in a row refused on their evidence, not 5: in hour-long demo runs
a run of refusals held 1-4 refused candidates and lasted until another of the same lineage got through a canary (up
to 574 s). Each candidate is the average of the learner's weights over its last ~33 updates
(``learner.candidate_ema`` 0.97), not its last update's: at lr 3e-4 one update's weights are a random draw around
the lineage (``scripts/plateau_sim.py``). The embedded broker keeps its log in the state folder, as `liverl up` does
(durable: a restart of the demo loses nothing acknowledged); on two cores it costs the demo about a quarter of its
requests against the in-memory broker (31,020 against 42,325 in 10 minutes, BENCHMARKS.md), and
`LIVERL__BROKER__EMBEDDED_STORAGE=memory` takes that back for a throwaway run."""


def final_window(demo) -> float:
    """Seconds at the end of the run in which the learner emits no candidates (``demo.final_window_s``), so that the
    last promoted version is measured on fresh traffic; at most half the run, so that a short run still trains: a
    120-s run with the 120-s default held the learner from its first second and produced no version at all."""
    return max(0.0, min(demo.final_window_s, demo.duration_s / 2))


def apply_demo_profile(cfg: LiverlConfig) -> dict[str, float | int | str]:
    """Sets ``DEMO_PROFILE``'s values that ``cfg`` did not set explicitly; returns what it set (section.field:
    value)."""
    applied = {}

    def fill(section: str, values: dict) -> None:
        sec = getattr(cfg, section)
        for name, value in values.items():
            if name not in sec.model_fields_set:
                setattr(sec, name, value)
                applied[f"{section}.{name}"] = value

    for section, values in DEMO_PROFILE.items():
        fill(section, values)
    if fleet.configured_nodes(cfg.serving) < 2:  # after the profile's serving.nodes (liverl.stack.up says why)
        fill("ingest", ONE_NODE_PROFILE)
    return applied


def _trap_kwargs(users, cfg: LiverlConfig) -> dict:
    """The reward-hacking trap (``demo.trap``) and the traffic (``demo.concurrency``), for a product's users that
    know them (the demo's do)."""
    params = inspect.signature(users).parameters
    out = {"trap": cfg.demo.trap} if "trap" in params else {}
    if "concurrency" in params:
        out["concurrency"] = min(cfg.demo.concurrency, cfg.demo.users)
    return out


def run_demo(
    cfg: LiverlConfig, model_dir: Path, summary_path: str | None = None, plot_path: str | None = None, live: bool = True
) -> dict:
    # the SDK's producer shares this process with the users' event loop; its "slow task" warnings are noise here
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    if cfg.product is None:
        cfg.product = DEMO_PRODUCT
    product = load_product(cfg)
    users = product.simulated_users()
    if users is None:
        raise ValueError(f"product {cfg.product!r} has no simulated users; `liverl up` runs a product without them")
    state = cfg.state_path
    demo_dir = state / "demo"
    demo_dir.mkdir(parents=True, exist_ok=True)
    profile = apply_demo_profile(cfg)
    summary_path = Path(summary_path) if summary_path else demo_dir / "summary.json"
    plot_path = Path(plot_path) if plot_path else demo_dir / "acceptance.png"

    hold_s = final_window(cfg.demo)
    print(
        f"liverl demo: {cfg.demo.duration_s:.0f} s, {cfg.demo.users} simulated users ({cfg.demo.concurrency} at once), "
        f"product {product.describe()}, state in {state}; no new candidates in the last {hold_s:.0f} s "
        "(the last promoted version is measured then)",
        flush=True,
    )
    print(
        f"  {cfg.serving.nodes} serving node(s); reward-hacking trap {'on' if cfg.demo.trap else 'off'}"
        + ("" if cfg.ingest.train_reverts else " (the learner chases raw acceptance: reverts train no correction)")
        + "; gate "
        + (
            "INTEGRITY ONLY"
            if cfg.gate.integrity_only
            else f"with canaries on {cfg.gate.canary_share:.0%} of users"
            if cfg.serving.nodes > 1
            else "offline checks"
        )
        + (f"; demo settings: {', '.join(f'{k}={v}' for k, v in profile.items())}" if profile else ""),
        flush=True,
    )
    print(
        "[1/3] embedded stack (Kafka-compatible broker, Redis, SQLite registry, blob folder) and the pipeline: "
        "serve (vLLM + gateway + agent), ingest, learn, gate ...",
        flush=True,
    )
    with Pipeline(cfg, model_dir, fresh=True) as pipe:
        print(f"[2/3] gateway ready at {pipe.gateway_url}; logs in {state / 'logs'}", flush=True)
        print(f"[3/3] simulated users for {cfg.demo.duration_s:.0f} s ...", flush=True)
        timeline = Timeline()
        sdk = FeedbackClient(pipe.stack.bootstrap, cfg.topics.feedback)
        stats, failure = _drive(cfg, pipe, users, sdk, timeline, live)
        sdk.flush()
        time.sleep(3.0)  # let ingest count the last feedback

        registry = open_registry(cfg)
        try:
            summary = build_summary(cfg, pipe.redis, registry, timeline, stats, product.describe())
        finally:
            registry.close()
        summary["failure"] = failure
        summary["process_restarts"] = dict(pipe.supervisor.restarts)
        sdk.close()

    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    plot_timeline(timeline, summary, plot_path)
    print_summary(summary, summary_path, plot_path)
    return summary


def _drive(cfg: LiverlConfig, pipe: Pipeline, users, sdk, timeline: Timeline, live: bool) -> tuple[object, str | None]:
    """Run the users in an asyncio loop on a thread while this thread supervises and displays."""
    r, prefix = pipe.redis, cfg.topics.prefix
    stats = SimStats()
    loop = asyncio.new_event_loop()
    stop: asyncio.Event | None = None
    ready = threading.Event()

    def users_thread():
        nonlocal stop
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        ready.set()
        loop.run_until_complete(
            users(
                pipe.gateway_url, sdk, cfg.demo.users, stop, stats, seed=cfg.model.seed + 1, **_trap_kwargs(users, cfg)
            )
        )

    th = threading.Thread(target=users_thread, name="sim-users", daemon=True)
    th.start()
    ready.wait()
    t0 = time.time()
    held = False
    failure = None
    registry = open_registry(cfg)
    try:
        with LiveView(cfg, live) as view:
            while (elapsed := time.time() - t0) < cfg.demo.duration_s:
                failure = pipe.supervisor.check()
                if failure:
                    break
                if not held and elapsed >= cfg.demo.duration_s - final_window(cfg.demo):
                    r.set(keys.learner_hold(prefix), "1")  # measure the last promoted version on fresh traffic
                    held = True
                served = _served_version(r, prefix)
                liv = read_live(r, prefix)
                timeline.add(served, liv)
                view.update(
                    elapsed,
                    stats,
                    served,
                    liv,
                    read_hash(r, keys.ingest_counters(prefix)),
                    read_hash(r, keys.learner(prefix)),
                    registry,
                    held,
                )
                time.sleep(1.0)
    finally:
        registry.close()
        loop.call_soon_threadsafe(stop.set)
        th.join(timeout=30)
    return stats, failure


def _served_version(r, prefix: str) -> int | None:
    """The newest version any node serves (the live view's headline)."""
    vs = [b.version for b in fleet.read_heartbeats(r, prefix).values() if b.version is not None]
    return max(vs) if vs else None
