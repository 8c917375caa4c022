"""Forgetting a user by destroying their data key (``core.shred``), through the real ``liverl ingest`` on an embedded
broker that keeps its topics in a folder: the user's text is sealed everywhere liverl keeps it, their samples open
only while the key exists, and after the key is destroyed a search of every byte of the broker's folder, the join
store (and its changelog topic, in that folder) and the registry's database finds none of it, their edits included
(sealed by the product under each generation's edit key, which only the sealed record holds), while another user's
text still flows."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from core.bus import feedback_client
from core.config import load_config
from core.credentials import write_secret
from core.schemas import DeadLetter, TrainingSample
from core.shred import UserKeys, load_kek, open_samples, seal_record
from deploy.registry.regdb import RegistryDB
from liverl_sdk.edits import new_edit_key
from tests.conftest import free_port
from tests.ingest.conftest import IngestHarness, ingest_config, make_generation, new_gid

A, B = "a1a1a1a1a1a1a1a1", "b2b2b2b2b2b2b2b2"
A_PROMPT, A_COMPLETION, A_EDIT = "ZEBRA-PROMPT-7731", "QUOKKA-COMPLETION-5512", "NARWHAL-EDIT-9043"
B_PROMPT = "OKAPI-PROMPT-2208"
PLAIN_EDIT = "WOMBAT-PLAIN-EDIT-3317"  # an edit of a generation without a user: in the clear, the search's control
A_IDS = [90001, 90002, 90003, 90004, 90005, 90006]  # distinctive token ids: their JSON is searched for too


def every_byte(*folders: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for d in folders for p in sorted(d.rglob("*")) if p.is_file()]


def found(needle: str, files: list[tuple[Path, bytes]]) -> list[str]:
    n = needle.encode()
    return [str(p) for p, data in files if n in data]


@pytest.fixture
def folder_stack(tmp_path):
    """An embedded broker of this test's own, keeping its topics in <state>/broker (the default storage)."""
    from liverl.stack.stack import start_stack

    cfg = load_config(
        env={},
        state_dir=str(tmp_path / "stack"),
        broker__embedded_port=free_port(),
        redis__url="redis://127.0.0.1:6379/0",
    )
    assert cfg.broker.embedded_storage == "folder"
    st = start_stack(cfg)
    stacks = [st]
    yield st, tmp_path / "stack" / "broker", lambda: stacks.append(start_stack(cfg)) or stacks[-1]
    for s in stacks:
        s.close()


def test_a_forgotten_users_text_is_nowhere_and_another_users_still_flows(folder_stack, tmp_path):
    """...and a restart of the whole stack (the broker on its folder, ingest restoring its join store) brings none of
    it back: feedback sent afterwards on the forgotten user's generations is dead-lettered, another user's flows."""
    st, broker_dir, restart = folder_stack
    state = tmp_path / "state"
    cfg = ingest_config(st, state)
    write_secret(state / "keys" / "shred.key")
    db = RegistryDB(cfg.registry_url)  # migrated: the user_keys table
    keys = UserKeys(db, load_kek(cfg))
    h = IngestHarness(cfg, tmp_path)
    try:
        h.start_worker()

        edit_keys: dict[str, str] = {}

        def sealed_generation(unit: str, prompt: str, ids: list[int] | None = None):
            rec = make_generation(new_gid(), 7).model_copy(
                update={"unit": unit, "prompt": prompt, "completion": f"{prompt}-ANSWER"}
            )
            if ids is not None:
                rec = rec.model_copy(update={"prompt_token_ids": ids, "completion": A_COMPLETION})
            edit_keys[rec.generation_id] = new_edit_key()  # the gateway's, returned to the product
            return seal_record(keys.key_for(unit), rec, edit_keys[rec.generation_id])

        a1, b1 = sealed_generation(A, A_PROMPT, A_IDS), sealed_generation(B, B_PROMPT)
        a2, b2 = sealed_generation(A, A_PROMPT, A_IDS), sealed_generation(B, B_PROMPT)
        a3 = sealed_generation(A, A_PROMPT, A_IDS)  # judged only after the forget and a restart
        plain = make_generation(new_gid(), 7)  # no unit: no one to forget, logged and joined as it is
        for rec in (a1, b1, a2, b2, a3, plain):
            sealed = rec.sealed and not rec.prompt_token_ids and A_PROMPT.encode() not in rec.to_bytes()
            assert rec.unit is None or sealed
            h.send_generation(rec)
        with feedback_client(cfg) as sdk, h.tail("samples") as samples:
            sdk.edit(a1.generation_id, A_EDIT, edit_key=edit_keys[a1.generation_id])
            sdk.accept(b1.generation_id)
            sdk.edit(plain.generation_id, PLAIN_EDIT)  # no user, no edit key
            got = samples.wait_for(samples.keys({a1.generation_id, b1.generation_id, plain.generation_id}), n=3)
            by_gid = {r.key.decode(): TrainingSample.from_bytes(r.value) for r in got}
            sa = by_gid[a1.generation_id]
            assert sa.unit == A and sa.sealed and sa.edited_text is None and sa.prompt_token_ids == []
            assert by_gid[plain.generation_id].sealed is None and by_gid[plain.generation_id].prompt_token_ids
            opened, gone = open_samples(keys, [sa, by_gid[b1.generation_id]])
            assert gone == [] and opened[0].prompt_token_ids == A_IDS and opened[0].edited_text == A_EDIT

            assert keys.destroy(A)  # forget A
            with h.tail("dead_letters") as dead:
                sdk.accept(a2.generation_id)  # joined after the forget: no sample, dead-lettered `forgotten`
                sdk.accept(b2.generation_id)
                letter = DeadLetter.from_bytes(dead.wait_for(lambda r: b'"forgotten"' in r.value)[0].value)
            assert letter.reason == "forgotten" and letter.value == "" and letter.source_topic == cfg.topics.feedback
            (b2s,) = samples.wait_for(samples.keys({b2.generation_id}))
            samples.poll()
            assert not samples.matching(samples.keys({a2.generation_id}))
            opened, gone = open_samples(keys, [TrainingSample.from_bytes(b2s.value), sa])
            assert [s.unit for s in opened] == [B] and [s.unit for s in gone] == [A]  # B flows; A's sample is gone
        assert h.counters().get("dlq:forgotten") == 1
        assert h.worker.stop(signal.SIGTERM) == 0  # the join store flushed to its files
        h.worker = None
    finally:
        h.close()
        keys.close()
        db.close()
    st.close()  # the broker's folder as it is left

    def search() -> None:
        files = every_byte(broker_dir, state / "ingest") + [(p, p.read_bytes()) for p in state.glob("registry.db*")]
        assert found(PLAIN_EDIT, files), "control: an edit sent in the clear is found in the broker's folder"
        for needle in (A_PROMPT, A_COMPLETION, A_EDIT, B_PROMPT, ",".join(map(str, A_IDS))):
            assert not found(needle, files), needle

    search()
    st = restart()  # the whole stack again, on the same folders (and the same address: cfg holds)
    assert st.bootstrap == cfg.broker.bootstrap
    db = RegistryDB(cfg.registry_url)
    keys = UserKeys(db, load_kek(cfg))
    h = IngestHarness(cfg, tmp_path)
    try:
        h.start_worker()  # restores the join store (A's sealed entries among them) from its files and changelog
        b3 = seal_record(keys.key_for(B), make_generation(new_gid(), 7).model_copy(update={"unit": B}))
        h.send_generation(b3)
        with feedback_client(cfg) as sdk, h.tail("samples") as samples, h.tail("dead_letters") as dead:
            sdk.accept(a3.generation_id)  # A's generation waiting in the restored join store: no sample
            sdk.edit(a2.generation_id, A_EDIT, edit_key=edit_keys[a2.generation_id])  # judged (forgotten) before
            sdk.accept(b3.generation_id)
            samples.wait_for(samples.keys({b3.generation_id}))
            reasons = {
                (r.key.decode(), DeadLetter.from_bytes(r.value).reason)
                for r in dead.wait_for(dead.keys({a2.generation_id, a3.generation_id}), n=3)
            }
            assert reasons == {
                (a2.generation_id, "forgotten"),  # (before the restart)
                (a2.generation_id, "already_judged"),
                (a3.generation_id, "forgotten"),
            }, reasons
            samples.poll()
            assert not samples.matching(samples.keys({a2.generation_id, a3.generation_id}))
        assert h.worker.stop(signal.SIGTERM) == 0
        h.worker = None
    finally:
        h.close()
        keys.close()
        db.close()
    st.close()
    search()


def test_a_worker_without_the_key_encryption_key_stops_on_a_sealed_generation_and_loses_nothing(stack, tmp_path):
    """A worker not given the deployment's shred.key cannot open a sealed generation: it stops without acknowledging
    its batch (exit 75, the log naming security.shred_key) rather than dead-letter every sealed user's feedback.
    Started again with the key (at its default place, ``<state_dir>/keys/shred.key``), it makes the sample from the
    same records."""
    from core.services import EXIT_TEMPFAIL
    from core.shred import read_kek
    from tests.ingest.conftest import wait_until

    cfg = ingest_config(stack, tmp_path / "state")
    kek = tmp_path / "shred.key"
    write_secret(kek)
    db = RegistryDB(cfg.registry_url)
    keys = UserKeys(db, read_kek(kek))
    h = IngestHarness(cfg, tmp_path)
    try:
        h.start_worker()  # (its probe generation has no user: not sealed)
        rec = seal_record(keys.key_for(A), make_generation(new_gid(), 7).model_copy(update={"unit": A}))
        h.send_generation(rec)
        with feedback_client(cfg) as sdk:
            sdk.accept(rec.generation_id)
        wait_until(lambda: h.worker.proc.poll() is not None, 90, what="the worker to stop")
        assert h.worker.proc.returncode == EXIT_TEMPFAIL, h.worker.log_tail()
        assert "security.shred_key" in h.worker.log_tail(), h.worker.log_tail()
        assert not h.counters().get("dlq:internal_error")
        (tmp_path / "state" / "keys").mkdir(parents=True, exist_ok=True)  # the key where the worker looks for it
        kek.rename(tmp_path / "state" / "keys" / "shred.key")
        with h.tail("samples") as samples:
            h.start_worker()
            (got,) = samples.wait_for(samples.keys({rec.generation_id}), timeout=60)
        sample = TrainingSample.from_bytes(got.value)
        assert sample.unit == A and sample.sealed
    finally:
        h.close()
        keys.close()
        db.close()
