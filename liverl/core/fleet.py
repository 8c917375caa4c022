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
