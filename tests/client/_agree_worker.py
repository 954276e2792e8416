"""One rank of the version-agreement test: rank 1 replaces the dataset (``ingest
--overwrite``) after rank 0's Loader made its job and before its own Loader is made.

Run by test_distributed.py as ``python tests/client/_agree_worker.py URL STORE SRC OUT`` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; SRC is the new version's ``.npz``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch.distributed as dist

from shardserve.client import Loader
from tests.support.data import cifar_images, sample_id_of

SEED = 9


def wait_for_rank0_job(url: str, timeout: float = 120.0) -> None:
    """Until the server lists a job of ``versioned`` with our seed (rank 0's, posted)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = httpx.get(f"{url}/v1/jobs", timeout=10).json()
        if any(j["spec"]["dataset"] == "versioned" and j["spec"]["seed"] == SEED for j in jobs):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no job of 'versioned' on {url} after {timeout} s")


def main() -> None:
    url, store, src, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        wait_for_rank0_job(url)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shardserve.server",
                "ingest",
                src,
                "--store",
                store,
                "--name",
                "versioned",
                "--overwrite",
                "--quiet",
            ],
            check=True,
            timeout=120,
            capture_output=True,
        )
    with Loader(url, "versioned", 50, seed=SEED, timeout=60) as loader:
        old = cifar_images(0, 600)
        ids, same = [], True
        for b in loader:
            got = b["image"].numpy()
            batch_ids = sample_id_of({"image": got})
            same = same and all(np.array_equal(got[j], old[i]) for j, i in enumerate(batch_ids))
            ids += [int(i) for i in batch_ids]
        info = {
            "rank": rank,
            "job": loader.job_id,
            "len": len(loader),
            "samples": len(loader.dataset),
            "ids": ids,
            "old_version": same,
        }
    dist.barrier()
    dist.destroy_process_group()
    out.write_text(json.dumps(info))


if __name__ == "__main__":
    main()
