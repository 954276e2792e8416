"""Train the digits CNN with DistributedDataParallel; each rank reads through its own Loader.

    torchrun --nproc_per_node 2 examples/train_ddp.py --url http://127.0.0.1:7070

gloo on CPU, nccl when CUDA is there. Rank and world size reach the Loader from
``torch.distributed``; all ranks post the same job and get disjoint, equal-sized shares of
every epoch. Rank 0 evaluates on the held-out split and prints the final line:
accuracy and the loader's stall fraction.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", required=True)
    p.add_argument("--dataset", default="digits-train")
    p.add_argument("--test-dataset", default="digits-test")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
    model = DistributedDataParallel(
        make_model().to(device), device_ids=[device.index] if cuda else None
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    with Loader(args.url, args.dataset, args.batch_size, seed=0, device=device) as loader:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            total = torch.zeros((), device=device)
            for batch in loader:
                loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.detach()
            dist.all_reduce(total)
            if rank == 0:
                print(
                    f"epoch {epoch}: loss {float(total) / len(loader) / dist.get_world_size():.4f}",
                    flush=True,
                )
        stall = torch.tensor([loader.stats().stall_fraction], device=device)
    dist.all_reduce(stall)
    stall /= dist.get_world_size()

    if rank == 0:
        correct = total_n = 0
        net = model.module.eval()
        with (
            torch.no_grad(),
            Loader(
                args.url, args.test_dataset, 256, shuffle=False, rank=0, world_size=1, device=device
            ) as test,
        ):
            for batch in test:
                correct += int((net(batch["image"]).argmax(1) == batch["label"]).sum())
                total_n += len(batch["label"])
        print(
            f"rank 0 of {dist.get_world_size()}: test accuracy {correct / max(1, total_n):.3f}, "
            f"loader stall fraction {float(stall):.3f}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
