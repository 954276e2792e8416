"""bench/device_run.sh: its stage list per mode, its refusals, and its CPU smoke end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_run.sh"


def _run(
    *args: str, out: Path | None = None, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    if out is not None:
        env["DEVICE_RUN_OUT"] = str(out)
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=scaled(timeout)
    )


def _stages(*args: str) -> dict[str, tuple[int, str]]:
    r = _run("--list", *args)
    assert r.returncode == 0, r.stderr
    rows = [line.split(" ", 2) for line in r.stdout.splitlines()]
    return {name: (int(budget), cmd) for name, budget, cmd in rows}


def test_gpu_mode_lists_every_row_within_nine_minutes() -> None:
    """The GPU run has the cuda, gpu, scaling (ranks 1,2,4,8 on 1 and 4 processes) and small rows, under 540 s."""
    stages = _stages()
    assert {"smoke", "cuda", "gpu", "scaling", "small"} <= set(stages)
    assert next(iter(stages)) == "smoke" and stages["smoke"][0] <= 60
    assert "--ranks 1,2,4,8 --processes 1,4" in stages["scaling"][1]
    assert "-m cuda" in stages["cuda"][1]
    assert sum(b for b, _ in stages.values()) <= 540 - 30  # 30 s left for setup


def test_cpu_mode_skips_the_cuda_rows() -> None:
    """--cpu drops the rows that need CUDA and keeps the rest; --smoke keeps only smoke."""
    assert set(_stages("--cpu")) == {"smoke", "scaling", "small"}
    assert set(_stages("--cpu", "--smoke")) == {"smoke"}
    assert "--ranks 1,2 " in _stages("--cpu")["scaling"][1] + " "


def test_unknown_argument_is_refused_by_name() -> None:
    """A misspelt option stops the script with status 2 and names the option."""
    r = _run("--cpus")
    assert r.returncode == 2 and "--cpus" in r.stderr


def test_cpu_smoke_runs_and_writes_its_row(tmp_path: Path) -> None:
    """--cpu --smoke starts a real server through the smoke row and writes device-cpu-smoke.json."""
    r = _run("--cpu", "--smoke", out=tmp_path, timeout=180.0)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row = json.loads((tmp_path / "device-cpu-smoke.json").read_text())
    assert row["row"] == "smoke" and row["rc"] == 0 and row["mode"] == "cpu"
    assert "sizing: cpus" in r.stdout
