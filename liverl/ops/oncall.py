"""The on-call page: ``liverl oncall`` serves one page that shows, refreshed every few seconds, what on-call needs
to see at a glance: the stable version and whether every node serves it, the versions and their lineage, live
acceptance by version, every gate check with its value, threshold and reason, and the audit log.

Read-only: it reads the registry (``cfg.registry_url``) and Redis (``core.keys``) and changes nothing, so
it needs no operator token; it binds ``serving.host`` (loopback by default). Routes:

- ``GET /``           the page (plain HTML and JavaScript, no build step, no outside resources);
- ``GET /api/state``  everything the page shows, as JSON (for scripts and dashboards);
- ``GET /healthz``    ``ok``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis

from core import fleet, keys
from core.config import LiverlConfig
from liverl.ops.admin import _live, open_redis, open_registry

log = logging.getLogger("liverl.oncall")


def collect_state(cfg: LiverlConfig, limit: int = 40) -> dict[str, Any]:
    """The page's data: versions (newest first) with their gate checks and live counts, the fleet, the audit tail."""
    reg = open_registry(cfg)
    p = cfg.topics.prefix
    live: dict[int, dict[str, int]] = {}
    desired = learner = view = None
    redis_error = None
    try:
        rows = reg.list(limit=limit)
        stable = reg.stable()
        checks: dict[int, list[dict]] = {}
        for g in reg.gate_results():
            checks.setdefault(g.version, []).append(
                {
                    "check": g.check,
                    "value": g.value,
                    "threshold": g.threshold,
                    "passed": g.passed,
                    "detail": g.detail,
                    "at": g.at,
                }
            )
        audit = [
            {"at": a.at, "actor": a.actor, "action": a.action, "version": a.version, "reason": a.reason}
            for a in reg.audit(limit=25)
        ][::-1]
        ro = reg.active_rollout()
        rollout = (
            None
            if ro is None
            else {
                "id": ro.id,
                "version": ro.version,
                "checksum": ro.checksum,
                "stable_version": ro.stable_version,
                "share": ro.share,
                "nodes": list(ro.nodes),
                "unit": ro.unit,
                "state": ro.state,
                "started_at": ro.started_at,
                "deadline_at": ro.deadline_at,
                "looks": list(ro.looks or []),
                "verdict": ro.verdict,
                "reason": ro.reason,
            }
        )
        r = open_redis(cfg)
        try:
            live = _live(r, p, [v.version for v in rows])
            view = fleet.fleet_view(reg, r, p, cfg.serving.fleet)
            desired = view.desired.model_dump() if view.desired is not None else None
            learner = r.hgetall(keys.learner(p)) or None
        except (redis.RedisError, ValueError) as e:
            redis_error = str(e)
        finally:
            r.close()
    finally:
        reg.close()
    versions = []
    for v in rows:
        c = live.get(v.version) or {}
        events = c.get("events", 0)
        versions.append(
            {
                "version": v.version,
                "parent": v.parent,
                "status": v.status,
                "reason": v.status_reason,
                "created_at": v.created_at,
                "promoted_at": v.promoted_at,
                "checksum": v.checksum,
                "delta_bytes": v.delta_bytes,
                "changed_fraction": v.changed_fraction,
                "checks": sorted(checks.get(v.version, []), key=lambda x: x["at"]),
                "live": {
                    "events": events,
                    "accept": c.get("accept", 0),
                    "reject": c.get("reject", 0),
                    "edit": c.get("edit", 0),
                    "acceptance": c.get("accept", 0) / events if events else None,
                },
            }
        )
    nodes = (
        []
        if view is None
        else [
            {
                "node": n.name,
                **n.beat.model_dump(),
                "age_s": max(0.0, time.time() - n.beat.ts),
                "known": n.known,
                "canary": n.canary,
                "converged": n.converged,
            }
            for n in view.nodes.values()
        ]
    )
    return {
        "now": time.time(),
        "prefix": p,
        "stable": {"version": stable.version, "checksum": stable.checksum, "promoted_at": stable.promoted_at},
        "desired": desired,
        "nodes": nodes,
        "converged": view is not None and view.converged,
        "versions": versions,
        "audit": audit,
        "learner": learner,
        "redis_error": redis_error,
        "rollout": rollout,
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>liverl on-call</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2430}
 header{background:#1d2430;color:#fff;padding:10px 20px;display:flex;gap:24px;align-items:baseline}
 header h1{font-size:18px;margin:0} header .meta{opacity:.75}
 main{display:grid;grid-template-columns:1fr 1fr;gap:16px;padding:16px 20px}
 section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:12px 14px;overflow:auto}
 section.wide{grid-column:1/3} h2{font-size:15px;margin:0 0 8px}
 table{border-collapse:collapse;width:100%} th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eef0f3;
 vertical-align:top} th{font-weight:600;color:#555}
 .stable{color:#0a7d32;font-weight:600} .rejected,.rolled_back,.fail{color:#b3261e} .candidate{color:#8a5a00}
 .retired{color:#777} .pass{color:#0a7d32} .big{font-size:22px;font-weight:600} .bad{color:#b3261e} .ok{color:#0a7d32}
 .muted{color:#777} svg text{font:11px system-ui,sans-serif}
</style></head>
<body>
<header><h1>liverl on-call</h1><span class="meta" id="meta">loading…</span></header>
<main>
 <section><h2>Release</h2><div id="release"></div></section>
 <section><h2>Fleet</h2><div id="fleet"></div></section>
 <section class="wide"><h2>Live acceptance by version</h2><div id="chart"></div></section>
 <section class="wide"><h2>Versions and lineage</h2><div id="versions"></div></section>
 <section class="wide"><h2>Gate checks</h2><div id="checks"></div></section>
 <section class="wide"><h2>Audit log</h2><div id="audit"></div></section>
</main>
<script>
const REFRESH_MS = __REFRESH_MS__;
const esc = s => String(s ?? "").replace(/[&<>"']/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));
const ago = (now, t) => { if (!t) return "-"; let s = Math.max(0, now - t);
  for (const [u, n] of [["d", 86400], ["h", 3600], ["m", 60]]) if (s >= n) return (s / n).toFixed(0) + u + " ago";
  return s.toFixed(0) + "s ago"; };
const pct = x => x == null ? "-" : (100 * x).toFixed(1) + "%";
const num = x => x == null ? "-" : (Math.abs(x) >= 100 ? x.toFixed(0) : x.toPrecision(4));
function table(cols, rows) {
  return "<table><thead><tr>" + cols.map(c => "<th>" + esc(c) + "</th>").join("") + "</tr></thead><tbody>" +
    rows.map(r => "<tr>" + r.map(c => "<td>" + c + "</td>").join("") + "</tr>").join("") + "</tbody></table>";
}
function chart(versions) {
  const vs = versions.filter(v => v.live.events > 0).slice().reverse();
  if (!vs.length) return '<p class="muted">no live feedback yet</p>';
  const w = 40, h = 160, pad = 24;
  const bars = vs.map((v, i) => {
    const y = h - v.live.acceptance * h;
    return `<g><rect x="${pad + i * w + 6}" y="${y}" width="${w - 12}" height="${h - y}" class="bar ${v.status}"
      fill="${v.status === "stable" ? "#0a7d32" : v.status === "rejected" ? "#d9a3a0" : "#7d8ca3"}">
      <title>v${v.version}: ${pct(v.live.acceptance)} of ${v.live.events}</title></rect>
      <text x="${pad + i * w + w / 2}" y="${y - 4}" text-anchor="middle">${pct(v.live.acceptance)}</text>
      <text x="${pad + i * w + w / 2}" y="${h + 14}" text-anchor="middle">v${v.version}</text></g>`;
  }).join("");
  return `<svg id="acceptance-chart" width="${pad + vs.length * w + 10}" height="${h + 20}" role="img"
    aria-label="live acceptance by version"><line x1="${pad}" y1="${h}" x2="${pad + vs.length * w}" y2="${h}"
    stroke="#999"/>${bars}</svg>`;
}
function rollout(s) {
  const p = s.rollout;
  if (!p) return `<div id="rollout">rollout: none in progress</div>`;
  const looks = p.looks || [], w = 420, h = 120;
  let svg = "";
  if (looks.length) {
    const t0 = looks[0].at, t1 = Math.max(looks[looks.length - 1].at, t0 + 1);
    const x = t => 30 + (w - 40) * (t - t0) / (t1 - t0), y = v => h - 10 - (h - 20) * v;
    const line = (key, color) => `<polyline fill="none" stroke="${color}" stroke-width="2" points="${
      looks.map(l => x(l.at).toFixed(1) + "," + y(l[key]).toFixed(1)).join(" ")}"/>`;
    svg = `<svg id="canary-chart" width="${w}" height="${h}" role="img" aria-label="canary vs stable acceptance">
      <line x1="30" y1="${h - 10}" x2="${w - 10}" y2="${h - 10}" stroke="#999"/>
      ${line("stable_acceptance", "#0a7d32")}${line("canary_acceptance", "#8a5a00")}
      <text x="32" y="12">acceptance: canary (amber) vs stable (green), ${looks.length} looks</text></svg>`;
  }
  const last = looks.length ? looks[looks.length - 1] : null;
  return `<div id="rollout"><b>canary v${p.version}</b> (rollout ${p.id}) on ${esc(p.nodes.join(", "))} for ${pct(p.share)} of ${esc(p.unit)}s,
    <b>${esc(p.state)}</b> · started ${ago(s.now, p.started_at)} · deadline in ${Math.max(0, p.deadline_at - s.now).toFixed(0)} s</div>` +
    (last ? `<div>kept acceptance canary ${pct(last.canary_acceptance)} on ${last.canary_events} events` +
      (last.canary_users == null ? "" : ` of ${last.canary_users} users`) +
      ` vs stable ${pct(last.stable_acceptance)} on ${last.stable_events}` +
      (last.stable_users == null ? "" : ` of ${last.stable_users} users`) +
      ` · always-valid p(better) ${last.p_better.toPrecision(3)}, p(worse) ${last.p_worse.toPrecision(3)}` +
      (last.cuped_removed ? ` · CUPED removed ${pct(last.cuped_removed)} of the variance` : "") + `</div>` : "") + `<div class="muted">${esc(p.reason)}</div>` + svg;
}
function render(s) {
  document.getElementById("meta").textContent =
    `topic prefix ${s.prefix} · refreshed ${new Date(s.now * 1000).toLocaleTimeString()} · every ${REFRESH_MS / 1000} s`;
  const d = s.desired;
  document.getElementById("release").innerHTML =
    `<div class="big">stable v${s.stable.version}</div>` +
    `<div>promoted ${ago(s.now, s.stable.promoted_at)} · checksum ${esc(s.stable.checksum.slice(0, 12))}…</div>` +
    `<div>desired (announced to the fleet): ${d ? "v" + d.version + " — " + esc(d.reason || "") : "none"}</div>` +
    rollout(s) +
    (s.learner ? `<div class="${Number(s.learner.backlog_s) > 120 ? "bad" : "muted"}" id="learner">learner: step ${esc(s.learner.step)}, ${esc(s.learner.samples_trained)} samples trained` +
      (Number(s.learner.backlog_samples) >= 0 ? `; backlog ${esc(s.learner.backlog_samples)} samples, oldest ${Math.round(Number(s.learner.backlog_s))} s` : "; backlog unknown") +
      (s.learner.hop_ingest_s !== undefined ? ` (last batch's oldest: ingest ${Math.round(Number(s.learner.hop_ingest_s))} s, fetch ${Math.round(Number(s.learner.hop_fetch_s))} s, learner queue ${Math.round(Number(s.learner.hop_queue_s))} s)` : "") + `</div>` : "") +
    (s.redis_error ? `<div class="bad">Redis unreachable: ${esc(s.redis_error)}</div>` : "");
  document.getElementById("fleet").innerHTML = s.nodes.length
    ? `<div class="${s.converged ? "ok" : "bad"}" id="converged">${s.converged ? (s.rollout ? "every node serves what it should (canary nodes: the canary)" : "all nodes serve the stable version")
        : (s.rollout ? "some nodes do not serve what they should" : "nodes disagree with the stable version")}</div>` +
      table(["node", "version", "checksum", "heartbeat", "as expected"], s.nodes.map(n => [esc(n.node), "v" + n.version,
        esc((n.checksum || "").slice(0, 12)) + "…", ago(s.now, n.ts), n.converged ? '<span class="ok">yes</span>'
        : '<span class="bad">no</span>']))
    : '<p class="bad">no serving node reports a heartbeat</p>';
  document.getElementById("chart").innerHTML = chart(s.versions);
  document.getElementById("versions").innerHTML = table(
    ["version", "lineage", "status", "created", "live acceptance", "changed", "delta"],
    s.versions.map(v => [`<b>v${v.version}</b>`, v.parent == null ? "base" : "v" + v.parent + " → v" + v.version,
      `<span class="${esc(v.status)}">${esc(v.status)}</span>` + (v.reason ? ` <span class="muted">(${esc(v.reason)})</span>` : ""),
      ago(s.now, v.created_at), v.live.events ? `${pct(v.live.acceptance)} of ${v.live.events}` : "-",
      v.changed_fraction == null ? "-" : pct(v.changed_fraction),
      v.delta_bytes == null ? "-" : (v.delta_bytes / 1024).toFixed(1) + " KiB"]));
  const rows = [];
  for (const v of s.versions) for (const c of v.checks)
    rows.push([`v${v.version}`, esc(c.check), `<span class="${c.passed ? "pass" : "fail"}">${c.passed ? "pass" : "FAIL"}</span>`,
      num(c.value), num(c.threshold), esc(c.detail)]);
  document.getElementById("checks").innerHTML = rows.length
    ? table(["version", "check", "result", "value", "threshold", "reason"], rows) : '<p class="muted">no checks yet</p>';
  document.getElementById("audit").innerHTML = table(["when", "who", "action", "version", "reason"],
    s.audit.map(a => [ago(s.now, a.at), esc(a.actor), esc(a.action), a.version == null ? "-" : "v" + a.version, esc(a.reason)]));
  document.body.dataset.loaded = "1";
}
async function refresh() {
  try { const r = await fetch("api/state"); if (!r.ok) throw new Error(r.status + " " + await r.text()); render(await r.json()); }
  catch (e) { document.getElementById("meta").textContent = "refresh failed: " + e; }
  setTimeout(refresh, REFRESH_MS);
}
refresh();
</script></body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    cfg: LiverlConfig
    refresh_ms: int

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("oncall: " + fmt, *args)

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, PAGE.replace("__REFRESH_MS__", str(self.refresh_ms)).encode(), "text/html; charset=utf-8")
        elif path == "/api/state":
            try:
                body = json.dumps(collect_state(self.cfg)).encode()
            except Exception as e:  # the registry unreachable: say so on the page, keep serving
                log.exception("oncall: collecting the state failed")
                self._send(503, f"cannot read the registry: {e}".encode(), "text/plain; charset=utf-8")
                return
            self._send(200, body, "application/json")
        elif path == "/healthz":
            self._send(200, b"ok", "text/plain")
        else:
            self._send(404, b"not found: / (the page), /api/state (JSON), /healthz", "text/plain")


def make_server(cfg: LiverlConfig, host: str, port: int, refresh_s: float = 2.0) -> ThreadingHTTPServer:
    handler = type("OncallHandler", (_Handler,), {"cfg": cfg, "refresh_ms": int(refresh_s * 1000)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve(cfg: LiverlConfig, host: str, port: int, refresh_s: float = 2.0) -> int:
    server = make_server(cfg, host, port, refresh_s)
    print(f"on-call page: http://{host}:{server.server_address[1]}/ (JSON: /api/state; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def start_in_thread(
    cfg: LiverlConfig, host: str = "127.0.0.1", port: int = 0, refresh_s: float = 2.0
) -> ThreadingHTTPServer:
    """For tests and the demo: the server on a background thread; ``shutdown()`` stops it."""
    server = make_server(cfg, host, port, refresh_s)
    threading.Thread(target=server.serve_forever, name="oncall-page", daemon=True).start()
    return server
