"""What every config section shares, and the URL redaction used wherever a configured URL is shown."""

from __future__ import annotations

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


class Section(BaseModel):
    """A table of the TOML file: unknown keys are refused, and so is a bad value assigned later."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
