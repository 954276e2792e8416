"""Two ranks under torch.distributed (gloo), and the DDP example trained end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.client.conftest import N_CIFAR
from tests.support.data import cifar_images, make_cifar_like
from tests.support.server import free_port, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    # ROOT for `tests`; the caller's path after it, so the workers import the same shardserve.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None) if k not in extra else None
    return env


def test_two_ranks_get_disjoint_batches_covering_the_dataset(server, tmp_path) -> None:
    """Ranks of a gloo group read disjoint, equally many batches whose union is the dataset."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = _env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [
            sys.executable,
            str(ROOT / "tests/client/_ddp_worker.py"),
            server.http_url,
            str(tmp_path / f"{rank}.json"),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outs = [p.communicate(timeout=scaled(90))[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    assert len(r0["batches"]) == len(r1["batches"]) == r0["len"] == r1["len"]
    s0 = [i for b in r0["batches"] for i in b]
    s1 = [i for b in r1["batches"] for i in b]
    assert len(s0) == len(s1) == N_CIFAR // 2
    assert not set(s0) & set(s1)
    assert sorted(s0 + s1) == list(range(N_CIFAR))


_TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun_train_ddp(url: str) -> subprocess.CompletedProcess[str]:
    """``examples/train_ddp.py`` for 4 epochs on 2 gloo ranks under torchrun."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "examples/train_ddp.py"),
        "--url",
        url,
        "--epochs",
        "4",
    ]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=scaled(100))


def test_train_ddp_example_reaches_good_accuracy(tmp_path) -> None:
    """examples/train_ddp.py trains with 2 CPU ranks via torchrun and ends with accuracy > 0.8."""
    store = tmp_path / "store"
    train, test = tmp_path / "digits-train.npz", tmp_path / "digits-test.npz"
    subprocess.run(
        [sys.executable, str(ROOT / "examples/prepare_digits.py"), str(train), str(test)],
        check=True,
        timeout=scaled(60),
        env=_env(),
    )
    for src, name in ((train, "digits-train"), (test, "digits-test")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shardserve.server",
                "ingest",
                str(src),
                "--store",
                str(store),
                "--name",
                name,
            ],
            check=True,
            timeout=scaled(60),
            env=_env(),
            capture_output=True,
        )
    with run_server(store) as srv:
        r = _torchrun_train_ddp(srv.http_url)
        if r.returncode != 0 and _TEARDOWN_ABORT in r.stdout + r.stderr and "accuracy" in r.stdout:
            # A gloo rank once aborted in torch's own teardown after its work was done (seen
            # once in CI, not in 30 runs here); training and its result line are what this
            # test is about, so that case alone runs once more.
            r = _torchrun_train_ddp(srv.http_url)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    m = re.search(r"test accuracy ([0-9.]+), loader stall fraction ([0-9.]+)", last)
    assert m, r.stdout
    assert float(m.group(1)) > 0.8, last
    assert 0.0 <= float(m.group(2)) <= 1.0


def test_ranks_agree_on_rank0s_version_across_an_overwrite(tmp_path) -> None:
    """Rank 1 makes its Loader after ``ingest --overwrite`` replaced the dataset (600 samples
    by 500 others) that rank 0's Loader pinned: through the process group it takes rank 0's
    job, so both ranks stream the same version, the same number of batches, and together
    every sample of that version once."""
    store = tmp_path / "store"
    make_cifar_like(store, "versioned", n=600)
    src = tmp_path / "new.npz"
    np.savez(src, image=cifar_images(0, 500, seed=7), label=np.arange(500, dtype=np.int64) % 10)
    port = str(free_port())
    with run_server(store) as srv:
        procs = []
        for rank in range(2):
            env = _env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            cmd = [
                sys.executable,
                str(ROOT / "tests/client/_agree_worker.py"),
                srv.http_url,
                str(store),
                str(src),
                str(tmp_path / f"{rank}.json"),
            ]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            )
        outs = [p.communicate(timeout=scaled(240))[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert r0["job"] == r1["job"]
    assert r0["len"] == r1["len"] == 6 and r0["samples"] == r1["samples"] == 600
    assert r0["old_version"] and r1["old_version"]
    assert sorted(r0["ids"] + r1["ids"]) == list(range(600))
