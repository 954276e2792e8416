"""A Lightning training run for the framework tests, run as ``python -m`` in a subprocess.

Trains a linear model on the cifar-like dataset through :class:`ShardserveDataModule` (or a
LightningModule that returns a bare Loader), records the sample ids of every batch each rank
trained on, by epoch, and writes them to ``OUT/rank{r}.json``. Lightning's DDP launcher starts
the other rank by running this same command again.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from shardserve.client import Loader
from shardserve.client.lightning import ShardserveDataModule
from tests.support.data import sample_id_of


class Recorder(LightningModule):
    """A linear classifier that writes down which samples each step saw."""

    def __init__(self, bare_loader: dict | None = None, hook: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * 32 * 32, 10)
        self.seen: dict[int, list[list[int]]] = {}
        self.bare = bare_loader
        self.hook = hook
        self.loader: Loader | None = None

    def train_dataloader(self) -> Loader:
        # Only used with --bare: the plain way, a Loader returned as is.
        assert self.bare is not None
        if self.loader is None:
            self.loader = Loader(**self.bare)
        return self.loader

    def on_train_epoch_start(self) -> None:
        if self.hook:  # the usual DistributedSampler habit
            loader = self.trainer.train_dataloader
            loader.set_epoch(self.current_epoch)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = sample_id_of({"image": batch["image"].numpy(), "label": batch["label"].numpy()})
        self.seen.setdefault(self.current_epoch, []).append([int(i) for i in ids])
        x = batch["image"].flatten(1).float() / 255.0
        return torch.nn.functional.cross_entropy(self.net(x), batch["label"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ValidatingRecorder(Recorder):
    """A Recorder with a validation step (used with ``--val``)."""

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        x = batch["image"].flatten(1).float() / 255.0
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), batch["label"]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--hook", action="store_true", help="call set_epoch in on_train_epoch_start")
    p.add_argument(
        "--bare", action="store_true", help="a Loader from train_dataloader, no DataModule"
    )
    p.add_argument("--val", action="store_true")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--resume", default=None, help="checkpoint to resume from")
    a = p.parse_args()
    out = Path(a.out)
    kwargs = {"url": a.url, "dataset": "cifar", "batch_size": a.batch_size, "seed": a.seed}
    # A model with a validation step only where there is validation data, as users write it.
    kind = ValidatingRecorder if a.val else Recorder
    model = kind(bare_loader=kwargs if a.bare else None, hook=a.hook)
    dm = None
    if not a.bare:
        dm = ShardserveDataModule(
            a.url, "cifar", a.batch_size, val_dataset="cifar" if a.val else None, seed=a.seed
        )
    callbacks = []
    if a.ckpt_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "ckpt",
                every_n_train_steps=a.ckpt_every,
                save_top_k=-1,
                filename="{step}",
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=a.devices,
        strategy="ddp" if a.devices > 1 else "auto",
        max_epochs=a.epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(a.ckpt_every),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    with warnings.catch_warnings(record=True) as caught:  # kept for the record, not printed
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm, ckpt_path=a.resume)
    rank = trainer.global_rank
    loader = trainer.train_dataloader
    record = {
        "rank": rank,
        "world_size": trainer.world_size,
        "seen": model.seen,
        "loader_type": type(loader).__name__,
        "loader_world": [loader.world.rank, loader.world.world_size] if loader else None,
        "pid": os.getpid(),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
