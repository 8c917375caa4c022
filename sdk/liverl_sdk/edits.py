"""An edit's text sealed under its generation's edit key, so that forgetting the user leaves it unreadable.

A user's edit is their text, and the product publishes it to the feedback topic, which Kafka cannot delete one record
from. So when the gateway logs a user's generation sealed (under that user's data key, liverl's crypto-shredding), it
also makes a fresh random key for the generation's edit, returns it to the product with the generation id
(``X-Liverl-Edit-Key``, or ``liverl.edit_key`` in the body) and keeps it only inside the sealed record. The product
seals the edit under it (``FeedbackClient.edit(..., edit_key=...)``, or ``edit_key`` beside ``edited_text`` in the
gateway's ``POST /v1/feedback``), and the event carries ``edited_sealed`` instead of ``edited_text``. Ingest opens it
with the key it finds in the generation's sealed record. Once the user's data key is destroyed, nobody can open that
record, so nobody can find the edit key, and the edit in the feedback topic is ciphertext for good. The product keeps
the edit key only as long as it may still judge the generation.

Envelope (any Kafka client can build it): ``lve1.`` + base64(12-byte nonce | AES-256-GCM ciphertext and tag) of the
edit's UTF-8 text, under the 32-byte key that the edit key (unpadded URL-safe base64) encodes, with associated data
``b"liverl-edit\\0v1\\0"`` + the generation id.
"""

from __future__ import annotations

import base64
import binascii
import os

EDIT_KEY_HEADER = "X-Liverl-Edit-Key"
EDIT_ENVELOPE = "lve1."
"""The sealed edit's version tag: ``lve1.`` + base64(nonce | AES-GCM ciphertext and tag)."""
_KEY_BYTES = 32
_NONCE_BYTES = 12
_AAD = b"liverl-edit\0v1\0"


class EditSealError(ValueError):
    """An edit key or a sealed edit that does not serve: malformed, cut, tampered with, or another generation's."""


def new_edit_key() -> str:
    """A fresh edit key: 32 random bytes as unpadded URL-safe base64 (43 characters)."""
    return base64.urlsafe_b64encode(os.urandom(_KEY_BYTES)).rstrip(b"=").decode("ascii")


def _key_bytes(edit_key: str) -> bytes:
    if not isinstance(edit_key, str):
        raise EditSealError(f"an edit key is a str, got {type(edit_key).__name__}")
    try:
        raw = base64.urlsafe_b64decode(edit_key + "=" * (-len(edit_key) % 4))
    except (binascii.Error, ValueError) as e:
        raise EditSealError(f"an edit key that is not URL-safe base64: {e}") from None
    if len(raw) != _KEY_BYTES:
        raise EditSealError(f"an edit key encodes {_KEY_BYTES} bytes, this one {len(raw)}")
    return raw


def _aead(edit_key: str):
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: PLC0415 (only where edits are sealed)
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise EditSealError(f"sealing an edit needs the cryptography package: {e}") from None
    return AESGCM(_key_bytes(edit_key))


def seal_edit(edit_key: str, generation_id: str, text: str) -> str:
    """``text`` sealed for ``generation_id`` under ``edit_key`` (what the gateway returned with that generation)."""
    if not isinstance(text, str):
        raise TypeError(f"an edit's text is a str, got {type(text).__name__}")
    nonce = os.urandom(_NONCE_BYTES)
    ct = _aead(edit_key).encrypt(nonce, text.encode("utf-8"), _AAD + generation_id.encode())
    return EDIT_ENVELOPE + base64.b64encode(nonce + ct).decode("ascii")


def open_edit(edit_key: str, generation_id: str, blob: str) -> str:
    """The text ``seal_edit`` sealed into ``blob``; ``EditSealError`` saying why when it does not open."""
    from cryptography.exceptions import InvalidTag  # noqa: PLC0415

    if not isinstance(blob, str) or not blob.startswith(EDIT_ENVELOPE):
        raise EditSealError(f"not a sealed edit (expected one starting {EDIT_ENVELOPE!r})")
    try:
        raw = base64.b64decode(blob[len(EDIT_ENVELOPE) :], validate=True)
    except (binascii.Error, ValueError) as e:
        raise EditSealError(f"a sealed edit whose body is not base64: {e}") from None
    if len(raw) < _NONCE_BYTES + 16:
        raise EditSealError(f"a sealed edit of {len(raw)} bytes is cut short (at least {_NONCE_BYTES + 16})")
    try:
        data = _aead(edit_key).decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _AAD + generation_id.encode())
    except InvalidTag:
        raise EditSealError(
            f"the sealed edit of generation {generation_id} does not open: tampered with, or sealed under another "
            "generation's edit key"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EditSealError(f"a sealed edit whose text is not UTF-8: {e}") from None
