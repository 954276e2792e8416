"""Train a small CNN on the digits through a shardserve ``Loader`` (one process).

    python examples/prepare_digits.py /tmp/digits-train.npz /tmp/digits-test.npz
    shardserve ingest /tmp/digits-train.npz --store store --name digits-train
    shardserve ingest /tmp/digits-test.npz  --store store --name digits-test
    shardserve serve --store store --http 127.0.0.1:7070 &
    python examples/train.py --url http://127.0.0.1:7070

Prints the loss of every epoch, then test accuracy and the loader's data-stall fraction.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from shardserve.client import Loader


def make_model() -> nn.Module:
    return nn.Sequential(
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


@torch.no_grad()
def evaluate(model: nn.Module, loader: Loader) -> float:
    model.eval()
    correct = total = 0
    for batch in loader:
        correct += int((model(batch["image"]).argmax(1) == batch["label"]).sum())
        total += len(batch["label"])
    model.train()
    return correct / max(1, total)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", required=True)
    p.add_argument("--dataset", default="digits-train")
    p.add_argument("--test-dataset", default="digits-test")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    with (
        Loader(args.url, args.dataset, args.batch_size, seed=0) as train,
        Loader(args.url, args.test_dataset, 256, shuffle=False, rank=0, world_size=1) as test,
    ):
        for epoch in range(args.epochs):
            train.set_epoch(epoch)
            total = 0.0
            for batch in train:
                loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach())
            print(f"epoch {epoch}: loss {total / len(train):.4f}")
        acc = evaluate(model, test)
        s = train.stats()
        print(
            f"test accuracy {acc:.3f}; stall fraction {s.stall_fraction:.3f} "
            f"({s.batches} batches over {s.transport}, first batch after {s.first_batch_s or 0:.3f} s)"
        )


if __name__ == "__main__":
    main()
