"""`shardserve demo` on a fresh store, end to end."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_trains_and_compares_with_dataloader(tmp_path) -> None:
    """The demo ingests, serves, trains through the Loader and a DataLoader, prints both rows, exits 0."""
    store = tmp_path / "store"
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "demo",
        "--epochs",
        "2",
        "--store",
        str(store),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ours = re.search(r"shardserve Loader\s+([0-9.]+)\s+([0-9]+)\s+([0-9.]+)", r.stdout)
    theirs = re.search(r"DataLoader \(workers=0\)\s+([0-9.]+)\s+([0-9]+)\s+([0-9.]+)", r.stdout)
    assert ours and theirs, r.stdout
    assert float(ours.group(1)) > 0.7 and int(ours.group(2)) > 0
    assert (store / "digits-train" / "manifest.json").exists()
