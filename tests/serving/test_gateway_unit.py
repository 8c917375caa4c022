"""Fast tests of the serving pieces that need no vLLM: request validation, the swap gate, delta chains, node errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from deploy.delta import checksum, encode_delta
from serving.agent import chain_ends
from serving.gateway import BadRequest, SwapGate, validate_completion_request
from serving.node import NodeError, NodeHandle, _wait_ready, node_command


def test_validation_accepts_and_normalises():
    fwd, wants = validate_completion_request({"prompt": ["[a]1+2="], "max_tokens": 5, "model": "whatever"})
    assert fwd["prompt"] == "[a]1+2=" and fwd["model"] == "liverl" and fwd["n"] == 1
    assert fwd["logprobs"] == 0 and fwd["return_token_ids"] is True and fwd["temperature"] == 1.0
    assert wants == {"logprobs": False, "token_ids": False}
    fwd, wants = validate_completion_request({"prompt": "x", "logprobs": 3, "return_token_ids": True,
                                              "temperature": 0, "top_p": 0.5})
    assert fwd["logprobs"] == 3 and fwd["temperature"] == 0.0 and fwd["top_p"] == 0.5
    assert wants == {"logprobs": True, "token_ids": True}


@pytest.mark.parametrize("body, param", [
    ([1, 2], None),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "stream": True}, "stream"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "logprobs": 99}, "logprobs"),
])
def test_validation_rejects(body, param):
    with pytest.raises(BadRequest) as e:
        validate_completion_request(body)
    assert e.value.param == param and str(e.value)


def test_swap_gate_holds_new_requests_and_drains_inflight():
    async def main():
        gate = SwapGate()
        log: list[str] = []
        release = asyncio.Event()

        async def request(name: str, hold: asyncio.Event | None = None):
            async with gate.admit(timeout_s=5):
                log.append(f"start {name}")
                if hold is not None:
                    await hold.wait()
                log.append(f"end {name}")

        async def swap():
            async with gate.closed() as drain_ms:
                log.append("swap")
                assert gate.inflight == 0 and drain_ms >= 0

        first = asyncio.create_task(request("a", release))
        await asyncio.sleep(0.01)
        swapping = asyncio.create_task(swap())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(request("b"))  # arrives during the swap: must wait, not fail
        await asyncio.sleep(0.01)
        assert log == ["start a"] and not gate.is_open
        release.set()
        await asyncio.gather(first, swapping, late)
        assert log == ["start a", "end a", "swap", "start b", "end b"] and gate.is_open

        async with gate.closed():  # admission times out (never hangs) while a swap holds the gate
            with pytest.raises(TimeoutError):
                async with gate.admit(timeout_s=0.05):
                    pass

    asyncio.run(main())


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(4, 4, generator=g).to(torch.bfloat16)}
    out = [base]
    for _ in range(n - 1):
        out.append({"w": (out[-1]["w"].float() + torch.randn(4, 4, generator=g)).to(torch.bfloat16)})
    return out


def test_chain_ends_follows_direction_and_refuses_gaps():
    from deploy.delta import DeltaError

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
        proc = subprocess.Popen([sys.executable, "-c", "print('engine exploded: bad config'); raise SystemExit(3)"],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    handle = NodeHandle(url="http://127.0.0.1:9", model_dir=tmp_path, log_path=log_path, device="cpu", proc=proc,
                        start_s=0.0)
    with pytest.raises(NodeError, match="(?s)exited with code 3.*engine exploded"):
        _wait_ready(handle, timeout_s=30)
    handle.stop()


def test_node_command_exposes_what_the_swap_needs(tmp_path):
    cmd = " ".join(node_command(tmp_path, "127.0.0.1", 8100, "cpu", 64, 32, 1 << 28))
    for flag in ("--worker-extension-cls serving.worker_ext.LiverlWorkerExtension", "--enforce-eager",
                 "--logprobs-mode processed_logprobs", "--generation-config vllm", "--max-model-len 32"):
        assert flag in cmd
