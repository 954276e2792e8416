"""Read one epoch through a ``Loader`` and print what arrived; run inside the trainer container.

    python /probe.py URL DATASET [--batch-size N] [--sleep S] [--timeout S]

tests/ops/test_containers.py mounts this file into ``shardserve-trainer`` and reads its output:
a ``batch I`` line per batch as it arrives (so the test can act mid-epoch), then one JSON line
with every ``idx`` value seen in order and the loader's stats. The client's warnings (the
shared-memory fallback among them) go to stderr.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import sys
import time

from shardserve.client import Loader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url")
    p.add_argument("dataset")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of 'training' per batch")
    # The test's tests.support.slowness is not in the container: the test passes scaled(60).
    p.add_argument("--timeout", type=float, default=60.0, help="the Loader's timeout")
    args = p.parse_args()
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    # Why a stream re-opened, for a test that fails after a restart.
    logging.getLogger("shardserve.client").setLevel(logging.INFO)
    # Where the probe is stuck, should it be: a failing test shows its stderr.
    faulthandler.dump_traceback_later(15, repeat=True)
    seen: list[int] = []
    with Loader(args.url, args.dataset, args.batch_size, seed=7, timeout=args.timeout) as loader:
        loader.set_epoch(0)
        for i, batch in enumerate(loader):
            seen.extend(int(v) for v in batch["idx"].tolist())
            print(f"batch {i}", flush=True)
            time.sleep(args.sleep)
        s = loader.stats()
    report = {
        "seen": seen,
        "transport": s.transport,
        "batches": s.batches,
        "reconnects": s.reconnects,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
