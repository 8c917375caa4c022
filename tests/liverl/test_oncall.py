"""The on-call page, opened in a real headless Chromium: it renders the release, the fleet, live acceptance by
version, the gate's checks with their reasons and the audit log from the registry and Redis, and refreshes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from liverl.ops.oncall import start_in_thread
from tests.liverl.test_admin import fleet  # noqa: F401 - the fixture: v0, v1 promoted, v2 rejected, node-0 on v1


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium (Debian: apt-get install chromium; scripts/services.sh installs it as root)")


def _render(url: str, tmp_path, screenshot: bool = False) -> str:
    """The DOM after the page's scripts ran (a real browser: fetch, JavaScript, SVG)."""
    args = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--virtual-time-budget=8000",
        "--run-all-compositor-stages-before-draw",
    ]
    if screenshot:
        out = subprocess.run(
            [*args, f"--screenshot={tmp_path / 'oncall.png'}", "--window-size=1400,1400", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (tmp_path / "oncall.png").stat().st_size > 10_000, out.stderr[-2000:]
    out = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_the_page_shows_release_fleet_acceptance_checks_and_audit(cfg, rds, fleet, tmp_path):  # noqa: F811
    v1, v2 = fleet
    server = start_in_thread(cfg, port=0, refresh_s=1.0)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        dom = _render(url, tmp_path, screenshot=True)
        assert 'data-loaded="1"' in dom, dom[-3000:]
        text = _text(dom)
        assert f"stable v{v1.version}" in text
        assert "all nodes serve the stable version" in text and "node-0" in text
        assert 'id="acceptance-chart"' in dom and "60.0%" in text and "40.0%" in text  # v1 and v0 from Redis
        assert f"v{v2.version}" in text and "rejected" in text and "failed collapse" in text  # lineage and why
        assert "v0 → v1" in text and "v1 → v2" in text
        assert "suite" in text and "0.612" in text and "0.48" in text  # the gate check with value and threshold
        assert "gate passed" in text and "gate" in text  # the audit log: who and why
        assert "0.0410 / 0.0230" in text and "0.0020 / 0.0000" in text  # v1's mismatch: |Δ logp| and KL, own / replay

        # the page follows the registry and Redis: node-0 falls behind, a new version is judged
        rds.set(
            f"{cfg.topics.prefix}:served:node-0", json.dumps({"version": 0, "checksum": "0" * 64, "ts": time.time()})
        )
        text = _text(_render(url, tmp_path))
        assert "nodes disagree with the stable version" in text and "rollout: none in progress" in text

        # a canary in progress: the registry's rollout, its evidence over time
        from deploy.registry.registry import open_registry
        from tests.deploy.conftest import perturb, tiny_model

        reg = open_registry(cfg)
        try:
            v3 = reg.add_candidate(perturb(tiny_model(), 0.05, seed=3), parent=v1.version)
            ro = reg.begin_rollout(
                v3.version,
                stable_version=v1.version,
                share=0.2,
                nodes=["node-0"],
                unit="user",
                deadline_at=time.time() + 600,
                settings={},
                actor="gate",
                reason="gate passed",
            )
            looks = [
                {
                    "at": time.time() - 60 + 10 * i,
                    "canary_events": 40 * i,
                    "stable_events": 160 * i,
                    "canary_acceptance": 0.5 + 0.02 * i,
                    "stable_acceptance": 0.4,
                    "p_better": 0.5 / (i + 1),
                    "p_worse": 1.0,
                    "canary_users": 10 * i,
                    "stable_users": 40 * i,
                    "effect": 0.02 * i,
                    "effect_corrected": 0.018 * i,
                    "effect_lo": 0.02 * i - 0.05,
                    "effect_hi": 0.02 * i + 0.05,
                }
                for i in range(1, 6)
            ]
            reg.save_rollout_evidence(
                ro.id,
                expect_revision=ro.revision,
                test_state={},
                looks=looks,
                verdict="continue",
                reason="collecting evidence",
            )
        finally:
            reg.close()
        rds.set(f"{cfg.topics.prefix}:rollout", '{"version": 99, "nodes": ["evil"]}')  # Redis decides nothing
        rds.hset(
            f"{cfg.topics.prefix}:learner",
            mapping={
                "step": 41,
                "samples_trained": 2624,
                "state": "running",
                "backlog_samples": 1900,
                "backlog_s": 150.2,
                "hop_ingest_s": 131.0,
                "hop_fetch_s": 4.2,
                "hop_queue_s": 15.0,
            },
        )
        dom = _render(url, tmp_path, screenshot=True)
        text = _text(dom)
        assert f"canary v{v3.version} (rollout {ro.id}) on node-0 for 20.0% of users" in text and "running" in text
        assert "kept acceptance canary 60.0% on 200 events of 50 users vs stable 40.0% on 800 of 200 users" in text
        assert "effect +10.0 points (bias-corrected +9.0, always-valid interval +5.0 to +15.0)" in text
        assert 'id="canary-chart"' in dom and "v99" not in text
        assert "learner: step 41, 2624 samples trained; backlog 1900 samples, oldest 150 s" in text  # its lag
        assert "(last batch's oldest: ingest 131 s, fetch 4 s, learner queue 15 s)" in text  # and where it was spent
        assert '<div class="bad" id="learner">' in dom  # over the alert's 2 minutes

        state = json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())
        assert state["stable"]["version"] == v1.version and not state["converged"]
        assert [v["version"] for v in state["versions"]] == [v3.version, v2.version, v1.version, 0]
        assert state["versions"][2]["live"]["acceptance"] == pytest.approx(0.6)
        assert state["rollout"]["id"] == ro.id and state["rollout"]["unit"] == "user"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "etc/passwd", timeout=10)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
