"""Plans are the same in any process: no hash(), no global RNG state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from shardserve.server.planning import plan
from tests.support.slowness import scaled

CASES = [
    # n, seed, epoch, ws, rank, bs, shuffle, drop_last, shard_rows, window
    (1000, 0, 0, 3, 1, 32, "global", False, None, 4),
    (300_000, 2**40 + 7, 3, 2, 0, 4096, "global", True, None, 4),
    (777, 5, 9, 4, 3, 10, "block", False, [100, 0, 250, 27, 400], 2),
    (200_000, 11, 1, 1, 0, 1000, "block", False, None, 1),
    (50, 1, 1, 8, 7, 3, "none", False, None, 4),
]

SCRIPT = """
import json, sys
import numpy as np
from shardserve.server.planning import plan
out = [np.concatenate([np.zeros(0, np.int64), *plan(*case)]).tolist()
       for case in json.loads(sys.argv[1])]
json.dump(out, sys.stdout)
"""


def in_subprocess(hash_seed: str) -> list[list[int]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=scaled(100),
    )
    return json.loads(done.stdout)


def test_same_plan_in_other_processes() -> None:
    """Two fresh interpreters with different hash seeds plan exactly what this process plans."""
    here = [
        np.concatenate([np.zeros(0, np.int64), *plan(*case)]).tolist()  # type: ignore[arg-type]
        for case in CASES
    ]
    assert in_subprocess("1") == here
    assert in_subprocess("2") == here
