"""Fleet and rollout state: the one module that reads it, and the rules that decide on it.

Who serves what is decided by the gate alone, through the registry and the announcements it signs; Redis carries
those announcements and signals (heartbeats, live counters), never authority. Every process that needs to know what
the fleet serves, which nodes may take traffic, or which arm of a rollout a user is on asks this module: the serving
agent, the router, the gateway, the gate's canary, ``liverl status``, the on-call page and ``liverl audit``.

Assignment (which arm of a rollout a user is on):

- The **unit** of a request is its stickiness key (``user_key``: the ``X-Liverl-User`` header, else the OpenAI
  ``user`` field of the body, else ``X-Session-Id``). The generation record carries it pseudonymised (``unit_id``),
  so ingest can keep per-user sums and the canary's test can take the user as its unit of analysis.
- A user's **bucket** in a rollout is a keyed hash of the rollout's id and the user key (``bucket``), with a secret
  that only the router holds (``security.assignment_key``): nobody can compute, from the outside, which arm a user
  key lands on, and each rollout draws its arms afresh (no user is on the canary of every rollout).
- The canary **nodes** rotate from one rollout to the next (``canary_nodes``), so a node's own speed or load is not
  always on the same arm.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from core import keys
from core.schemas import AnnouncementChannel, VersionAnnouncement, WireError

log = logging.getLogger("liverl.fleet")

UNIT_ID_BYTES = 8


def user_key(headers, body: bytes) -> str | None:
    """The stickiness key of a request: X-Liverl-User, else the body's OpenAI ``user``, else X-Session-Id."""
    if v := headers.get("X-Liverl-User"):
        return v
    if body[:1] == b"{" and b'"user"' in body:
        try:
            u = json.loads(body).get("user")
        except (ValueError, AttributeError, RecursionError):
            u = None
        if isinstance(u, str) and u:
            return u
    return headers.get("X-Session-Id") or None


def unit_id(key: str | None) -> str | None:
    """A user key, pseudonymised for the generation record (16 hex digits; None without a key). Stable across
    rollouts: it identifies the user's per-unit sums, not their arm."""
    if not key:
        return None
    return hashlib.blake2b(key.encode(), digest_size=UNIT_ID_BYTES, person=b"liverl-unit").hexdigest()


def bucket(secret: bytes, rollout_id: int, key: str) -> float:
    """A user's place in [0, 1) for one rollout: the router sends buckets below the rollout's share to the canary.
    Keyed (``secret``, which only the router holds) and salted by the rollout, so no caller can predict an arm and each
    rollout draws its arms afresh."""
    if not secret:
        raise ValueError("the assignment needs a secret key (security.assignment_key)")
    mac = hmac.new(secret, f"{int(rollout_id)}\0{key}".encode(), hashlib.blake2b).digest()
    return int.from_bytes(mac[:8], "big") / 2**64


def canary_nodes(nodes: list[str], rollout_id: int, count: int) -> list[str]:
    """Which of ``nodes`` (the routable ones, by name) serve rollout ``rollout_id``'s canary: ``count`` of them, at
    most all but one (a stable node stays), starting at a place that moves with the rollout, so the canary nodes rotate
    from one rollout to the next."""
    nodes = sorted(nodes)
    if len(nodes) < 2:
        raise ValueError(f"a canary needs at least 2 routable nodes, not {len(nodes)}")
    k = max(1, min(int(count), len(nodes) - 1))
    start = int(rollout_id) % len(nodes)
    return sorted(nodes[(start + i) % len(nodes)] for i in range(k))


# ---------------------------------------------------------------------------------------------------------- nodes
#
# Which serving nodes may take traffic. The router, the gate's canary and ``liverl status`` all decide it here, the
# same way: a node is routable when the config knows it (``serving.fleet``: name -> URL) and its heartbeat
# (``<p>:served:<node>``, written by its agent) is live and healthy. The heartbeat says whether and what a node
# serves; it never says where the node is: the URL is the config's, so a heartbeat written by anyone else (an unknown
# name, or a known name with another URL) moves no request.


@dataclass(frozen=True)
class Node:
    """A serving node in rotation: its name and URL from ``serving.fleet``, its version and health from its
    heartbeat."""

    name: str
    url: str
    version: int | None


def _parse_heartbeat(
    prefix: str, key, raw, into: dict[str, keys.ServedHeartbeat], unreadable: list[str] | None = None
) -> None:
    if raw is None:  # expired between the scan and the read
        return
    try:
        into[keys.node_of_served(prefix, key)] = keys.ServedHeartbeat.from_json(raw)
    except ValueError as e:
        log.warning("unreadable heartbeat %r: %s", key, e)
        if unreadable is not None:
            unreadable.append(key.decode() if isinstance(key, bytes) else str(key))


def _wrong_type_heartbeat(key, e: Exception, unreadable: list[str] | None) -> None:
    """A heartbeat key that holds another type than a string: not a heartbeat (its node is not routable by it), never
    a reason to stop reading the others."""
    if not keys.wrong_type(e):
        raise e
    name = key.decode() if isinstance(key, bytes) else str(key)
    log.warning("ignoring heartbeat key %r: %s", name, e)
    if unreadable is not None:
        unreadable.append(name)


def read_heartbeats(redis, prefix: str, unreadable: list[str] | None = None) -> dict[str, keys.ServedHeartbeat]:
    """Every live heartbeat of ``prefix``, by node name, known to the config or not (a sync Redis client; one GET per
    key: the keys sit in different Cluster slots). A key that holds no heartbeat (another type, or no valid record)
    is skipped, logged, and appended to ``unreadable`` when given."""
    beats: dict[str, keys.ServedHeartbeat] = {}
    for k in redis.scan_iter(match=keys.served_pattern(prefix), count=500):
        try:
            raw = redis.get(k)
        except Exception as e:  # noqa: BLE001 - re-raised unless WRONGTYPE
            _wrong_type_heartbeat(k, e, unreadable)
            continue
        _parse_heartbeat(prefix, k, raw, beats, unreadable)
    return beats


async def read_heartbeats_async(
    redis, prefix: str, unreadable: list[str] | None = None
) -> dict[str, keys.ServedHeartbeat]:
    """``read_heartbeats`` for a ``redis.asyncio`` client (the router)."""
    beats: dict[str, keys.ServedHeartbeat] = {}
    async for k in redis.scan_iter(match=keys.served_pattern(prefix), count=500):
        try:
            raw = await redis.get(k)
        except Exception as e:  # noqa: BLE001 - re-raised unless WRONGTYPE
            _wrong_type_heartbeat(k, e, unreadable)
            continue
        _parse_heartbeat(prefix, k, raw, beats, unreadable)
    return beats


def routable(beats: Mapping[str, keys.ServedHeartbeat], allowed: Mapping[str, str]) -> list[Node]:
    """The nodes that may take traffic, by name: named in ``allowed`` (``serving.fleet``), with a live heartbeat that
    says healthy. Each node's URL is ``allowed``'s, never its heartbeat's."""
    return [
        Node(name, allowed[name].rstrip("/"), b.version)
        for name, b in sorted(beats.items())
        if name in allowed and b.healthy
    ]


def unknown(beats: Mapping[str, keys.ServedHeartbeat], allowed: Mapping[str, str]) -> list[str]:
    """Heartbeats of nodes ``serving.fleet`` does not name (ignored for routing: a misconfigured node, or a forgery)."""
    return sorted(name for name in beats if name not in allowed)


def routable_nodes(redis, prefix: str, allowed: Mapping[str, str]) -> list[str]:
    """The names of the routable nodes (a sync Redis client: the gate's canary, ``liverl status``)."""
    return [n.name for n in routable(read_heartbeats(redis, prefix), allowed)]


def configured_nodes(serving) -> int:
    """How many serving nodes the deployment is configured to run: ``serving.fleet``'s, else ``serving.nodes``
    (``liverl up``'s count). With 2 or more the gate never promotes without a canary: it defers while fewer than 2
    are routable."""
    return len(serving.fleet) or int(serving.nodes)


# -------------------------------------------------------------------------------------------------- announcements
#
# What each node serves: the gate's signed announcements, ``<p>:desired`` (every node) and ``<p>:canary`` (the nodes
# the rollout's signed terms name). The serving agent and the router read them here, the same way:
# ``AnnouncementReader.read`` verifies one (``check_announcement``) and refuses a replay; ``serving_target`` picks a
# node's. The unsigned ``<p>:rollout`` plan is for display (status, the on-call page): nothing here reads it.

CHANNELS: tuple[AnnouncementChannel, ...] = ("desired", "canary")


class AnnouncementVerifier(Protocol):
    """What checks a signature (``deploy.registry.signing.Verifier``): raises ``ValueError`` unless ``ann`` is signed by
    the release tier's key."""

    def verify(self, ann: VersionAnnouncement) -> None: ...


class AnnouncementRefused(ValueError):
    """An announcement a reader must not act on. ``reason`` is a short, countable code: ``malformed``, ``unsigned``,
    ``bad_signature``, ``wrong_channel``, ``wrong_prefix``, ``unbound`` (no prefix or no expiry: bound to nothing),
    ``expired``, ``replayed`` (older than the newest one this reader accepted: by audit sequence, else by time),
    ``wrong_type`` (the key holds another Redis type than a string: nothing announced there can be read)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def announcement_key(prefix: str, channel: AnnouncementChannel) -> str:
    """The Redis key a channel's announcement lives under."""
    if channel == "desired":
        return keys.desired(prefix)
    if channel == "canary":
        return keys.canary(prefix)
    raise ValueError(f"unknown announcement channel {channel!r}; one of {CHANNELS}")


def check_announcement(
    raw: bytes | str,
    channel: AnnouncementChannel,
    prefix: str,
    verifier: AnnouncementVerifier | None,
    now: float | None = None,
    allow_expired: bool = False,
) -> VersionAnnouncement:
    """Parse and check an announcement read from ``<prefix>:<channel>``; raises ``AnnouncementRefused``. With a
    ``verifier`` the signature must verify (it covers every field); then the announcement must name this channel and
    this prefix and not have expired at ``now`` (unless ``allow_expired``: an agent's kept copy of the last desired
    announcement it verified, see ``serving.agent``). Stateless: ``AnnouncementReader`` adds the replay check."""
    try:
        ann = VersionAnnouncement.from_bytes(raw)
    except WireError as e:
        raise AnnouncementRefused("malformed", str(e)) from None
    if verifier is not None:
        if not ann.signature:
            raise AnnouncementRefused("unsigned", f"the announcement of v{ann.version} is not signed")
        try:
            verifier.verify(ann)
        except ValueError as e:
            raise AnnouncementRefused("bad_signature", str(e)) from None
    if ann.channel != channel:
        raise AnnouncementRefused(
            "wrong_channel",
            f"v{ann.version} was announced on {ann.channel!r}, and it was read "
            f"from {announcement_key(prefix, channel)!r}",
        )
    if ann.prefix is None or ann.expires_at is None:
        raise AnnouncementRefused(
            "unbound", f"the announcement of v{ann.version} names no {'prefix' if ann.prefix is None else 'expiry'}"
        )
    if ann.prefix != prefix:
        raise AnnouncementRefused(
            "wrong_prefix", f"v{ann.version} was announced for deployment {ann.prefix!r}, not {prefix!r}"
        )
    now = time.time() if now is None else now
    if ann.expires_at <= now and not allow_expired:
        raise AnnouncementRefused(
            "expired",
            f"the announcement of v{ann.version} expired at {ann.expires_at:.0f} "
            "(Unix s; the gate re-announces well before: is it running?)",
        )
    return ann


class AnnouncementReader:
    """One process's reader of the announcements (a serving agent's, the router's): ``check_announcement`` with this
    process's prefix and verifier, and a replay guard: it keeps the newest announcement it accepted per channel and
    refuses an older one (an old signed one written back). Older is by ``seq``, the registry's audit sequence, when
    both carry one: the gate and an operator's CLI sign on different hosts, and a clock running behind must not make
    a rollback look like a replay. An announcement without ``seq`` is ordered by its ``ts`` (the signer's clock).

    A channel read empty after an accepted announcement was withdrawn (an aborted canary): from then on the reader
    takes only an announcement signed after the one it accepted (a higher ``seq``, or the same with a later ``ts``),
    so the withdrawn one written back is ``replayed``, not served again until the next withdrawal. The signer's own
    re-announcement (after Redis lost its data) is signed afresh, so it passes. The caller counts the refusals."""

    def __init__(self, prefix: str, verifier: AnnouncementVerifier | None):
        self.prefix = prefix
        self.verifier = verifier
        self.newest: dict[str, float] = {}  # channel -> ts of the newest announcement accepted
        self.newest_seq: dict[str, int] = {}  # channel -> the highest seq accepted
        self.withdrawn: set[str] = set()  # channels read empty since their newest accepted announcement

    def accept(
        self, channel: AnnouncementChannel, raw: bytes | str | None, now: float | None = None
    ) -> VersionAnnouncement | None:
        """The announcement ``raw`` read from ``channel``'s key (None: nothing announced), checked; raises
        ``AnnouncementRefused``."""
        if raw is None:
            if channel in self.newest:
                self.withdrawn.add(channel)
            return None
        ann = check_announcement(raw, channel, self.prefix, self.verifier, now)
        newest, newest_seq = self.newest.get(channel), self.newest_seq.get(channel)
        if channel in self.withdrawn and newest is not None:
            same_seq = ann.seq is None or newest_seq is None or ann.seq == newest_seq
            if same_seq and ann.ts <= newest:
                raise AnnouncementRefused(
                    "replayed",
                    f"v{ann.version} was announced at {ann.ts:.3f}, no later than the announcement accepted on "
                    f"{channel!r} before it was withdrawn: the withdrawn announcement written back",
                )
        if ann.seq is not None:
            if newest_seq is not None and ann.seq < newest_seq:
                raise AnnouncementRefused(
                    "replayed",
                    f"v{ann.version} was announced at audit sequence {ann.seq}, before the announcement accepted on "
                    f"{channel!r} at {newest_seq}",
                )
            self.newest_seq[channel] = ann.seq
        elif newest is not None and ann.ts < newest:
            raise AnnouncementRefused(
                "replayed",
                f"v{ann.version} was announced at {ann.ts:.3f}, before the "
                f"announcement accepted on {channel!r} at {newest:.3f}",
            )
        self.newest[channel] = ann.ts
        self.withdrawn.discard(channel)
        return ann

    async def read(self, redis, channel: AnnouncementChannel, now: float | None = None) -> VersionAnnouncement | None:
        """Read ``channel``'s announcement (a ``redis.asyncio`` client) and ``accept`` it; raises
        ``AnnouncementRefused``, returns None when nothing is announced."""
        key = announcement_key(self.prefix, channel)
        try:
            raw = await redis.get(key)
        except Exception as e:  # noqa: BLE001 - re-raised unless WRONGTYPE
            if not keys.wrong_type(e):
                raise
            raise AnnouncementRefused(
                "wrong_type", f"{key} holds another Redis type than a string ({e}); the gate replaces it"
            ) from None
        return self.accept(channel, raw, now)


def serving_target(
    node: str, desired: VersionAnnouncement | None, canary: VersionAnnouncement | None
) -> VersionAnnouncement | None:
    """What ``node`` should serve, from the verified announcements (None where one was missing or refused): the canary
    when its signed terms name the node, else the desired version (None: nothing valid is announced for it)."""
    if canary is not None and canary.rollout is not None and node in canary.rollout.nodes:
        return canary
    return desired


# ------------------------------------------------------------------------------------------------------- the view
#
# What the fleet serves against what it should: ``liverl status``, the on-call page, ``liverl audit``, the demo and
# chaos read it here, and decide "in sync" by one rule (``expected``). What a node should serve comes from the
# registry (its stable version, and the active rollout's canary on the rollout's nodes); what it serves, from its
# heartbeat (a signal, not authority).


@dataclass(frozen=True)
class NodeState:
    """One node as the fleet view sees it: its heartbeat, what it should serve, and whether it does."""

    name: str
    beat: keys.ServedHeartbeat
    known: bool  # named in serving.fleet (when the config names the fleet)
    canary: bool  # one of the active rollout's canary nodes
    expected: tuple[int, str]  # (version, checksum) the registry says it should serve
    converged: bool


@dataclass(frozen=True)
class FleetView:
    stable: tuple[int, str]
    rollout: Any | None  # the registry's active rollout (``deploy.registry.tables.Rollout``), or None
    nodes: dict[str, NodeState]
    desired: VersionAnnouncement | None  # what <p>:desired holds (parsed, for display; agents verify it)

    @property
    def converged(self) -> bool:
        """Every known node serves what it should (and there is at least one)."""
        known = [n for n in self.nodes.values() if n.known]
        return bool(known) and all(n.converged for n in known)

    def serving_version(self) -> int | None:
        """The newest version any known node serves (the demo's display)."""
        vs = [n.beat.version for n in self.nodes.values() if n.known and n.beat.version is not None]
        return max(vs) if vs else None


def expected(node: str, stable: tuple[int, str], rollout) -> tuple[int, str]:
    """What ``node`` should serve: the canary on the active rollout's nodes, the stable version everywhere else."""
    if rollout is not None and node in (rollout.nodes or ()):
        return int(rollout.version), str(rollout.checksum)
    return stable


def read_desired(redis, prefix: str) -> VersionAnnouncement | None:
    """``<p>:desired`` parsed, unverified: for display only (the agents and the router verify what they act on). None
    when nothing readable is there."""
    try:
        raw = redis.get(announcement_key(prefix, "desired"))
    except Exception as e:  # noqa: BLE001 - re-raised unless WRONGTYPE
        if not keys.wrong_type(e):
            raise
        return None
    if raw is None:
        return None
    try:
        return VersionAnnouncement.from_bytes(raw if isinstance(raw, bytes) else raw.encode())
    except ValueError:
        return None


def fleet_view(registry, redis, prefix: str, allowed: Mapping[str, str] | None = None) -> FleetView:
    """The fleet against the registry: ``registry`` answers ``stable()`` and ``active_rollout()``; ``allowed`` is
    ``serving.fleet`` (empty or None: every heartbeat counts as known)."""
    st = registry.stable()
    stable = (int(st.version), str(st.checksum))
    rollout = registry.active_rollout()
    nodes = {}
    for name, beat in read_heartbeats(redis, prefix).items():
        want = expected(name, stable, rollout)
        nodes[name] = NodeState(
            name=name,
            beat=beat,
            known=not allowed or name in allowed,
            canary=rollout is not None and name in (rollout.nodes or ()),
            expected=want,
            converged=(beat.version, beat.checksum) == want,
        )
    return FleetView(stable=stable, rollout=rollout, nodes=nodes, desired=read_desired(redis, prefix))
