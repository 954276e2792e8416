#!/usr/bin/env bash
# Build the server and trainer images with podman, for CI and for a developer on a Debian machine
# without Docker or an image registry (issue 17). Run from anywhere, as root:
#
#   bash docker/ci-engine.sh          # installs podman, makes the base image once, builds both images
#
# Then `python -m pytest -m containers` runs tests/ops/test_containers.py against the images and
# `docker/podman-stack.sh` runs docker-compose.yml's stack. Where no engine can be installed (not
# root, no apt-get) it says so in one line and exits 0; the container tests then skip.
#
# Steps, each skipped when already done on this machine:
#  1. apt-get install podman (runc, not crun: crun refuses this machine's hybrid cgroup layout),
#     netavark + aardvark-dns (a compose-like network where `server` resolves), mmdebstrap.
#  2. The base image: no registry is reachable, so Debian bookworm (whose Python is 3.11) is
#     bootstrapped with mmdebstrap and tagged as the `python:3.11-slim` the Dockerfiles name.
#     It stays in podman's storage, so later runs on the machine reuse it (BASE_RECIPE bumps it).
#  3. `podman build` of docker/Dockerfile and docker/Dockerfile.trainer. pip inside the build
#     reaches the registry as this machine does (host network, the host's certificates and
#     /etc/pip.conf mounted read-only). torch comes from a local CPU wheel when pip's find-links
#     hold one, pinned to its `+cpu` version so that a missing wheel fails instead of pulling CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
READY="$ROOT/docker/.engine-ready"
rm -f "$READY"

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "== container engine: skipped (needs root and apt-get to install podman); container tests will skip"
  exit 0
fi

export CONTAINERS_CONF="$ROOT/docker/podman/containers.conf"
BASE=docker.io/library/python:3.11-slim
BASE_RECIPE=1 # bump when the base image recipe below changes
SERVER_IMAGE=${SHARDSERVE_IMAGE:-localhost/shardserve:latest}
TRAINER_IMAGE=${SHARDSERVE_TRAINER_IMAGE:-localhost/shardserve-trainer:latest}
TORCH_VERSION=2.13.0
t0=$SECONDS
step() { echo "== container engine: $1 ($((SECONDS - t0)) s)"; }

# --- 1. the engine ---------------------------------------------------------------------------
pkgs=(podman runc conmon netavark aardvark-dns iptables catatonit uidmap slirp4netns mmdebstrap)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "apt-get install ${missing[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
podman --version

# --- 2. the base image -----------------------------------------------------------------------
have_recipe=$(podman image inspect --format '{{ index .Labels "org.shardserve.base-recipe" }}' "$BASE" 2>/dev/null || true)
if [ "$have_recipe" != "$BASE_RECIPE" ]; then
  step "bootstrapping the base image $BASE (Debian bookworm, python3)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # No docs, man pages or locales: they are most of a minbase system's size.
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$work/rootfs.tar" http://deb.debian.org/debian
  podman import --quiet "$work/rootfs.tar" localhost/shardserve-base-rootfs:bookworm >/dev/null
  # What python:3.11-slim offers that the Dockerfiles rely on: `python`/`pip` on PATH and a
  # pip that installs system-wide (Debian marks its Python externally managed).
  cat >"$work/Containerfile" <<EOF
FROM localhost/shardserve-base-rootfs:bookworm
RUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \\
 && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip
ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL org.shardserve.base-recipe=$BASE_RECIPE
CMD ["python3"]
EOF
  podman build --quiet --pull=never --network none -t "$BASE" -f "$work/Containerfile" "$work" >/dev/null
  podman rmi --force localhost/shardserve-base-rootfs:bookworm >/dev/null
  rm -rf "$work"
  trap - EXIT
else
  step "base image $BASE is cached"
fi

# --- 3. the images ---------------------------------------------------------------------------
# --format docker keeps HEALTHCHECK (the OCI image format has no field for it).
build=(podman build --quiet --pull=never --format docker --network host
  -v /etc/ssl/certs:/etc/ssl/certs:ro)
[ -f /etc/pip.conf ] && build+=(-v /etc/pip.conf:/etc/pip.conf:ro)

# The sources' hash: the server image's last stage installs from a bind mount, which podman's
# layer cache does not look into (see docker/Dockerfile, SOURCE_ID).
source_id=$(tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --exclude=__pycache__ \
  --exclude='*.so' -cf - pyproject.toml setup.py README.md proto server client | sha256sum | cut -c1-16)
# The images these builds replace: each is a GB or so, and one left behind per run fills a disk.
replaced=()
for image in "$SERVER_IMAGE" "$TRAINER_IMAGE"; do
  id=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
  [ -n "$id" ] && replaced+=("$id")
done
step "building $SERVER_IMAGE (sources $source_id)"
"${build[@]}" --build-arg "SOURCE_ID=$source_id" -f docker/Dockerfile -t "$SERVER_IMAGE" . >/dev/null

# A local CPU torch wheel: look where this machine's pip looks (PIP_FIND_LINKS, pip config).
wheels=""
for d in ${SHARDSERVE_TORCH_WHEELS:-} ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
  if compgen -G "$d/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then wheels=$d; break; fi
done
torch_args=()
if [ -n "$wheels" ]; then
  torch_args=(-v "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels
    --build-arg "TORCH=torch==$TORCH_VERSION+cpu" --build-arg TORCH_INDEX_URL=)
fi
step "building $TRAINER_IMAGE (torch from ${wheels:-the CPU wheel index})"
"${build[@]}" "${torch_args[@]}" -f docker/Dockerfile.trainer -t "$TRAINER_IMAGE" . >/dev/null

# A replaced build that no tag names any more goes now. Other untagged images are build stages,
# the next run's cache (the server's wheel stage above all): those older than a day go.
for id in "${replaced[@]}"; do
  tags=$(podman image inspect --format '{{len .RepoTags}}' "$id" 2>/dev/null || echo gone)
  if [ "$tags" = 0 ]; then podman rmi --force "$id" >/dev/null; fi
done
podman image prune --force --filter until=24h >/dev/null
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
  | grep -E "^($SERVER_IMAGE|$TRAINER_IMAGE|$BASE) " | sed 's/^/   /'
printf 'SHARDSERVE_IMAGE=%s\nSHARDSERVE_TRAINER_IMAGE=%s\n' "$SERVER_IMAGE" "$TRAINER_IMAGE" >"$READY"
step "images ready"
