"""The audit log's keyed chain and its head anchored outside the database.

Each audit entry carries ``seq`` (its position, 1, 2, ...) and ``mac`` = HMAC-SHA256, under the audit key, over the
previous entry's link, ``seq`` and the entry's fields (``audit_mac``). An entry's link is its ``mac``; an entry written
before the log was keyed (a legacy registry, or a process without a key on a log not keyed yet) has no ``mac`` and
its link is its plain ``entry_hash`` (``deploy.registry.tables.audit_hash``), so the first keyed entry also seals every
unkeyed entry before it. The key is a file (``security.audit_key``, default ``<state_dir>/keys/audit.key``, which
``liverl up`` makes); it is never stored in the database, so whoever can write the database but does not hold the key
cannot rewrite an entry and recompute the chain.

The head ``(seq, mac)`` of the chain is also written to Redis (``<p>:audit:head``, ``audit_head_key``) after every
append, only ever forward (a Lua compare-and-set on ``seq``), with a tag keyed like the entries. ``check_chain`` then
tells a log whose tail was cut (the anchored head is past the last entry, or the entry at the anchor's seq is not the
one anchored) from a log that merely got ahead of the anchor (Redis was down during an append: reported as lagging).

What is and is not detected (``liverl history --verify``), without the key:
- an entry edited, inserted, removed or reordered, with or without the chain recomputed: detected;
- keyed entries stripped of their MAC, or unkeyed entries appended after keyed ones: detected;
- the tail cut (newest entries deleted) while the anchor in Redis is intact: detected;
- the tail cut by someone who can also write Redis and resets the anchor to an older entry's (seq, mac) (or deletes
  it and waits for the next append, which anchors the cut chain): NOT detected; the anchor cannot be forged forward,
  only rolled back. A deleted anchor makes ``--verify`` fail ("cannot check the tail") until the next append.
- every MAC stripped, the plain chain recomputed and the anchor deleted: the log then reads like one written before
  the key existed. ``--verify`` fails (no anchor), and a keyed writer refuses to append to an unkeyed log: only an
  admin's explicit seal (``Registry.seal_audit``, ``liverl history --seal``, an audited ``audit_seal`` entry naming
  how many unkeyed entries it vouches for) makes the chain keyed from there, so no ordinary write seals a forgery.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from core import keys
from core.config import LiverlConfig
from core.credentials import write_secret
from deploy.registry.tables import audit_hash

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

log = logging.getLogger("liverl.registry.audit")

AUDIT_KEY_NAME = "audit.key"
MIN_AUDIT_KEY_LEN = 32

# SET the head only if its seq is past the stored one: concurrent writers finish their appends in any order, and the
# anchor must never move back (a head that lags is fine, ``check_chain`` says so; one that moved back would hide a cut)
_ADVANCE = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'hash' and t ~= 'none' then redis.call('DEL', KEYS[1]) end  -- another type: no head, as if deleted
local cur = redis.call('HGET', KEYS[1], 'seq')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'seq', ARGV[1], 'mac', ARGV[2], 'tag', ARGV[3])
return 1
"""


def audit_head_key(prefix: str) -> str:
    """``<p>:audit:head``: a hash ``seq``, ``mac``, ``tag`` (the newest anchored audit entry)."""
    return keys.audit_head(prefix)


def audit_mac(
    key: bytes, prev_link: str, seq: int, actor: str, action: str, version: int | None, reason: str | None, at: float
) -> str:
    """The keyed link of one audit entry: HMAC-SHA256 over canonical JSON of the previous link, seq and the fields."""
    blob = json.dumps(
        ["liverl-audit-v1", prev_link, int(seq), actor, action, version, reason, repr(float(at))], separators=(",", ":")
    )
    return hmac.new(key, blob.encode(), hashlib.sha256).hexdigest()


def head_tag(key: bytes, prefix: str, seq: int, mac: str) -> str:
    """The anchor's own tag: binds it to this deployment's prefix, so garbage in Redis is told from a real head."""
    return hmac.new(key, f"liverl-audit-head\0{prefix}\0{int(seq)}\0{mac}".encode(), hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------------------------- the key


def audit_key_path(cfg: LiverlConfig) -> Path | None:
    """``security.audit_key``, else ``<state_dir>/keys/audit.key`` if present."""
    if cfg.security.audit_key:
        return Path(cfg.security.audit_key)
    default = cfg.state_path / "keys" / AUDIT_KEY_NAME
    return default if default.exists() else None


def read_audit_key(path: Path) -> bytes:
    """The key in ``path`` (whitespace stripped). ValueError, saying what to do, if unreadable or short."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"cannot read the audit key (security.audit_key) at {path}: {e}") from e
    if len(key) < MIN_AUDIT_KEY_LEN:
        raise ValueError(
            f"the audit key at {path} has {len(key)} bytes; it needs at least {MIN_AUDIT_KEY_LEN} random "
            "ones (e.g. `umask 077; openssl rand -base64 48 > audit.key`)"
        )
    return key


def load_audit_key(cfg: LiverlConfig) -> bytes | None:
    """The configured audit key, or None when none is configured and ``<state_dir>/keys/audit.key`` does not exist.
    A configured path that is missing is a ValueError (never a silent "unkeyed")."""
    path = audit_key_path(cfg)
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(
            f"security.audit_key is {path}, which is not a file: point it at the audit key, or unset it "
            f"and `liverl up` makes one in {cfg.state_path / 'keys'}"
        )
    return read_audit_key(path)


def ensure_audit_key(cfg: LiverlConfig) -> Path:
    """``liverl up``: ``<state_dir>/keys/audit.key`` (random, mode 0600) unless a key is configured or made already."""
    path = audit_key_path(cfg)
    if path is not None:
        read_audit_key(path)  # a configured key that is missing or short stops `up` before anything starts
        return path
    return write_secret(cfg.state_path / "keys" / AUDIT_KEY_NAME)


# ---------------------------------------------------------------------------------------------- the anchor


@dataclass(frozen=True)
class Head:
    seq: int
    mac: str
    tag: str


class AuditHead:
    """The chain's head in Redis (``audit_head_key``): advanced after every append, read by ``check_chain``.

    ``connect``: makes the Redis client when first needed (a registry that never writes or verifies opens none)."""

    def __init__(self, connect: Callable[[], redis.Redis], prefix: str):
        self._connect, self.prefix = connect, prefix
        self._redis: redis.Redis | None = None
        self.key = audit_head_key(prefix)

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = self._connect()
        return self._redis

    def advance(self, key: bytes, seq: int, mac: str) -> bool:
        """Move the anchor to ``(seq, mac)`` unless it is there or further already. True if it moved."""
        return bool(self.redis.eval(_ADVANCE, 1, self.key, int(seq), mac, head_tag(key, self.prefix, seq, mac)))

    def read(self) -> Head | None:
        """The anchored head; None when there is none. A key that holds another Redis type reads as an unreadable
        head (``check_chain`` calls it forged), and the next append replaces it (``advance``)."""
        try:
            raw = self.redis.hgetall(self.key)
        except redis.ResponseError as e:
            if not keys.wrong_type(e):
                raise
            return Head(-1, f"a key of another Redis type ({e})", "")
        if not raw:
            return None
        fields = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        try:
            return Head(int(fields["seq"]), fields["mac"], fields["tag"])
        except (KeyError, ValueError):
            return Head(-1, str(fields), "")  # unreadable: its tag cannot verify, so check_chain calls it forged

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
            self._redis = None


# ---------------------------------------------------------------------------------------------- verification


@dataclass
class AuditCheck:
    """What ``check_chain`` found. ``ok``: nothing wrong that it could check; ``warnings`` say what it could not."""

    entries: int = 0
    keyed: int = 0  # entries with a MAC
    unkeyed: int = 0  # entries before the first keyed one (legacy, or written without a key): chained by hash only
    bad_id: int | None = None  # id of the first entry that does not verify
    problem: str | None = None  # why the log is not intact (None: intact as far as checked)
    kind: str | None = None  # tampered | truncated | unverifiable (no key, no anchor, Redis unreachable)
    head_seq: int | None = None  # the anchor's seq, when read
    warnings: list[str] | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def _fail(self, problem: str, bad_id: int | None = None, kind: str = "tampered") -> AuditCheck:
        self.problem, self.bad_id, self.kind = problem, bad_id, kind
        return self

    def _warn(self, text: str) -> None:
        self.warnings = [*(self.warnings or []), text]


def check_chain(entries: Iterable[Any], key: bytes | None, head: AuditHead | None) -> AuditCheck:
    """Walk the audit entries in id order (``AuditEntry`` rows), then compare the end with the anchored head.

    Without ``key``: only the plain hash chain of unkeyed entries can be checked; a keyed log is reported as not
    verifiable (a problem). With ``key`` and no ``head``: the tail is not checked (a warning)."""
    res = AuditCheck()
    prev_hash, link = "", ""
    by_seq: dict[int, str] = {}
    for e in entries:
        res.entries += 1
        pos = res.entries
        if e.seq is not None and e.seq != pos:
            return res._fail(
                f"entry {e.id} is number {e.seq} of the chain but sits at position {pos}: an entry "
                "before it was removed or inserted",
                e.id,
            )
        if e.mac is None:
            if res.keyed:
                return res._fail(
                    f"entry {e.id} has no MAC but follows keyed entries: it was added, or its MAC "
                    "stripped, by someone without the audit key",
                    e.id,
                )
            if e.prev_hash != prev_hash or e.entry_hash != audit_hash(
                prev_hash, e.actor, e.action, e.version, e.reason, e.at
            ):
                return res._fail(f"entry {e.id} does not match the hash chain", e.id)
            res.unkeyed += 1
            link = e.entry_hash
        else:
            if key is None:
                return res._fail(
                    "the audit log is keyed (HMAC) and this process has no audit key: set "
                    "security.audit_key to the key file the registry's writers use",
                    kind="unverifiable",
                )
            want = audit_mac(key, link, pos, e.actor, e.action, e.version, e.reason, e.at)
            if not hmac.compare_digest(e.mac, want):
                return res._fail(
                    f"entry {e.id}'s MAC does not verify: it (or an entry before it) was rewritten, "
                    "or written with another audit key",
                    e.id,
                )
            res.keyed += 1
            link = by_seq[pos] = e.mac
        prev_hash = e.entry_hash
    if key is None:
        res._warn(
            "the audit log is not keyed (no security.audit_key): an entry rewritten with the hash chain "
            "recomputed, or a cut tail, would not be detected"
        )
        return res
    if head is None:
        res._warn("no head anchor configured: a cut tail would not be detected")
        return res
    try:
        anchor = head.read()
    except redis.RedisError as e:
        return res._fail(
            f"cannot read the audit head in Redis ({head.key}): {e}; the tail cannot be checked", kind="unverifiable"
        )
    if anchor is None:
        if res.entries:  # a log stripped of its MACs with the anchor deleted reads exactly like a legacy one
            return res._fail(
                f"no audit head in Redis ({head.key}): the tail cannot be checked (Redis lost its data, "
                "or the anchor was deleted; the next audited change re-anchors it)"
                + (
                    ""
                    if res.keyed
                    else "; no entry has a MAC: a log from before the audit key, or one whose MACs were stripped "
                    "(a keyed writer refuses to extend it until an admin seals it: `liverl history --seal`)"
                ),
                kind="unverifiable",
            )
        return res
    if not hmac.compare_digest(anchor.tag, head_tag(key, head.prefix, anchor.seq, anchor.mac)):
        return res._fail(f"the audit head in Redis ({head.key}) is forged: its tag does not verify with the audit key")
    res.head_seq = anchor.seq
    if anchor.seq > res.entries:
        return res._fail(
            f"the anchored head is entry number {anchor.seq}, the log ends at number {res.entries}", kind="truncated"
        )
    if by_seq.get(anchor.seq) is None:
        return res._fail(
            f"entry number {anchor.seq} has no MAC, but the head anchored in Redis is a keyed entry: MACs "
            "were stripped from the log"
        )
    if not hmac.compare_digest(by_seq[anchor.seq], anchor.mac):
        return res._fail(
            f"entry number {anchor.seq} is not the one anchored in Redis: the log was cut and entries "
            "written in place of its tail",
            kind="truncated",
        )
    if anchor.seq < res.entries:
        res._warn(
            f"the head anchor lags the log by {res.entries - anchor.seq} entries (Redis was unreachable "
            "during an append); entries after number "
            f"{anchor.seq} are chained but a cut among them would not be detected"
        )
    return res
