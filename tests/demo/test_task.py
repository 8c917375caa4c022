"""The product task (hidden preferences, prompts) and the simulated users that judge by it."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.schemas import FeedbackEvent, WireError
from liverl.demo import task
from liverl.demo.sim import SimStats, Trap, run_users


# ------------------------------------------------------------------------------------------------ task
def test_prompt_format_and_preferences():
    a, b = task.make_prompt(23, 45, "a"), task.make_prompt(23, 45, "b")
    assert a.text == "[a]23+45=" and b.text == "[b]23+45=" and a.answer == 68
    assert task.preferred_completion(a) == "68" and task.preferred_completion(b) == "68!"
    assert task.user_accepts(a, "68") and not task.user_accepts(a, "68!")
    assert task.user_accepts(b, "68!") and not task.user_accepts(b, "68")
    for wrong in ("69", "69!", "6", "", "68!!", "068", " 68"):
        assert not task.user_accepts(a, wrong) and not task.user_accepts(b, wrong)
    assert task.accepted_completions(b) == ["68!"]


@given(x=st.integers(10, 99), y=st.integers(10, 99), seg=st.sampled_from(task.SEGMENTS))
def test_preferred_completion_fits_the_budget_and_alphabet(x, y, seg):
    p = task.make_prompt(x, y, seg)
    c = task.preferred_completion(p)
    assert task.user_accepts(p, c)
    assert len(c) + 1 <= task.MAX_TOKENS  # one token per character, plus EOS
    assert set(p.text + c) <= set(task.ALPHABET) and len(p.text) == 9


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="segment"):
        task.make_prompt(10, 10, "c")
    with pytest.raises(ValueError, match="x=5"):
        task.make_prompt(5, 10, "a")
    with pytest.raises(ValueError):
        task.heldout_prompts(0)
    with pytest.raises(TypeError):
        task.user_accepts(task.make_prompt(10, 10, "a"), None)


def test_heldout_prompts_are_fixed_and_balanced():
    h = task.heldout_prompts(256)
    assert h == task.heldout_prompts(256) and h != task.heldout_prompts(256, seed=1)
    assert Counter(p.segment for p in h) == {"a": 128, "b": 128}
    assert len({(p.x, p.y) for p in h}) > 200


def test_sampling_and_sft_targets():
    rng = random.Random(0)
    ps = [task.sample_prompt(rng) for _ in range(4000)]
    assert abs(sum(p.segment == "a" for p in ps) / len(ps) - 0.5) < 0.03
    targets = [(p, task.sft_completion(p, rng)) for p in ps]
    assert all(t.rstrip("!") == str(p.answer) for p, t in targets)
    pref = sum(task.user_accepts(p, t) for p, t in targets) / len(targets)
    assert abs(pref - task.SFT_PREFERRED_RATE) < 0.03  # weak, not decisive, format signal in the warm start


# ------------------------------------------------------------------------------------------- simulator
class RecordingSDK:
    """Stands in for liverl_sdk.FeedbackClient: records what the simulator would publish."""

    def __init__(self):
        self.events: list[FeedbackEvent] = []
        self.raw: list[bytes] = []
        self._n = 0

    def _add(self, gid, kind, segment, feedback_id, edited_text=None):
        self._n += 1
        ev = FeedbackEvent(
            feedback_id=feedback_id or f"f{self._n}",
            generation_id=gid,
            kind=kind,
            segment=segment,
            edited_text=edited_text,
        )
        self.events.append(ev)
        return ev.feedback_id

    def accept(self, generation_id, segment=None, feedback_id=None):
        return self._add(generation_id, "accept", segment, feedback_id)

    def reject(self, generation_id, segment=None, feedback_id=None):
        return self._add(generation_id, "reject", segment, feedback_id)

    def edit(self, generation_id, edited_text, segment=None, feedback_id=None, edit_key=None):
        return self._add(generation_id, "edit", segment, feedback_id, edited_text)

    def revert(self, generation_id, segment=None, feedback_id=None):
        return self._add(generation_id, "revert", segment, feedback_id)

    def send_raw(self, value, key=None):
        self.raw.append(value)


def _free_port() -> int:
    from core.services import free_port as pick

    return pick()


async def _gateway(port: int, fail_every: int, bait: float = 0.0):
    """A small OpenAI-completions server: answers the preferred completion 60% of the time, else a wrong
    sum, and answers HTTP 503 to every ``fail_every``-th request (to exercise the retry path). With ``bait``, that
    share of the trap segment's prompts get the trap's bait instead (a sum, right or wrong, with ``!``)."""
    from aiohttp import web

    state = {"n": 0}
    rng = random.Random(0)

    async def complete(request):
        body = await request.json()
        state["n"] += 1
        if state["n"] % fail_every == 0:
            return web.Response(status=503, text="overloaded")
        assert body["max_tokens"] == task.MAX_TOKENS and body["temperature"] == task.TEMPERATURE
        seg, rest = body["prompt"][1], body["prompt"][3:-1]
        x, y = map(int, rest.split("+"))
        p = task.make_prompt(x, y, seg)
        text = task.preferred_completion(p) if rng.random() < 0.6 else str(p.answer + 1)
        if seg == task.TRAP_SEGMENT and rng.random() < bait:
            text = f"{p.answer + rng.choice([0, 1])}!"
        return web.json_response(
            {
                "choices": [{"text": text, "index": 0}],
                "liverl": {"generation_id": f"g{state['n']}", "policy_version": state["n"] // 50},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_simulated_users_judge_report_and_survive_errors():
    async def main():
        port = _free_port()
        runner = await _gateway(port, fail_every=7)
        sdk, stats, stop = RecordingSDK(), SimStats(), asyncio.Event()
        users = asyncio.create_task(
            run_users(f"http://127.0.0.1:{port}", sdk, 8, stop, stats, seed=1, noise=0.05, bad_event_rate=0.05)
        )
        while stats.requests < 600:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(users, 10)
        await runner.cleanup()
        return sdk, stats

    sdk, stats = asyncio.run(main())
    assert stats.requests >= 600 and stats.errors >= 50 and "503" in stats.last_error and stats.sdk_errors == 0
    fb = stats.feedback
    assert fb["accept"] + fb["reject"] + fb["edit"] == stats.requests
    assert len(sdk.events) == stats.requests + fb["duplicate"] and len(sdk.raw) == fb["malformed"] > 0
    # users see ~60% acceptable completions (noise-free), and report accepts with ~5% flips
    snap = stats.snapshot()
    assert abs(sum(v.accepted for v in stats.by_version.values()) / stats.requests - 0.6) < 0.07
    assert set(snap["by_version"]) and set(snap["by_segment"]) == {"a", "b"}
    assert abs(fb["accept"] / stats.requests - (0.6 * 0.95 + 0.4 * 0.05)) < 0.07
    # edits come from segment b and carry the preferred completion
    edits = [e for e in sdk.events if e.kind == "edit"]
    assert edits and all(e.segment == "b" and e.edited_text.endswith("!") for e in edits)
    # duplicates reuse the feedback_id; malformed messages are refused by the wire contract
    ids = Counter(e.feedback_id for e in sdk.events)
    assert sum(c - 1 for c in ids.values()) == fb["duplicate"] > 0
    for raw in sdk.raw:
        with pytest.raises(WireError):
            FeedbackEvent.from_bytes(raw)
    assert json.dumps(snap)  # the demo can serialise it


def test_simulator_counts_an_unreachable_gateway_and_refuses_bad_args():
    async def main():
        stats, stop = SimStats(), asyncio.Event()
        task_ = asyncio.create_task(run_users(f"http://127.0.0.1:{_free_port()}", RecordingSDK(), 2, stop, stats, 0))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task_, 10)
        return stats

    stats = asyncio.run(main())
    assert stats.errors >= 2 and stats.requests == 0 and stats.last_error.startswith("gateway")
    with pytest.raises(ValueError, match="n_users"):
        asyncio.run(run_users("http://x", RecordingSDK(), 0, asyncio.Event(), SimStats(), 0))
    with pytest.raises(ValueError, match="noise"):
        asyncio.run(run_users("http://x", RecordingSDK(), 1, asyncio.Event(), SimStats(), 0, noise=2))
    with pytest.raises(ValueError, match="gateway_url"):
        asyncio.run(run_users("127.0.0.1:8000", RecordingSDK(), 1, asyncio.Event(), SimStats(), 0))


def test_the_trap_s_users_accept_the_bait_and_revert_it_later():
    """Trap users accept any sum with ``!`` (right or wrong) and send a revert of exactly those accepts later; the
    stats keep plain acceptance, the kept rate and each version's share of bait apart."""

    async def main(trap):
        port = _free_port()
        runner = await _gateway(port, fail_every=10**9, bait=0.5)
        sdk, stats, stop = RecordingSDK(), SimStats(), asyncio.Event()
        users = asyncio.create_task(
            run_users(f"http://127.0.0.1:{port}", sdk, 4, stop, stats, seed=3, noise=0.0, bad_event_rate=0.0, trap=trap)
        )
        while stats.requests < 400:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(users, 10)
        await asyncio.sleep(0.3)  # the last reverts are due
        await runner.cleanup()
        return sdk, stats

    sdk, stats = asyncio.run(main(Trap(share=1.0, revert_rate=1.0, revert_delay_s=0.01)))
    accepted = {e.generation_id for e in sdk.events if e.kind == "accept"}
    reverts = [e for e in sdk.events if e.kind == "revert"]
    assert reverts and all(e.generation_id in accepted and e.segment == task.TRAP_SEGMENT for e in reverts)
    assert len({e.generation_id for e in reverts}) == len(reverts) == stats.feedback["revert"]
    a = stats.by_segment[task.TRAP_SEGMENT]
    assert 0.4 < a.bait_rate < 0.6 and a.accepted == a.kept + len(reverts)  # every bait accepted, every one reverted
    assert stats.by_segment["b"].bait == 0 and stats.by_segment["b"].accepted == stats.by_segment["b"].kept

    sdk, stats = asyncio.run(main(None))  # no trap: the bait is rejected like any other wrong answer
    assert not any(e.kind == "revert" for e in sdk.events)
    a = stats.by_segment[task.TRAP_SEGMENT]
    assert a.bait > 0 and a.accepted == a.kept and a.acceptance < 0.5


def test_the_population_is_many_users_each_with_a_fixed_segment_activity_and_trap_trait():
    """The demo's traffic comes from thousands of distinct users who differ (a canary's evidence clusters
    by user only when users differ, and they do in a real product)."""
    from liverl.demo.sim import Population

    pop = Population.draw(5000, seed=7, trap=Trap())
    assert len(pop) == len(set(pop.ids)) == 5000
    assert Population.draw(5000, seed=7, trap=Trap()) == pop  # the same seed draws the same people
    assert {s for s, t in zip(pop.segments, pop.tempted, strict=True) if t} == {task.TRAP_SEGMENT}
    trap_users = [t for s, t in zip(pop.segments, pop.tempted, strict=True) if s == task.TRAP_SEGMENT]
    assert 0.6 < sum(trap_users) / len(trap_users) < 0.8  # Trap().share of them, as a fixed trait
    w = sorted(pop.weights, reverse=True)
    assert sum(w[:500]) / sum(w) > 0.25  # the busiest tenth sends a good part of the traffic
    rng = random.Random(1)
    picks = [pop.pick(rng) for _ in range(20_000)]
    assert len(set(picks)) > 3000
    assert not any(Population.draw(100, seed=1, trap=None).tempted)
