"""The erasure client: how a product asks liverl to forget one of its users (stdlib only).

    from liverl_sdk import ErasureClient

    er = ErasureClient("http://ingest:6066", product_key)
    eid = er.forget("alice@example.com", reason="account deleted")   # recorded: 202, state pending
    er.wait(eid)                                                      # {"id": ..., "state": "done", "report": {...}}

``forget`` posts ``{"user": ..., "reason": ...}`` to ingest's ``POST /v1/erasures`` with the product key in the
``X-Liverl-Product-Key`` header (the key ``POST /v1/feedback`` takes) and returns the erasure's id; ``status`` reads
``GET /v1/erasures/{id}``. The user is the user key the product sends with its completions (``X-Liverl-User`` or the
OpenAI ``user`` field); liverl stores only its unit id. The erasure runs in the gate's loop (or an operator's
``liverl forget --resume``): its data key is destroyed, its per-user sums deleted, and the report names the versions
that trained on the user.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

PRODUCT_KEY_HEADER = "X-Liverl-Product-Key"


class ErasureError(RuntimeError):
    """liverl refused or did not answer the request: ``status`` is the HTTP status (0: no answer), ``message`` its
    reason."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status, self.message = status, message


class ErasureClient:
    """Erasure requests to ingest's web server at ``base_url`` (``ingest.web_port``, 6066 by default)."""

    def __init__(self, base_url: str, product_key: str, timeout_s: float = 10.0):
        if not product_key:
            raise ValueError("the product key (security.feedback_key) is required")
        self.base = base_url.rstrip("/")
        self.key, self.timeout_s = product_key, timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header(PRODUCT_KEY_HEADER, self.key)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw.decode(errors="replace")[:300] or e.reason
            raise ErasureError(e.code, msg) from None
        except (urllib.error.URLError, OSError) as e:
            raise ErasureError(0, f"{self.base} did not answer: {e}") from None

    def forget(self, user: str, reason: str) -> str:
        """Ask liverl to forget ``user`` (the user key); returns the erasure id (``er-...``) once it is recorded."""
        if not user or not reason:
            raise ValueError("forget needs the user key and a reason")
        return self._call("POST", "/v1/erasures", {"user": user, "reason": reason})["id"]

    def status(self, erasure_id: str) -> dict[str, Any]:
        """The erasure as it stands: ``state`` (pending ... done), ``report`` once its steps have run."""
        return self._call("GET", f"/v1/erasures/{erasure_id}")

    def wait(self, erasure_id: str, timeout_s: float = 300.0, poll_s: float = 1.0) -> dict[str, Any]:
        """``status`` until the erasure is done; ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.status(erasure_id)
            if got.get("state") == "done":
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"erasure {erasure_id} is still {got.get('state')} after {timeout_s:g} s")
            time.sleep(poll_s)
