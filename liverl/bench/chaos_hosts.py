"""``liverl chaos --hosts``: the pipeline on hosts of its own under load, a schedule of host losses and partitions,
then the invariants, checked by ``liverl audit`` and the registry.

The deployment is ``liverl.bench.chaos_deploy``'s: one network namespace and address per host (broker, Redis, the
PostgreSQL registry, serving nodes, routers behind HAProxy, gate, learner, ingest workers); this machine is the
product: its simulated users send completions to the front door (HAProxy) and feedback to the broker.

Faults (``Fault``), one at a time, each followed by its heal and the fleet's convergence:

- ``loss``: every process of the host killed with SIGKILL; the host stays down ``duration`` seconds, then boots
  (its processes start again on the same disk);
- ``cut``: the host's link down for ``duration`` seconds (30-120 by default), its processes running; then up again.

The schedule (``make_schedule``) takes the kinds of host in shuffled rounds, so ``--faults 16`` or more reaches every
kind with a loss and a cut: serving node, ingest worker, learner, gate, router, Redis, database and broker.

Invariants, per fault and at the end:

- **front door**: a request that failed must have been in flight, at the fault, on the router or node that was lost
  or cut; any other failure counts against the fault it followed (``other``);
- **lost / twice**: ``liverl audit`` after the drain: no acknowledged feedback event lost, no sample trained twice,
  each counted in the row of the fault its feedback was sent after; and the feedback topic holds every record the
  broker acknowledged;
- **converge**: seconds from the heal (the link up, or the lost host's processes answering again) until every node
  serves what the registry says it should (stable, or the canary on its nodes), has a fresh heartbeat, and every
  router is UP in HAProxy; at most 60;
- **served, not chosen**: every completion names its node and version; each version must have been chosen by the
  gate (stable, or a rollout's canary, in the registry whose audit log verifies) before it was served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core.config import DELIVERY_MARGIN_S, LiverlConfig
from liverl.bench.chaos_deploy import KINDS, HostDeployment, host_names, kind_of

log = logging.getLogger("liverl.chaos")

CONVERGE_LIMIT_S = 60.0
CUT_S = (30.0, 120.0)
DOWN_S = (5.0, 30.0)


@dataclass(frozen=True)
class Fault:
    what: str  # loss | cut
    host: str
    duration_s: float

    def __str__(self) -> str:
        return f"{self.what}:{self.host}:{self.duration_s:g}"

    @classmethod
    def parse(cls, text: str, default_s: float = 30.0) -> Fault:
        """``loss:router-1`` or ``cut:ingest-1:45`` (seconds down; default ``default_s``)."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ("loss", "cut"):
            raise ValueError(f"a fault is loss:HOST[:SECONDS] or cut:HOST[:SECONDS], not {text!r}")
        return cls(parts[0], parts[1], float(parts[2]) if len(parts) == 3 else default_s)


def make_schedule(
    names: list[str], n: int, seed: int, cut_s: tuple[float, float] = CUT_S, down_s: tuple[float, float] = DOWN_S
) -> list[Fault]:
    """``n`` faults over the hosts ``names``: the kinds (``chaos_deploy.KINDS`` present in ``names``) in shuffled
    rounds; within a kind, a loss and a cut in turn (so two rounds give every kind both), and its hosts in turn, each
    for two rounds (so four rounds give both nodes, both routers and both ingest workers a loss and a cut)."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if any(kind_of(h) == k for h in names)]
    first = {k: rng.randrange(len([h for h in names if kind_of(h) == k])) for k in kinds}
    out: list[Fault] = []
    r = 0
    while len(out) < n:
        order = list(kinds)
        rng.shuffle(order)
        for k in order[: n - len(out)]:
            of_kind = [h for h in names if kind_of(h) == k]
            host = of_kind[(first[k] + r // 2) % len(of_kind)]
            what = "loss" if (r + KINDS.index(k)) % 2 == 0 else "cut"
            lo, hi = down_s if what == "loss" else cut_s
            out.append(Fault(what, host, round(rng.uniform(lo, hi))))
        r += 1
    return out


def hosts_config(cfg: LiverlConfig, nodes: int) -> LiverlConfig:
    """The config a ``--hosts`` run starts from: the demo's product and profile (as ``liverl demo`` sets them where
    the config did not; with one node, the one-node profile too), and partial batches trained within 5 s (the drain
    waits for them). The product must be the demo's: the load is its users.

    Every producer retries a record longer than the longest cut (``broker.delivery_timeout_s``, where the config did
    not set it, 30 s above ``CUT_S``'s longest; ``ingest.pending_ttl_s`` as far above that as the config requires):
    a generation record the gateway could not log while the broker was cut off is logged after the heal, not given
    up on, which is what a deployment that must ride out broker outages of that length configures. The pending TTL
    leaves room, too, for a record that waited out a database cut for its user's key (``record_hold_s``)."""
    from core.product import DEMO_PRODUCT  # noqa: PLC0415
    from liverl.demo.run import apply_demo_profile  # noqa: PLC0415 torch: imported when the command runs

    if cfg.product not in (None, DEMO_PRODUCT):
        raise ValueError(f"liverl chaos --hosts drives the demo product's users; product {cfg.product!r} is not it")
    cfg.product = DEMO_PRODUCT
    if "nodes" not in cfg.serving.model_fields_set:
        cfg.serving.nodes = nodes  # (what the profile's one-node rule counts; the fleet is named by address later)
    apply_demo_profile(cfg)
    cfg.learner.max_batch_wait_s = min(cfg.learner.max_batch_wait_s, 5.0)
    if "delivery_timeout_s" not in cfg.broker.model_fields_set:
        cfg.broker.delivery_timeout_s = max(cfg.broker.delivery_timeout_s, CUT_S[1] + DELIVERY_MARGIN_S)
    if "pending_ttl_s" not in cfg.ingest.model_fields_set:  # and a record may wait out a database cut for its key
        hold_s = CUT_S[1] + DELIVERY_MARGIN_S
        cfg.ingest.pending_ttl_s = max(
            cfg.ingest.pending_ttl_s, cfg.broker.delivery_timeout_s + DELIVERY_MARGIN_S + hold_s
        )
    return cfg


# ------------------------------------------------------------------------------------------------------ the load


@dataclass
class Request:
    start: float  # time.time()
    end: float
    ok: bool
    version: int | None = None
    node: str | None = None
    router: str | None = None
    error: str = ""


class Load:
    """The product: ``concurrency`` simulated users sending the demo's completions to the front door (sticky by user
    key), judging each answer as the demo's users do and sending the feedback from a thread of its own (a broker
    that is away blocks that thread, never the requests). Every request is recorded."""

    def __init__(self, url: str, sdk, concurrency: int, users: int, seed: int, timeout_s: float = 30.0):
        self.url, self.sdk, self.concurrency, self.users = url, sdk, concurrency, users
        self.seed, self.timeout_s = seed, timeout_s
        self.requests: list[Request] = []
        self.sent: dict[str, float] = {}  # feedback id -> time.time() it was handed to the SDK
        self.events: dict[str, tuple[str, bool, float]] = {}  # feedback id -> (generation id, accepted, its ts)
        self.feedback_errors = 0
        self.resent = 0
        self._stop = threading.Event()
        self._fb: queue.Queue = queue.Queue(maxsize=100_000)
        self._threads: list[threading.Thread] = []

    def start(self) -> Load:
        self._threads = [
            threading.Thread(target=lambda: asyncio.run(self._users()), name="chaos-users", daemon=True),
            threading.Thread(target=self._feedback, name="chaos-feedback", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._fb.put(None)
        for t in self._threads:
            t.join(timeout=self.timeout_s + 120)

    def _feedback(self) -> None:
        while (item := self._fb.get()) is not None:
            gid, accept = item
            try:
                ts = time.time()
                fid = (self.sdk.accept if accept else self.sdk.reject)(gid, ts=ts)
                self.sent[fid], self.events[fid] = time.time(), (gid, accept, ts)
            except Exception as e:  # noqa: BLE001 - counted; the broker acknowledged nothing, so nothing is owed
                self.feedback_errors += 1
                log.debug("chaos: feedback not sent: %r", e)

    def deliver(self, rounds: int = 5) -> None:
        """Flush the SDK; what the broker did not take (its link was down longer than the delivery timeout) is sent
        again with the same feedback id and time, as the SDK's ``DeliveryError`` tells a product to. What is still
        undelivered after ``rounds`` was never acknowledged, so nothing is owed for it (``feedback_not_sent``)."""
        from liverl_sdk.client import DeliveryError  # noqa: PLC0415

        for _ in range(rounds):
            try:
                self.sdk.flush()
                return
            except DeliveryError as e:
                for fid, _exc in e.failed:
                    gid, accept, ts = self.events[fid]
                    (self.sdk.accept if accept else self.sdk.reject)(gid, feedback_id=fid, ts=ts)
                    self.resent += 1
        try:
            self.sdk.flush()
        except DeliveryError as e:
            self.feedback_errors += len(e.failed)

    async def _users(self) -> None:
        import aiohttp  # noqa: PLC0415 aiohttp: the CLI's parser stays light

        from liverl.demo import task  # noqa: PLC0415

        async def user(i: int, session) -> None:
            rng = random.Random(self.seed * 1_000_003 + i)
            while not self._stop.is_set():
                p = task.sample_prompt(rng)
                body = {
                    "model": "liverl",
                    "prompt": p.text,
                    "max_tokens": task.MAX_TOKENS,
                    "temperature": task.TEMPERATURE,
                    "user": f"sim-user-{rng.randrange(self.users)}",
                }
                rec = Request(time.time(), 0.0, False)
                try:
                    async with session.post(self.url + "/v1/completions", json=body) as r:
                        rec.router, rec.node = r.headers.get("X-Liverl-Router"), r.headers.get("X-Liverl-Node")
                        data = await r.json(content_type=None)
                        if r.status == 200:
                            text, gid = data["choices"][0]["text"], str(data["liverl"]["generation_id"])
                            rec.version, rec.ok = int(data["liverl"]["policy_version"]), True
                            self._fb.put_nowait((gid, task.user_accepts(p, text)))
                        else:
                            rec.error = f"HTTP {r.status}"
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
                    rec.error = f"{type(e).__name__}: {e}"[:200]
                rec.end = time.time()
                self.requests.append(rec)
                if not rec.ok:
                    await asyncio.sleep(0.5)

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency), timeout=timeout
        ) as session:
            await asyncio.gather(*(user(i, session) for i in range(self.concurrency)))


# ------------------------------------------------------------------------------------------------ the invariants


def converged(dep: HostDeployment, registry, redis, max_age_s: float = 10.0) -> bool:
    """Every node of the fleet serves what the registry says (with a fresh heartbeat), every gateway and router
    answers, and HAProxy has every router UP."""
    from core import fleet  # noqa: PLC0415

    if not all(dep.ready().values()):
        return False
    view = fleet.fleet_view(registry, redis, dep.cfg.topics.prefix, dep.fleet())
    now = time.time()
    return all(
        h in view.nodes and view.nodes[h].converged and now - view.nodes[h].beat.ts < max_age_s for h in dep.fleet()
    )


def chosen_at(registry) -> dict[int, float]:
    """When the gate first chose each version (made it stable, or began a rollout of it as the canary); the base
    version counts from its registration."""
    versions = registry.list()
    out: dict[int, float] = {}
    base = min(v.version for v in versions)
    for v in versions:
        if v.version == base:
            out[v.version] = v.created_at
        elif v.promoted_at is not None:
            out[v.version] = v.promoted_at
    for r in registry.rollouts(limit=None):
        out[r.version] = min(out.get(r.version, r.started_at), r.started_at)
    return out


def served_not_chosen(requests: list[Request], chosen: dict[int, float], slack_s: float = 1.0) -> list[Request]:
    """Answers whose version the gate had not chosen when they were served."""
    return [r for r in requests if r.ok and (r.version not in chosen or chosen[r.version] > r.end + slack_s)]


@dataclass
class Row:
    """One fault and what followed it, up to the next fault (the table's row)."""

    fault: Fault
    t: float  # time.time() of the fault
    back_s: float | None = None  # loss: seconds from the boot until the host answered again
    noticed_s: float | None = None  # a router's fault: seconds until the balancer took it out of rotation
    converge_s: float | None = None
    failed_in_flight: int = 0
    failed_other: int = 0
    lost: int | None = None
    twice: int | None = None
    not_chosen: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.failed_other == 0
            and self.lost == 0
            and self.twice == 0
            and self.not_chosen == 0
            and self.converge_s is not None
            and self.converge_s <= CONVERGE_LIMIT_S
        )


def attribute(rows: list[Row], requests: list[Request], end: float) -> None:
    """Each failed request to the fault it followed (it ended after that fault, before the next one, or ``end``).
    Excused (``failed_in_flight``): it started before the fault (a router's: before the balancer took the router out
    of rotation, ``noticed_s``: until then the balancer still sends it requests), the fault hit a router or a node
    (the hosts a request passes through), and a response head, if it got one, names that host (HAProxy's
    ``X-Liverl-Router``, the router's ``X-Liverl-Node``). Every other failure is ``failed_other``."""
    for i, row in enumerate(rows):
        t1 = rows[i + 1].t if i + 1 < len(rows) else end
        kind, victim = kind_of(row.fault.host), row.fault.host
        cutoff = row.t + (row.noticed_s or 0.0) if kind == "router" else row.t
        for r in requests:
            if r.ok or not (row.t <= r.end < t1):
                continue
            named = r.router if kind == "router" else r.node
            if kind in ("router", "node") and r.start < cutoff and named in (None, victim):
                row.failed_in_flight += 1
            else:
                row.failed_other += 1
                if len(row.errors) < 3:
                    row.errors.append(r.error)


def place_verdicts(rows: list[Row], report, samples: dict, sent: dict[str, float], end: float) -> dict[str, int]:
    """Each row's ``lost`` and ``twice`` from the final audit (``report``): its lost feedback events, and those whose
    sample (``samples``: feedback id -> (partition, offset, sample id), the audit's read of the samples topic) was
    trained twice, each in the row of the fault it was sent after (``sent``: feedback id -> when). Returns how many
    fell in no row (sent before the first fault, or not by the load)."""
    if report is None:
        return {}
    twice = set(report.trained_twice)
    twice_fids = {fid for fid, recs in samples.items() if any(sid in twice for _, _, sid in recs)}
    for row in rows:
        row.lost, row.twice = 0, 0
    out = {"lost": 0, "twice": 0}
    for name, fids in (("lost", report.lost_examples), ("twice", sorted(twice_fids))):
        for fid in fids:
            t = sent.get(fid)
            row = next((r for i, r in enumerate(rows) if t is not None and r.t <= t < _next_t(rows, i, end)), None)
            if row is None:
                out[name] += 1
            else:
                setattr(row, name, getattr(row, name) + 1)
    return out


def _next_t(rows: list[Row], i: int, end: float) -> float:
    return rows[i + 1].t if i + 1 < len(rows) else end


def table(rows: list[Row], before: int, command: str) -> str:
    lines = [
        "",
        "| # | t (s) | fault | host | duration (s) | back after (s) | failed at the front door: in flight on it / "
        "other | lost | twice | converge (s) | served, not chosen | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    t0 = rows[0].t if rows else 0.0
    for i, r in enumerate(rows):
        back = "-" if r.back_s is None else f"{r.back_s:.0f}"
        conv = "NOT" if r.converge_s is None else f"{r.converge_s:.0f}"
        lines.append(
            f"| {i + 1} | {r.t - t0:.0f} | {r.fault.what} | {r.fault.host} | {r.fault.duration_s:g} | {back} | "
            f"{r.failed_in_flight} / {r.failed_other} | {r.lost} | {r.twice} | {conv} | {r.not_chosen} | "
            f"{'yes' if r.ok else 'NO'} |"
        )
    lines += ["", f"requests failed before the first fault: {before}", f"reproduce: `{command}`"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- the run


def run_chaos_hosts(
    cfg: LiverlConfig,
    model_dir: Path,
    faults: list[Fault] | None = None,
    n_faults: int = 16,
    seed: int = 0,
    nodes: int = 2,
    ingest: int = 2,
    concurrency: int = 8,
    warm_s: float = 30.0,
    gap_s: float = 10.0,
    drain_timeout_s: float = 600.0,
    summary_path: str | None = None,
    command: str = "liverl chaos --hosts",
) -> dict:
    """Start the deployment, run the load, apply ``faults`` (or ``n_faults`` from ``make_schedule``), drain, audit;
    print the table and return the summary (``ok``: every invariant held)."""
    from deploy.registry.registry import open_registry  # noqa: PLC0415 torch: imported when the command runs
    from liverl.ops.audit import _samples  # noqa: PLC0415
    from liverl.ops.chaos import _acked_client, _drain  # noqa: PLC0415

    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # the users' client retries while the broker is away
    for sig in (signal.SIGINT, signal.SIGTERM):  # stopped (Ctrl-C, a timeout's SIGTERM): every host is stopped too
        signal.signal(sig, _interrupt)
    names = host_names(nodes=nodes, ingest=ingest)
    schedule = faults if faults is not None else make_schedule(names, n_faults, seed)
    unknown = [f.host for f in schedule if f.host not in names or kind_of(f.host) not in KINDS]
    if unknown:
        raise ValueError(f"no such host to fault: {unknown} (hosts: {', '.join(h for h in names if h != 'lb')})")
    print(
        f"liverl chaos --hosts: {len(names)} hosts ({', '.join(names)}), {len(schedule)} faults: "
        f"{', '.join(map(str, schedule))}; state in {cfg.state_path}",
        flush=True,
    )
    rows: list[Row] = []
    with HostDeployment(cfg, model_dir, names) as dep:
        from core.services import redis_from_url  # noqa: PLC0415

        print(f"  every host up; the front door is {dep.front_door}", flush=True)
        dep.cfg.registry.url = dep.registry_url + "?connect_timeout=5"  # (the machine's own reads of the registry)
        redis = redis_from_url(dep.redis_url, socket_timeout=5, socket_connect_timeout=3)
        registry = open_registry(dep.cfg)
        sdk = _acked_client(dep.bootstrap, cfg.topics.feedback, cfg.broker)
        load = Load(dep.front_door, sdk, concurrency, cfg.demo.users, seed).start()
        try:
            _pause(dep, warm_s)
            t_first = time.time()
            for fault in schedule:
                rows.append(_apply(dep, fault, registry, redis))
                r = rows[-1]
                print(f"  {fault}: back after {r.back_s} s, converged {r.converge_s} s after the heal", flush=True)
                _pause(dep, gap_s)
        finally:
            load.stop()
        load.deliver()
        load_end = time.time()
        print(f"load stopped: {len(load.requests)} requests; draining ...", flush=True)
        sdk.close()
        registry.close()
        redis.close()  # (clients of their own for the end: these may hold connections a fault broke)
        redis = redis_from_url(dep.redis_url, socket_timeout=10, socket_connect_timeout=3)
        report, converge_s = _drain(dep.cfg, _DrainView(dep, redis), time.monotonic(), drain_timeout_s)
        registry = open_registry(dep.cfg)
        try:
            chosen = chosen_at(registry)
            audit_log = registry.verify_audit()
            audit_log_ok = audit_log.ok
        finally:
            registry.close()
            redis.close()
        attribute(rows, load.requests, load_end)
        unplaced = place_verdicts(rows, report, _samples(dep.cfg, dep.bootstrap) if report else {}, load.sent, load_end)
        bad = served_not_chosen(load.requests, chosen)
        for row_i, row in enumerate(rows):
            t1 = rows[row_i + 1].t if row_i + 1 < len(rows) else load_end
            row.not_chosen = sum(1 for r in bad if row.t <= r.end < t1)
        before = sum(1 for r in load.requests if not r.ok and r.end < t_first)
        restarts = dict(dep.restarts)
    missing = sdk.acked - (report.feedback_records if report else 0)
    summary = {
        "hosts": names,
        "schedule": [str(f) for f in schedule],
        "rows": [{**asdict(r), "fault": str(r.fault), "ok": r.ok} for r in rows],
        "requests": len(load.requests),
        "failed_before_first_fault": before,
        "lost_or_twice_not_in_a_row": unplaced,
        "served_not_chosen_before_first_fault": sum(1 for r in bad if r.end < t_first),
        "acked_feedback_records": sdk.acked,
        "acked_not_in_topic": max(missing, 0),
        "feedback_not_sent": load.feedback_errors,
        "feedback_sent_again": load.resent,
        "roles_restarted_by_their_host": restarts,
        "audit_log_verifies": audit_log_ok,
        "audit_log_problem": audit_log.problem,
        "drain_converge_s": None if converge_s is None else round(converge_s, 1),
        "audit": report.as_dict() if report is not None else None,
        "command": command,
    }
    summary["ok"] = bool(
        rows
        and all(r.ok for r in rows)
        and before == 0
        and not bad
        and report is not None
        and not report.problems()
        and converge_s is not None
        and missing <= 0
        and audit_log_ok
    )
    print(table(rows, before, command))
    print(
        f"\nfeedback acknowledged {sdk.acked} (in the topic: {report.feedback_records if report else '?'}; "
        f"{load.resent} sent again after a delivery timeout); "
        f"drain converged after {summary['drain_converge_s']} s; audit problems: "
        f"{report.problems() if report else 'no audit'}; audit log verifies: {audit_log_ok}; "
        f"roles their host restarted: {restarts}; {'OK' if summary['ok'] else 'FAILED'}"
    )
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2, default=str))
        print(f"summary: {summary_path}")
    return summary


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class _DrainView:
    """What ``liverl.ops.chaos._drain`` reads of a pipeline: its supervisor's ``check``, Redis and the broker."""

    def __init__(self, dep: HostDeployment, redis):
        self.redis, self.supervisor = redis, self
        self.stack = type("S", (), {"bootstrap": dep.bootstrap})()
        self._dep = dep

    def check(self) -> None:
        self._dep.check()


def _pause(dep: HostDeployment, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dep.check()
        time.sleep(0.5)


def _apply(dep: HostDeployment, fault: Fault, registry, redis) -> Row:
    """One fault: apply it, hold it ``duration_s`` (the hosts' init systems keep running), heal it, wait for the
    fleet to converge (up to 3x the limit, to report how long it took)."""
    row = Row(fault, time.time())
    print(f"  {time.strftime('%H:%M:%S')} {fault.what} {fault.host} for {fault.duration_s:g} s", flush=True)
    if fault.what == "loss":
        dep.lose(fault.host)
    else:
        dep.hosts.cut(fault.host)
    if kind_of(fault.host) == "router":  # when the balancer took it out: until then it still gets requests
        end = time.monotonic() + fault.duration_s
        while time.monotonic() < end and row.noticed_s is None:
            dep.check()
            if dep.lb_states().get(fault.host, "UP").startswith(("DOWN", "MAINT")):
                row.noticed_s = round(time.time() - row.t, 2)
            time.sleep(0.1)
        _pause(dep, end - time.monotonic())
    else:
        _pause(dep, fault.duration_s)
    if fault.what == "loss":
        t_boot = time.monotonic()
        dep.boot(fault.host, wait=False)
        _until(dep, lambda: dep.host_back(fault.host), 600)
        row.back_s = round(time.monotonic() - t_boot, 1)
    else:
        dep.hosts.restore(fault.host)
    healed = time.monotonic()
    if _until(dep, lambda: _safe(converged, dep, registry, redis), 3 * CONVERGE_LIMIT_S + 120):
        row.converge_s = round(time.monotonic() - healed, 1)
    return row


def _until(dep: HostDeployment, pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        dep.check()
        if pred():
            return True
        time.sleep(1.0)
    return False


def _safe(fn, *args):
    """``fn(*args)``, or None when a service it reads is away (logged: the caller retries or reports it)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a retry boundary: the registry or Redis may be mid-recovery
        log.info("chaos: %s: %r", getattr(fn, "__name__", fn), e)
        return None
