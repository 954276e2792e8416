#!/usr/bin/env bash
# One command for a big host: the first thing to run when a GPU host is available.
#
#   bench/device_run.sh [--cpu] [--smoke] [--full] [--list] [--ranks 1,2,4,8] [--processes 1,4]
#
# Stages, each under its own `timeout` (seconds) so that the whole run stays under 9 minutes
# on a 16-core GPU host, each writing bench/results/device-<row>.json (device-cpu-<row>.json
# with --cpu) as soon as it finishes, whatever its exit status:
#
#   setup         versions (python, torch, CUDA, GPU), the machine's sizing, install from
#                 bench/wheelhouse (bench/device_wheels.sh builds it) where shardserve is missing
#   smoke    45   a real server on a real store: tests/server/test_sizing.py
#   cuda     60   python -m pytest -m cuda                              (skipped with --cpu)
#   gpu     100   bench/bench_gpu.py --quick                            (skipped with --cpu)
#   scaling 185   bench/bench_scaling.py --quick --ranks R --processes P (raw and chain, each
#                 rank count on 1 and on P streaming processes)
#   small    70   bench/bench_small.py --quick
#   devtx    50   bench/bench_device_transforms.py --device cuda        (if the file exists;
#                                                                       skipped with --cpu)
#
# --cpu: this machine, no GPU (the cuda rows are skipped; ranks and processes default to 1,2). --smoke: setup
# and smoke only. --full: the benches without --quick (longer than 9 minutes: budgets x3).
# DEVICE_RUN_OUT=DIR writes the rows there instead. --list: print the stages that would run, one per line, and exit. The GPU host reaches no
# package registry: build the wheelhouse here first (bench/device_wheels.sh) and carry
# bench/wheelhouse with the call; torch is the host's own.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu SMOKE_ONLY=0 FULL=0 LIST=0 RANKS="" PROCS=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) MODE=cpu; shift ;;
    --smoke) SMOKE_ONLY=1; shift ;;
    --full) FULL=1; shift ;;
    --list) LIST=1; shift ;;
    --ranks) RANKS=${2:?--ranks needs a value such as 1,2,4,8}; shift 2 ;;
    --processes) PROCS=${2:?--processes needs a value such as 1,4}; shift 2 ;;
    *) echo "device_run.sh: unknown argument '$1'; known: --cpu --smoke --full --list --ranks R --processes P" >&2
       exit 2 ;;
  esac
done
[[ -n $RANKS ]] || { [[ $MODE == cpu ]] && RANKS=1,2 || RANKS=1,2,4,8; }
[[ -n $PROCS ]] || { [[ $MODE == cpu ]] && PROCS=1,2 || PROCS=1,4; }
QUICK=--quick SCALE=1
[[ $FULL == 1 ]] && QUICK="" SCALE=3
PY=${PYTHON:-python3}
RESULTS=bench/results  # where the benches write theirs
OUTDIR=${DEVICE_RUN_OUT:-$RESULTS}  # where the rows go (tests point it at a temporary folder)
PREFIX=$OUTDIR/device-$([[ $MODE == cpu ]] && echo cpu-)

# name budget_s needs_cuda command...
STAGES=(
  "smoke|45|0|$PY -m pytest tests/server/test_sizing.py -q -p no:cacheprovider"
  "cuda|60|1|$PY -m pytest -m cuda -q -p no:cacheprovider tests"
  "gpu|100|1|$PY bench/bench_gpu.py $QUICK --device cuda --out $RESULTS/gpu-device-run.json|gpu-device-run.json"
  "scaling|185|0|$PY bench/bench_scaling.py $QUICK --ranks $RANKS --processes $PROCS|scaling.json"
  "small|70|0|$PY bench/bench_small.py $QUICK|small.json"
  "devtx|50|1|$PY bench/bench_device_transforms.py --device cuda"
)

selected() {
  local name needs cmd
  for s in "${STAGES[@]}"; do
    IFS='|' read -r name _ needs cmd _ <<<"$s"
    [[ $SMOKE_ONLY == 1 && $name != smoke ]] && continue
    [[ $MODE == cpu && $needs == 1 ]] && continue
    [[ $name == devtx && ! -f bench/bench_device_transforms.py ]] && continue
    echo "$s"
  done
}

if [[ $LIST == 1 ]]; then
  selected | while IFS='|' read -r name budget _ cmd _; do
    echo "$name $((budget * SCALE)) $cmd"
  done
  exit 0
fi

mkdir -p "$RESULTS" "$OUTDIR"
START=$(date +%s)
echo "== setup ($MODE mode, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
if ! $PY -c 'import shardserve.server, pyarrow, zmq' 2>/dev/null; then
  [[ -d bench/wheelhouse ]] || { echo "shardserve is not installed and bench/wheelhouse is missing: run bench/device_wheels.sh here and carry bench/wheelhouse" >&2; exit 3; }
  $PY -m pip install -q --no-index --find-links bench/wheelhouse \
    'shardserve[server]' pyzmq httpx pytest pytest-timeout pytest-xdist || exit 3
fi
$PY - <<'EOF'
import platform, sys
import numpy, pyarrow, torch
from shardserve.server.runtime.sizing import choose, probe
cuda = torch.version.cuda if torch.cuda.is_available() else "none"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()} torch {torch.__version__} cuda {cuda} gpu {gpu} "
      f"numpy {numpy.__version__} pyarrow {pyarrow.__version__}")
print("sizing:", choose(probe(), {}).line())
from shardserve.server.transforms.compiled import KERNELS
print("kernels:", {k: "compiled" if v else "numpy (the wheel's C extension did not load)" for k, v in KERNELS.items()})
EOF
[[ $MODE == gpu ]] && command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

run_row() {  # name budget cmd [bench result file the command writes]
  local name=$1 budget=$2 cmd=$3 result=${4:-} out="${PREFIX}$1.json" log t0 rc
  log=$(mktemp)
  local saved=""
  if [[ -n $result && -f $RESULTS/$result ]]; then  # a published result: put it back after
    saved=$(mktemp) && cp "$RESULTS/$result" "$saved"
  fi
  echo "== $name (budget ${budget}s): $cmd"
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$budget" bash -c "$cmd" </dev/null >"$log" 2>&1
  rc=$?
  tail -n 25 "$log"
  ROW=$name CMD=$cmd RC=$rc T0=$t0 LOG=$log RESULT=${result:+$RESULTS/$result} OUT=$out \
    MODE=$MODE BUDGET=$budget $PY - <<'EOF'
import json, os, platform, time
from pathlib import Path
res = os.environ["RESULT"]
row = {
    "row": os.environ["ROW"], "mode": os.environ["MODE"], "cmd": os.environ["CMD"],
    "rc": int(os.environ["RC"]), "timed_out": os.environ["RC"] in ("124", "137"),
    "budget_s": int(os.environ["BUDGET"]),
    "wall_s": round(time.time() - float(os.environ["T0"]), 1),
    "host": platform.node(), "cpus": os.cpu_count(), "load": os.getloadavg(),
    "result": json.loads(Path(res).read_text()) if res and Path(res).exists() else None,
    "log_tail": Path(os.environ["LOG"]).read_text(errors="replace")[-6000:],
}
Path(os.environ["OUT"]).write_text(json.dumps(row, indent=2))
print(f"   {row['row']}: rc {row['rc']} in {row['wall_s']} s -> {os.environ['OUT']}")
EOF
  if [[ -n $saved ]]; then mv "$saved" "$RESULTS/$result"; elif [[ -n $result ]]; then rm -f "$RESULTS/$result"; fi
  rm -f "$log"
  return "$rc"
}

FAILED=()
while IFS='|' read -r name budget _ cmd result; do
  run_row "$name" $((budget * SCALE)) "$cmd" "$result" || FAILED+=("$name")
  if [[ $name == smoke && ${#FAILED[@]} -gt 0 ]]; then
    echo "smoke failed: the rows after it would fail the same way; stopping" >&2
    exit 1
  fi
done < <(selected)
echo "== done in $(($(date +%s) - START)) s; failed: ${FAILED[*]:-none}"
[[ ${#FAILED[@]} -eq 0 ]]
