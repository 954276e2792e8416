"""Elastic resume under torchrun with Accelerate, for the framework tests (``python -m``).

``--phase save``: every rank takes ``--k`` batches of epoch 1, then ``save_state`` checkpoints
the registered Loader (Accelerate writes rank 0's state only). ``--phase resume`` (another
number of processes): ``load_state`` restores that checkpoint into each rank's fresh Loader,
which yields the rest of the epoch dealt over the new world size. Each rank writes the ids
it received to ``OUT/{phase}{rank}.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from accelerate import Accelerator

from shardserve.client import Loader
from tests.support.data import sample_id_of


def ids(batch: dict) -> list[int]:
    got = sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()})
    return [int(i) for i in got]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=["save", "resume"], required=True)
    p.add_argument("--k", type=int, default=2)
    a = p.parse_args()
    out = Path(a.out)
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(Loader(a.url, "cifar", 10, seed=7))
    accelerator.register_for_checkpointing(loader)
    rank = accelerator.process_index
    if a.phase == "save":
        loader.set_epoch(1)
        got = [ids(b) for b in itertools.islice(iter(loader), a.k)]
        accelerator.save_state(str(out / "ckpt"))
    else:
        accelerator.load_state(str(out / "ckpt"))
        got = [ids(b) for b in loader]
    record = {
        "world": [loader.world.rank, loader.world.world_size],
        "batches": got,
        "job": loader.job_id,
        "state": loader.state_dict(),
    }
    (out / f"{a.phase}{rank}.json").write_text(json.dumps(record))
    loader.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
