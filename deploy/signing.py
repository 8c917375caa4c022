"""Signed version announcements: the fleet serves only what the gate (or an operator's verb) announced.

Redis carries ``<prefix>:desired``; anyone who can write Redis could write it. The release tier signs each
``VersionAnnouncement`` with an Ed25519 private key that only it holds, and every serving agent verifies the
signature with the public key before it looks at the version (and then checks the registry says the version is
stable). Keys are PEM files: ``liverl up`` makes a pair in ``<state_dir>/keys`` on first start; in production
put the private key only where the gate and operators run (``security.signing_key``) and the public key on
every serving node (``security.verify_key``).
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from liverl.core import keys
from liverl.core.schemas import VersionAnnouncement

PRIVATE_NAME, PUBLIC_NAME = "announce.key", "announce.pub"


class SignatureError(ValueError):
    """An announcement that is unsigned, signed by another key, or altered after signing."""


def message(ann: VersionAnnouncement) -> bytes:
    """What is signed: every field of the announcement but the signature, canonically."""
    return ann.model_copy(update={"signature": None}).to_bytes()


def generate_keypair(folder: str | os.PathLike) -> tuple[Path, Path]:
    """Write a new Ed25519 pair into ``folder`` (private key readable by the owner only); returns both paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private, public = folder / PRIVATE_NAME, folder / PUBLIC_NAME
    tmp = private.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    os.replace(tmp, private)
    return private, public


def announce(r, prefix: str, version: int, checksum: str, reason: str, signer: Signer | None) -> VersionAnnouncement:
    """Tell the fleet which version to serve (``<prefix>:desired``), signed when there is a ``signer``."""
    ann = VersionAnnouncement(version=version, checksum=checksum, reason=reason[:1024])
    if signer is not None:
        ann = signer.sign(ann)
    r.set(keys.desired(prefix), ann.to_bytes())
    return ann


class Signer:
    def __init__(self, private_key: str | os.PathLike):
        key = serialization.load_pem_private_key(Path(private_key).read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{private_key} is not an Ed25519 private key")
        self._key = key

    def sign(self, ann: VersionAnnouncement) -> VersionAnnouncement:
        sig = base64.b64encode(self._key.sign(message(ann))).decode()
        return ann.model_copy(update={"signature": sig})


class Verifier:
    def __init__(self, public_key: str | os.PathLike):
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
            raise SignatureError(f"the announcement of version {ann.version} has a signature that does not "
                                 "verify with this node's key") from None
