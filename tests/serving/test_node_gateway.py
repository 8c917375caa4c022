"""The gateway runs inside the vLLM node's API-server process (``serving.node.gateway_host``): the product's
port is a socket of the node's process, the serving process holds none, the agent's reports reach the gateway only
with the node key, and they carry state (the served version, a node taken out of service), never counters: the
agent's counters are the serving process's own (``serving.agent.metrics``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import psutil
import pytest

from serving.node.gateway_host import CONTROL_PATH, GatewayLink, apply_ops


def _listeners(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def _call(url: str, body=None, key: str = "") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_gateway_port_is_the_node_process_s_and_the_serving_process_holds_no_socket_for_it(srv):
    """No second hop: the gateway's port is listened on by the vLLM API-server process itself, beside vLLM's own
    port; the serving process (the agent, here the test's own process) listens on neither."""
    node_pid = srv.serving.node.proc.pid
    node_ports = _listeners(node_pid)
    assert srv.cfg.serving.gateway_port in node_ports and srv.cfg.serving.vllm_port in node_ports
    assert srv.cfg.serving.gateway_port not in _listeners(psutil.Process().pid)
    status, out = _call(srv.url + "/v1/completions", {"prompt": "[a]23+45=", "max_tokens": 3})
    assert status == 200 and out["choices"][0]["generation_id"], out


def test_the_agent_s_reports_need_the_node_key_and_reach_the_gateway(srv):
    """``/liverl/gateway`` sits inside the node key check; with the key it answers the gateway's state, which agrees
    with what the product sees at ``/liverl/version`` and with what the agent holds."""
    url = srv.node_url + CONTROL_PATH
    assert _call(url)[0] == 401
    assert _call(url, {"ops": [["unhealthy", "forged"]]})[0] == 401
    status, state = _call(url, key=srv.node_key)
    served = json.loads(urllib.request.urlopen(srv.url + "/liverl/version", timeout=30).read())
    link = srv.serving.gateway
    assert status == 200 and state["version"] == served["version"] == link.version
    assert state["checksum"] == served["checksum"] == link.checksum and state["unhealthy_reason"] is None
    status, out = _call(url, {"ops": [["inc", "m_requests", {}, 1]]}, key=srv.node_key)  # state only, no counters
    assert status == 400 and "unknown op" in out["error"]
    status, out = _call(url, {"ops": [["served", 1]]}, key=srv.node_key)
    assert status == 400, out
    assert _call(url, key=srv.node_key)[1]["version"] == served["version"]


# The two tests below use stand-ins on purpose: a node that is unreachable on demand, and an engine that goes silent
# mid-stream, are failure modes the real vLLM node cannot be made to show at a chosen moment. The real node's side
# of the same routes is checked by the two tests above.


class _Gateway:
    def __init__(self):
        self.version = self.checksum = None
        self.unhealthy_reason = "not initialised"

    def set_served(self, version, checksum):
        self.version, self.checksum, self.unhealthy_reason = version, checksum, None


class _Node:
    """What GatewayLink posts to: applies the ops to a gateway, or fails like an unreachable node."""

    def __init__(self, gw):
        self.gw, self.down, self.calls = gw, False, 0

    async def request(self, method, path, retry=True, json=None):
        self.calls += 1
        if self.down:
            raise ConnectionError("node unreachable")
        try:
            apply_ops(self.gw, json["ops"])
        except ValueError as e:
            return 400, {"error": str(e)}
        return 200, {}


def test_the_link_sends_the_agent_s_latest_state_and_keeps_it_while_the_node_is_unreachable():
    import asyncio

    gw = _Gateway()
    node = _Node(gw)
    link = GatewayLink(node, "node-x")
    assert not hasattr(link, "m_swaps")  # the agent's counters are its own process's (serving.agent.metrics)
    link.set_served(3, "c" * 64)
    link.unhealthy_reason = "SERVED WEIGHTS CHANGED"
    assert gw.version is None  # nothing sent before the flush
    asyncio.run(link.flush())
    assert (gw.version, gw.unhealthy_reason) == (3, "SERVED WEIGHTS CHANGED")  # served first, then unhealthy

    node.down = True
    link.set_served(4, "d" * 64)
    link.unhealthy_reason = "vLLM did not resume"
    with pytest.raises(ConnectionError):
        asyncio.run(link.flush())
    assert gw.version == 3 and link.version == 4  # kept, not lost
    link.set_served(5, "e" * 64)  # more changes while the node is down: the latest state is what is sent
    node.down = False
    asyncio.run(link.flush())
    assert (gw.version, gw.checksum, gw.unhealthy_reason) == (5, "e" * 64, None)
    calls = node.calls
    asyncio.run(link.flush())
    assert node.calls == calls  # nothing changed: no call

    for counter_op in (["inc", "m_swaps", {"outcome": "ok"}, 1], ["observe", "m_pause", 0.02]):
        with pytest.raises(ValueError, match="unknown op"):
            apply_ops(gw, [counter_op])


def test_in_process_calls_time_out_like_the_http_client_and_a_left_stream_tells_the_app():
    """A silent engine ends a call with ``NodeUnreachable`` (what the gateway answers 502 or an error event for),
    not a hang; leaving a stream early makes the app's ``receive`` say ``http.disconnect`` (vLLM then aborts)."""
    import asyncio

    from serving.node.gateway_host import InProcessNode
    from serving.node.rawhttp import NodeUnreachable

    seen: list[str] = []

    async def silent(scope, receive, send):
        await asyncio.sleep(3600)

    async def stalls_after_one_event(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'data: {"a": 1}\n\n', "more_body": True})
        seen.append((await receive())["type"])  # blocks until the gateway leaves the stream

    async def run() -> None:
        with pytest.raises(NodeUnreachable, match="within 0.2 s"):
            await InProcessNode(silent, "k" * 32, timeout_s=0.2).post("/v1/completions", b"{}")
        node = InProcessNode(stalls_after_one_event, "k" * 32, timeout_s=2.0)  # the first event comes at once
        async with node.stream("/v1/completions", b"{}") as s:
            events = s.events()
            assert await events.__anext__() == b'{"a": 1}'
            with pytest.raises(NodeUnreachable):
                await events.__anext__()
        await asyncio.sleep(0.05)
        assert seen == ["http.disconnect"]

    asyncio.run(run())
