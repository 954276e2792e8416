"""Train the digits CNN with PyTorch Lightning; batches come from shardserve.

    python examples/prepare_digits.py /tmp/digits-train.npz /tmp/digits-test.npz
    shardserve ingest /tmp/digits-train.npz --store store --name digits-train
    shardserve ingest /tmp/digits-test.npz  --store store --name digits-test
    shardserve serve --store store --http 127.0.0.1:7070 &
    python examples/train_lightning.py --url http://127.0.0.1:7070                  # 1 device
    python examples/train_lightning.py --url http://127.0.0.1:7070 --devices 2      # DDP (gloo on CPU)

``ShardserveDataModule`` builds each rank's Loader inside ``train_dataloader()``, after
Lightning started the process group, so every rank streams its own part of each epoch.
Lightning passes the Loader through as it is (no ``DistributedSampler``), and checkpoints
hold its position: ``--resume CKPT`` continues mid-epoch at the next batch. Prints the
held-out accuracy on rank 0. Needs ``pip install 'shardserve[lightning]'``.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from shardserve.client.lightning import ShardserveDataModule


class DigitsCNN(LightningModule):
    """The same small CNN as examples/train.py, as a LightningModule."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch["image"]), batch["label"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        acc = (self.net(batch["image"]).argmax(1) == batch["label"]).float().mean()
        self.log("val_acc", acc, sync_dist=True, batch_size=len(batch["label"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", required=True)
    p.add_argument("--dataset", default="digits-train")
    p.add_argument("--test-dataset", default="digits-test")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--ckpt-dir", default=None, help="save a checkpoint every --ckpt-every steps")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--resume", default=None, help="a checkpoint to continue from")
    args = p.parse_args()

    torch.manual_seed(0)
    data = ShardserveDataModule(
        args.url, args.dataset, args.batch_size, val_dataset=args.test_dataset, seed=0
    )
    callbacks: list[Callback] = []
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1)
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsCNN(), datamodule=data, ckpt_path=args.resume)
    if trainer.is_global_zero:
        acc = float(trainer.callback_metrics["val_acc"])
        print(
            f"val accuracy {acc:.3f} after {trainer.current_epoch} epochs on {args.devices} device(s)"
        )


if __name__ == "__main__":
    main()
