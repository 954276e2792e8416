"""An Accelerate training loop for the framework tests, run as ``python -m`` (or by torchrun).

``accelerator.prepare`` returns a shardserve Loader unchanged (it only wraps DataLoaders): the
Loader already takes its rank from ``torch.distributed`` and its device from the argument.
The Loader is registered for checkpointing, saved mid-epoch with ``save_state`` and restored
into a fresh Loader with ``load_state``. Writes ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
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
    a = p.parse_args()
    out = Path(a.out)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3 * 32 * 32, 10)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = Loader(a.url, "cifar", 100, seed=3, device=accelerator.device)
    model, opt, prepared = accelerator.prepare(model, opt, loader)
    accelerator.register_for_checkpointing(prepared)
    seen: dict[int, list[list[int]]] = {}
    losses = []
    for epoch in range(2):
        prepared.set_epoch(epoch)
        for step, batch in enumerate(prepared):
            seen.setdefault(epoch, []).append(ids(batch))
            x = batch["image"].flatten(1).float() / 255.0
            loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            if epoch == 1 and step == 1:
                accelerator.save_state(str(out / "state"))
    # A fresh Loader restored from the mid-epoch state yields the rest of epoch 1.
    restorer = Accelerator(cpu=True)
    again = restorer.prepare(Loader(a.url, "cifar", 100, seed=3))
    restorer.register_for_checkpointing(again)
    restorer.load_state(str(out / "state"))
    rest = [ids(b) for b in again]
    record = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "same_object": prepared is loader,
        "loader_world": [loader.world.rank, loader.world.world_size],
        "seen": seen,
        "rest": rest,
        "steps": len(losses),
        "weights_moved": float(
            (accelerator.unwrap_model(model).weight.detach() - before).abs().sum()
        ),
    }
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    loader.close()
    again.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
