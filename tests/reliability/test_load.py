"""Load, CI size: 32 streams (8 jobs x 4 ranks, 2 datasets) from one client process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.loadgen import create_jobs, run_load
from tests.support.server import run_server

JOBS = 8
RANKS = 4
SECONDS = 4.0
RSS_GROWTH_LIMIT = 200 << 20


@pytest.mark.slow
def test_32_streams_all_progress_fairly_with_flat_memory(rel_store: Path, tmp_path: Path) -> None:
    """32 concurrent streams for a bounded time: every stream progresses with no protocol error, the slowest gets >= 1/3 of the mean rate, server RSS grows < 200 MB over its idle baseline."""
    with run_server(rel_store, "--state-dir", str(tmp_path / "state")) as srv:
        specs = [
            {"dataset": ("cifar", "other")[j % 2], "batch_size": 16, "seed": j, "world_size": RANKS}
            for j in range(JOBS)
        ]
        jobs = create_jobs(srv, specs)
        res = run_load(srv, [(j, RANKS) for j in jobs], seconds=SECONDS, credit=4, warmup_s=1.0)
        summary = res.summary()
        print("\nload:", json.dumps(summary))
        assert res.streams == JOBS * RANKS
        assert not res.errors, res.errors[:5]
        assert min(res.rates) > 0, "a stream made no progress"
        assert res.fairness >= 1 / 3, summary
        assert res.rss_end - res.rss_idle < RSS_GROWTH_LIMIT, summary
        assert srv.proc.poll() is None
