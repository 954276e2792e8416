"""The MosaicML Streaming side of the MDS row in ``bench_ingest_formats.py``, run with the
Python of ``.venv-mds`` (Streaming's pins conflict with the dev extra):

    python bench/mds_side.py write DIR N    # N CIFAR-like samples with MDSWriter
    python bench/mds_side.py read DIR       # one pass of StreamingDataset; prints seconds
    python bench/mds_side.py load DIR W B   # bench_peers' row: shuffled, DataLoader with W
                                            # workers, batch B; prints JSON
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types

import numpy as np

# As in tests/formats/mds_writer.py: streaming's top-level __init__ imports torchvision.
_spec = importlib.util.find_spec("streaming")
assert _spec is not None and _spec.submodule_search_locations is not None
_pkg = types.ModuleType("streaming")
_pkg.__path__ = list(_spec.submodule_search_locations)
sys.modules["streaming"] = _pkg

from streaming.base import MDSWriter, StreamingDataset  # noqa: E402


def write(out: str, n: int) -> None:
    rng = np.random.default_rng(7)
    columns = {"x": "ndarray:uint8:3,32,32", "y": "int"}
    with MDSWriter(out=out, columns=columns, size_limit=64 << 20) as w:
        for i in range(n):
            w.write({"x": rng.integers(0, 256, (3, 32, 32), dtype=np.uint8), "y": i % 10})


def read(out: str) -> float:
    ds = StreamingDataset(local=out, shuffle=False, batch_size=256)
    t0 = time.perf_counter()
    for _ in ds:  # as a training loop reads it
        pass
    return time.perf_counter() - t0


def load(out: str, workers: int, batch: int) -> dict[str, object]:
    """As ``bench_peers.measure`` does: epoch 0 warms up, epoch 1 is timed."""
    from torch.utils.data import DataLoader

    ds = StreamingDataset(local=out, shuffle=True, shuffle_seed=0, batch_size=batch)
    dl = DataLoader(ds, batch_size=batch, num_workers=workers)
    for _ in dl:
        pass
    t0 = time.perf_counter()
    first, seen = float("nan"), 0
    for b in dl:
        if seen == 0:
            first = time.perf_counter() - t0
        seen += len(b["y"])
    wall = time.perf_counter() - t0
    return {
        "row": {"samples_s": seen / wall, "first_batch_s": first, "epoch_s": wall},
        "samples": seen,
    }


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "load":
        print(json.dumps(load(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        print(read(sys.argv[2]))
