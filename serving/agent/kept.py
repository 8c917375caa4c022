"""The last desired announcement a serving agent verified, kept on disk (``<state_dir>/agent/<node>.desired.json``).

With the gate down longer than ``security.announce_ttl_s`` the announcement in Redis expires, and a node that restarts
starts from its model directory (version 0). Its agent then follows this copy instead: verified again when read
(signed, for the desired channel and this deployment; its expiry aside), and its version must still be ``stable`` in
the registry before the agent swaps to it, so a copy kept past a rollback moves nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from core import fleet
from core.fleet import AnnouncementVerifier
from core.schemas import VersionAnnouncement

log = logging.getLogger("liverl.serving.agent")


class KeptAnnouncement:
    def __init__(self, state_dir: Path, node: str, prefix: str, verifier: AnnouncementVerifier | None):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
        self.path = Path(state_dir) / "agent" / f"{safe}.desired.json"
        self.prefix, self.verifier = prefix, verifier
        self._raw: bytes | None = None  # what the file holds, as far as this process knows
        self._said: str | None = None  # the last thing logged about the copy (said once, not every poll)

    def keep(self, ann: VersionAnnouncement) -> None:
        """Write ``ann`` (a verified desired announcement) when it differs from the copy kept."""
        raw = ann.to_bytes()
        if self._raw is None and self.path.exists():
            self._raw = self.path.read_bytes()
        if raw == self._raw:
            return
        self._raw = raw  # a failed write is said once per announcement, not every poll
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(raw)
            os.replace(tmp, self.path)
        except OSError as e:  # the node serves on; a restart without the copy waits for the gate's next announcement
            log.error("cannot keep the desired announcement in %s: %s", self.path, e)

    def read(self) -> VersionAnnouncement | None:
        """The kept announcement, verified again (its expiry aside), or None; which one is followed is said once."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.error("cannot read the kept desired announcement %s: %s", self.path, e)
            return None
        try:
            ann = fleet.check_announcement(raw, "desired", self.prefix, self.verifier, allow_expired=True)
        except fleet.AnnouncementRefused as e:
            self._say(str(e), "refusing the kept desired announcement %s: %s", self.path, e)
            return None
        self._raw = raw
        self._say(
            f"v{ann.version}",
            "no valid desired announcement in Redis (is the gate running?): following the last one verified, v%d "
            "(%s), kept in %s",
            ann.version,
            ann.reason,
            self.path,
        )
        return ann

    def _say(self, what: str, msg: str, *args) -> None:
        if self._said != what:
            self._said = what
            log.warning(msg, *args)
