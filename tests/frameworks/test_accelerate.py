"""Hugging Face Accelerate: a prepared training loop over a shardserve Loader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.server.planning import plan
from tests.frameworks.conftest import N_EVAL, N_SAMPLES
from tests.support.server import free_port
from tests.support.slowness import scaled

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]


def test_accelerate_prepared_loop_runs_and_checkpoints(server, tmp_path: Path) -> None:
    """prepare() hands the Loader back as is; the loop trains (optimizer steps) on the plan's
    batches, and save_state/load_state mid-epoch resumes a fresh Loader at the next batch."""
    cmd = [sys.executable, "-m", "tests.frameworks._accelerate_worker"]
    r = subprocess.run(
        [*cmd, "--url", server.http_url, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rec = json.loads((tmp_path / "rank0.json").read_text())
    assert rec["same_object"] and rec["loader_world"] == [0, 1]
    for epoch in (0, 1):
        want = plan(N_SAMPLES, seed=3, epoch=epoch, world_size=1, rank=0, batch_size=100)
        assert rec["seen"][str(epoch)] == [[int(i) for i in b] for b in want]
    assert rec["rest"] == rec["seen"]["1"][2:]
    assert rec["steps"] == 20 and rec["weights_moved"] > 0


@pytest.mark.slow
def test_accelerate_under_torchrun_two_ranks(server, tmp_path: Path) -> None:
    """Launched by torchrun with 2 processes (gloo), each rank's prepared Loader streams its plan
    part, and load_state on every rank restores the position rank 0 saved."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "tests.frameworks._accelerate_worker",
    ]
    r = subprocess.run(
        [*cmd, "--url", server.http_url, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for rank in (0, 1):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["loader_world"] == [rank, 2] and rec["world_size"] == 2
        for epoch in (0, 1):
            want = plan(N_SAMPLES, seed=3, epoch=epoch, world_size=2, rank=rank, batch_size=100)
            assert rec["seen"][str(epoch)] == [[int(i) for i in b] for b in want]
        assert rec["rest"] == rec["seen"]["1"][2:]


@pytest.mark.slow
def test_skip_first_batches_and_gather_for_metrics_two_ranks(server, tmp_path: Path) -> None:
    """Under torchrun with 2 ranks, ``skip_first_batches(loader, 3)`` yields the epoch's batches
    from 3 on and ``gather_for_metrics`` over 1001 in-order samples gives each once on every rank."""
    # The skipped batches are never sent and the Loader then goes on with the next epoch; the plan's
    # padding is dropped by gather_for_metrics, with batches of 64 and of 1. One torchrun: the two
    # ranks' start is most of the test's time.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "tests.frameworks._accelerate_habits_worker",
    ]
    r = subprocess.run(
        [*cmd, "--url", server.http_url, "--out", str(tmp_path), "--eval-batch", "64", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(240),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for rank in (0, 1):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["habits"] == [100, False, True, N_SAMPLES]
        want = plan(N_SAMPLES, seed=3, epoch=1, world_size=2, rank=rank, batch_size=100)
        assert rec["rest"] == [[int(i) for i in b] for b in want][3:]
        assert rec["skipped_len"] == len(want) - 3
        nxt = plan(N_SAMPLES, seed=3, epoch=2, world_size=2, rank=rank, batch_size=100)
        assert rec["after"] == [[int(i) for i in b] for b in nxt]
        assert sorted(rec["evals"]) == ["1", "64"]
        for ev in rec["evals"].values():
            assert ev["eval_samples"] == N_EVAL
            assert len(ev["gathered"]) == ev["preds"] == N_EVAL, ev["eval_len"]
            assert sorted(ev["gathered"]) == list(range(N_EVAL))
            assert not [w for w in ev["warnings"] if "gather_for_metrics" in w], ev["warnings"]
