"""Fast tests of the serving pieces that need no vLLM: request validation, response folding, swap spans,
delta chains, node errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from core.schemas import SamplingParams
from deploy.registry.delta import checksum, encode_delta
from serving.agent.agent import chain_ends
from serving.agent.launch import NodeError, NodeHandle, _wait_ready, node_command
from serving.node.openai_api import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    add_chat_chunk,
    add_completion_chunk,
    for_client,
)


def _parse(model, body) -> object:
    return model.parse(json.dumps(body).encode())


def test_validation_accepts_and_normalises():
    req = _parse(CompletionRequest, {"prompt": ["[a]1+2="], "max_tokens": 5, "model": "whatever", "stop": ["!"]})
    fwd = req.node_body()
    assert fwd["prompt"] == ["[a]1+2="] and fwd["model"] == "liverl" and fwd["stop"] == ["!"]  # unknown: passed on
    assert fwd["logprobs"] == 0 and fwd["return_token_ids"] is True and "temperature" not in fwd
    assert req.untrainable_reason() is None and req.sampling(5).temperature == 1.0 and req.n_choices == 1
    req = _parse(
        CompletionRequest, {"prompt": ["x", "y"], "n": 3, "logprobs": 3, "temperature": 0, "top_p": 0.5, "seed": 7}
    )
    assert req.node_body()["logprobs"] == 3 and req.n_choices == 6 and req.untrainable_reason() == "greedy"
    assert req.sampling(16) == SamplingParams(temperature=0.0, top_p=0.5, seed=7, max_tokens=16)
    assert _parse(CompletionRequest, {"prompt": "x", "top_k": 1}).untrainable_reason() == "greedy"
    chat = _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "[a]1+2="}], "n": 2})
    fwd = chat.node_body()
    assert fwd["logprobs"] is True and fwd["top_logprobs"] == 0 and fwd["return_prompt_text"] is True
    assert chat.max_tokens_for(32, 7) == 25 and chat.n_choices == 2  # vLLM's default: the rest of the context


@pytest.mark.parametrize(
    "body, param",
    [
        ([1, 2], None),
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": ["a"] * 40, "n": 2}, "n"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "logprobs": 99}, "logprobs"),
        ({"prompt": "a", "logprob_token_ids": [1]}, "logprob_token_ids"),
    ],
)
def test_validation_rejects(body, param):
    with pytest.raises(BadRequest) as e:
        _parse(CompletionRequest, body)
    assert e.value.param == param and e.value.status == 400 and len(str(e.value)) > 10
    if param:
        assert param in str(e.value)


def test_chat_validation_rejects():
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50}, "top_logprobs"),
    ]:
        with pytest.raises(BadRequest) as e:
            _parse(ChatCompletionRequest, body)
        assert e.value.param == param
    with pytest.raises(BadRequest, match="not valid JSON") as e:
        ChatCompletionRequest.parse(b"{nope")
    assert e.value.param is None


def test_stream_chunks_fold_into_records_and_the_client_sees_only_what_it_asked_for():
    req = _parse(CompletionRequest, {"prompt": "[a]1+2=", "n": 2, "stream": True})
    acc: dict = {}
    chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "text": "3",
                    "token_ids": [5],
                    "prompt_token_ids": [1, 2],
                    "logprobs": {"token_logprobs": [-0.5]},
                    "finish_reason": None,
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 1,
                    "text": "4",
                    "token_ids": [6],
                    "prompt_token_ids": [1, 2],
                    "logprobs": {"token_logprobs": [-1.5]},
                    "finish_reason": "length",
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "text": "!",
                    "token_ids": [7],
                    "logprobs": {"token_logprobs": [-0.25]},
                    "finish_reason": "stop",
                }
            ]
        },
    ]
    finished = [add_completion_chunk(req, c, acc) for c in chunks]
    assert finished == [[], [1], [0]]
    assert "".join(acc[0].text) == "3!" and acc[0].token_ids == [5, 7] and acc[0].logprobs == [-0.5, -0.25]
    assert acc[0].prompt == "[a]1+2=" and acc[0].prompt_token_ids == [1, 2] and acc[1].finish_reason == "length"
    out = for_client(req, chunks[2], ["g0", "g1"], 3)
    assert out["liverl"] == {"generation_id": "g0", "policy_version": 3}
    assert out["choices"][0]["generation_id"] == "g0" and "logprobs" not in out["choices"][0]
    assert "token_ids" not in out["choices"][0]

    chat = _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    acc = {}
    body = {
        "prompt_token_ids": [1, 2],
        "prompt_text": "hi",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "yo"},
                "token_ids": [8, 9],
                "logprobs": {"content": [{"token": "y", "logprob": -1.0}, {"token": "o", "logprob": -2.0}]},
                "finish_reason": "stop",
            }
        ],
    }
    assert add_chat_chunk(chat, body, acc) == [0]
    assert (acc[0].prompt, acc[0].prompt_token_ids, acc[0].logprobs) == ("hi", [1, 2], [-1.0, -2.0])
    out = for_client(chat, body, ["g0"], 1)
    assert "prompt_token_ids" not in out and "prompt_text" not in out and "logprobs" in out["choices"][0]
    assert out["liverl"] == {"generation_id": "g0", "generation_ids": ["g0"], "policy_version": 1}


class _SpanNode:
    """Answers ``spans`` as the node's ``serving.node.versions`` route would, for a request of 2 prompts x n=2."""

    def __init__(self, reply):
        self.reply, self.asked = reply, []

    async def spans(self, rid, prompts):
        self.asked.append((rid, prompts))
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


def test_a_request_is_checked_for_spans_only_when_a_swap_overlapped_it_and_choices_map_to_their_index():
    import types

    from serving.node.gateway import _SwapWatch

    gw = types.SimpleNamespace(swap_epoch=3, swapping=False, node=None)
    watch = _SwapWatch(gw)
    assert not watch.crossed()
    gw.swap_epoch += 1  # a swap began while the request was in flight
    assert watch.crossed()
    gw.swapping = True
    assert _SwapWatch(gw).crossed()  # sent while the engine was paused: its tokens may be the new version's
    req = _parse(CompletionRequest, {"prompt": ["a", "b"], "n": 2})
    gw.node = _SpanNode(
        {
            "cmpl-r-0": {"0": [["4", 0, 3], ["5", 3, 7]], "1": [["4", 0, 2]]},
            "cmpl-r-1": {"1": [["5", 0, 6]], "0": [["default", 0, 1]]},
        }
    )
    got = asyncio.run(watch.spans(req, "r"))
    assert gw.node.asked == [("r", 2)]
    # choice index = prompt * n + j; a label that is not a version (the engine's "default") is not a span
    assert got == {0: [[4, 0, 3], [5, 3, 7]], 1: [[4, 0, 2]], 3: [[5, 0, 6]]}
    gw.node = _SpanNode(RuntimeError("node down"))
    assert asyncio.run(watch.spans(req, "r")) == {}  # unknown: the records say so (version_unknown)


def test_version_spans_must_tile_the_completion_and_mark_mixed_generations():
    from core.schemas import GenerationRecord, WireError

    base = dict(
        generation_id="g",
        policy_version=4,
        node="n",
        prompt="p",
        completion="c",
        prompt_token_ids=[1],
        completion_token_ids=[1, 2, 3],
        completion_logprobs=[-1.0, -1.0, -1.0],
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=3),
    )
    assert not GenerationRecord(**base).mixed_versions
    assert GenerationRecord(**base, version_spans=[(4, 0, 1), (5, 1, 3)]).mixed_versions
    assert GenerationRecord(**base, version_spans=[]).mixed_versions  # unknown spans: no version may claim it
    assert not GenerationRecord(**base, version_spans=[(4, 0, 3)]).mixed_versions
    rec = GenerationRecord(**base, version_spans=[(4, 0, 1), (5, 1, 3)])
    assert GenerationRecord.from_bytes(rec.to_bytes()).version_spans == [(4, 0, 1), (5, 1, 3)]
    for bad in ([(4, 0, 2)], [(4, 0, 1), (5, 2, 3)], [(4, 0, 0), (5, 0, 3)]):
        with pytest.raises((ValueError, WireError), match="tile"):
            GenerationRecord(**base, version_spans=bad)


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(4, 4, generator=g).to(torch.bfloat16)}
    out = [base]
    for _ in range(n - 1):
        out.append({"w": (out[-1]["w"].float() + torch.randn(4, 4, generator=g)).to(torch.bfloat16)})
    return out


def test_chain_ends_follows_direction_and_refuses_gaps():
    from deploy.registry.delta import DeltaError

    s0, s1, s2 = _states(3)
    c0, c1, c2 = map(checksum, (s0, s1, s2))
    d01, d12 = encode_delta(s0, s1, 0, 1), encode_delta(s1, s2, 1, 2)
    assert chain_ends([d01, d12], c0, c2) == [c1, c2]
    assert chain_ends([d12, d01], c2, c0) == [c1, c0]  # rollback: the same deltas, inverted
    with pytest.raises(DeltaError, match="does not apply"):
        chain_ends([d12], c0, c2)
    with pytest.raises(DeltaError, match="not the target"):
        chain_ends([d01], c0, c2)
    with pytest.raises(DeltaError):
        chain_ends([], c0, c0)


def test_node_death_is_reported_with_log_tail(tmp_path):
    log_path = tmp_path / "node.log"
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('engine exploded: bad config'); raise SystemExit(3)"],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    handle = NodeHandle(
        url="http://127.0.0.1:9",
        key="k" * 32,
        model_dir=tmp_path,
        log_path=log_path,
        device="cpu",
        proc=proc,
        start_s=0.0,
    )
    with pytest.raises(NodeError, match="(?s)exited with code 3.*engine exploded"):
        _wait_ready(handle, timeout_s=30)
    handle.stop()


def test_node_command_exposes_what_the_swap_needs(tmp_path):
    cmd = " ".join(node_command(tmp_path, "127.0.0.1", 8100, "cpu", 64, 32, 1 << 28))
    for flag in (
        "--worker-extension-cls serving.node.worker.extension.LiverlWorkerExtension",
        "--enforce-eager",
        "--middleware serving.node.auth.NodeKeyMiddleware",
        "--logprobs-mode processed_logprobs",
        "--generation-config vllm",
        "--max-model-len 32",
        '--weight-transfer-config {"backend": "liverl_delta"}',
    ):
        assert flag in cmd
    # the swap and span routes sit inside the key check: Starlette makes the LAST middleware added the outermost
    assert cmd.index("serving.node.swap.SwapMiddleware") < cmd.index("serving.node.auth.NodeKeyMiddleware")
    assert cmd.index("serving.node.versions.VersionSpansMiddleware") < cmd.index("serving.node.auth.NodeKeyMiddleware")


def test_the_swap_route_refuses_a_malformed_body_with_what_it_needs():
    from serving.node.swap import SwapBodyError, parse_body

    ok = b'{"deltas": [["/d/a.delta", "c1"], ["/d/b.delta", "c2"]], "from": [3, "c0"], "to": [5, "c2"]}'
    assert parse_body(ok) == ([("/d/a.delta", "c1"), ("/d/b.delta", "c2")], (3, "c0"), (5, "c2"), "vllm")
    assert parse_body(ok[:-1] + b', "via": "liverl"}')[3] == "liverl"
    for bad, match in [
        (b'{"deltas": [["/d/a", "c2"]], "from": [3, "c0"], "to": [5, "c2"], "via": "http"}', "via"),
        (b"not json", "needs JSON"),
        (b'{"deltas": [], "from": [3, "c0"], "to": [5, "c2"]}', "no deltas"),
        (b'{"deltas": [["/d/a", "c1"]], "from": [3, "c0"], "to": [5, "c2"]}', "does not lead"),
        (b'{"deltas": [["/d/a", "c2"]], "from": ["x", "c0"], "to": [5, "c2"]}', "needs JSON"),
        (b'{"deltas": [["/d/a", "c2"]], "to": [5, "c2"]}', "needs JSON"),
    ]:
        with pytest.raises(SwapBodyError, match=match):
            parse_body(bad)


def test_the_node_key_middleware_refuses_every_route_but_health_without_the_key(monkeypatch):
    """The ASGI middleware vLLM loads, on its own: which requests reach the app."""
    import asyncio

    from serving.node.auth import ENV_KEY, NodeKeyMiddleware

    monkeypatch.delenv(ENV_KEY, raising=False)
    with pytest.raises(RuntimeError, match=ENV_KEY):
        NodeKeyMiddleware(None)
    monkeypatch.setenv(ENV_KEY, "s" * 43)
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    mw = NodeKeyMiddleware(app)

    def call(path: str, auth: bytes | None = None, kind: str = "http") -> int:
        sent: list[dict] = []

        async def send(msg):
            sent.append(msg)

        headers = [(b"authorization", auth)] if auth is not None else []
        asyncio.run(mw({"type": kind, "path": path, "headers": headers}, None, send))
        return sent[0].get("status", sent[0].get("code"))

    assert call("/health") == 200
    for path in ("/v1/models", "/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/metrics"):
        assert call(path) == 401
        assert call(path, b"Bearer " + b"x" * 43) == 401
        assert call(path, b"Basic " + b"s" * 43) == 401
        assert call(path, b"bearer " + b"s" * 43) == 200
    assert call("/v1/models", kind="websocket") == 1008
    assert reached == ["/health"] + [
        "/v1/models",
        "/collective_rpc",
        "/pause",
        "/resume",
        "/reset_prefix_cache",
        "/metrics",
    ]
