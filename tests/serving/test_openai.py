"""The gateway as OpenAI clients see it: the ``openai`` package against the real gateway and vLLM node (conftest's
serving stack), and every choice's generation record read back from the topic."""

from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest

from tests.serving.conftest import records

pytestmark = pytest.mark.slow

PROMPTS = ["[a]23+45=", "[b]17+61=", "[a]90+9=", "[b]50+44="]


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _liverl(obj) -> dict:
    return obj.model_extra["liverl"]


def _gid(choice) -> str:
    return choice.model_extra["generation_id"]


def _check_record(rec, version: int, text: str, *, trainable: bool = True, temperature: float = 1.0) -> None:
    assert rec.policy_version == version and rec.completion == text
    assert len(rec.completion_token_ids) == len(rec.completion_logprobs) >= 1
    assert all(lp <= 0 for lp in rec.completion_logprobs) and rec.prompt_token_ids
    assert rec.sampling.temperature == temperature and rec.trainable is trainable
    assert rec.untrainable_reason == (None if trainable else "greedy")
    assert rec.latency_s is not None and 0 < rec.latency_s < 120  # served in: the latency guardrail's input


def test_completions_plain(srv, client):
    raw = client.completions.with_raw_response.create(
        model="liverl", prompt=PROMPTS[0], max_tokens=5, top_p=0.9, seed=3
    )
    out = raw.parse()
    gid, version = _liverl(out)["generation_id"], _liverl(out)["policy_version"]
    assert raw.headers["X-Liverl-Generation-Id"] == gid == _gid(out.choices[0])
    assert raw.headers["X-Liverl-Version"] == str(version)
    assert out.choices[0].logprobs is None and "token_ids" not in out.choices[0].model_extra  # not asked for
    rec = records(srv, {gid})[gid]
    _check_record(rec, version, out.choices[0].text)
    assert rec.prompt == PROMPTS[0] and len(rec.prompt_token_ids) == len(PROMPTS[0])
    assert (rec.sampling.top_p, rec.sampling.seed, rec.sampling.max_tokens) == (0.9, 3, 5)


def test_completions_streamed_with_n_and_batched_prompts(srv, client):
    raw = client.completions.with_raw_response.create(
        model="liverl", prompt=PROMPTS[:2], n=2, max_tokens=5, stream=True, logprobs=1
    )
    ids = raw.headers["X-Liverl-Generation-Id"].split(",")
    version = int(raw.headers["X-Liverl-Version"])
    texts: dict[int, str] = {}
    for chunk in raw.parse():
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            assert _gid(c) == ids[c.index] == _liverl(chunk)["generation_id"]
            assert _liverl(chunk)["policy_version"] == version and c.logprobs is not None
    assert len(ids) == len(set(ids)) == 4 and sorted(texts) == [0, 1, 2, 3]
    recs = records(srv, set(ids))
    for i, gid in enumerate(ids):  # one record per choice, choice i answering prompt i // n
        _check_record(recs[gid], version, texts[i])
        assert recs[gid].prompt == PROMPTS[i // 2]


def test_chat_plain_and_streamed_log_what_the_model_read(srv, client):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    raw = client.chat.completions.with_raw_response.create(
        model="liverl", messages=messages, max_tokens=5, logprobs=True
    )
    out = raw.parse()
    gid = _liverl(out)["generation_id"]
    assert raw.headers["X-Liverl-Generation-Id"] == gid == _gid(out.choices[0])
    assert out.choices[0].logprobs.content and out.choices[0].message.role == "assistant"

    stream = client.chat.completions.create(model="liverl", messages=messages, max_tokens=5, stream=True, n=2)
    streamed: dict[int, str] = {}
    stream_ids: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            stream_ids[c.index] = _gid(c)
    plain = client.completions.create(model="liverl", prompt=PROMPTS[2], max_tokens=1)

    recs = records(srv, {gid, *stream_ids.values(), _liverl(plain)["generation_id"]})
    version = _liverl(out)["policy_version"]
    _check_record(recs[gid], version, out.choices[0].message.content)
    for i, sid in stream_ids.items():
        _check_record(recs[sid], version, streamed[i])
    # the demo's chat template is the message itself: the chat prompt is token for token the completion prompt
    reference = recs[_liverl(plain)["generation_id"]].prompt_token_ids
    assert all(
        recs[g].prompt_token_ids == reference and recs[g].prompt == PROMPTS[2] for g in [gid, *stream_ids.values()]
    )
    assert [lp.logprob for lp in out.choices[0].logprobs.content] == pytest.approx(recs[gid].completion_logprobs)


def test_greedy_is_served_and_logged_but_not_trainable(srv, client):
    before = _untrainable(srv)
    out = client.completions.create(model="liverl", prompt=PROMPTS[3], max_tokens=5, temperature=0)
    chat = client.chat.completions.create(
        model="liverl", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=5, temperature=0
    )
    ids = {_liverl(out)["generation_id"], _liverl(chat)["generation_id"]}
    recs = records(srv, ids)
    for rec in recs.values():
        _check_record(rec, rec.policy_version, rec.completion, trainable=False, temperature=0.0)
    assert out.choices[0].text == chat.choices[0].message.content  # greedy: the same answer on both routes
    assert _untrainable(srv) == before + 2


def _untrainable(srv) -> float:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    line = next(
        (s for s in text.splitlines() if s.startswith('liverl_gateway_untrainable_generations_total{reason="greedy"}')),
        None,
    )
    return float(line.split()[-1]) if line else 0.0


def test_concurrent_clients_mixed_routes(srv):
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:

            async def one(i: int) -> str:
                p = PROMPTS[i % 4]
                if i % 4 == 0:
                    r = await c.chat.completions.create(
                        model="liverl", messages=[{"role": "user", "content": p}], max_tokens=5
                    )
                    return _liverl(r)["generation_id"]
                if i % 4 == 1:
                    ids = set()
                    async for chunk in await c.completions.create(model="liverl", prompt=p, max_tokens=5, stream=True):
                        ids.add(_liverl(chunk)["generation_id"])
                    assert len(ids) == 1
                    return ids.pop()
                return _liverl(await c.completions.create(model="liverl", prompt=p, max_tokens=5))["generation_id"]

            return await asyncio.gather(*(one(i) for i in range(48)))

    ids = asyncio.run(main())
    assert len(set(ids)) == 48
    assert set(records(srv, set(ids))) == set(ids)


def test_models_and_openai_style_refusals(client):
    assert [m.id for m in client.models.list().data] == ["liverl"]
    for kwargs, param in [
        ({"prompt": "x", "n": 100}, "n"),
        ({"prompt": "x", "extra_body": {"best_of": 3}}, "best_of"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": [1, 2]}, "prompt"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="liverl", **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param and param in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="liverl", messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
