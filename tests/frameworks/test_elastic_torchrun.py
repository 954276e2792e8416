"""torchrun: a checkpoint of 3 ranks (Accelerate's, rank 0's Loader state only) resumes on 2."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from shardserve.server.planning import plan
from tests.frameworks.conftest import N_SAMPLES
from tests.support.server import free_port
from tests.support.slowness import scaled

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(n: int, url: str, out: Path, phase: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(n),
        "--master_port",
        str(free_port()),
        "-m",
        "tests.frameworks._elastic_worker",
        "--url",
        url,
        "--out",
        str(out),
        "--phase",
        phase,
        "--k",
        "2",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [json.loads((out / f"{phase}{rank}.json").read_text()) for rank in range(n)]


@pytest.mark.slow
def test_torchrun_two_ranks_resume_a_three_rank_checkpoint(server, tmp_path: Path) -> None:
    saved = _torchrun(3, server.http_url, tmp_path, "save")
    assert [s["world"] for s in saved] == [[0, 3], [1, 3], [2, 3]]
    assert {s["state"]["position"] for s in saved} == {2 * 10 * 3}
    resumed = _torchrun(2, server.http_url, tmp_path, "resume")
    assert [s["world"] for s in resumed] == [[0, 2], [1, 2]]
    # Each rank got the pure planner's deal of the rest (position 60) over 2 ranks...
    for rank, rec in enumerate(resumed):
        want = plan(N_SAMPLES, 7, 1, 2, rank, 10, "global", position=60)
        assert rec["batches"] == [[int(i) for i in b] for b in want]
    # ...so the epoch is every sample exactly once, in equal batches per rank.
    assert len({len(rec["batches"]) for rec in resumed}) == 1
    seen = Counter(i for rec in saved + resumed for b in rec["batches"] for i in b)
    assert set(seen) == set(range(N_SAMPLES)) and max(seen.values()) == 1
    status = httpx.get(f"{server.http_url}/v1/jobs/{resumed[0]['job']}", timeout=scaled(10)).json()
    assert status["resumed_from"] == saved[0]["job"]
