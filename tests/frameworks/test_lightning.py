"""PyTorch Lightning ``Trainer.fit`` from a shardserve Loader: partitions, epochs, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardserve.client import Loader
from shardserve.server.planning import plan
from tests.frameworks.conftest import N_SAMPLES
from tests.support.data import sample_id_of
from tests.support.slowness import scaled
from tests.support.zygote import Zygote

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def forked() -> Iterator[Zygote]:
    """One-device runs fork from a process that imported Lightning once (its import is most of
    a short run's CPU); DDP runs start as real commands, which Lightning's launcher re-runs."""
    with Zygote(["torch", "lightning.pytorch", "shardserve.client.lightning"]) as z:
        yield z


def fit(
    url: str, out: Path, *args: str, timeout: float | None = None, forked: Zygote | None = None
) -> dict[int, dict]:
    """Run the Lightning worker (forked from ``forked`` when given); its records by rank."""
    timeout = scaled(150) if timeout is None else timeout
    out.mkdir(parents=True, exist_ok=True)
    argv = ["-m", "tests.frameworks._lightning_worker", "--url", url, "--out", str(out), *args]
    if forked is not None:
        done = forked.run(argv, cwd=ROOT, env=os.environ, timeout=timeout)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    else:
        r = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def planned(
    epoch: int, world_size: int, rank: int, seed: int = 5, bs: int = 100
) -> list[list[int]]:
    p = plan(N_SAMPLES, seed=seed, epoch=epoch, world_size=world_size, rank=rank, batch_size=bs)
    return [[int(i) for i in b] for b in p]


@pytest.mark.parametrize("how", ["datamodule", "bare", "bare-hook"])
def test_one_device_epochs_follow_the_plan(
    server, forked: Zygote, tmp_path: Path, how: str
) -> None:
    """Trainer(devices=1) epochs 0..2 stream plan epochs 0..2, the same as a plain
    `for epoch: set_epoch(epoch)` loop, whether through the DataModule or a bare Loader with
    or without a set_epoch hook; Lightning passes the Loader through unwrapped."""
    args = {"datamodule": ["--val"], "bare": ["--bare"], "bare-hook": ["--bare", "--hook"]}[how]
    rec = fit(server.http_url, tmp_path, "--epochs", "3", *args, forked=forked)[0]
    assert rec["loader_type"] == "Loader" and rec["loader_world"] == [0, 1]
    with Loader(server.http_url, "cifar", 100, seed=5, rank=0, world_size=1) as loader:
        plain = {}
        for epoch in range(3):
            loader.set_epoch(epoch)
            plain[str(epoch)] = [
                [int(i) for i in sample_id_of({k: b[k].numpy() for k in ("image", "label")})]
                for b in loader
            ]
    assert rec["seen"] == plain
    for epoch in range(3):
        assert rec["seen"][str(epoch)] == planned(epoch, 1, 0), f"epoch {epoch}"


def test_mid_epoch_checkpoint_resumes_exactly(server, forked: Zygote, tmp_path: Path) -> None:
    """A checkpoint saved after 4 batches of epoch 1, resumed in a new process, trains on
    exactly the batches the uninterrupted run had left: the rest of epoch 1, then epoch 2."""
    full = fit(
        server.http_url, tmp_path / "full", "--epochs", "3", "--ckpt-every", "14", forked=forked
    )[0]
    ckpt = tmp_path / "full" / "ckpt" / "step=14.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "full" / "ckpt").iterdir())
    resumed = fit(
        server.http_url, tmp_path / "resumed", "--epochs", "3", "--resume", str(ckpt), forked=forked
    )[0]
    assert resumed["seen"] == {"1": full["seen"]["1"][4:], "2": full["seen"]["2"]}
    assert full["seen"]["1"] == planned(1, 1, 0)


@pytest.mark.slow
def test_ddp_two_ranks_each_train_their_part_and_resume(server, tmp_path: Path) -> None:
    """Trainer(devices=2, strategy="ddp") on gloo: each rank trains its plan part, together
    every sample once per epoch; a mid-epoch checkpoint resumes both ranks exactly."""
    recs = fit(
        server.http_url,
        tmp_path / "full",
        "--devices",
        "2",
        "--epochs",
        "2",
        "--ckpt-every",
        "7",
        timeout=scaled(240),
    )
    assert sorted(recs) == [0, 1]
    for rank, rec in recs.items():
        assert rec["loader_type"] == "Loader" and rec["loader_world"] == [rank, 2]
        for epoch in range(2):
            assert rec["seen"][str(epoch)] == planned(epoch, 2, rank), (rank, epoch)
    for epoch in ("0", "1"):
        union = sorted(i for r in recs.values() for b in r["seen"][epoch] for i in b)
        assert union == list(range(N_SAMPLES))
    # 5 steps per epoch: step 7 is after batch 2 of epoch 1.
    ckpt = tmp_path / "full" / "ckpt" / "step=7.ckpt"
    resumed = fit(
        server.http_url,
        tmp_path / "resumed",
        "--devices",
        "2",
        "--epochs",
        "2",
        "--resume",
        str(ckpt),
        timeout=scaled(240),
    )
    for rank in (0, 1):
        assert resumed[rank]["seen"] == {"1": recs[rank]["seen"]["1"][2:]}, rank


@pytest.mark.slow
def test_datamodule_without_validation_under_ddp_warns_nothing(server, tmp_path: Path) -> None:
    """A ShardserveDataModule without ``val_dataset`` under 2-rank DDP is a DataModule without
    validation data, as Lightning's own: no validation loop, no warning about it, and no
    warning that names the Loader; training follows the plan."""
    recs = fit(server.http_url, tmp_path, "--devices", "2", "--epochs", "1", timeout=scaled(240))
    for rank, rec in recs.items():
        about_val = [w for w in rec["warnings"] if "val" in w.lower() or "across ranks" in w]
        assert not about_val, about_val
        assert not [w for w in rec["warnings"] if "Loader" in w], rec["warnings"]
        assert rec["seen"]["0"] == planned(0, 2, rank)
