"""The serving tier against real parts: vLLM on CPU (one engine for the package, see conftest.py), Kafka, Redis, the
registry.

Order of the tests does not matter: each reads the version being served and moves from there.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from core.schemas import RolloutTerms
from deploy.registry.signing import announce
from tests.serving.conftest import records as _records

pytestmark = pytest.mark.slow

PROMPTS = ["[a]23+45=", "[b]17+61=", "[a]90+9=", "[b]50+44="]


# ---------------------------------------------------------------------------------------------- helpers


def _post(url: str, body, raw: bytes | None = None, timeout: float = 60, key: str = "") -> tuple[int, dict, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _served(srv) -> dict:
    return json.loads(_get(srv.url + "/liverl/version")[1])


def _node_checksum(srv) -> dict:
    """What the worker reads back from the live weights (bypassing the gateway's bookkeeping)."""
    status, _, body = _post(srv.node_url + "/collective_rpc", {"method": "liverl_checksum"}, key=srv.node_key)
    assert status == 200, body
    return body["results"][0]


def _hf_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Log-probs of ``completion_ids`` under a transformers model (fp32 compute on the same bf16 weights)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    p = len(prompt_ids)
    return [logp_TV[p - 1 + i, t].item() for i, t in enumerate(completion_ids)]


def _perturbed(state: dict, seed: int, scale: float = 0.08) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v.float() + scale * v.float().std() * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
        for k, v in state.items()
    }


def _announce(srv, version: int, checksum: str) -> None:
    """What the gate (promote) or an operator (rollback) does: the registry first, then the announcement."""
    row = srv.registry.get(version)
    if row.status == "candidate":
        srv.registry.promote(version, actor="test", reason="test")
    elif row.status != "stable":
        srv.registry.rollback(actor="test", reason="test", to=version)
    announce(srv.redis, srv.cfg.topics.prefix, version, checksum, "test", srv.signer)


def _wait_version(srv, version: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = _served(srv)
        if info["version"] == version:
            return info
        time.sleep(0.05)
    raise AssertionError(
        f"node never served version {version}; swap errors: "
        f"{srv.redis.lrange(srv.cfg.topics.prefix + ':swap_errors', 0, -1)}"
    )


def _wait_swap(srv, from_: int, to: int, timeout_s: float = 30) -> dict:
    """The latest swap record from ``from_`` to ``to``: the agent pushes it right after the node reports the new version
    (``_wait_version`` can return first), so wait for it."""
    key = f"{srv.cfg.topics.prefix}:swaps"
    deadline = time.monotonic() + timeout_s
    while True:
        for raw in reversed(srv.redis.lrange(key, -20, -1)):
            rec = json.loads(raw)
            if (rec["from"], rec["to"]) == (from_, to):
                return rec
        if time.monotonic() > deadline:
            raise AssertionError(f"no swap record {from_} -> {to}: {srv.redis.lrange(key, -5, -1)}")
        time.sleep(0.05)


def _greedy(srv, prompt: str) -> dict:
    status, _, out = _post(
        srv.url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0, "return_token_ids": True},
    )
    assert status == 200, out
    c = out["choices"][0]
    return {
        "version": out["liverl"]["policy_version"],
        "tokens": c["token_ids"],
        "prompt_ids": c["prompt_token_ids"],
        "logprobs": c["logprobs"]["token_logprobs"],
    }


# ---------------------------------------------------------------------------------------------- tests


def test_completion_is_logged_with_tokens_logprobs_and_version(srv):
    status, headers, out = _post(
        srv.url + "/v1/completions",
        {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 1.0, "logprobs": 0, "return_token_ids": True},
    )
    assert status == 200, out
    gid, version = out["liverl"]["generation_id"], out["liverl"]["policy_version"]
    assert headers["X-Liverl-Generation-Id"] == gid and headers["X-Liverl-Version"] == str(version)
    assert version == _served(srv)["version"] and len(gid) == 32
    choice = out["choices"][0]
    rec = _records(srv, {gid})[gid]
    assert rec.policy_version == version and rec.node == srv.cfg.serving.node_name
    assert rec.prompt == PROMPTS[0] and rec.completion == choice["text"]
    assert rec.prompt_token_ids == choice["prompt_token_ids"] and len(rec.prompt_token_ids) == len(PROMPTS[0])
    assert rec.completion_token_ids == choice["token_ids"] and 1 <= len(rec.completion_token_ids) <= 5
    assert rec.completion_logprobs == pytest.approx(choice["logprobs"]["token_logprobs"])
    assert all(lp <= 0 for lp in rec.completion_logprobs)
    assert rec.sampling.temperature == 1.0 and rec.sampling.max_tokens == 5 and rec.finish_reason in ("stop", "length")

    # without logprobs / return_token_ids the client sees a plain OpenAI response, the record is complete anyway
    status, _, plain = _post(srv.url + "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 3})
    assert status == 200 and "logprobs" not in plain["choices"][0] and "token_ids" not in plain["choices"][0]
    rec = _records(srv, {plain["liverl"]["generation_id"]})[plain["liverl"]["generation_id"]]
    assert len(rec.completion_logprobs) == len(rec.completion_token_ids) >= 1


def test_bad_requests_get_400_with_a_clear_message(srv):
    url = srv.url + "/v1/completions"
    cases = [
        (None, b"{not json"),
        ([1, 2], None),
        ({"max_tokens": 5}, None),
        ({"prompt": PROMPTS[0], "n": 100}, None),
        ({"prompt": PROMPTS[0], "best_of": 3}, None),
        ({"prompt": PROMPTS[0], "max_tokens": -1}, None),
        ({"prompt": PROMPTS[0], "temperature": "hot"}, None),
        ({"prompt": PROMPTS[0], "max_tokens": 10_000}, None),  # beyond the model's context: vLLM's own 400
    ]
    for body, raw in cases:
        status, _, out = _post(url, body, raw=raw)
        assert status == 400, (body, out)
        message = out["error"]["message"] if isinstance(out.get("error"), dict) else out.get("message", out)
        assert isinstance(message, str) and len(message) > 5, out
    status, _, out = _post(url, {"prompt": PROMPTS[0], "n": 100})
    assert "n" in out["error"]["message"] and out["error"]["param"] == "n"
    assert _get(srv.url + "/healthz")[0] == 200
    status, body = _get(srv.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "liverl"


def test_hot_swap_under_load_is_exact(srv):
    """Swap while 12 clients generate: nothing fails, versions are exact, the served weights are the target's."""
    from deploy.registry.delta import checksum

    old = _served(srv)
    old_state = srv.registry.materialize(old["version"])
    refs = {old["version"]: {p: _greedy(srv, p) for p in PROMPTS}}
    new_state = _perturbed(old_state, seed=old["version"] + 1, scale=0.3)  # clearly different weights
    row = srv.registry.add_candidate(new_state, parent=old["version"], metrics={}, sample_offsets={}, learner_step=1)
    assert row.checksum == checksum(new_state)

    results: list[dict] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(i: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            t0 = time.time()
            status, _, out = _post(
                srv.url + "/v1/completions",
                {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0, "return_token_ids": True},
            )
            item = {"t0": t0, "t1": time.time(), "status": status, "prompt": prompt}
            if status == 200:
                c = out["choices"][0]
                item.update(
                    version=out["liverl"]["policy_version"],
                    gid=out["liverl"]["generation_id"],
                    tokens=c["token_ids"],
                    logprobs=c["logprobs"]["token_logprobs"],
                    mixed="version_spans" in c,
                )  # spanned the swap (tests/serving/test_swap_spans.py)
            with lock:
                results.append(item)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    _announce(srv, row.version, row.checksum)
    info = _wait_version(srv, row.version)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)

    # no request failed or was dropped, and the swap was verified against the target checksum
    assert results and all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    swap = _wait_swap(srv, old["version"], row.version)
    assert swap["verify_ok"]
    assert info["checksum"] == row.checksum == _node_checksum(srv)["checksum"] == checksum(new_state)
    versions = {r["version"] for r in results}
    assert versions == {old["version"], row.version}, versions
    assert all(r["version"] == row.version for r in results if r["t0"] > swap["ts"])
    # finished before the agent called the node to swap: the old version (``ts`` is written after the call returns,
    # later still on a loaded box, so ``ts - call_ms`` can fall after the call started: the record says when it did)
    assert all(r["version"] == old["version"] for r in results if r["t1"] < swap["called_at"])

    # each response was produced entirely by the version it names: its greedy tokens and log-probs are that
    # version's (log-probs within bf16 batch-to-batch noise), and the logged record says the same version
    refs[row.version] = {p: _greedy(srv, p) for p in PROMPTS}
    for r in (r for r in results if not r["mixed"]):
        ref = refs[r["version"]][r["prompt"]]
        assert r["tokens"] == ref["tokens"], (r, ref)
        assert r["logprobs"] == pytest.approx(ref["logprobs"], abs=0.05)
    sample = {r["gid"]: r for r in results[:: max(1, len(results) // 40)]}
    for gid, rec in _records(srv, set(sample)).items():
        assert rec.policy_version == sample[gid]["version"]

    # the new log-probs are the new weights' (transformers on the same bf16 weights), not the old ones'
    from learner.model import load_model

    model_new = load_model(srv.model_dir, state_dict=new_state, dtype=torch.float32)
    model_old = load_model(srv.model_dir, state_dict=old_state, dtype=torch.float32)
    gap_to_old = err_to_new = 0.0
    for prompt in PROMPTS:
        ref = refs[row.version][prompt]
        hf_new = _hf_logprobs(model_new, ref["prompt_ids"], ref["tokens"])
        hf_old = _hf_logprobs(model_old, ref["prompt_ids"], ref["tokens"])
        err_to_new = max(err_to_new, *(abs(a - b) for a, b in zip(ref["logprobs"], hf_new, strict=True)))
        gap_to_old = max(gap_to_old, *(abs(a - b) for a, b in zip(ref["logprobs"], hf_old, strict=True)))
    # vLLM's bf16 kernels against transformers in fp32: within 0.05 on AVX2 CPUs, up to 0.08 seen on AMX CPUs (their
    # small-GEMM kernels differ); the old weights' log-probs are further away than that, by a wide margin
    assert err_to_new < 0.12, err_to_new
    assert gap_to_old > max(0.2, 2 * err_to_new), (gap_to_old, err_to_new)


def test_rollback_and_on_the_fly_delta(srv):
    """Back to the parent with the current version's own delta inverted, then forward with an encoded delta."""
    from deploy.registry.delta import checksum

    cur = _served(srv)
    state = srv.registry.materialize(cur["version"])
    row = srv.registry.add_candidate(
        _perturbed(state, seed=100 + cur["version"]),
        parent=cur["version"],
        metrics={},
        sample_offsets={},
        learner_step=2,
    )
    _announce(srv, row.version, row.checksum)
    _wait_version(srv, row.version)
    _announce(srv, cur["version"], cur["checksum"])  # rollback
    info = _wait_version(srv, cur["version"])
    swap = _wait_swap(srv, row.version, cur["version"])
    assert swap["how"] == "stored x1" and swap["verify_ok"] and info["checksum"] == cur["checksum"]
    assert _node_checksum(srv)["checksum"] == checksum(state)

    agent = srv.serving.agent
    agent.max_chain = 0  # force the agent to encode its own delta from registry-materialized weights
    try:
        _announce(srv, row.version, row.checksum)
        assert _wait_version(srv, row.version)["checksum"] == row.checksum
        deadline = time.monotonic() + 10  # the swap record is pushed right after the gate reopens
        while True:
            swap = json.loads(srv.redis.lrange(f"{srv.cfg.topics.prefix}:swaps", -1, -1)[0])
            if swap["to"] == row.version or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert swap["how"] == "encoded" and swap["verify_ok"]
    finally:
        agent.max_chain = 4
    deadline = time.monotonic() + 10  # the heartbeat follows the swap (written right after the gate reopens)
    while True:
        beat = json.loads(srv.redis.get(f"{srv.cfg.topics.prefix}:served:{srv.cfg.serving.node_name}"))
        if beat["version"] == row.version or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert beat["version"] == row.version and beat["checksum"] == row.checksum and beat["last_swap_pause_ms"] > 0
    assert beat["healthy"] is True


def test_a_version_the_registry_does_not_call_stable_is_not_served(srv):
    """Finding: one Redis write put any registered version live, rejected ones included. Even an announcement signed
    with the gate's key (a leaked key, an operator's mistake) serves only what the registry calls stable."""
    cur = _served(srv)
    state = srv.registry.materialize(cur["version"])
    row = srv.registry.add_candidate(
        _perturbed(state, seed=55), parent=cur["version"], metrics={}, sample_offsets={}, learner_step=3
    )
    srv.registry.set_status(row.version, "rejected", actor="gate", reason="failed suite")
    announce(srv.redis, srv.cfg.topics.prefix, row.version, row.checksum, "forged", srv.signer)
    deadline = time.monotonic() + 5
    errors = []
    while time.monotonic() < deadline and not errors:
        errors = [
            e
            for e in srv.redis.lrange(f"{srv.cfg.topics.prefix}:swap_errors", 0, -1)
            if f'"to":{row.version}'.encode() in e
        ]
        time.sleep(0.1)
    assert errors and b"rejected in the registry, not stable" in errors[-1]
    assert _served(srv)["version"] == cur["version"]
    _announce(srv, cur["version"], cur["checksum"])


def test_a_canary_node_serves_the_canary_and_returns_to_stable_when_the_rollout_ends(srv):
    """The signed canary announcement's terms name this node: its agent serves <p>:canary (a version the registry has
    on canary) instead of <p>:desired; when the canary goes (an abort) it swaps back to the stable version by the
    inverse delta. The unsigned <p>:rollout plan moves nothing."""
    from core import keys

    cur = _served(srv)
    p = srv.cfg.topics.prefix
    _announce(srv, cur["version"], cur["checksum"])  # the fleet's desired version (the gate keeps it set)
    state = srv.registry.materialize(cur["version"])
    row = srv.registry.add_candidate(
        _perturbed(state, seed=77), parent=cur["version"], metrics={}, sample_offsets={}, learner_step=4
    )
    ro = srv.registry.begin_rollout(
        row.version,
        stable_version=cur["version"],
        share=0.2,
        nodes=["node-other"],
        unit="user",
        deadline_at=time.time() + 600,
        settings=None,
        actor="gate",
        reason="passed the offline checks",
    )

    def canary_on(*nodes: str) -> None:
        announce(
            srv.redis,
            p,
            row.version,
            row.checksum,
            "canary",
            srv.signer,
            channel="canary",
            rollout=RolloutTerms(rollout_id=ro.id, share=0.2, nodes=list(nodes), unit="user"),
        )

    canary_on("node-other")
    plan = {
        "version": row.version,
        "checksum": row.checksum,
        "stable_version": cur["version"],
        "share": 0.2,
        "nodes": [srv.cfg.serving.node_name],
        "deadline_at": time.time() + 600,
    }
    srv.redis.set(keys.rollout(p), json.dumps(plan))  # an unsigned plan naming this node (main's agent followed it)
    time.sleep(1.0)  # announced, but the signed terms do not name this node: it stays on desired
    assert _served(srv)["version"] == cur["version"]
    canary_on("node-other", srv.cfg.serving.node_name)
    info = _wait_version(srv, row.version)
    assert info["checksum"] == row.checksum == _node_checksum(srv)["checksum"]
    srv.redis.delete(keys.rollout(p), keys.canary(p))  # aborted
    srv.registry.finish_rollout_abort(ro.id, actor="gate", reason="canary aborted")
    info = _wait_version(srv, cur["version"])
    assert info["checksum"] == cur["checksum"] == _node_checksum(srv)["checksum"]
    back = _wait_swap(srv, row.version, cur["version"])
    assert back["deltas"] == 1  # the one delta it holds, inverted


def test_corrupt_and_wrong_base_deltas_are_refused(srv):
    from deploy.registry.delta import checksum, encode_delta
    from serving.agent.agent import SwapError

    cur = _served(srv)
    before = _node_checksum(srv)["checksum"]
    assert before == cur["checksum"]
    state = srv.registry.materialize(cur["version"])
    target = _perturbed(state, seed=7)
    good = encode_delta(state, target, cur["version"], 999)
    corrupt = bytearray(good)
    corrupt[-20] ^= 0xFF  # payload damage: the header still parses, the worker's verification must catch it
    other = _perturbed(state, seed=8)
    wrong_base = encode_delta(other, target, 998, 999)
    errors_key = f"{srv.cfg.topics.prefix}:swap_errors"
    n_errors = srv.redis.llen(errors_key)

    agent = srv.serving.agent
    with pytest.raises(SwapError, match="refused"):
        srv.serving.call(agent.apply_blobs, [bytes(corrupt)], 999, checksum(target))
    with pytest.raises(SwapError, match="does not apply"):
        srv.serving.call(agent.apply_blobs, [wrong_base], 999, checksum(target))
    assert srv.redis.llen(errors_key) == n_errors + 2
    last = json.loads(srv.redis.lrange(errors_key, -2, -2)[0])
    assert last["restored"] and last["to"] == 999

    # the worker refuses a bad delta on its own too (nothing changes before verification)
    from serving.agent.launch import delta_dir

    bad_file = delta_dir(srv.cfg) / "wrong-base.delta"
    bad_file.write_bytes(wrong_base)
    rpc = srv.node_url + "/collective_rpc"
    status, _, body = _post(
        rpc, {"method": "liverl_apply_delta", "args": [str(bad_file), checksum(target)]}, key=srv.node_key
    )
    assert status == 200 and not body["results"][0]["ok"] and "DeltaError" in body["results"][0]["error"]
    # ... and one without the checksum it must lead to, or from outside the agent's delta folder
    status, _, body = _post(rpc, {"method": "liverl_apply_delta", "args": [str(bad_file)]}, key=srv.node_key)
    assert not body["results"][0]["ok"] and "expect_checksum is required" in body["results"][0]["error"]
    outside = srv.cfg.state_path / "secret.txt"
    outside.write_text("root:x:0:0:secret")
    for path in (str(outside), "/etc/passwd", str(delta_dir(srv.cfg) / ".." / "secret.txt"), "/no/such/file"):
        status, _, body = _post(
            rpc, {"method": "liverl_apply_delta", "args": [path, checksum(target)]}, key=srv.node_key
        )
        err = body["results"][0]["error"]
        assert not body["results"][0]["ok"] and err.startswith("PermissionError: delta files are read only from")
        assert "root" not in err.replace(str(delta_dir(srv.cfg).resolve()), "")

    assert _node_checksum(srv)["checksum"] == before
    info = _served(srv)
    assert info["version"] == cur["version"] and info["checksum"] == before
    status, _, out = _post(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3})
    assert status == 200 and out["liverl"]["policy_version"] == cur["version"]


def test_the_node_answers_only_its_serving_process(srv):
    """Every route of the vLLM node but /health needs the key the serving process generated, the dev and
    RL routes (pause, collective_rpc) included, which vLLM's --api-key leaves open."""
    from serving.agent.launch import node_key_path, read_node_key

    assert read_node_key(srv.cfg) == srv.node_key and len(srv.node_key) >= 32
    key_file = node_key_path(srv.cfg)
    assert key_file.parent == srv.cfg.state_path / "serving"
    assert key_file.stat().st_mode & 0o077 == 0  # only its user can read it
    assert _get(srv.node_url + "/health")[0] == 200
    for path, body in [
        ("/v1/models", None),
        ("/v1/completions", {"model": "liverl", "prompt": "x", "max_tokens": 1}),
        ("/pause?mode=abort", {}),
        ("/collective_rpc", {"method": "liverl_checksum"}),
        ("/reset_prefix_cache", {}),
        ("/liverl/swap", {"deltas": [], "from": [0, ""], "to": [0, ""]}),
        ("/liverl/spans?rid=x&prompts=1", None),
    ]:
        if body is None:
            status = _get(srv.node_url + path)[0]
        else:
            status, _, out = _post(srv.node_url + path, body)
            assert "unauthorized" in out["error"]
        assert status == 401, path
        if body is not None:
            assert _post(srv.node_url + path, body, key="wrong-" + srv.node_key)[0] == 401
    assert _node_checksum(srv)["ok"]  # with the key: answered (and nothing above paused the node)
    status, _, out = _post(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 200, out


@pytest.mark.parametrize("via", ["liverl", "vllm"])
def test_a_swap_that_fails_inside_the_pause_puts_the_old_weights_back_and_resumes(srv, via):
    """The node's own swap route (serving.node.swap), driven directly: the delta is valid but leads to a version
    other than the one asked for. Through liverl's RPC it is written inside the pause, so the route must undo the
    write; through vLLM's update_weights the liverl_delta backend refuses it before any write. Either way the route
    checks the old checksum and resumes, and the node keeps serving the old weights."""
    from deploy.registry.delta import checksum, encode_delta
    from serving.agent.launch import delta_dir

    cur = _served(srv)
    state = srv.registry.materialize(cur["version"])
    target = _perturbed(state, seed=11)
    blob = encode_delta(state, target, cur["version"], 997)  # the delta says version 997
    path = delta_dir(srv.cfg) / "test-inside-pause.delta"
    path.write_bytes(blob)
    try:
        status, _, out = _post(
            srv.node_url + "/liverl/swap",
            {
                "deltas": [[str(path), checksum(target)]],
                "from": [cur["version"], cur["checksum"]],
                "to": [998, checksum(target)],
                "via": via,
            },
            key=srv.node_key,
        )
    finally:
        path.unlink()
    assert status == 200, out
    assert not out["ok"] and out["restored"] is True and "998" in out["error"], out
    if via == "liverl":
        assert out["worker"] and out["worker"][0]["changed_tensors"] > 0  # it was written, then undone
    assert out["pause_ms"] > 0 and "resume_error" not in out
    assert _node_checksum(srv)["checksum"] == cur["checksum"]
    paused = json.loads(_get_key(srv.node_url + "/is_paused", srv.node_key))
    assert paused == {"is_paused": False}, paused
    status, _, out = _post(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 200 and out["liverl"]["policy_version"] == cur["version"], out


def _get_key(url: str, key: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def _rpc(srv, method: str, *args: str) -> dict:
    status, _, body = _post(srv.node_url + "/collective_rpc", {"method": method, "args": list(args)}, key=srv.node_key)
    assert status == 200, body
    return body["results"][0]


def test_a_crafted_delta_is_refused_before_any_write_and_an_out_of_band_change_is_noticed(srv):
    """A delta whose header claims the expected checksum but decodes to other weights is refused before
    the write (the worker hashes what the weights would be); weights changed behind the agent's back are found by
    the agent's periodic read-back, which takes the node out of service."""
    from deploy.registry.container import open_container, pack_container
    from deploy.registry.delta import DELTA_MAGIC, checksum, encode_delta
    from serving.agent.launch import delta_dir

    cur = _served(srv)
    state = srv.registry.materialize(cur["version"])
    wanted, evil = _perturbed(state, seed=21), _perturbed(state, seed=22)
    blob = encode_delta(state, evil, cur["version"], 777)
    header, payload = open_container(blob, DELTA_MAGIC, "delta")
    header["target_checksum"] = checksum(wanted)  # self-consistent framing: the container's hashes are recomputed
    crafted = delta_dir(srv.cfg) / "crafted.delta"
    crafted.write_bytes(bytes(pack_container(DELTA_MAGIC, header, [bytes(payload)])))
    r = _rpc(srv, "liverl_apply_delta", str(crafted), checksum(wanted))
    assert not r["ok"] and "refused before any write" in r["error"], r
    assert _node_checksum(srv)["checksum"] == cur["checksum"]

    # an out-of-band change (a valid delta applied straight to the worker, bypassing the agent)
    oob = delta_dir(srv.cfg) / "oob.delta"
    oob.write_bytes(encode_delta(state, evil, cur["version"], 778))
    agent, gw = srv.serving.agent, srv.serving.gateway
    try:
        assert _rpc(srv, "liverl_apply_delta", str(oob), checksum(evil))["ok"]
        assert srv.serving.call(agent.reverify) is False
        assert gw.unhealthy_reason and "SERVED WEIGHTS CHANGED" in gw.unhealthy_reason
        status, _, out = _post(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
        assert status == 503 and "SERVED WEIGHTS CHANGED" in out["error"]["message"]
    finally:
        assert _rpc(srv, "liverl_apply_delta", str(oob), cur["checksum"])["ok"]  # the XOR delta undoes itself
        assert srv.serving.call(agent.reverify) is True
        gw.set_served(cur["version"], cur["checksum"])  # the operator's fix: told to the gateway in the node
        srv.serving.call(gw.flush)
    status, _, out = _post(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 200, out


def test_metrics_parse_as_prometheus_text(srv):
    from prometheus_client.parser import text_string_to_metric_families

    _post(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    _post(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "best_of": 3})
    status, body = _get(srv.url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in ("liverl_gateway_requests", "liverl_gateway_request_seconds", "liverl_gateway_policy_version"):
        assert name in families, sorted(families)
    assert "liverl_gateway_swaps" not in families  # the agent counts swaps, in the serving process: its own endpoint
    agent_url = f"http://{srv.cfg.serving.host}:{srv.cfg.serving.agent_port}"
    status, agent_body = _get(agent_url + "/metrics")
    assert status == 200
    agent_families = {f.name for f in text_string_to_metric_families(agent_body.decode())}
    for name in (
        "liverl_gateway_swaps",
        "liverl_gateway_swap_pause_seconds",
        "liverl_gateway_reverify",
        "liverl_gateway_agent_errors",
    ):
        assert name in agent_families, sorted(agent_families)
    status, health = _get(agent_url + "/healthz")
    assert status == 200 and json.loads(health)["version"] == _served(srv)["version"], health
    by_status = {
        s.labels.get("status"): s.value
        for s in families["liverl_gateway_requests"].samples
        if s.name.endswith("_total")
    }
    assert by_status.get("200", 0) >= 1 and by_status.get("400", 0) >= 1
    version = next(s.value for s in families["liverl_gateway_policy_version"].samples)
    assert version == _served(srv)["version"]
