"""The 15-line training loop of the docs' Getting started, run by tests/docs/test_docs.py.

python examples/quickstart.py http://127.0.0.1:7070 digits-train
"""

import sys

import torch
from torch import nn

from shardserve.client import Loader

url, dataset = sys.argv[1], sys.argv[2]
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = Loader(url, dataset=dataset, batch_size=64, seed=0, timeout=60.0)
for epoch in range(2):
    loader.set_epoch(epoch)  # a new shuffle each epoch, the same on every run
    for batch in loader:  # dict[str, torch.Tensor], already collated
        loss = nn.functional.cross_entropy(model(batch["image"].float()), batch["label"].long())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"epoch {epoch}: loss {loss.item():.3f}; {loader.stats()}")
loader.close()
