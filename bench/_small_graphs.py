"""The ``graphs`` and ``crystals`` rows of ``bench_small.py``: ``Loader(collate="graph")``
against a ``DataLoader`` over the same graphs held in a list and collated like PyG (and, for the
crystals, PyG itself and the per-file ``.pt`` loader CHGNet users run).

::

    rows = bench_graphs(url, store, ["graphs2", "graphs15"], 20_000)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _loops import Step, loader_epochs, measure, server_pid
from _small_data import crystals, graphs
from torch.utils.data import DataLoader

from shardserve.client import Loader

GRAPH_BATCH = 64
#: CHGNet's fields do not say which counts the nodes (atom_fea and bond_fea look alike).
CRYSTAL_COLLATE = {"graph": {"node_field": "atom_fea"}}


def collate_like_pyg(
    items: list[dict[str, torch.Tensor]], node_field: str
) -> dict[str, torch.Tensor]:
    """PyG's ``Batch.from_data_list`` in torch: ``edge_index`` shifted by the nodes (rows of
    ``node_field``) before each graph and joined along its last dim, scalars stacked, every
    other field joined along its first; ``batch`` and ``ptr`` added."""
    counts = torch.tensor([g[node_field].shape[0] for g in items])
    ptr = torch.zeros(len(items) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=ptr[1:])
    out = {
        k: torch.cat([g[k] + int(o) for g, o in zip(items, ptr[:-1], strict=True)], 1)
        if k == "edge_index"
        else torch.stack([g[k] for g in items])
        if v.dim() == 0
        else torch.cat([g[k] for g in items])
        for k, v in items[0].items()
    }
    return {**out, "batch": torch.repeat_interleave(torch.arange(len(items)), counts), "ptr": ptr}


def bench_graphs(url: str, store: Path, names: list[str], n: int) -> dict[str, dict[str, float]]:
    held = [{k: torch.from_numpy(np.asarray(v)) for k, v in g.items()} for g in graphs(n)]
    dl: DataLoader[dict[str, torch.Tensor]] = DataLoader(
        held,  # type: ignore[arg-type]  # a list is a map-style dataset
        batch_size=GRAPH_BATCH,
        shuffle=True,
        num_workers=0,
        collate_fn=partial(collate_like_pyg, node_field="x"),
    )
    rows = {"DataLoader(list in RAM, workers 0)": measure(shuffled(dl), GRAPH_BATCH)}
    pid = server_pid(store)
    for name in names:
        with Loader(url, name, GRAPH_BATCH, collate="graph", seed=0, rank=0, world_size=1) as ld:
            rows[f"shardserve Loader(collate='graph'), {name}"] = measure(
                loader_epochs(ld), GRAPH_BATCH, pid, loader=ld
            )
    return rows


def shuffled(dl: DataLoader[Any]) -> Callable[[int], Iterable[Step]]:
    """A shuffling DataLoader's epochs: epoch ``e`` draws its order from torch seeded with
    ``e``."""

    def epoch(e: int) -> Iterable[Step]:
        torch.manual_seed(e)
        return dl

    return epoch


class CrystalFiles(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """One ``.pt`` dict per graph, as CHGNet users keep them."""

    def __init__(self, files: Path) -> None:
        self.paths = sorted(files.iterdir())

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = torch.load(self.paths[i], weights_only=True)
        return out


def bench_crystals(url: str, store: Path, files: Path, n: int) -> dict[str, dict[str, float]]:
    held = [{k: torch.from_numpy(np.asarray(v)) for k, v in g.items()} for g in crystals(n)]

    def loader(
        data: Any, workers: int, collate: Callable[..., Any]
    ) -> Callable[[int], Iterable[Step]]:
        return shuffled(
            DataLoader(
                data,
                batch_size=GRAPH_BATCH,
                shuffle=True,
                num_workers=workers,
                collate_fn=collate,
                persistent_workers=workers > 0,
            )
        )

    rows = {
        "DataLoader(list in RAM, workers 0)": measure(
            loader(held, 0, partial(collate_like_pyg, node_field="atom_fea")), GRAPH_BATCH
        )
    }
    try:
        from torch_geometric.data import Batch, Data
    except ImportError:
        print("  PyG row: torch_geometric is not installed")
    else:
        pyg = [Data(num_nodes=g["atom_fea"].shape[0], **g) for g in held]
        rows["PyG Batch.from_data_list (list in RAM, workers 0)"] = measure(
            loader(pyg, 0, Batch.from_data_list), GRAPH_BATCH
        )
    for workers in (0, 2):
        rows[f"DataLoader(per-file .pt, workers {workers})"] = measure(
            loader(CrystalFiles(files), workers, partial(collate_like_pyg, node_field="atom_fea")),
            GRAPH_BATCH,
            repeats=1,
        )
    with Loader(
        url, "crystals", GRAPH_BATCH, collate=CRYSTAL_COLLATE, seed=0, rank=0, world_size=1
    ) as ld:
        rows["shardserve Loader(collate=graph, node_field)"] = measure(
            loader_epochs(ld), GRAPH_BATCH, server_pid(store), loader=ld
        )
    return rows
