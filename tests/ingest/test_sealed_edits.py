"""An edit the product sealed under its generation's edit key (``liverl_sdk.edits``) through the join: opened with the
key the generation's sealed record holds and sealed again into the sample under the user's data key; an edit that
does not open (another generation's key, or a generation logged unsealed, so no key at all) is dead-lettered
``unsealable`` and makes no sample; once the user is forgotten, nothing opens it. The real join and Redis, the
registry's SQLite for the users' keys, and a recorder for what ingest produces (``test_fuzz.Broker``)."""

from __future__ import annotations

import pytest

from core.schemas import DeadLetter, FeedbackEvent, TrainingSample
from core.shred import UserKeys, open_samples, seal_record
from deploy.registry.regdb import RegistryDB
from ingest.join import Ingest, Source
from liverl_sdk.edits import EditSealError, new_edit_key, open_edit, seal_edit
from tests.ingest.conftest import make_generation
from tests.ingest.test_fuzz import Broker, world  # noqa: F401 world: the fixture

UNIT = "a1a1a1a1a1a1a1a1"
EDIT = "MARMOT-EDIT-4471"


def test_an_edit_opens_only_under_its_generations_key_and_for_that_generation():
    key, other = new_edit_key(), new_edit_key()
    blob = seal_edit(key, "g1", EDIT)
    assert EDIT not in blob and open_edit(key, "g1", blob) == EDIT
    for k, gid, b in ((other, "g1", blob), (key, "g2", blob), (key, "g1", blob[:-4] + "AAA=")):
        with pytest.raises(EditSealError):
            open_edit(k, gid, b)
    for bad in ("short", key + "AAAA", "!" * 43):
        with pytest.raises(EditSealError):
            seal_edit(bad, "g1", EDIT)
    with pytest.raises(ValueError, match="exactly one"):  # an edit carries its text one way
        FeedbackEvent(feedback_id="f", generation_id="g1", kind="edit", edited_text=EDIT, edited_sealed=blob)
    with pytest.raises(ValueError, match="only allowed with kind 'edit'"):
        FeedbackEvent(feedback_id="f", generation_id="g1", kind="accept", edited_sealed=blob)


def test_the_join_opens_a_sealed_edit_with_the_records_key_and_refuses_any_other(world, tmp_path):  # noqa: F811
    cfg, metrics, loop = world
    db = RegistryDB(f"sqlite:///{tmp_path / 'registry.db'}")
    keys = UserKeys(db, bytes(range(32)))
    broker = Broker()
    ing = Ingest(cfg, metrics, {}, broker, user_keys=keys)
    try:
        user_key = keys.key_for(UNIT)
        edit_keys = {g: new_edit_key() for g in ("g-ok", "g-wrong", "g-plain-edit", "g-forgotten")}

        def sealed(gid: str):
            rec = make_generation(gid, 1).model_copy(update={"unit": UNIT})
            return seal_record(user_key, rec, edit_keys[gid])

        gens = {g: sealed(g) for g in edit_keys} | {"g-unsealed": make_generation("g-unsealed", 1)}
        loop.run_until_complete(
            ing.process(
                [(Source(cfg.topics.generations, 0, i, g), r.to_bytes()) for i, (g, r) in enumerate(gens.items())]
            )
        )

        def edit(gid: str, key: str | None) -> FeedbackEvent:
            if key is None:
                return FeedbackEvent(feedback_id=f"f-{gid}", generation_id=gid, kind="edit", edited_text=EDIT)
            return FeedbackEvent(
                feedback_id=f"f-{gid}", generation_id=gid, kind="edit", edited_sealed=seal_edit(key, gid, EDIT)
            )

        events = [
            edit("g-ok", edit_keys["g-ok"]),
            edit("g-wrong", new_edit_key()),  # another key: does not open
            edit("g-plain-edit", None),  # the product did not seal it: sealed into the sample all the same
            edit("g-unsealed", new_edit_key()),  # a record logged unsealed holds no edit key
        ]
        for e in events:
            assert e.edited_text is None or e.generation_id == "g-plain-edit"
        loop.run_until_complete(
            ing.process(
                [(Source(cfg.topics.feedback, 0, i, e.generation_id), e.to_bytes()) for i, e in enumerate(events)]
            )
        )
        samples = {k: TrainingSample.from_bytes(v) for k, v in broker.of(cfg.topics.samples)}
        assert sorted(samples) == ["g-ok", "g-plain-edit"]
        assert all(EDIT.encode() not in v for _, v in broker.of(cfg.topics.samples))  # sealed in every sample
        opened, gone = open_samples(keys, [samples["g-ok"], samples["g-plain-edit"]])
        assert [s.edited_text for s in opened] == [EDIT, EDIT] and gone == []
        dead = {d.key: d for d in (DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters))}
        assert {k: d.reason for k, d in dead.items()} == {"g-wrong": "unsealable", "g-unsealed": "unsealable"}
        assert "another generation's edit key" in dead["g-wrong"].detail
        assert "logged unsealed" in dead["g-unsealed"].detail

        assert keys.destroy(UNIT)  # forgotten: the edit key is in a record nobody can open now
        late = edit("g-forgotten", edit_keys["g-forgotten"])
        loop.run_until_complete(ing.process([(Source(cfg.topics.feedback, 0, 9, "g-forgotten"), late.to_bytes())]))
        dead = {d.key: d.reason for d in (DeadLetter.from_bytes(v) for _, v in broker.of(cfg.topics.dead_letters))}
        assert dead["g-forgotten"] == "forgotten" and "g-forgotten" not in dict(broker.of(cfg.topics.samples))
    finally:
        keys.close()
        db.close()


def test_a_batchs_keys_are_read_on_a_thread_while_the_event_loop_runs_on(world, tmp_path):  # noqa: F811
    """A registry slow to give the keys (a second a query here) holds up the batch's decisions, not the event loop:
    the loop ticks while the keys are read, the batch is then decided with the keys read once, and its sample made."""
    import asyncio
    import time

    cfg, metrics, loop = world
    db = RegistryDB(f"sqlite:///{tmp_path / 'registry.db'}")
    keys = UserKeys(db, bytes(range(32)))

    class Slow(UserKeys):
        def keys_for(self, units):
            time.sleep(1.0)
            return super().keys_for(units)

    slow = Slow(db, bytes(range(32)))
    broker = Broker()
    ing = Ingest(cfg, metrics, {}, broker, user_keys=slow)
    try:
        rec = seal_record(keys.key_for(UNIT), make_generation("g-slow", 1).model_copy(update={"unit": UNIT}))
        fb = FeedbackEvent(feedback_id="f-slow", generation_id="g-slow", kind="accept")
        events = [
            (Source(cfg.topics.generations, 0, 0, "g-slow"), rec.to_bytes()),
            (Source(cfg.topics.feedback, 0, 0, "g-slow"), fb.to_bytes()),
        ]

        async def run() -> int:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            out = ing.begin()
            assert await ing.prefetch_keys(out, events)
            seen = ticks
            ing.decide_some(out, events, prefetched=True)
            await ing.settle(ing.end(out))
            ticker.cancel()
            return seen

        assert loop.run_until_complete(run()) >= 10  # the loop ran on through the second the keys took
        assert ing.decider.keys.queries == 1  # read once, on the thread; none while deciding
        assert [k for k, _ in broker.of(cfg.topics.samples)] == ["g-slow"]
    finally:
        keys.close()
        slow.close()
        db.close()
