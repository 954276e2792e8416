"""Random ``kill -9`` over several epochs: a real server is SIGKILLed at random
points while two ranks stream, restarted on the same ports and state dir, and the Loaders
resume by themselves; every (epoch, rank) still gets exactly its plan: 0 lost, 0 duplicated.

The kill points are drawn from a seeded generator (``SHARDSERVE_KILL_SEED`` picks another
run), each a random batch of the run plus a random delay of up to 50 ms, so a kill lands
mid-prefetch, mid-send or between epochs rather than only at quiet moments.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from shardserve.client import Loader
from tests.reliability.conftest import CIFAR_N
from tests.reliability.test_restart import BATCH, _ids, _plan_ids, _Restarter
from tests.support.slowness import scaled

EPOCHS = 3
WORLD = 2
KILLS = 4
SEED = int(os.environ.get("SHARDSERVE_KILL_SEED", "20"))


class _Killer(threading.Thread):
    """Waits for the consumer to reach each drawn step, then kills and restarts the server."""

    def __init__(self, r: _Restarter, steps: list[int], delays: list[float]) -> None:
        super().__init__(name="kill9", daemon=True)
        self.r, self.targets = r, list(zip(steps, delays, strict=True))
        self.step = 0
        self.kills = 0
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            for target, delay in self.targets:
                deadline = time.monotonic() + scaled(120)
                while self.step < target:
                    if self.done.is_set():
                        return  # the consumer failed: stop killing
                    if time.monotonic() > deadline:
                        raise AssertionError(f"consumer did not reach step {target} in 120 s")
                    time.sleep(0.002)  # polling the consumer's progress with a deadline
                time.sleep(delay)
                self.r.crash_and_restart()
                self.kills += 1
        except BaseException as e:  # reported by the test thread
            self.error = e


def test_random_kill9_over_epochs_loses_and_duplicates_nothing(
    rel_store: Path, tmp_path: Path
) -> None:
    """SIGKILL at random points over 3 epochs x 2 ranks: each (epoch, rank) equals its plan."""
    rng = np.random.default_rng(SEED)
    with _Restarter(rel_store, tmp_path) as r:
        srv = r.start()
        loaders = [
            Loader(
                srv.http_url,
                "cifar",
                batch_size=BATCH,
                seed=SEED,
                rank=k,
                world_size=WORLD,
                prefetch=2,
                timeout=scaled(30.0),
            )
            for k in range(WORLD)
        ]
        per_epoch = len(loaders[0])
        total = EPOCHS * per_epoch
        # Not in the last steps: the consumer's 20 ms "compute" per step leaves the kill (up
        # to 50 ms after its step) time to land while the run still streams.
        steps = sorted(rng.choice(np.arange(1, total - 3), size=KILLS, replace=False).tolist())
        killer = _Killer(r, steps, rng.uniform(0.0, 0.05, size=KILLS).tolist())
        seen: dict[tuple[int, int], list[int]] = {}
        killer.start()
        try:
            for epoch in range(EPOCHS):
                for ld in loaders:
                    ld.set_epoch(epoch)
                its = [iter(ld) for ld in loaders]
                for _ in range(per_epoch):
                    for k, it in enumerate(its):
                        seen.setdefault((epoch, k), []).extend(_ids(next(it)))
                    killer.step += 1
                    time.sleep(0.02)  # the training step
                for it in its:
                    assert next(it, None) is None, "an epoch ran past its plan"
            killer.join(timeout=scaled(60))
        finally:
            killer.done.set()
            for ld in loaders:
                ld.close()
        assert killer.error is None, f"seed {SEED}: {killer.error!r}"
        assert killer.kills == KILLS, f"seed {SEED}: {killer.kills} kills of {KILLS} ({steps})"
    for (epoch, k), ids in sorted(seen.items()):
        counts = Counter(ids)
        dup = sorted(i for i, c in counts.items() if c > 1)
        want = _plan_ids(rel_store, seed=SEED, epoch=epoch, world_size=WORLD, rank=k)
        lost = sorted(set(want) - set(ids))
        assert not dup and not lost, (
            f"seed {SEED} epoch {epoch} rank {k}: lost {lost[:10]}, duplicated {dup[:10]} (kills at steps {steps})"
        )
        assert ids == want, f"seed {SEED} epoch {epoch} rank {k}: order differs from the plan"
    for epoch in range(EPOCHS):
        union = sorted(i for k in range(WORLD) for i in seen[(epoch, k)])
        assert union == list(range(CIFAR_N)), (
            f"seed {SEED} epoch {epoch}: union is not every sample"
        )
