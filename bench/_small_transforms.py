"""The ``upt`` and ``shogi`` rows of ``bench_small.py``: a server transform (``random_subset``,
``unpack_bits``), on the server's threads and in its process pool, against the trainer doing
the same work in its own loop over the samples held in RAM.

::

    rows = bench_shogi(url, pool_url, store, make_shogi(store, 100_000))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _loops import Contender, Step, loader_epochs, measure, measure_together, server_pid
from _small_data import SHOGI_PLANES, upt

from shardserve.client import Loader

SHOGI_BATCH = 256
SHOGI_FEATURIZE = [
    {
        "name": "unpack_bits",
        "params": {
            "field": "packed",
            "shape": list(SHOGI_PLANES),
            "dtype": "float32",
            "to": "planes",
        },
    }
]
UPT_QUERIES, UPT_BATCH = 512, 16
UPT_REPEATS = 7
UPT_SUBSET = [{"name": "random_subset", "params": {"field": "points", "n": UPT_QUERIES}}]


def upt_batch(items: list[dict[str, Any]], rng: np.random.Generator) -> Step:
    """What the trainer does without the sidecar: sample each cloud's queries itself, stack
    them, and collate the masked fields by hand."""
    pts = [s["points"][rng.choice(len(s["points"]), UPT_QUERIES, replace=False)] for s in items]
    mask = torch.tensor([s["params"] is not None for s in items])
    params = torch.stack(
        [
            torch.from_numpy(s["params"]) if s["params"] is not None else torch.zeros(4)
            for s in items
        ]
    )
    bcs = [
        torch.from_numpy(s["bc"]) if s["bc"] is not None else torch.zeros(0, dtype=torch.int32)
        for s in items
    ]
    return {
        "points": torch.from_numpy(np.stack(pts)),
        "params": params,
        "mask": mask,
        "bc": torch.cat(bcs),
    }


def bench_upt(url: str, purl: str, store: Path, n: int) -> dict[str, dict[str, float]]:
    held = list(upt(n))

    def trainer(e: int) -> Iterator[Step]:
        rng = np.random.default_rng(e)
        order = rng.permutation(n)
        for i in range(0, n - UPT_BATCH + 1, UPT_BATCH):
            yield upt_batch([held[j] for j in order[i : i + UPT_BATCH]], rng)

    contenders = {"trainer samples its queries (RAM)": Contender(trainer, UPT_BATCH)}
    with contextlib.ExitStack() as open_loaders:
        for where, label in ((url, ""), (purl, ", process pool")):
            ld = open_loaders.enter_context(
                Loader(
                    where,
                    "upt",
                    UPT_BATCH,
                    transforms=UPT_SUBSET,
                    seed=0,
                    rank=0,
                    world_size=1,
                    drop_last=True,
                )
            )

            def epoch(e: int, ld: Loader = ld) -> Iterable[Step]:
                ld.set_epoch(e)
                # Masked fields come as Masked(values, mask): touch their tensors.
                return (
                    {"points": b["points"], "params": b["params"].values, "mask": b["params"].mask}
                    for b in ld
                )

            contenders[f"shardserve Loader(transforms=[random_subset]){label}"] = Contender(
                epoch, UPT_BATCH, server_pid(store, where == purl), ld
            )
        # Short epochs (about a quarter second): more of them, taken in turn.
        return measure_together(contenders, repeats=UPT_REPEATS)


def bench_shogi(
    url: str, purl: str, store: Path, arrays: dict[str, np.ndarray]
) -> dict[str, dict[str, float]]:
    """The trainer featurizing in its own main thread (gather the records, unpack the bits to
    float32 planes) against the same featurizing as a server transform (data only)."""
    n = len(arrays["move"])
    packed, move, result = arrays["packed"], arrays["move"], arrays["result"]
    bits = int(np.prod(SHOGI_PLANES))

    def trainer(e: int) -> Iterator[Step]:
        order = np.random.default_rng(e).permutation(n)
        for i in range(0, n - SHOGI_BATCH + 1, SHOGI_BATCH):
            idx = order[i : i + SHOGI_BATCH]
            planes = np.unpackbits(packed[idx], axis=1, count=bits).reshape(-1, *SHOGI_PLANES)
            yield {
                "planes": torch.from_numpy(planes.astype(np.float32)),
                "move": torch.from_numpy(move[idx]),
                "result": torch.from_numpy(result[idx]),
            }

    rows = {"trainer featurizes in its main thread (RAM)": measure(trainer, SHOGI_BATCH)}
    for where, label in ((url, ""), (purl, ", process pool")):
        with Loader(
            where,
            "shogi",
            SHOGI_BATCH,
            transforms=SHOGI_FEATURIZE,
            seed=0,
            rank=0,
            world_size=1,
            drop_last=True,
        ) as ld:
            rows[f"shardserve Loader(transforms=[unpack_bits]){label}"] = measure(
                loader_epochs(ld), SHOGI_BATCH, server_pid(store, where == purl), loader=ld
            )
    return rows
