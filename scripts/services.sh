#!/usr/bin/env bash
# Make sure the services the TESTS talk to are up: Redis on 127.0.0.1:6379 and PostgreSQL on 127.0.0.1:5432,
# and the tools they run: promtool (the alert rules' check), Chromium (the on-call page's browser test), podman,
# buildah, runc, debootstrap, catatonit and CNI's dnsname plugin (the image, compose and chart tests,
# tests/packaging/), HAProxy (several routers behind a balancer) and socat (hosts in network namespaces, tests/netns.py).
# Starts them when installed but stopped; installs them (Debian packages) when missing and we are root.
# (The demo needs neither: it starts its own broker, and Redis if none answers; the registry is SQLite.)
set -uo pipefail
up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
need_apt=()
if ! up 6379; then
  if command -v redis-server >/dev/null; then
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  else need_apt+=(redis-server); fi
fi
if ! up 5432; then
  if ! ls /etc/postgresql >/dev/null 2>&1; then need_apt+=(postgresql); fi
fi
command -v promtool >/dev/null || need_apt+=(prometheus)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need_apt+=(chromium)
for t in podman buildah runc debootstrap haproxy socat; do command -v $t >/dev/null || need_apt+=($t); done
# podman kube play runs a pod's infra container with catatonit as its init
[ -e /usr/libexec/podman/catatonit ] || command -v catatonit >/dev/null || need_apt+=(catatonit)
# containers find each other by name on a podman network (the compose deployment): CNI's dnsname plugin
[ -e /usr/lib/cni/dnsname ] || need_apt+=(golang-github-containernetworking-plugin-dnsname)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[services] installing ${need_apt[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    up 6379 || redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  else
    echo "[services] missing: ${need_apt[*]} (install the Debian packages, or run as root)" >&2
  fi
fi
if ! up 5432 && ls /etc/postgresql >/dev/null 2>&1; then
  ver=$(ls /etc/postgresql | head -1)
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start 2>/dev/null || pg_ctlcluster "$ver" main start || true
  sleep 2
  # trust auth on loopback for the tests' throwaway databases
  if ! psql -h 127.0.0.1 -U postgres -c 'select 1' postgres >/dev/null 2>&1; then
    hba=/etc/postgresql/$ver/main/pg_hba.conf
    sed -i 's/^\(host.*127.0.0.1\/32\s*\)\S*$/\1trust/' "$hba" && pg_ctlcluster "$ver" main reload || true
  fi
fi
# podman on these machines: runc (crun fails to set RLIMIT_NOFILE, then on the hybrid cgroup hierarchy), cgroupfs,
# and lowered limits. Written only where no containers.conf exists.
if [ "$(id -u)" = 0 ] && command -v podman >/dev/null && [ ! -e /etc/containers/containers.conf ]; then
  mkdir -p /etc/containers
  cat >/etc/containers/containers.conf <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
fi
for t in promtool chromium podman haproxy socat; do command -v $t >/dev/null || echo "[services] $t missing (tests that need it will skip and say why)" >&2; done
for p in 6379 5432; do up $p && echo "[services] 127.0.0.1:$p up" >&2 || echo "[services] 127.0.0.1:$p NOT up (tests that need it will skip and say why)" >&2; done
exit 0
