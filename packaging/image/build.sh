#!/usr/bin/env bash
# Build liverl's OCI image with podman: the CPU build (default, tag localhost/liverl:cpu) or the CUDA build (--cuda,
# tag localhost/liverl:cuda), and the small infrastructure image the compose file runs HAProxy, Redis and PostgreSQL
# from (--infra, tag localhost/liverl-infra:bookworm).
#
# No container registry is needed: the base is Debian bookworm made with debootstrap from the mirror apt already uses,
# imported once as localhost/liverl-base:bookworm and reused while that tag exists (--rebase makes it again). pip in
# the build trusts this machine's CA bundle and uses its pip settings (index, local wheel folders) through a build
# secret and read-only mounts, so neither stays in the image.
#
#   packaging/image/build.sh                 # CPU image
#   packaging/image/build.sh --cuda          # CUDA image (vllm==0.32.0 from PyPI; run it with a GPU: --device nvidia.com/gpu=all)
#   packaging/image/build.sh --infra         # HAProxy + Redis + PostgreSQL image for packaging/compose
#   packaging/image/build.sh --tag NAME      # another tag; extra arguments after -- go to `podman build`
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
flavour=cpu tag="" rebase=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) flavour=cuda ;;
    --cpu) flavour=cpu ;;
    --infra) flavour=infra ;;
    --tag) tag=$2; shift ;;
    --rebase) rebase=1 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
case "$flavour" in
  infra) tag=${tag:-localhost/liverl-infra:bookworm} ;;
  *) tag=${tag:-localhost/liverl:$flavour} ;;
esac
base=${LIVERL_IMAGE_BASE:-localhost/liverl-base:bookworm}
command -v podman >/dev/null || { echo "build.sh: podman is not installed (scripts/services.sh installs it as root)" >&2; exit 1; }
t0=$(date +%s)

# --- the base: Debian bookworm minbase, made once --------------------------------------------------------------
if [ "$rebase" = 1 ] || ! podman image exists "$base"; then
  command -v debootstrap >/dev/null || { echo "build.sh: debootstrap is not installed" >&2; exit 1; }
  [ "$(id -u)" = 0 ] || { echo "build.sh: making the base with debootstrap needs root" >&2; exit 1; }
  # the mirror apt already uses (deb822 .sources or one-line .list), else Debian's own
  mirror=${DEBIAN_MIRROR:-$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)}
  [ -n "$mirror" ] || mirror=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    | awk '{for (i=2;i<=NF;i++) if ($i ~ /^https?:/) {print $i; exit}}' | grep -v security | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d /var/tmp/liverl-base.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "[build] base: debootstrap --variant=minbase bookworm from $mirror" >&2
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; exit 1; }
  rm -f "$rootfs.log"
  # apt inside the image fetches from the same mirror; no recommends, no docs or caches kept
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" >"$rootfs/etc/apt/sources.list"
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$rootfs/etc/apt/apt.conf.d/99liverl"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import \
    --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
    --message "debootstrap --variant=minbase bookworm $mirror" - "$base" >/dev/null
  rm -rf "$rootfs"; trap - EXIT
  echo "[build] base $base made in $(( $(date +%s) - t0 )) s" >&2
fi

# --- pip's settings for the build, from this machine: a secret (CA bundle, pip.conf) and read-only folders ---------
args=(--build-arg "BASE=$base" --label "org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
if [ "$flavour" != infra ]; then
  py=${PYTHON:-python3}
  [ -x "$repo/.venv/bin/python" ] && py="$repo/.venv/bin/python"
  version=$("$py" -c 'import tomllib; print(tomllib.load(open("'"$repo"'/pyproject.toml", "rb"))["project"]["version"])')
  commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  git -C "$repo" diff --quiet HEAD 2>/dev/null || commit="$commit-dirty"
  args+=(--label "org.opencontainers.image.version=$version" --label "org.opencontainers.image.revision=$commit")
  ca=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
  for c in "$ca" /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    if [ -n "$c" ] && [ -f "$c" ]; then ca=$c; break; fi
  done
  secrets=$(mktemp -d); trap 'rm -rf "$secrets"' EXIT
  # the host's effective pip settings as one pip.conf (index URLs may carry credentials: a secret, never a layer)
  "$py" - "$secrets/pip.conf" "$flavour" <<'PY'
import configparser, os, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
cfg = configparser.ConfigParser(interpolation=None)
for line in out.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.partition(".")
    section = "global" if section.startswith(":env:") else section
    if name in ("cert", "constraint", "find-links", "index-url", "extra-index-url", "trusted-host", "timeout",
                "default-timeout", "retries"):
        cfg.setdefault(section, {})[name] = value.strip().strip("'\"")
for k, v in os.environ.items():
    if k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CONSTRAINT"):
        cfg.setdefault("global", {})[k[4:].lower().replace("_", "-")] = v
if sys.argv[2] == "cuda":
    # this machine's local wheel folders hold CPU builds (torch 2.13.0+cpu satisfies vLLM's torch==2.13.0 pin): the
    # CUDA image takes vLLM and its torch from the indexes alone, as scripts/setup.sh does on a GPU machine
    for section in cfg.sections():
        cfg[section].pop("find-links", None)
        urls = [u for u in cfg[section].get("extra-index-url", "").split() if not u.startswith("file:")]
        cfg[section]["extra-index-url"] = " ".join(urls)
        if cfg[section].get("index-url", "").startswith("file:"):
            cfg[section].pop("index-url")
cfg.setdefault("global", {})["cert"] = "/run/secrets/hostca"
cfg["global"].pop("constraint", None)   # the constraint file is passed as its own mount, below
cfg.write(open(sys.argv[1], "w"))
# the local folders those settings name (find-links, file:// indexes), one a line, for read-only mounts
dirs = set()
for section in cfg.sections():
    for name in ("find-links", "index-url", "extra-index-url"):
        for v in cfg[section].get(name, "").split():
            path = v[len("file://"):] if v.startswith("file://") else v
            if path.startswith("/"):
                if name != "find-links":  # an index's pages link to files beside it (../../files/...)
                    path = os.path.dirname(path.rstrip("/"))
                while path != "/" and not os.path.isdir(path):
                    path = os.path.dirname(path)
                if path != "/":
                    dirs.add(path)
open(sys.argv[1] + ".dirs", "w").write("".join(d + "\n" for d in sorted(dirs)))
PY
  args+=(--secret "id=hostca,src=$ca" --secret "id=pipconf,src=$secrets/pip.conf")
  # local wheel folders and file:// indexes the host's pip reads, mounted read-only at the same paths
  while read -r d; do [ -n "$d" ] && args+=(--volume "$d:$d:ro"); done <"$secrets/pip.conf.dirs"
  constraint=${PIP_CONSTRAINT:-$(pip config get global.constraint 2>/dev/null || true)}
  if [ -n "$constraint" ] && [ -f "$constraint" ]; then cp "$constraint" "$secrets/constraints.txt"
  else : >"$secrets/constraints.txt"; fi
  args+=(--secret "id=pipconstraint,src=$secrets/constraints.txt")
fi

echo "[build] $tag (target $flavour)" >&2
t1=$(date +%s)
podman build --target "$flavour" --tag "$tag" "${args[@]}" --file "$here/Containerfile" \
  --ignorefile "$here/Containerfile.ignore" "${extra[@]}" "$repo"
if [ "$flavour" != infra ]; then
  # the commit and version as labels in an instruction of their own: when every layer comes from buildah's cache, a
  # --label given to the build above can leave the cached image's labels (an earlier commit's) in place
  printf 'FROM %s\nLABEL org.opencontainers.image.version="%s" org.opencontainers.image.revision="%s"\n' \
    "$tag" "$version" "$commit" | podman build --tag "$tag" --file - "$here" >/dev/null
  got=$(podman image inspect "$tag" --format '{{index .Labels "org.opencontainers.image.revision"}}')
  [ "$got" = "$commit" ] || { echo "build.sh: $tag is labelled revision $got, not $commit" >&2; exit 1; }
fi
t2=$(date +%s)
size=$(podman image inspect "$tag" --format '{{.Size}}')
echo "[build] $tag built in $(( t2 - t1 )) s (total $(( t2 - t0 )) s), $(( size / 1000000 )) MB" >&2
