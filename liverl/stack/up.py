"""``liverl up``: the whole pipeline (serve, ingest, learn, gate) for your model, on the embedded stack, until
stopped. It prints where the endpoint is, how to send feedback (SDK, HTTP, kcat), and where the logs and metrics
are; Ctrl-C stops everything cleanly. ``liverl demo`` is this plus simulated users, for a bounded time.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
from pathlib import Path

from core import fleet, procs
from core.bus import all_topics, ensure_topics, topic_configs
from core.config import LiverlConfig, ServingConfig, advertised_url, redact_url
from core.credentials import PRODUCT_KEY_HEADER, ensure_secrets, feedback_key_path
from core.product import load_product
from core.services import redis_from_url
from liverl.stack.deployment import bind, check_model, claim, made_before_ids, prefix_keys, record
from liverl.stack.releases import log_release
from liverl.stack.stack import Stack, start_stack
from liverl.stack.supervisor import (
    Supervisor,
    child_env,
    ensure_keys,
    init_registry,
    node_serving,
    roles_for,
    wait_http,
)

log = logging.getLogger("liverl.up")

ONE_NODE_PROFILE: dict[str, float] = {"heldout_share": 0.2}
"""What ``liverl up`` (and ``liverl demo``) set in ``[ingest]`` with one configured node, where the config file, the
environment or a flag did not: with no canary to run, the off-policy check on held-out feedback is the only evidence a
candidate can pass on, and the gate waits until its effective sample size reaches ``gate.offpolicy_min_ess``
(``deploy.gate.waiting``). The held-out samples that takes depend on how far the candidate moved, not on the share;
the judged events are that divided by the share. Measured one-node runs of the demo policy (``scripts/onenode_wait.py``,
docs/release.md "One node"): at the default 5% the first promotion came 2,006 and 5,654 judged events (43 and 242 s of
waiting) after its candidate, at 20% 1,050 (5 s); a gate that refuses thin evidence at once (``gate.offpolicy_wait_s``
0) refused all 25 candidates of a 4-minute one-node demo at 5%. The price: the learner trains on 80% of the judged
events, not 95%."""


def apply_one_node_profile(cfg: LiverlConfig) -> dict[str, float]:
    """With fewer than two configured nodes, sets ``ONE_NODE_PROFILE``'s ``[ingest]`` values that ``cfg`` did not set
    explicitly; returns what it set (``ingest.field``: value)."""
    if fleet.configured_nodes(cfg.serving) >= 2:
        return {}
    applied = {}
    for name, value in ONE_NODE_PROFILE.items():
        if name not in cfg.ingest.model_fields_set:
            setattr(cfg.ingest, name, value)
            applied[f"ingest.{name}"] = value
    return applied


class Pipeline:
    """The embedded stack plus the supervised processes, as a context manager."""

    def __init__(self, cfg: LiverlConfig, model_dir: Path, fresh: bool = False):
        self.cfg, self.model_dir, self.fresh = with_local_fleet(cfg), Path(model_dir), fresh
        self.stack: Stack | None = None
        self.supervisor: Supervisor | None = None
        self.redis = None
        self._before: set[int] = set()

    @property
    def gateway_url(self) -> str:
        """Where clients go: the router in front of several nodes, else the one node's gateway."""
        s = self.cfg.serving
        return f"http://{s.host}:{s.router_port if s.nodes > 1 else s.gateway_port}"

    def __enter__(self) -> Pipeline:
        cfg = self.cfg
        load_product(cfg)  # a product that cannot load is refused here, before anything starts
        check_model(cfg, self.model_dir, self.fresh)  # a state dir of another model: refused before anything starts
        procs.become_subreaper()  # a grandchild whose parent dies comes to us, so __exit__ can stop it
        self._before = procs.descendants()
        adopt = made_before_ids(cfg)  # (asked before --fresh removes the registry that says so)
        if self.fresh:
            reset_files(cfg)  # before the broker opens its folder
        try:
            self.stack = start_stack(cfg)
            self.redis = redis_from_url(self.stack.redis_url)
            me = bind(cfg, self.redis, self.model_dir, self.fresh, adopt)  # refuses another deployment's namespace
            if self.fresh:
                reset_keys(cfg, self.redis)
            claim(cfg, self.redis, me, self.model_dir)
            ensure_topics(
                self.stack.bootstrap,
                all_topics(cfg),
                cfg.broker.partitions,
                broker=cfg.broker,
                configs=topic_configs(cfg),
            )
            ensure_keys(cfg)
            ensure_secrets(cfg)  # the router's assignment key and the product key of /v1/feedback
            init_registry(cfg, self.model_dir, self.redis)
            record(cfg, me, self.model_dir)  # in the registry too: what standalone processes check (before they start)
            log_release(cfg, self.redis, me)  # the release that freed the prefix, if any: into this registry's history
            self.supervisor = Supervisor.from_config(
                cfg, child_env(cfg, self.stack, self.model_dir), cfg.state_path / "logs", roles_for(cfg)
            ).start()
            s = cfg.serving
            # ready, not only up: each gateway's /readyz is 200 only when a completion sent now would be served (the
            # engine loaded, a verified version served, the generation log's producer running), the router's only
            # when it routes the stable arm to a node; so the first completion after "liverl is up" succeeds
            for i in range(s.nodes):
                wait_http(
                    f"http://{s.host}:{s.gateway_port + i}/readyz",
                    s.engine_ready_timeout_s + 60,  # (the node's own limit for its engine, then the gateway's start)
                    self.supervisor.children,
                    f"node-{i}'s gateway (vLLM engine start)",
                )
            if s.nodes > 1:
                wait_http(f"{self.gateway_url}/readyz", 60, self.supervisor.children, "the router")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.supervisor is not None:
                self.supervisor.stop()
            if self.redis is not None:
                self.redis.close()
            if self.stack is not None:
                self.stack.close()
        finally:  # whatever a child left behind (an engine core whose server died first): nothing outlives `up`
            left = procs.kill_descendants(self._before)
            if left:
                log.warning(
                    "stopped %d process(es) the pipeline's children left behind: %s", len(left), ", ".join(left)
                )


def local_fleet(cfg: LiverlConfig) -> dict[str, str]:
    """The nodes ``up`` starts, by name, with the URL of each one's gateway (what the router may route to)."""
    s = cfg.serving
    if s.nodes <= 1:
        return {s.node_name: advertised_url(s)}
    nodes = (ServingConfig.model_validate(node_serving(s.model_dump(), i)) for i in range(s.nodes))
    return {n.node_name: advertised_url(n) for n in nodes}


def with_local_fleet(cfg: LiverlConfig) -> LiverlConfig:
    """``cfg`` with ``serving.fleet`` naming the nodes ``up`` starts. A configured fleet must be exactly those nodes:
    ``up`` runs no other."""
    local = local_fleet(cfg)
    if cfg.serving.fleet and cfg.serving.fleet != local:
        raise ValueError(
            f"serving.fleet names {cfg.serving.fleet}, but liverl up runs the nodes {local}; leave "
            "serving.fleet unset for liverl up and liverl demo (they fill it)"
        )
    out = cfg.model_copy(deep=True)
    out.serving.fleet = local
    return out


def reset_files(cfg: LiverlConfig) -> None:
    """A fresh start, on disk: registry, blobs, checkpoints, the broker's log and ingest's tables go (the model
    cache, the keys and the deployment's id stay). Only this state dir's own files: nothing else is touched."""
    state = cfg.state_path
    for name in ("registry.db", "registry.db-wal", "registry.db-shm"):
        (state / name).unlink(missing_ok=True)
    for name in ("blobs", "learner", "logs", "serving", "gate", "broker", "ingest"):
        shutil.rmtree(state / name, ignore_errors=True)


def reset_keys(cfg: LiverlConfig, r) -> None:
    """A fresh start, in Redis: the keys of this deployment's prefix go (the prefix's record of its releases stays:
    ``prefix_keys``). Call only after ``bind`` (which refuses a prefix another deployment claims), so ``--fresh``
    never deletes another deployment's keys."""
    stale = list(prefix_keys(r, cfg.topics.prefix))
    if stale:
        r.delete(*stale)


def agent_metrics(cfg: LiverlConfig) -> str:
    """The usage line of the serving agents' /metrics (swaps, swap pauses): one port per node, counted up."""
    s = cfg.serving
    if not s.agent_port:
        return ""
    ports = f"{s.agent_port}" if s.nodes == 1 else f"{s.agent_port}-{s.agent_port + s.nodes - 1}"
    return f",\n                     http://{s.host}:{ports}/metrics (serving agent: swaps, swap pauses)"


def usage(cfg: LiverlConfig, pipe: Pipeline, model_dir: Path) -> str:
    s, t = pipe.stack, cfg.topics
    gw = pipe.gateway_url
    key = feedback_key_path(pipe.cfg)
    return f"""\
liverl is up: model {model_dir}
  product            {load_product(cfg).describe()}
  OpenAI endpoint    {gw}/v1   (chat/completions, completions, models; the response carries
                     the generation id and the policy version in its body and X-Liverl-* headers)
  send feedback      Python SDK:  FeedbackClient("{s.bootstrap}", "{t.feedback}").accept(generation_id)
                     HTTP:        curl -X POST {gw}/v1/feedback -H 'content-type: application/json' \\
                                    -H "{PRODUCT_KEY_HEADER}: $(cat {key})" \\
                                    -d '{{"feedback_id": "fb-1", "generation_id": "<id>", "kind": "accept"}}'
                     kcat:        echo '<id>|{{"feedback_id":"fb-1","generation_id":"<id>","kind":"reject"}}' \\
                                    | kcat -P -b {s.bootstrap} -t {t.feedback} -K'|' -X partitioner=murmur2_random
  Kafka              {s.bootstrap}  topics {t.feedback}, {t.generations}, {t.samples}, {t.dead_letters}
  Redis / registry   {redact_url(s.redis_url)}  /  {redact_url(s.registry_url)}
  metrics            {gw}/metrics (gateway), http://127.0.0.1:{cfg.ingest.web_port}/metrics (ingest),
                     http://{cfg.serving.host}:{cfg.gate.metrics_port}/metrics (gate){agent_metrics(cfg)}
  logs               {cfg.state_path / "logs"}/{{serve,ingest,learn,gate}}.log
  operate            liverl status | versions | history | promote N | rollback   (another shell)
Ctrl-C stops everything."""


def run_up(cfg: LiverlConfig, model_dir: Path, fresh: bool = False) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"liverl up: starting the embedded stack and the pipeline (state in {cfg.state_path}) ...", flush=True)
    one_node = apply_one_node_profile(cfg)
    if one_node:
        print(
            "liverl up: one serving node, so no canary: candidates are judged on held-out feedback alone and wait "
            f"until it suffices; {', '.join(f'{k}={v}' for k, v in one_node.items())} (set it to override)",
            flush=True,
        )
    with Pipeline(cfg, model_dir, fresh=fresh) as pipe:
        print(usage(cfg, pipe, model_dir), flush=True)
        while not stop.is_set():
            failure = pipe.supervisor.check()
            if failure:
                print(f"liverl up: {failure}; stopping (logs in {cfg.state_path / 'logs'})", flush=True)
                return 1
            stop.wait(1.0)
        print("liverl up: stopping ...", flush=True)
    return 0
