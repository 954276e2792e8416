"""Epochs are the trainer's: a run's batches depend on its script, never on the server's history."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardserve.client import Loader
from shardserve.server.planning import plan
from tests.client.conftest import N_CIFAR, ids
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]

# A training script that never calls set_epoch: two epochs, then a state taken mid-epoch.
SCRIPT = """
import json, sys
from shardserve.client import Loader
from tests.client.conftest import ids
with Loader(sys.argv[1], "cifar", 200, seed=21, rank=0, world_size=1) as loader:
    epochs = [[ids(b) for b in loader] for _ in range(2)]
    it = iter(loader)
    epochs.append([ids(next(it))])
    print(json.dumps({"epochs": epochs, "state": loader.state_dict()}))
"""


def _want(seed: int, epoch: int, batch_size: int) -> list[tuple[int, ...]]:
    p = plan(N_CIFAR, seed=seed, epoch=epoch, world_size=1, rank=0, batch_size=batch_size)
    return [tuple(int(i) for i in b) for b in p]


def test_two_fresh_runs_of_one_script_see_the_same_batches(server) -> None:
    """Run twice against one live server, a script without set_epoch streams epochs 0, 1, 2 both times."""
    runs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, server.http_url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=scaled(90),
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first == second
    got = [[tuple(b) for b in e] for e in first["epochs"]]
    assert got[0] == _want(21, 0, 200) and got[1] == _want(21, 1, 200)
    assert got[2] == _want(21, 2, 200)[:1]
    assert (first["state"]["epoch"], first["state"]["next_batch"]) == (2, 1)


def test_an_iter_that_yields_nothing_does_not_move_the_epoch(server) -> None:
    """iter() dropped unused (Lightning's iterable check) leaves the loop at epoch 0; a pass
    abandoned after yielding moves it on; set_epoch after iter() still chooses the next pass."""
    with Loader(server.http_url, "cifar", 250, seed=4, rank=0, world_size=1) as loader:
        iter(loader)
        iter(loader)
        assert loader.state_dict()["epoch"] == 0
        assert [ids(b) for b in loader] == _want(4, 0, 250)
        it = iter(loader)
        assert ids(next(it)) == _want(4, 1, 250)[0]
        del it
        assert [ids(b) for b in loader] == _want(4, 2, 250)  # epoch 1 was abandoned
        loader.set_epoch(0)
        assert [ids(b) for b in loader] == _want(4, 0, 250)


def test_state_at_an_epochs_last_batch_is_the_next_epochs_start(server) -> None:
    """After the last batch is received (before the loop asks again) the state is (epoch + 1, 0)."""
    with Loader(server.http_url, "cifar", 250, seed=4, rank=0, world_size=1) as loader:
        loader.set_epoch(6)
        it = iter(loader)
        for _ in range(len(loader) - 1):
            next(it)
        assert (loader.state_dict()["epoch"], loader.state_dict()["next_batch"]) == (6, 3)
        next(it)
        assert (loader.state_dict()["epoch"], loader.state_dict()["next_batch"]) == (7, 0)
        assert [ids(b) for b in loader] == _want(4, 7, 250)
