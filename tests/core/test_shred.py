"""Per-user data keys (``core.shred``) on the registry's real databases: sealing, the keys' table, racing makers,
destroying a key, and the roles' grants on PostgreSQL."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import uuid

import pytest
import sqlalchemy as sa

from core.roles import Role, roles
from core.shred import ENVELOPE, KeyCache, SealError, UserKeys, open_sealed, read_kek, seal
from deploy.registry.regdb import RegistryDB

KEK = bytes(range(32))


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def user_keys(db_url):
    db = RegistryDB(db_url)  # migrated to head, as every process that opens the registry does
    keys = UserKeys(db, KEK)
    yield keys
    keys.close()
    db.close()


def test_seal_opens_under_its_key_and_unit_only_and_refuses_any_change():
    key, other = os.urandom(32), os.urandom(32)
    payload = {"prompt": "héllo [b]23+45=", "completion_token_ids": [1, 2, 3], "edited_text": None}
    blob = seal(key, "00aa11bb22cc33dd", payload)
    assert blob.startswith(ENVELOPE) and "23+45" not in blob
    assert open_sealed(key, "00aa11bb22cc33dd", blob) == payload
    assert seal(key, "00aa11bb22cc33dd", payload) != blob  # a fresh nonce each time
    with pytest.raises(SealError, match="another key or unit"):
        open_sealed(other, "00aa11bb22cc33dd", blob)
    with pytest.raises(SealError, match="another key or unit"):
        open_sealed(key, "00aa11bb22cc33de", blob)  # the unit is the associated data
    for at in (len(ENVELOPE) + 3, len(blob) // 2, len(blob) - 3):  # in the nonce, the ciphertext, the tag
        tampered = blob[:at] + ("A" if blob[at] != "A" else "B") + blob[at + 1 :]
        with pytest.raises(SealError, match="another key or unit"):
            open_sealed(key, "00aa11bb22cc33dd", tampered)
    bad_blobs = (("plain", "not a sealed envelope"), (ENVELOPE + "AAAAA", "not base64"), (ENVELOPE + "AAAA", "cut"))
    for bad, why in bad_blobs:
        with pytest.raises(SealError, match=why):
            open_sealed(key, "00aa11bb22cc33dd", bad)


def test_a_kek_file_is_at_least_32_bytes(tmp_path):
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="at least 32"):
        read_kek(tmp_path / "short")
    (tmp_path / "ok").write_text(secrets.token_urlsafe(32) + "\n")
    assert len(read_kek(tmp_path / "ok")) == 32 and read_kek(tmp_path / "ok") == read_kek(tmp_path / "ok")


def test_keys_are_made_once_read_in_batches_and_destroyed(user_keys, db_url):
    a, b = "0123456789abcdef", "fedcba9876543210"
    assert user_keys.key_for(a, create=False) is None and not user_keys.known(a)
    ka = user_keys.key_for(a)
    assert len(ka) == 32 and user_keys.key_for(a) == ka and user_keys.known(a)
    kb = user_keys.key_for(b)
    assert user_keys.keys_for([a, b, "never-seen", a]) == {a: ka, b: kb}
    assert user_keys.destroy(a) is True and user_keys.destroy(a) is False
    assert user_keys.keys_for([a, b]) == {b: kb} and not user_keys.known(a)
    # the table holds only the wrapped key: another KEK does not unwrap it
    with pytest.raises(SealError, match="does not unwrap"):
        UserKeys(db_url, bytes(32)).keys_for([b])


def test_a_row_copied_to_another_unit_does_not_unwrap(user_keys):
    user_keys.key_for("aaaaaaaaaaaaaaaa")
    with user_keys.engine.begin() as c:
        c.execute(sa.text("INSERT INTO user_keys SELECT 'bbbbbbbbbbbbbbbb', wrapped, created_at FROM user_keys"))
    with pytest.raises(SealError):
        user_keys.keys_for(["bbbbbbbbbbbbbbbb"])


def _race(url: str, unit: str, ready, go, out) -> None:
    keys = UserKeys(url, KEK)
    keys.keys_for(["warm"])  # connected: the race is the insert, not the start
    ready.release()
    go.wait(60)
    out.put(keys.key_for(unit))
    keys.close()


def test_two_processes_racing_for_a_new_unit_get_the_one_key(user_keys, db_url):
    ctx = mp.get_context("spawn")
    unit = uuid.uuid4().hex[:16]
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(db_url, unit, ready, go, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        assert ready.acquire(timeout=120)
    go.set()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert got[0] == got[1] == user_keys.key_for(unit, create=False)


def test_sqlite_destroy_leaves_no_byte_of_the_wrapped_key_in_the_files(tmp_path):
    path = tmp_path / "registry.db"
    db = RegistryDB(f"sqlite:///{path}")
    keys = UserKeys(db, KEK)
    for i in range(50):
        keys.key_for(f"{i:016x}")
    with db.engine.connect() as c:
        wrapped = c.execute(sa.text("SELECT wrapped FROM user_keys WHERE unit = :u"), {"u": f"{7:016x}"}).scalar_one()
    files = lambda: b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("registry.db"))  # noqa: E731
    assert wrapped in files()
    assert keys.destroy(f"{7:016x}")
    assert wrapped not in files()
    assert len(keys.keys_for(f"{i:016x}" for i in range(50))) == 49
    keys.close()
    db.close()


def test_the_key_cache_is_bounded_and_reads_again_after_its_ttl(user_keys):
    cache = KeyCache(user_keys, size=2, ttl_s=3600)
    units = [uuid.uuid4().hex[:16] for _ in range(3)]
    first = [cache.get(u) for u in units]
    assert len(cache._lru) == 2 and cache.misses == 3
    assert cache.get(units[2]) == first[2] and cache.hits == 1
    user_keys.destroy(units[2])
    assert cache.get(units[2]) == first[2]  # within the TTL: from memory
    cache.ttl_s = 0
    assert cache.get(units[2]) != first[2]  # read again: a new key for a user who came back


def test_each_role_may_do_only_its_part_with_the_keys(pg_url):
    from deploy.registry.roles import apply_roles, drop_roles, role_url

    prefix = f"t{uuid.uuid4().hex[:8]}_"
    RegistryDB(pg_url).close()
    passwords = {r: secrets.token_urlsafe(16) for r in roles(("node-a",), prefix)}
    apply_roles(pg_url, prefix, passwords)
    made: list[UserKeys] = []

    def as_role(role: Role) -> UserKeys:
        url = sa.engine.make_url(role_url(pg_url, role, prefix)).set(password=passwords[role])
        made.append(UserKeys(url.render_as_string(hide_password=False), KEK))
        return made[-1]

    def denied(call, *args):
        with pytest.raises(sa.exc.ProgrammingError) as err:
            call(*args)
        assert err.value.orig.sqlstate == "42501", err.value

    try:
        node = as_role(Role("node", "node-a"))
        key = node.key_for("0123456789abcdef")
        for p in ("ingest", "learner", "gate"):
            reader = as_role(Role(p))
            assert reader.keys_for(["0123456789abcdef"]) == {"0123456789abcdef": key}
            denied(reader.key_for, "1111111111111111")
            if p != "gate":  # the gate's loop runs the product's erasures (liverl.ops.forget): it destroys keys
                denied(reader.destroy, "0123456789abcdef")
        denied(node.destroy, "0123456789abcdef")
        for p in ("viewer", "router"):
            denied(as_role(Role(p)).keys_for, ["0123456789abcdef"])
        admin = as_role(Role("admin"))
        assert admin.destroy("0123456789abcdef") and not node.known("0123456789abcdef")
        with admin.engine.begin() as c:
            c.execute(
                sa.text(
                    "INSERT INTO erasures (id, unit, requested_by, reason, source, requested_at, state) "
                    "VALUES ('e1', '0123456789abcdef', 'op', 'gdpr', 'cli', 1.0, 'done')"
                )
            )
        with as_role(Role("viewer")).engine.connect() as c:
            assert c.execute(sa.text("SELECT count(*) FROM erasures")).scalar_one() == 1
    finally:
        for k in made:
            k.close()
        drop_roles(pg_url, prefix)


def test_the_key_cache_serves_what_it_read_while_the_registry_is_away_and_asks_it_again_only_after_retry_s(
    user_keys, monkeypatch
):
    """A gateway whose registry database is cut off keeps sealing its known users' records with the keys it read
    (past their TTL), asks the database again at most once a retry_s, and fails at once, without waiting on the
    database, for a user it has no key of."""
    import sqlalchemy as sa

    from core.shred import KeysUnavailable

    cache = KeyCache(user_keys, size=8, ttl_s=0, retry_s=3600)
    known, new = uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]
    key = cache.get(known)
    asked = []

    def away(unit, create=False):
        asked.append(unit)
        raise sa.exc.OperationalError("SELECT", {}, OSError("connection timed out"))

    monkeypatch.setattr(user_keys, "key_for", away)
    assert cache.get(known) == key and cache.stale == 1  # the database failed: the key read before
    assert cache.get(known) == key and cache.stale == 2  # not asked again within retry_s
    with pytest.raises(KeysUnavailable):
        cache.get(new)
    assert asked == [known]
    cache.retry_s, cache._down_until = 0.0, 0.0
    with pytest.raises(KeysUnavailable, match="did not answer"):
        cache.get(new)
    assert asked == [known, new]
