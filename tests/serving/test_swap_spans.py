"""A hot-swap without a drain, against a real vLLM CPU node: streamed requests in flight across the swap complete,
and their records say which tokens each version sampled, exactly (log-probs checked against each version's weights).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request

import pytest
import torch

from tests.serving.conftest import records as _records
from tests.serving.test_serving import _announce, _hf_logprobs, _perturbed, _served, _wait_version

pytestmark = pytest.mark.slow

TOKENS = 20  # the longest completion the test node's max_model_len leaves room for after these prompts


def _stream(url: str, prompt: str) -> dict:
    """One streamed completion of TOKENS sampled tokens (ignore_eos); returns what the client saw."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True, "stream": True, "logprobs": 0}
    ).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    out = {"t0": time.time(), "chunks": [], "done": False}
    with urllib.request.urlopen(req, timeout=60) as r:
        out["status"] = r.status
        for line in r:
            line = line.strip()
            if line == b"data: [DONE]":
                out["done"] = True
            elif line.startswith(b"data: "):
                out["chunks"].append(json.loads(line[6:]))
    out["t1"] = time.time()
    return out


def test_streams_in_flight_across_a_swap_finish_and_their_records_show_both_versions(srv):
    from learner.model import load_model

    old = _served(srv)
    states = {old["version"]: srv.registry.materialize(old["version"])}
    chain = [old["version"]]  # the versions served, in order
    swaps_before = srv.redis.llen(f"{srv.cfg.topics.prefix}:swaps")

    results: list[dict] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                results.append(_stream(srv.url, ["[a]23+45=", "[b]17+61="][i % 2]))
            except Exception as e:  # noqa: BLE001 - collected and asserted on below
                errors.append(e)

    def spanned_seen() -> int:  # how many choices the clients saw with version_spans (they spanned a swap)
        return sum("version_spans" in c["choices"][0] for r in list(results) for c in r["chunks"] if c.get("choices"))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    # one swap normally leaves streams spanning it; on a starved box the gateway (in this process, beside the 16
    # client threads) can lag so far behind the node that nothing is generating at the pause: swap again (<= 8 times)
    # until 4 streams spanned one (the attribution check below tolerates one record in four a routing flip blurs)
    for attempt in range(8):
        state = _perturbed(states[chain[-1]], seed=chain[-1] + 7 + attempt, scale=0.3)
        row = srv.registry.add_candidate(state, parent=chain[-1], metrics={}, sample_offsets={}, learner_step=1)
        states[row.version] = state
        _announce(srv, row.version, row.checksum)
        _wait_version(srv, row.version)
        chain.append(row.version)
        time.sleep(1.5)
        if spanned_seen() >= 4:
            break
    stop.set()
    for t in threads:
        t.join(60)

    # nothing dropped, nothing failed: every stream ended with [DONE] and TOKENS tokens
    assert not errors, errors[:3]
    assert results and all(r["status"] == 200 and r["done"] for r in results)
    deadline = time.monotonic() + 30  # the agent pushes a swap's record right after the node reports the new version
    while True:
        swaps = [json.loads(x) for x in srv.redis.lrange(f"{srv.cfg.topics.prefix}:swaps", swaps_before, -1)]
        if len(swaps) >= len(chain) - 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [(w["from"], w["to"]) for w in swaps] == list(itertools.pairwise(chain)), swaps
    for swap in swaps:
        assert swap["verify_ok"], swap
        assert swap.get("drain_ms") is None  # nothing drained
        print("swap record:", swap)
    # requests were in flight at a swap (a later swap, made to collect more spanning streams, may find none on a
    # starved box: the clients' threads are waiting on the gateway in this same process)
    assert any(swap["inflight"] > 0 for swap in swaps), swaps

    gids = {r["chunks"][0]["choices"][0]["generation_id"]: r for r in results}
    recs = _records(srv, set(gids))
    assert set(recs) == set(gids)
    mixed = [rec for rec in recs.values() if rec.mixed_versions]
    spanned = sorted((r.version_spans for r in recs.values() if r.version_spans is not None), key=str)
    assert mixed, (
        f"no stream spanned any of {len(swaps)} swaps (16 clients of {TOKENS}-token streams); spans: {spanned[:20]}"
    )
    for rec in recs.values():
        assert len(rec.completion_token_ids) == TOKENS
        if rec.version_spans is None:
            assert rec.policy_version in chain
        else:
            vs = [v for v, _, _ in rec.version_spans]
            # versions served one after the other (a slow stream may span two swaps)
            assert vs[0] in chain and vs == chain[chain.index(vs[0]) : chain.index(vs[0]) + len(vs)], rec.version_spans
            assert rec.policy_version == vs[0]
            # the client saw the spans too, in the choice's last chunk
            if len(vs) > 1:
                last = [c for c in gids[rec.generation_id]["chunks"] if c.get("choices")][-1]["choices"][0]
                assert last["version_spans"] == [list(s) for s in rec.version_spans]

    # exact attribution: each token's logged log-prob is the one its span's version gives it over the whole context
    # (KV recomputed under the new weights after the swap); the other version's is far off. One token is no proof
    # either way: this is an MoE with top-2 routing, and bf16 rounding flips a token's experts now and then. The same
    # weights computed in bf16 and in fp32 by transformers differ by p50 0.0035, p99 0.47 and at most 7.6 nats over 400
    # sampled tokens, the tail vLLM shows too (a CI run once saw 4.1 nats on a span's last token). The split itself is
    # what the labels claim, and a mislabelled token moves it: for each record, the boundary at which the first version
    # best explains the tokens before it and the second the rest is the labelled one (off by one token, the cost grows
    # by that token's gap between the versions; one stray token away from the boundary cannot move it)
    checked = [rec for rec in mixed if len(rec.version_spans) == 2][:6]
    assert checked, [rec.version_spans for rec in mixed]
    models = {
        v: load_model(srv.model_dir, state_dict=states[v], dtype=torch.float32)
        for v in {v for rec in checked for v, _, _ in rec.version_spans}
    }
    own: list[float] = []
    other_err: list[float] = []
    off: list[str] = []  # records whose log-probs point to another split than their labels
    table: list[str] = []
    for n, rec in enumerate(checked):
        (v0, _, _), (v1, split, _) = rec.version_spans
        lp = rec.completion_logprobs
        ref = {v: _hf_logprobs(models[v], rec.prompt_token_ids, rec.completion_token_ids) for v in (v0, v1)}
        for v, a, b in rec.version_spans:
            other = v1 if v == v0 else v0
            for i in range(a, b):
                own.append(abs(lp[i] - ref[v][i]))
                other_err.append(abs(lp[i] - ref[other][i]))
                table.append(
                    f"rec {n} token {i:2d} label {v} logged {lp[i]:8.4f} "
                    f"v{v0} {ref[v0][i]:8.4f} v{v1} {ref[v1][i]:8.4f}"
                )
        cost = [
            sum(abs(lp[i] - ref[v0][i]) for i in range(s)) + sum(abs(lp[i] - ref[v1][i]) for i in range(s, len(lp)))
            for s in range(len(lp) + 1)
        ]
        best = min(range(len(lp) + 1), key=cost.__getitem__)
        if cost[split] > cost[best] + 0.5:
            off.append(
                f"rec {n}: labelled split at token {split} (cost {cost[split]:.2f}), "
                f"the log-probs' at {best} ({cost[best]:.2f})"
            )
    mean_own, mean_other = sum(own) / len(own), sum(other_err) / len(other_err)
    worst = sorted(range(len(own)), key=lambda k: -own[k])[:5]
    print(
        f"log-prob error to the span's version: mean {mean_own:.4f} max {max(own):.4f}; to the other version: mean "
        f"{mean_other:.4f}; the worst tokens:\n" + "\n".join(table[k] for k in worst)
    )
    # a mislabelling bug moves the split of (nearly) every record; a routing flip at a boundary token, one at most
    assert len(off) <= len(checked) // 4, "splits the log-probs do not support:\n" + "\n".join(off)
    # sampled (not greedy) tokens include unlikely ones, where bf16 kernels stray further than on greedy tokens:
    # 0.027-0.029 on the base weights' first swap, 0.054 once other tests had perturbed the weights twice before, 0.122
    # on a fresh clone's CI run swapping 2 -> 5 (each perturbation grows the logits, and bf16's error with them): the
    # bound that says which version sampled a token is the split check above; this one only catches a broken
    # scoring path
    assert mean_own < 0.25, mean_own
    assert mean_other > 10 * mean_own, (mean_other, mean_own)
