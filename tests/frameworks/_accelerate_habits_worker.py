"""Accelerate's DataLoader helpers on a shardserve Loader, run by torchrun (or ``python -m``).

- ``skip_first_batches(loader, 3)`` after ``set_epoch(1)``: the rest of epoch 1, from batch 3.
- ``gather_for_metrics`` over an evaluation pass (``shuffle=False``) of the ``eval`` dataset,
  once per ``--eval-batch`` size: the gathered ids and predictions, exactly as many as the
  dataset has samples.

Writes ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches

from shardserve.client import Loader
from tests.support.data import sample_id_of


def ids(batch: dict) -> list[int]:
    return [int(i) for i in sample_id_of({"image": batch["image"].numpy()})]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--eval-batch", type=int, nargs="+", default=[64])
    a = p.parse_args()
    accelerator = Accelerator(cpu=True)
    loader = Loader(a.url, "cifar", 100, seed=3)
    loader.set_epoch(1)
    skipped = skip_first_batches(loader, 3)
    rest = [ids(b) for b in skipped]
    # The Loader itself goes on with epoch 2 afterwards.
    after = [ids(b) for b in loader]
    model = accelerator.prepare(torch.nn.Linear(3 * 32 * 32, 10))
    evals = {
        str(b): evaluate(accelerator, model, Loader(a.url, "eval", b, shuffle=False))
        for b in a.eval_batch
    }
    record = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "habits": [loader.batch_size, loader.drop_last, loader.shuffle, len(loader.dataset)],
        "skipped_len": len(skipped),
        "rest": rest,
        "after": after,
        "evals": evals,
    }
    (Path(a.out) / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    loader.close()
    accelerator.end_training()


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: Loader) -> dict:
    """One evaluation pass of the prepared ``loader`` through ``gather_for_metrics``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluation = accelerator.prepare(loader)
        gathered: list[int] = []
        preds = 0
        with torch.no_grad():
            for batch in evaluation:
                x = batch["image"].flatten(1).float() / 255.0
                got_ids, got_pred = accelerator.gather_for_metrics(
                    (torch.as_tensor(ids(batch)), model(x).argmax(1))
                )
                gathered += got_ids.tolist()
                preds += len(got_pred)
    evaluation.close()
    return {
        "gathered": gathered,
        "preds": preds,
        "eval_len": len(evaluation),
        "eval_samples": len(evaluation.dataset),
        "warnings": [str(w.message) for w in caught],
    }


if __name__ == "__main__":
    main()
