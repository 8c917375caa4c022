"""`liverl keys`: every key file a deployment needs, made once into one folder, mode 0600, never overwritten.

The files (``core.roles`` says which process mounts which, and the setting that points at each):

- ``announce.key`` / ``announce.pub``: the Ed25519 pair that signs and verifies version announcements
  (``deploy.registry.signing``);
- ``audit.key``: the audit log's HMAC key (``deploy.registry.auditchain``);
- ``shred.key``: the key-encryption key that wraps each user's data key (``core.shred``);
- ``feedback.key``: the product key ``POST /v1/feedback`` takes; ``assignment.key``: the routers' secret
  (``core.credentials``);
- ``db-<role>.password`` and ``redis-<role>.password``: each process's database role and Redis user
  (``liverl db roles`` and ``liverl redis acl`` make them with these passwords).

A file is created only where none is (``O_EXCL``): a second run refuses, naming what is there; ``missing`` makes only
the files not there yet (a node added to the fleet). ``rotate`` replaces one key by name, explicitly. The audit key is
never rotated here: every keyed entry of the log is chained under it, and a new key would make the whole log fail
verification, so the gate would sign nothing. Nothing here runs at a process's start; only the one-machine
``liverl up`` makes its own keys (``liverl.stack.supervisor.ensure_keys``).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from core.roles import KEY_FILES, Role


def _secret() -> bytes:
    return (secrets.token_urlsafe(32) + "\n").encode()  # 32 random bytes, as `liverl up`'s keys (core.credentials)


def _pair() -> tuple[bytes, bytes]:
    from deploy.registry.signing import keypair_pem  # noqa: PLC0415 cryptography: only when a pair is made

    return keypair_pem()


@dataclass(frozen=True)
class KeyFile:
    """One key by the name ``--rotate`` takes (``announce``, ``audit``, ``db-gate``, ``redis-node-a``...): its files and
    how their contents are made."""

    name: str
    files: tuple[str, ...]
    make: Callable[[], tuple[bytes, ...]]


def key_files(roles: Iterable[Role]) -> list[KeyFile]:
    """Every key file of a deployment whose processes are ``roles`` (``core.roles.roles``)."""
    out = [KeyFile("announce", tuple(f for f, _ in KEY_FILES["announce"]), _pair)]
    for name in ("audit", "feedback", "assignment", "shred"):
        out.append(KeyFile(name, (KEY_FILES[name][0][0],), lambda: (_secret(),)))
    for role in roles:
        for service in ("db", "redis"):
            name = role.password_file(service).removesuffix(".password")
            out.append(KeyFile(name, (role.password_file(service),), lambda: (_secret(),)))
    return out


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # FileExistsError: never over an existing key
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _replace(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        os.fchmod(f.fileno(), mode)  # exactly ``mode``, whatever the umask
    os.replace(tmp, path)


def write_public(path: str | os.PathLike, data: bytes) -> None:
    """``data`` into ``path``, mode 0644, written under a temporary name and renamed: a reader (a server loading it
    at start) sees the old file or the new one, never half of one. For files that hold no secret (an ACL file of
    password digests)."""
    _replace(Path(path), data, 0o644)


def make_keys(folder: str | os.PathLike, roles: Iterable[Role], missing: bool = False) -> list[tuple[KeyFile, str]]:
    """Make every key file into ``folder`` (made 0700 if absent), each mode 0600. Refuses (ValueError, nothing
    written) when any of them exists already, unless ``missing``: then the files present are kept and only the others
    made. Returns each key with ``made`` or ``kept``."""
    folder = Path(folder)
    plan = key_files(roles)
    present = [f for kf in plan for f in kf.files if (folder / f).exists()]
    if present and not missing:
        raise ValueError(
            f"{folder} already holds {', '.join(present)}: `liverl keys` never overwrites a key. Pass --missing to "
            "make only the files not there yet (a new node's passwords), or --rotate NAME to replace one key"
        )
    for kf in plan:
        there = [f for f in kf.files if (folder / f).exists()]
        if there and len(there) < len(kf.files):
            raise ValueError(
                f"{folder} holds {', '.join(there)} without the rest of the {kf.name} pair: restore it, or replace "
                f"both with --rotate {kf.name}"
            )
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = []
    for kf in plan:
        if (folder / kf.files[0]).exists():
            out.append((kf, "kept"))
            continue
        for name, data in zip(kf.files, kf.make(), strict=True):
            _write_new(folder / name, data)
        out.append((kf, "made"))
    return out


def rotate_key(folder: str | os.PathLike, name: str, roles: Iterable[Role]) -> KeyFile:
    """Replace the key ``name`` in ``folder`` with a new one (mode 0600, written under a temporary name and renamed).
    The product key file keeps its old key on a second line, so the product can move to the new one before the old
    goes (``core.credentials``); remove that line afterwards. ValueError for the audit key, an unknown name or a key
    not made yet."""
    folder = Path(folder)
    plan = {kf.name: kf for kf in key_files(roles)}
    if name == "shred":
        raise ValueError(
            "the key-encryption key is not rotated in place: every user's data key in the registry is wrapped under "
            "it, so a new one would forget every user at once (core.shred)"
        )
    if name == "audit":
        raise ValueError(
            "the audit key is not rotated: every keyed audit entry is chained under it, so a new key makes the whole "
            "log fail `liverl history --verify` and the gate sign nothing (deploy.registry.attest). Keep it; if it "
            "leaked, start a new registry"
        )
    if name not in plan:
        raise ValueError(f"no key {name!r}; one of: {', '.join(sorted(plan))}")
    kf = plan[name]
    missing = [f for f in kf.files if not (folder / f).exists()]
    if missing:
        raise ValueError(f"{folder} has no {', '.join(missing)} to rotate: make it with `liverl keys` first")
    contents = kf.make()
    if name == "feedback":
        contents = (contents[0] + (folder / kf.files[0]).read_bytes(),)
    for f, data in zip(kf.files, contents, strict=True):
        _replace(folder / f, data)
    return kf


def read_passwords(folder: str | os.PathLike, roles: Iterable[Role], service: str) -> dict[Role, str]:
    """Each role's ``<service>-<role>.password`` in ``folder``; ValueError naming the missing ones and how to make
    them."""
    folder = Path(folder)
    out, missing = {}, []
    for role in roles:
        path = folder / role.password_file(service)
        try:
            out[role] = path.read_text().strip()
        except FileNotFoundError:
            missing.append(path.name)
            continue
        if not out[role]:
            raise ValueError(f"{path} is empty: replace it with `liverl keys {folder} --rotate {path.stem}`")
    if missing:
        raise ValueError(
            f"{folder} has no {', '.join(missing)}: `liverl keys {folder} --missing --nodes ...` makes them"
        )
    return out
