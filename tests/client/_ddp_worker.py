"""One rank of the two-process test: join a gloo group, read one epoch, write its sample ids.

Run by test_distributed.py as ``python tests/client/_ddp_worker.py URL OUT`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from shardserve.client import Loader


def main() -> None:
    url, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    with Loader(
        url, "cifar", 64, seed=5, drop_last=False
    ) as loader:  # rank/world from torch.distributed
        loader.set_epoch(1)
        batches = []
        for b in loader:
            head = np.ascontiguousarray(b["image"].numpy().reshape(len(b["image"]), -1)[:, :4])
            batches.append(head.view("<u4").reshape(-1).tolist())
        info = {
            "rank": loader.world.rank,
            "world_size": loader.world.world_size,
            "len": len(loader),
            "batches": batches,
        }
    dist.barrier()
    dist.destroy_process_group()
    out.write_text(json.dumps(info))


if __name__ == "__main__":
    main()
