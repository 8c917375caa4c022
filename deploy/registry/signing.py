"""Signed version announcements: the fleet serves only what the gate (or an operator's verb) announced.

Redis carries ``<prefix>:desired`` (what every node serves) and ``<prefix>:canary`` (what a rollout's nodes serve, with
the rollout's terms); anyone who can write Redis could write them. The release tier signs each
``VersionAnnouncement`` with an Ed25519 private key that only it holds. The signature covers every field: the
version, the channel it is announced on, the deployment's prefix, its expiry and, for a canary, the rollout's terms
(share, nodes, unit). Every serving agent (and the router, for the canary's terms) reads them through
``core.fleet.AnnouncementReader``, which verifies the signature with the public key and refuses an announcement
read from another channel's key, another deployment's, an expired one and a replayed older one; the agent then checks
that the registry calls the version ``stable`` (desired) or ``canary`` (canary). The gate keeps them fresh
(``keep_announced``: re-announced before half of ``security.announce_ttl_s`` is left).

Keys are PEM files: ``liverl up`` makes a pair in ``<state_dir>/keys`` on first start; in production put the private
key only where the gate and operators run (``security.signing_key``) and the public key on every serving node
(``security.verify_key``). ``liverl serve`` refuses to start without a verify key, and the gate without a signing
key, unless ``security.allow_unsigned`` is set.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from core import fleet, keys
from core.schemas import AnnouncementChannel, RolloutTerms, VersionAnnouncement

log = logging.getLogger("liverl.signing")

WRONG_TYPE_WAS = "a key of another type"
"""What ``keep_announced`` says was there (``"was " + WRONG_TYPE_WAS``) when the key held another Redis type."""

PRIVATE_NAME, PUBLIC_NAME = "announce.key", "announce.pub"
DEFAULT_TTL_S = 600.0
"""``security.announce_ttl_s``'s default, for callers without a config."""


class SignatureError(ValueError):
    """An announcement that is unsigned, signed by another key, or altered after signing."""


def message(ann: VersionAnnouncement) -> bytes:
    """What is signed: every field of the announcement but the signature, canonically."""
    return ann.model_copy(update={"signature": None}).to_bytes()


def keypair_pem() -> tuple[bytes, bytes]:
    """A new Ed25519 pair: the private key in PKCS8 PEM, the public key in SubjectPublicKeyInfo PEM."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


def generate_keypair(folder: str | os.PathLike) -> tuple[Path, Path]:
    """Write a new Ed25519 pair into ``folder`` (private key readable by the owner only); returns both paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    private_pem, public_pem = keypair_pem()
    private, public = folder / PRIVATE_NAME, folder / PUBLIC_NAME
    tmp = private.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    public.write_bytes(public_pem)
    os.replace(tmp, private)
    return private, public


def announce(
    r,
    prefix: str,
    version: int,
    checksum: str,
    reason: str,
    signer: Signer | None,
    *,
    channel: AnnouncementChannel = "desired",
    rollout: RolloutTerms | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    seq: int | None = None,
) -> VersionAnnouncement:
    """Tell the fleet which version to serve on ``channel`` (``<prefix>:desired``, or ``<prefix>:canary`` with the
    rollout's terms), valid for ``ttl_s`` (``security.announce_ttl_s``); signed when there is a ``signer``. ``seq``:
    the registry's audit sequence (``Registry.audit_seq``) read before the state announced, which readers order
    announcements by (None: by ``ts``, the signer's clock)."""
    if ttl_s <= 0:
        raise ValueError(f"an announcement's ttl_s must be > 0, not {ttl_s}")
    now = time.time()
    ann = VersionAnnouncement(
        version=version,
        checksum=checksum,
        reason=reason[:1024],
        ts=now,
        channel=channel,
        prefix=prefix,
        expires_at=now + ttl_s,
        rollout=rollout,
        seq=seq,
    )
    if signer is not None:
        ann = signer.sign(ann)
    r.set(fleet.announcement_key(prefix, channel), ann.to_bytes())
    return ann


def withdraw(r, prefix: str, channel: AnnouncementChannel) -> None:
    """Delete ``channel``'s announcement: on the canary channel its nodes return to desired at their next poll."""
    r.delete(fleet.announcement_key(prefix, channel))


def needs_refresh(ann: VersionAnnouncement, now: float | None = None) -> bool:
    """True when less than half of the announcement's lifetime (``expires_at - ts``) is left, or it has no expiry:
    the gate then announces it again, so readers never see it expire while the gate runs."""
    if ann.expires_at is None:
        return True
    now = time.time() if now is None else now
    return ann.expires_at - now < (ann.expires_at - ann.ts) / 2


def keep_announced(
    r,
    prefix: str,
    channel: AnnouncementChannel,
    version: int,
    checksum: str,
    reason: str,
    signer: Signer | None,
    *,
    rollout: RolloutTerms | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    seq: int | None = None,
) -> str | None:
    """Make ``<prefix>:<channel>`` announce ``version`` (with ``rollout``'s terms on the canary channel) with at least
    half its lifetime left. What is there is checked as the agents check it (``fleet.check_announcement``, verified
    with the signer's own public key): missing, unreadable, unsigned while there is a signer, signed by another key,
    bound to another channel or prefix, expired, or naming another version or other terms, it is replaced (reason
    ``"<reason> (was ...)"``; a key of another Redis type too: ``SET`` overwrites any type); valid and matching but
    past half its lifetime, it is announced again as it was (its reason kept). What is written carries ``seq`` (see
    ``announce``). Returns None when nothing was written, ``"refreshed"``, or ``"was <what was there>"``."""
    now = time.time() if now is None else now
    key = fleet.announcement_key(prefix, channel)
    try:
        raw = r.get(key)
    except Exception as e:  # noqa: BLE001 - re-raised unless WRONGTYPE
        if not keys.wrong_type(e):
            raise
        log.error("%s holds another Redis type than a string (%s); replacing it with the announcement", key, e)
        raw, was = None, WRONG_TYPE_WAS
    else:
        was = "nothing"
    if raw is not None:
        try:
            ann = fleet.check_announcement(raw, channel, prefix, signer.verifier() if signer else None, now=now)
        except fleet.AnnouncementRefused as e:
            was = f"refused: {e}"
        else:
            if (ann.version, ann.checksum, ann.rollout) != (version, checksum, rollout):
                was = f"v{ann.version}" + (" with other terms" if ann.version == version else "")
            elif not needs_refresh(ann, now):
                return None
            else:
                announce(
                    r,
                    prefix,
                    version,
                    checksum,
                    ann.reason,
                    signer,
                    channel=channel,
                    rollout=rollout,
                    ttl_s=ttl_s,
                    seq=seq,
                )
                return "refreshed"
    announce(
        r,
        prefix,
        version,
        checksum,
        f"{reason} (was {was})",
        signer,
        channel=channel,
        rollout=rollout,
        ttl_s=ttl_s,
        seq=seq,
    )
    return f"was {was}"


class Signer:
    def __init__(self, private_key: str | os.PathLike):
        key = serialization.load_pem_private_key(Path(private_key).read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{private_key} is not an Ed25519 private key")
        self._key = key

    def sign(self, ann: VersionAnnouncement) -> VersionAnnouncement:
        sig = base64.b64encode(self._key.sign(message(ann))).decode()
        return ann.model_copy(update={"signature": sig})

    def verifier(self) -> Verifier:
        """A verifier for this signer's public key (the gate checks what Redis holds against its own key)."""
        return Verifier(self._key.public_key())


class Verifier:
    def __init__(self, public_key: str | os.PathLike | Ed25519PublicKey):
        if isinstance(public_key, Ed25519PublicKey):
            self._key = public_key
            return
        key = serialization.load_pem_public_key(Path(public_key).read_bytes())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{public_key} is not an Ed25519 public key")
        self._key = key

    def verify(self, ann: VersionAnnouncement) -> None:
        if not ann.signature:
            raise SignatureError(f"the announcement of version {ann.version} is not signed")
        try:
            self._key.verify(base64.b64decode(ann.signature, validate=True), message(ann))
        except (InvalidSignature, ValueError):
            raise SignatureError(
                f"the announcement of version {ann.version} has a signature that does not verify with this node's key"
            ) from None
