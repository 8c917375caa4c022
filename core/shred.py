"""Per-user data keys, so that a user can be forgotten by destroying one key ("crypto-shredding").

Kafka topics cannot delete one record, and a user's text travels through several of them (generations, samples,
held-out, dead letters) and through ingest's join store and its changelog. So the text of every generation that has
a user (``GenerationRecord.unit``, the gateway's ``core.fleet.unit_id`` of the request's user key) is sealed under
that user's own data key before it leaves the gateway, and stays sealed wherever liverl keeps it; a process opens it
only in memory, right before it uses it. Forgetting the user deletes the key's row: every copy of the text, in every
store and every backup of those stores, is then ciphertext nobody can open.

- **Data key**: 32 random bytes per unit, made on first use (``UserKeys.key_for``), kept in the registry's database
  (table ``user_keys``) wrapped with AES-256-GCM under the deployment's key-encryption key; the unit is the wrap's
  associated data, so a row copied to another unit does not open.
- **Key-encryption key** (``security.shred_key``, default ``<state_dir>/keys/shred.key``; ``liverl keys`` and
  ``liverl up`` make it): a file the database never holds. The processes that seal or open text mount it (the serving
  nodes, ingest, the learner, the gate) and the admin role, which destroys keys. It is never rotated in place: a new
  one would leave every wrapped key unreadable, which forgets every user at once.
- **Sealed payload** (``seal``/``open_sealed``): a dict (the text fields) as compact JSON, AES-256-GCM under the data
  key with a fresh 96-bit nonce, the unit as associated data, in a versioned envelope ``lvs1.<base64(nonce |
  ciphertext)>``.
- **Destroying** (``UserKeys.destroy``): ``DELETE`` of the row. SQLite runs with ``secure_delete`` (freed bytes are
  zeroed) and is checkpointed with ``wal_checkpoint(TRUNCATE)`` after the delete, so neither the database file nor its
  write-ahead log keeps the wrapped key. PostgreSQL keeps the deleted tuple until ``VACUUM`` reclaims its space
  (autovacuum, or ``VACUUM user_keys``), and its WAL archive and base backups keep it for their retention: without the
  key-encryption key the wrapped key is useless, but whoever holds both can open it until those expire (docs/forget.md).

A unit without a row is forgotten (or never seen): readers ask with ``create=False`` and treat the absence as "this
user's text is gone", never as an error. Only the gateway creates keys.
"""

from __future__ import annotations

import binascii
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic_core import from_json, to_json

log = logging.getLogger("liverl.shred")

KEY_BYTES = 32
NONCE_BYTES = 12
MIN_KEK_LEN = 32
SHRED_KEY_NAME = "shred.key"
ENVELOPE = "lvs1."
"""The sealed envelope's version tag: ``lvs1.`` + base64(nonce | AES-GCM ciphertext and tag)."""
_IN_MAX = 2000  # units per query (SQLite's and PostgreSQL's limits on bound parameters are far above)
_SEAL_AAD = b"liverl-sealed\0v1\0"
_WRAP_AAD = b"liverl-user-key\0v1\0"

_TABLE = sa.table(
    "user_keys", sa.column("unit", sa.Text), sa.column("wrapped", sa.LargeBinary), sa.column("created_at", sa.Float)
)


class SealError(ValueError):
    """A sealed blob that does not open: not an envelope, another version, cut, tampered with, or sealed under another
    key or unit."""


# ---------------------------------------------------------------------------------------------- sealing


def seal(key: bytes, unit: str, payload: dict[str, Any]) -> str:
    """``payload`` (JSON-serialisable) sealed under the data key ``key`` for ``unit``: the envelope string."""
    nonce = os.urandom(NONCE_BYTES)
    data = to_json(payload)
    ct = AESGCM(key).encrypt(nonce, data, _SEAL_AAD + unit.encode())
    return ENVELOPE + binascii.b2a_base64(nonce + ct, newline=False).decode("ascii")


def open_sealed(key: bytes, unit: str, blob: str) -> dict[str, Any]:
    """The payload ``seal`` sealed into ``blob``; ``SealError`` saying why when it does not open."""
    if not isinstance(blob, str) or not blob.startswith(ENVELOPE):
        head = blob[:8] if isinstance(blob, str) else type(blob).__name__
        raise SealError(f"not a sealed envelope (expected one starting {ENVELOPE!r}, got {head!r}...)")
    try:  # (not validated character by character: that costs 10x the decryption, and the tag refuses any change)
        raw = binascii.a2b_base64(blob[len(ENVELOPE) :])
    except (binascii.Error, ValueError) as e:
        raise SealError(f"a sealed envelope whose body is not base64: {e}") from None
    if len(raw) < NONCE_BYTES + 16:
        raise SealError(f"a sealed envelope of {len(raw)} bytes is cut short (at least {NONCE_BYTES + 16})")
    try:
        data = AESGCM(key).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], _SEAL_AAD + unit.encode())
    except InvalidTag:
        raise SealError(
            f"a sealed envelope for unit {unit!r} does not open: tampered with, or sealed under another key or unit"
        ) from None
    out = from_json(data)
    if not isinstance(out, dict):
        raise SealError("a sealed envelope whose payload is not an object")
    return out


def is_sealed(text: Any) -> bool:
    return isinstance(text, str) and text.startswith(ENVELOPE)


# ---------------------------------------------------------------------------------------------- the KEK


def shred_key_path(cfg) -> Path | None:
    """``security.shred_key``, else ``<state_dir>/keys/shred.key`` if present."""
    if cfg.security.shred_key:
        return Path(cfg.security.shred_key)
    default = cfg.state_path / "keys" / SHRED_KEY_NAME
    return default if default.exists() else None


def read_kek(path: str | os.PathLike) -> bytes:
    """The key-encryption key derived from the secret in ``path`` (HKDF-SHA256 of its stripped bytes); ValueError,
    saying what to do, when the file is unreadable or holds fewer than ``MIN_KEK_LEN`` bytes."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the key-encryption key (security.shred_key) at {path}: {e}") from e
    if len(secret) < MIN_KEK_LEN:
        raise ValueError(
            f"the key-encryption key at {path} has {len(secret)} bytes; it needs at least {MIN_KEK_LEN} random ones "
            "(`liverl keys DIR --missing` makes shred.key)"
        )
    return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=b"liverl user-key wrap v1").derive(secret)


def load_kek(cfg) -> bytes | None:
    """The deployment's key-encryption key, or None when none is configured and ``<state_dir>/keys/shred.key`` does not
    exist (then nothing is sealed, and no user can be forgotten: the caller says so). A configured path that is missing
    is a ValueError."""
    path = shred_key_path(cfg)
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(
            f"security.shred_key is {path}, which is not a file: point it at the key-encryption key, or unset it "
            f"and `liverl up` makes one in {cfg.state_path / 'keys'}"
        )
    return read_kek(path)


def ensure_kek(cfg) -> Path:
    """``liverl up``: ``<state_dir>/keys/shred.key`` (random, mode 0600) unless a key is configured or made already."""
    from core.credentials import write_secret  # noqa: PLC0415 (core.config: only when made)

    path = shred_key_path(cfg)
    if path is not None:
        read_kek(path)
        return path
    return write_secret(cfg.state_path / "keys" / SHRED_KEY_NAME)


# ---------------------------------------------------------------------------------------------- the keys


class UserKeys:
    """Each unit's data key, in the registry database's ``user_keys`` table, wrapped under ``kek``.

    ``db``: the registry's database, as a ``deploy.registry.regdb.RegistryDB``, an SQLAlchemy engine, or its URL (an
    engine is then made, as the registry makes one; ``close`` disposes of it). The table is the registry's migration
    0008: a process that opens the registry migrates it; ``UserKeys`` itself never migrates, so a role that may only
    read keys can use it.
    """

    def __init__(self, db: Any, kek: bytes):
        if len(kek) != KEY_BYTES:
            raise ValueError(f"the key-encryption key is {KEY_BYTES} bytes (read_kek derives it), not {len(kek)}")
        self._wrap = AESGCM(kek)
        self._own = False
        if isinstance(db, str):
            from core.db import make_engine  # noqa: PLC0415 (SQLAlchemy's engine: only where keys are used)

            db, self._own = make_engine(db), True
        self.engine: sa.Engine = getattr(db, "engine", db)
        self._sqlite = self.engine.dialect.name == "sqlite"
        self._writer = self.engine.execution_options(sqlite_begin="IMMEDIATE")

    def close(self) -> None:
        if self._own:
            self.engine.dispose()

    def _wrapped(self, unit: str, key: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._wrap.encrypt(nonce, key, _WRAP_AAD + unit.encode())

    def _unwrap(self, unit: str, wrapped: bytes) -> bytes:
        try:
            nonce, ct = bytes(wrapped[:NONCE_BYTES]), bytes(wrapped[NONCE_BYTES:])
            return self._wrap.decrypt(nonce, ct, _WRAP_AAD + unit.encode())
        except InvalidTag:
            raise SealError(
                f"the data key of unit {unit!r} does not unwrap: the registry's user_keys row was written under "
                "another key-encryption key (security.shred_key) or altered"
            ) from None

    def key_for(self, unit: str, create: bool = True) -> bytes | None:
        """``unit``'s data key; with ``create``, made and stored first when it has none (insert-if-absent: processes
        racing for a new unit all get the one key that was stored first). Without ``create``, None when it has none."""
        if not unit:
            raise ValueError("a data key is per unit: unit is empty")
        found = self.keys_for([unit])
        if unit in found or not create:
            return found.get(unit)
        row = {"unit": unit, "wrapped": self._wrapped(unit, os.urandom(KEY_BYTES)), "created_at": time.time()}
        from sqlalchemy.dialects import postgresql, sqlite  # noqa: PLC0415

        insert: Any = sqlite.insert if self._sqlite else postgresql.insert
        with self._writer.begin() as c:
            c.execute(insert(_TABLE).values(**row).on_conflict_do_nothing(index_elements=["unit"]))
            wrapped = c.execute(sa.select(_TABLE.c.wrapped).where(_TABLE.c.unit == unit)).scalar_one()
        return self._unwrap(unit, wrapped)

    def keys_for(self, units: Iterable[str]) -> dict[str, bytes]:
        """The data keys of ``units`` that have one, in one query; a unit without a row is absent (forgotten, or never
        seen)."""
        wanted = sorted({u for u in units if u})
        if not wanted:
            return {}
        rows: list[Any] = []
        with self.engine.connect() as c:
            for i in range(0, len(wanted), _IN_MAX):  # (one query unless a batch names more units than that)
                part = wanted[i : i + _IN_MAX]
                rows += c.execute(sa.select(_TABLE.c.unit, _TABLE.c.wrapped).where(_TABLE.c.unit.in_(part))).all()
        return {u: self._unwrap(u, w) for u, w in rows}

    def known(self, unit: str) -> bool:
        """Whether ``unit`` has a data key."""
        with self.engine.connect() as c:
            return c.execute(sa.select(_TABLE.c.unit).where(_TABLE.c.unit == unit)).first() is not None

    def destroy(self, unit: str) -> bool:
        """Delete ``unit``'s data key: everything sealed under it is unreadable from now on. True if it had one.

        SQLite: the row's bytes are zeroed (``secure_delete``) and the write-ahead log is checkpointed and truncated,
        so no page of either file keeps the wrapped key (a checkpoint that a reader holds back is retried, then
        logged). PostgreSQL: see the module doc (``VACUUM``)."""
        with self._writer.begin() as c:
            if self._sqlite:
                c.exec_driver_sql("PRAGMA secure_delete=ON")
            gone = c.execute(sa.delete(_TABLE).where(_TABLE.c.unit == unit)).rowcount
        if self._sqlite and gone:
            self._checkpoint()
        return bool(gone)

    def _checkpoint(self, tries: int = 20) -> None:
        for _ in range(tries):
            with self.engine.connect() as c:
                busy, _, _ = c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
            if not busy:
                return
            time.sleep(0.05)
        log.warning(
            "a destroyed user key's page could not be checkpointed out of the registry's write-ahead log (a reader "
            "held it): it is overwritten at the next checkpoint"
        )


def open_user_keys(cfg) -> UserKeys | None:
    """The registry's users' keys for a process of ``cfg``, or None (logged) when it has no key-encryption key."""
    kek = load_kek(cfg)
    if kek is None:
        log.warning(
            "no key-encryption key (security.shred_key): sealed users' text cannot be opened here, and nothing this "
            "process writes is sealed"
        )
        return None
    return UserKeys(cfg.registry_url, kek)


class KeyCache:
    """A bounded, in-process LRU of data keys for the gateway: ``get`` returns a unit's key, made on first use
    (``UserKeys.key_for``), from memory for ``ttl_s`` after it was read from the registry. A key destroyed meanwhile
    may still seal this process's records for up to ``ttl_s``: those are unreadable to everyone (lost to training,
    never exposed); afterwards the user, if they come back, gets a new key. Thread-safe."""

    def __init__(self, keys: UserKeys, size: int = 65536, ttl_s: float = 60.0, retry_s: float = 30.0):
        if size < 1:
            raise ValueError(f"a key cache holds at least 1 key, not {size}")
        self.keys, self.size, self.ttl_s, self.retry_s = keys, size, ttl_s, retry_s
        self._lru: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self._down_until = 0.0  # the registry failed a read: it is not asked again before then
        self.hits = self.misses = self.stale = 0

    def get(self, unit: str) -> bytes:
        """``unit``'s key. While the registry does not answer, a key read before is used past its TTL (a forget
        cannot finish there either; a key it destroyed meanwhile seals records nobody can open) and the registry is
        asked again only every ``retry_s``, so a gateway whose database is cut off waits on it at most once a
        ``retry_s``. A unit with no key read before raises ``sqlalchemy.exc.SQLAlchemyError``: its record is not
        logged."""
        now = time.monotonic()
        with self._lock:
            hit = self._lru.get(unit)
            if hit is not None and now - hit[0] < self.ttl_s:
                self._lru.move_to_end(unit)
                self.hits += 1
                return hit[1]
            down = now < self._down_until
        if down:
            return self._stale(unit, hit, None)
        try:
            key = self.keys.key_for(unit, create=True)
        except sa.exc.SQLAlchemyError as e:
            with self._lock:
                self._down_until = time.monotonic() + self.retry_s
            return self._stale(unit, hit, e)
        assert key is not None
        with self._lock:
            self.misses += 1
            self._lru[unit] = (now, key)
            self._lru.move_to_end(unit)
            while len(self._lru) > self.size:
                self._lru.popitem(last=False)
        return key

    def peek(self, unit: str) -> bytes | None:
        """``unit``'s key when ``get`` would return it without asking the registry (a fresh key, or one read before
        while the registry is not asked again), else None: the caller that must not block calls ``get`` elsewhere."""
        now = time.monotonic()
        with self._lock:
            hit = self._lru.get(unit)
            if hit is None or (now - hit[0] >= self.ttl_s and now >= self._down_until):
                return None
            if now - hit[0] < self.ttl_s:
                self._lru.move_to_end(unit)
                self.hits += 1
            else:
                self.stale += 1
            return hit[1]

    def retry_in(self) -> float:
        """Seconds until the registry is asked again (0: it may be asked now)."""
        with self._lock:
            return max(0.0, self._down_until - time.monotonic())

    def _stale(self, unit: str, hit: tuple[float, bytes] | None, error: Exception | None) -> bytes:
        if hit is None:
            raise KeysUnavailable(
                f"the registry's database did not answer for the key of unit {unit} "
                f"({error or f'asked again within {self.retry_s:g} s'})"
            )
        with self._lock:
            self.stale += 1
        return hit[1]

    def forget(self, unit: str) -> None:
        with self._lock:
            self._lru.pop(unit, None)


class KeysUnavailable(sa.exc.SQLAlchemyError):
    """A unit's key could not be read: the registry's database does not answer and the cache holds none."""


# ---------------------------------------------------------------------------------------------- the wire's text

RECORD_TEXT = ("prompt", "completion", "prompt_token_ids", "completion_token_ids", "routed_experts")
"""What a sealed ``GenerationRecord`` carries only sealed. (The routing too: a first MoE layer's choice of experts
is a function of the token alone, so it decodes to tokens.)"""
EDIT_KEY = "edit_key"
"""The sealed payload's field that holds the generation's edit key (the product seals the user's edit under it)."""
SAMPLE_TEXT = ("prompt_token_ids", "completion_token_ids", "routed_experts", "edited_text")
"""What a sealed ``TrainingSample`` carries only sealed."""
_EMPTY: dict[str, Any] = {
    "prompt": "",
    "completion": "",
    "prompt_token_ids": [],
    "completion_token_ids": [],
    "routed_experts": None,
}


def seal_record(key: bytes, rec, edit_key: str | None = None):
    """``rec`` (a ``GenerationRecord`` with a unit, not sealed) with its text sealed under ``key``; ``edit_key``: the
    key its edit is sealed under (``liverl_sdk.edits``), kept only in the sealed payload."""
    assert rec.unit is not None and rec.sealed is None
    payload = {f: getattr(rec, f) for f in RECORD_TEXT}
    if edit_key is not None:
        payload[EDIT_KEY] = edit_key
    return rec.model_copy(update={**_EMPTY, "sealed": seal(key, rec.unit, payload)})


def open_record(key: bytes, rec):
    """A sealed ``GenerationRecord`` opened (validated again: its log-probs against its tokens); ``SealError`` when it
    does not open, ValueError when the opened record is not valid."""
    from core.schemas import GenerationRecord  # noqa: PLC0415 (pydantic models: only where records are opened)

    payload = open_sealed(key, rec.unit, rec.sealed)
    return GenerationRecord.model_validate(
        {**rec.model_dump(), **{f: payload.get(f, _EMPTY[f]) for f in RECORD_TEXT}, "sealed": None}
    )


def open_sample(key: bytes, sample):
    """A sealed ``TrainingSample`` opened (its text fields filled, ``sealed`` None); ``SealError`` when it does not
    open. A sample that is not sealed is returned as it is."""
    if sample.sealed is None:
        return sample
    payload = open_sealed(key, sample.unit, sample.sealed)
    fields = {f: payload.get(f, [] if f.endswith("_ids") else None) for f in SAMPLE_TEXT}
    return sample.model_copy(update={**fields, "sealed": None})


def open_samples(keys: UserKeys | None, samples: list) -> tuple[list, list]:
    """Open ``samples`` with one key lookup for all of them: (opened, forgotten), each in the order given. Samples that
    are not sealed pass as they are; a sealed one whose unit has no key any more is forgotten. Without ``keys`` (no
    key-encryption key) a sealed sample raises ValueError: the process must mount security.shred_key."""
    sealed_units = {s.unit for s in samples if s.sealed is not None}
    if not sealed_units:
        return list(samples), []
    if keys is None:
        raise ValueError(
            "sealed samples and no key-encryption key to open them: set security.shred_key to the deployment's "
            "shred.key (the file the serving nodes seal with)"
        )
    found = keys.keys_for(sealed_units)
    opened, forgotten = [], []
    for s in samples:
        if s.sealed is None:
            opened.append(s)
        elif s.unit in found:
            opened.append(open_sample(found[s.unit], s))
        else:
            forgotten.append(s)
    return opened, forgotten
