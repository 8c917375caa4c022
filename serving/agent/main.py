"""The serving process (``liverl serve``): a vLLM node with the OpenAI gateway inside it, and the hot-swap agent.

The gateway runs in the node's API-server process (``serving.node.gateway_host``): product requests reach vLLM's engine
client with no second process and no second HTTP hop. This process starts that node, runs the agent (which decides
what the node serves: ``serving.agent.agent``), serves the agent's metrics and health on
``serving.host:serving.agent_port`` (``serving.agent.metrics``; 0: off) and watches the node.

``serve`` refuses to start without an announcement verify key (``security.verify_key`` or
``<state_dir>/keys/announce.pub``) unless ``security.allow_unsigned`` is set; it starts the node and the agent and
runs until its stop event is set (or the node dies: the process then exits with the node's log tail, and its
supervisor restarts it); ``run_serving`` is the blocking entry point that sets the stop event on SIGTERM or SIGINT.

Probes, on ``serving.agent_port``: ``/livez`` (this process's event loop answers and its node runs) and ``/readyz``
(the agent's side of the gateway's own ``/readyz``). A stop drains the node (``drain``): at once the gateway admits no
new generation (its ``/readyz`` answers 503, a generation request 503 with ``X-Liverl-Draining``, which routers take as
"try the next node") and the heartbeat says the node is out of service, so routers take it out of rotation; then the
generations in flight finish (at most ``serving.drain_timeout_s``), the heartbeat is deleted and vLLM is stopped,
with nothing in flight to cut. A stop while the engine is still starting abandons the start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from core import keys
from core.config import LiverlConfig
from core.services import redis_from_url, required_verify_key
from deploy.registry.blobstore import open_blob_store
from serving.agent.agent import Agent
from serving.agent.launch import NodeStartCancelled, start_node
from serving.agent.metrics import AgentMetrics, start_agent_server
from serving.node.client import NodeClient
from serving.node.gateway import event_loop_factory
from serving.node.gateway_host import CONTROL_PATH, GatewayLink

log = logging.getLogger("liverl.serving")


async def _bounded_executor(loop: asyncio.AbstractEventLoop, n: int) -> None:
    """Give the loop a fixed pool of ``n`` worker threads, all started now (registry, codec and DNS calls run
    there): the thread count stays bounded and constant while serving, rather than growing on demand."""
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="liverl-serving")
    loop.set_default_executor(pool)
    barrier = threading.Barrier(n)
    await asyncio.gather(*[loop.run_in_executor(pool, barrier.wait, 10) for _ in range(n)])


async def serve(
    cfg: LiverlConfig,
    model_dir: str | os.PathLike,
    bootstrap: str,
    redis_url: str,
    registry_url: str | None,
    stop: asyncio.Event,
    on_ready=None,
    base_version: int = 0,
) -> None:
    """Start the node (its gateway inside) and the agent, serve until ``stop`` is set, then shut everything down.
    Refuses to start (a ``ValueError`` naming both ways out) without an announcement verify key, unless
    ``security.allow_unsigned``. ``on_ready(gateway_link, agent, node)`` is called once the node serves."""
    required_verify_key(cfg)  # before the node starts: an agent that would follow any Redis writer does not start
    await _bounded_executor(asyncio.get_running_loop(), 4)
    metrics = AgentMetrics()
    agent: Agent | None = None

    starting = "the vLLM node is starting"

    def health() -> tuple[bool, dict]:
        if agent is None:
            return False, {"ok": False, "reason": starting, "version": None, "node": cfg.serving.node_name}
        return agent.health()

    def ready() -> tuple[bool, dict]:
        if agent is None or stop.is_set():
            why = starting if not stop.is_set() else "draining: the node is stopping"
            return False, {"ready": False, "reason": why, "version": None, "node": cfg.serving.node_name}
        return readiness(agent)

    def live() -> tuple[bool, dict]:  # this loop answers; a dead node ends the process (the agent's node_alive)
        ok = node is None or node.alive
        return ok, {"ok": ok, "node": cfg.serving.node_name, "reason": None if ok else "the vLLM node exited"}

    # before the node: a port in use stops the process at once, not after the engine's start
    node = client = rds = registry = agent_task = None
    web = await start_agent_server(metrics, health, cfg.serving.host, cfg.serving.agent_port, live=live, ready=ready)
    try:
        log_path = cfg.state_path / "logs" / f"vllm-{cfg.serving.node_name}.log"
        cancel = threading.Event()  # a SIGTERM during the engine's start abandons it: no wait for the model to load
        watch = asyncio.create_task(stop.wait())
        watch.add_done_callback(lambda _t: cancel.set())
        try:
            node = await asyncio.to_thread(
                start_node,
                cfg,
                model_dir,
                log_path,
                base_version=base_version,
                gateway_bootstrap=bootstrap,
                cancel=cancel,
            )
        except NodeStartCancelled:
            log.info("stopped while the vLLM node was starting")
            return
        finally:
            watch.cancel()
        client = NodeClient(node.url, key=node.key)
        link = GatewayLink(client, cfg.serving.node_name)
        rds = redis_from_url(redis_url, asyncio=True)
        await client.start()
        if registry_url:
            from deploy.registry.registry import Registry  # noqa: PLC0415 torch: via deploy.registry.registry, with a registry only

            registry = Registry(registry_url, open_blob_store(cfg.blob_location))
        agent = Agent(cfg, link, rds, registry, metrics=metrics)
        await agent.init()
        agent_task = asyncio.create_task(agent.run(stop, node_alive=lambda: node.alive))
        log.info(
            "gateway on http://%s:%d, in the vLLM node's process (node %s, engine start %.1f s)",
            cfg.serving.host,
            cfg.serving.gateway_port,
            node.url,
            node.start_s,
        )
        if on_ready is not None:
            on_ready(link, agent, node)
        stop_task = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({agent_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
        if agent_task in done and agent_task.exception() is not None:
            raise RuntimeError(f"serving stopped: {agent_task.exception()}; vLLM log tail:\n{node.log_tail()}")
        await drain(cfg, agent, agent_task, client, node)
    finally:
        if agent_task is not None and not agent_task.done():
            agent_task.cancel()
            await asyncio.gather(agent_task, return_exceptions=True)
        if web is not None:
            await web.cleanup()
        if client is not None:
            await client.close()
        if rds is not None:
            await rds.aclose()
        if registry is not None:
            registry.close()
        if node is not None:
            await asyncio.to_thread(node.stop)  # SIGTERM: the node's gateway flushes its producer before it exits


def readiness(agent: Agent) -> tuple[bool, dict]:
    """(ready, body) of the serving process's ``/readyz``: the agent's side of the gateway's ``/readyz`` (a verified
    version served, not draining)."""
    gw = agent.gw
    reason = "draining: the node is stopping" if gw.draining else gw.unhealthy_reason
    if reason is None and gw.version is None:
        reason = "no verified version served yet"
    return reason is None, {"ready": reason is None, "reason": reason, "version": gw.version, "node": agent.name}


async def drain(cfg: LiverlConfig, agent: Agent, agent_task: asyncio.Task, client: NodeClient, node) -> None:
    """The graceful stop (SIGTERM): admit nothing new and leave the routers' rotation at once (``Agent.drain``), let
    the agent finish the step in hand (a swap is never cut), wait until the gateway has no generation in its handlers
    (at most ``serving.drain_timeout_s`` in all), then delete the heartbeat: the node has left the fleet, and stopping
    it cuts nothing."""
    t0 = time.monotonic()
    deadline = t0 + cfg.serving.drain_timeout_s
    log.info("node %s draining: no new generations, out of rotation", cfg.serving.node_name)
    await agent.drain()
    try:
        await asyncio.wait_for(asyncio.shield(agent_task), max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        log.warning("the agent's step did not end within serving.drain_timeout_s; cutting it")
    except Exception:  # noqa: BLE001 - the agent's failure is logged where it happened; the drain goes on
        pass
    active = None
    while node.alive and time.monotonic() < deadline:
        try:
            status, state = await client.request("GET", CONTROL_PATH, retry=False)
        except Exception as e:  # noqa: BLE001 - a node that does not answer has nothing to drain that we can wait for
            log.warning("the node's gateway did not answer during the drain (%s); stopping it", e)
            break
        if status != 200:  # no gateway runs in the node: nothing to wait for
            log.warning("the node's gateway answered HTTP %s during the drain: %s; stopping it", status, state)
            break
        if not state.get("draining"):  # the agent's report was lost: say it again
            await agent.drain()
        elif (active := int(state.get("active") or 0)) == 0:
            break
        await asyncio.sleep(0.05)
    if active:
        log.warning("%d generation(s) still in flight after serving.drain_timeout_s; stopping anyway", active)
    try:  # the node has left the fleet now, not when its heartbeat expires
        await agent.redis.delete(keys.served(agent.prefix, agent.name))
    except Exception as e:  # noqa: BLE001 - the heartbeat (out of service already) expires on its own
        log.error("could not delete node %s's heartbeat: %s", agent.name, e)
    log.info("node %s drained in %.2f s; stopping it", cfg.serving.node_name, time.monotonic() - t0)


def run_serving(
    cfg: LiverlConfig, model_dir: str | os.PathLike, bootstrap: str, redis_url: str, registry_url: str | None
) -> None:
    """Blocking entry point (``liverl serve``): serve until SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, model_dir, bootstrap, redis_url, registry_url, stop)

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(main())
