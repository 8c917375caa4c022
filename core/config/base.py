"""What every config section shares, the URL redaction used wherever a configured URL is shown, and the password a
URL takes from a file."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict


def redact_url(url: str | None) -> str | None:
    """``scheme://user:password@host/...`` with the password replaced by ``***`` (for logs and `liverl config`)."""
    if not url or "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, at, host = rest.rpartition("@")
    if ":" in creds:
        creds = creds.split(":", 1)[0] + ":***"
    elif creds:
        creds = "***"  # redis://:password@host puts the password alone
    return f"{scheme}://{creds}{at}{host}"


def url_with_password_file(url: str | None, password_file: str | None, setting: str) -> str | None:
    """``url`` with the password held in ``password_file`` (whitespace stripped, URL-quoted) in place of any it has,
    for the user it names (``scheme://user@host/...``; no user: ``scheme://:password@host``, Redis's default user).
    ``setting``: the config section named in errors (``registry``, ``redis``). No file: ``url`` as it is."""
    if not password_file:
        return url
    if not url or "://" not in url:
        raise ValueError(
            f"{setting}.password_file is set but {setting}.url is not a URL naming the user it is the password of "
            f"(e.g. scheme://liverl_gate@host/...); got {url!r}"
        )
    try:
        password = Path(password_file).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read {setting}.password_file {password_file}: {e}") from e
    if not password:
        raise ValueError(f"{setting}.password_file {password_file} is empty; `liverl keys` makes password files")
    scheme, rest = url.split("://", 1)
    creds, at, host = rest.rpartition("@")
    user = creds.split(":", 1)[0] if at else ""
    return f"{scheme}://{user}:{quote(password, safe='')}@{host}"


class Section(BaseModel):
    """A table of the TOML file: unknown keys are refused, and so is a bad value assigned later."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
