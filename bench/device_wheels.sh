#!/usr/bin/env bash
# Build the wheelhouse that bench/device_run.sh installs from on a GPU host that reaches no
# package registry: shardserve itself plus its server, client and test dependencies, for the
# host's Python, WITHOUT torch (the host's own CUDA build is used) and, by default, without
# numpy (torch images ship it; --with-numpy adds it, about 17 MB).
#
#   bench/device_wheels.sh [--python-version 3.11] [--platform manylinux_2_28_x86_64] [--with-numpy]
#
# Writes bench/wheelhouse/ (ignored by git) and prints its size: the device call carries the
# working tree and this folder together, 64 MiB at most (pyarrow alone is about 50 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PLATFORM=manylinux_2_28_x86_64
NUMPY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) PYVER=$2; shift 2 ;;
    --platform) PLATFORM=$2; shift 2 ;;
    --with-numpy) NUMPY=1; shift ;;
    *) echo "device_wheels.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
OUT=bench/wheelhouse
rm -rf "$OUT" && mkdir -p "$OUT"
# The server's and client's dependencies (pyproject.toml) and what the cuda tests import.
DEPS=(pyarrow pyzmq fastapi uvicorn pydantic-settings prometheus-client xxhash tqdm httpx
      pytest pytest-timeout pytest-xdist)
[[ $NUMPY == 1 ]] && DEPS+=(numpy)
python3 -m pip download -q --only-binary=:all: --python-version "$PYVER" --platform "$PLATFORM" \
  --platform manylinux2014_x86_64 --platform linux_x86_64 -d "$OUT" "${DEPS[@]}"
# numpy comes in as nobody's dependency above except by name; drop one a dependency pulled in.
[[ $NUMPY == 1 ]] || rm -f "$OUT"/numpy-*.whl
# Flight, headers and tests: about a third of pyarrow, never loaded by shardserve.
python3 bench/slim_wheel.py "$OUT"/pyarrow-*.whl
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" .
du -sh "$OUT"
ls "$OUT"
