#!/usr/bin/env bash
# docker-compose.yml run with plain `podman run`, for a machine with podman and no Docker:
#
#   export SHARDSERVE_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
#   docker/podman-stack.sh ingest     # = docker compose run --rm ingest
#   docker/podman-stack.sh up         # = docker compose up trainer (server, its health, then train)
#   docker/podman-stack.sh down [-v]  # = docker compose down [-v]
#
# Also: `server` (start it and wait for its health check), `trainer [ARGS]` (run the trainer
# against a running server; ARGS replace its command; SHARDSERVE_TRAINER_OPTS adds podman
# options such as `--entrypoint python`). Images: docker/ci-engine.sh builds them.
#
# Why not podman-compose: Debian's 1.0.3 drops `ipc:` (the trainer would not share the server's
# IPC namespace, so no shared memory) and starts `depends_on` services without waiting for their
# health check (seen with `podman-compose --dry-run up trainer`). Each function below is the
# compose service of its name, key for key (the comment after a flag names the key);
# tests/ops/test_podman_stack.py fails when the two drift apart.
set -euo pipefail
: "${SHARDSERVE_TOKEN:?set SHARDSERVE_TOKEN to a shared secret}"
# The compose project name: prefix of the containers, the volumes and the network.
P=${SHARDSERVE_STACK:-shardserve}
IMAGE=${SHARDSERVE_IMAGE:-localhost/shardserve:latest}                       # x-shardserve-image
TRAINER_IMAGE=${SHARDSERVE_TRAINER_IMAGE:-localhost/shardserve-trainer:latest} # x-trainer-image
HEALTH_TIMEOUT_S=${SHARDSERVE_HEALTH_TIMEOUT_S:-60}
TRAINER_COMMAND=(--url http://server:7070 --dataset digits-train --test-dataset digits-test)

# Compose's default network: every service reachable by its name.
network() { podman network exists "$P" || podman network create "$P" >/dev/null; }

prepare() {
  podman run --rm --name "$P-prepare" --network "$P" --network-alias prepare \
    --entrypoint '["python", "examples/prepare_digits.py", "/data/source/digits-train.npz", "/data/source/digits-test.npz"]' \
    --user root \
    --volume "$P-source:/data/source" \
    "$TRAINER_IMAGE"
}

ingest() {
  prepare # depends_on: prepare: service_completed_successfully (set -e stops on its failure)
  podman run --rm --name "$P-ingest" --network "$P" --network-alias ingest \
    --entrypoint '["sh", "-c"]' \
    --volume "$P-store:/data/store" \
    --volume "$P-source:/data/source:ro" \
    "$IMAGE" \
    "shardserve ingest /data/source/digits-train.npz --store /data/store --name digits-train --overwrite && shardserve ingest /data/source/digits-test.npz --store /data/store --name digits-test --overwrite"
}

server() {
  podman run --detach --name "$P-server" --network "$P" --network-alias server \
    --env SHARDSERVE_TOKEN \
    --env SHARDSERVE_VERIFY=lazy \
    --env SHARDSERVE_LOG_FORMAT=json \
    --volume "$P-store:/data/store:ro" \
    --volume "$P-state:/data/state" \
    --volume "$P-run:/run/shardserve" \
    --ipc shareable \
    --shm-size 2gb \
    --publish "127.0.0.1:${SHARDSERVE_HTTP_PORT:-7070}:7070" \
    --publish "127.0.0.1:${SHARDSERVE_DATA_PORT:-7071}:7071" \
    "$IMAGE" >/dev/null
}

# depends_on: server: service_healthy. Without systemd podman runs no health-check timer, so
# the image's HEALTHCHECK is run here until it passes (which also marks the container healthy).
wait_healthy() {
  local deadline=$((SECONDS + HEALTH_TIMEOUT_S))
  until podman healthcheck run "$P-server" >/dev/null 2>&1; do
    if [ "$(podman inspect --format '{{.State.Running}}' "$P-server")" != true ] || [ $SECONDS -ge $deadline ]; then
      podman logs --tail 20 "$P-server" >&2 || true
      echo "podman-stack: $P-server did not turn healthy within ${HEALTH_TIMEOUT_S} s" >&2
      return 1
    fi
    sleep 1
  done
}

trainer() {
  [ $# -gt 0 ] || set -- "${TRAINER_COMMAND[@]}"
  # shellcheck disable=SC2086 # SHARDSERVE_TRAINER_OPTS is a list of podman options
  podman run --rm --name "$P-trainer" --network "$P" --network-alias trainer \
    --env SHARDSERVE_TOKEN \
    --ipc "container:$P-server" \
    --volume "$P-run:/run/shardserve" \
    ${SHARDSERVE_TRAINER_OPTS:-} \
    "$TRAINER_IMAGE" \
    "$@"
}

down() {
  podman rm --force --volumes --ignore "$P-trainer" "$P-ingest" "$P-prepare" "$P-server" >/dev/null
  if podman network exists "$P"; then podman network rm "$P" >/dev/null; fi
  if [ "${1:-}" = -v ]; then
    for v in store state source run; do podman volume rm --force "$P-$v" >/dev/null 2>&1 || true; done
  fi
}

case "${1:-}" in
  ingest) network && ingest ;;
  server) network && server && wait_healthy ;;
  trainer) shift && trainer "$@" ;;
  up)
    shift
    network
    if [ "$(podman inspect --format '{{.State.Running}}' "$P-server" 2>/dev/null)" != true ]; then
      podman rm --force --ignore "$P-server" >/dev/null
      server
    fi
    wait_healthy
    trainer "$@"
    ;;
  down) shift && down "$@" ;;
  *)
    echo "usage: $0 ingest | up [TRAINER ARGS] | server | trainer [ARGS] | down [-v]" >&2
    exit 2
    ;;
esac
