"""A learning-rate sweep whose trials share one pass of the server (the "Sweeps and notebooks"
guide), run by tests/docs/test_docs.py.

python examples/sweep.py http://127.0.0.1:7070 digits-train
"""

import sys
from concurrent.futures import ProcessPoolExecutor

import torch
from torch import nn

from shardserve.client import Loader

URL, DATASET = sys.argv[1], sys.argv[2]
AUGMENT = [{"name": "random_crop", "params": {"size": 8, "padding": 1, "layout": "CHW"}}]


def trial(lr: float) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    # Same arguments and share name in every trial: one pass, the same batches for each.
    loader = Loader(URL, DATASET, batch_size=64, seed=0, transforms=AUGMENT, share="lr-sweep")
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    stats = loader.stats()
    loader.close()
    return f"lr {lr}: loss {loss.item():.3f}, {stats.batches} batches, detached {stats.detached}"


if __name__ == "__main__":
    learning_rates = [0.03, 0.1, 0.3]
    with ProcessPoolExecutor(len(learning_rates)) as trials:
        for line in trials.map(trial, learning_rates):
            print(line)
