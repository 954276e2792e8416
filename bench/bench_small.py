"""Small batches, many environments and graphs (issue 22): shardserve against in-process loops.

    python bench/bench_small.py [--quick] [--workdir DIR]

One run, ratios within it (the machine is shared and noisy: compare rows of one run only):

* ``envs``: a PPO-like step of 4 environments x 32 CIFAR-like samples, each environment
  from its own shuffle (and, in ``envs split``, the seed's semantics: one shuffle dealt
  across the 4, ``env_shuffle="split"``), against the per-sample ``select``/``stack`` loop over tensors held in
  RAM (what the user wanted gone) and an in-process ``index_select`` per environment (the
  floor). shardserve rows: ``Loader(envs=4)`` streaming, resident (``resident="cpu"``), and
  ``plan(envs=4)`` + ``index_select``. Env batches are checked never to share storage.
  Targets: streaming >= 5x the select/stack loop; split streaming >= 3x it and >= 0.9x the
  in-process ``index_select``.
* ``graphs``: 20k variable-size graphs (2-200 atoms: ``x[N,16]``, ``pos[N,3]``,
  ``edge_index[2,2N]``, ``y``), batch 64, ``Loader(collate="graph")`` over a 2-shard and a
  15-shard store, against a ``DataLoader`` (``num_workers=0``) over the same graphs held in a
  Python list, collated like PyG (``cat`` with shifted ``edge_index``, ``batch``, ``ptr``).
  Targets: >= 1x the DataLoader; 15 shards within 20% of 2.
* ``crystals``: 20k CHGNet-shaped graphs (2-200 atoms: ``atom_fea[N,16]``,
  ``edge_index[2,4N]``, ``bond_fea[4N,8]``, ``energy``; about 1.6 MB a batch of 64), as
  CHGNet users keep them (a dict per ``.pt`` file) and as a list in RAM.
  ``Loader(collate={"graph": {"node_field": "atom_fea"}})`` against a ``DataLoader`` over the
  list (collated like PyG, in torch), PyG's own ``Batch.from_data_list`` over the list (when
  ``torch_geometric`` is installed), and the per-file ``DataLoader`` with 0 and 2 workers
  (``torch.load(weights_only=True)`` per graph). Targets: >= 1.2x the list DataLoader,
  >= 20x the per-file DataLoader with 2 workers.
* ``upt``: 5,000 UPT-like samples (a point cloud ``points[N,3]`` of 1,000-5,000 points,
  ``params[4]`` missing in a third of the samples, ``bc`` int32 ``[-1]`` missing in a fifth),
  batch 16: 512 random query points per sample. ``Loader(transforms=[random_subset])`` on the
  server against the trainer doing it in its loop over the same samples held in RAM
  (``Generator.choice`` per sample, ``stack``, the masked fields collated by hand); the
  same on a second server with ``--transform-pool process``. Target: >= 1x the trainer.
* ``shogi``: 100,000 shogi-like positions (104 planes of 9x9 bits packed into 1,053 bytes,
  a move, a result), batch 256: the ``unpack_bits`` transform to float32 planes on the
  server against the trainer doing the same in its main thread (gather, ``np.unpackbits``,
  ``astype``) over the records held in RAM; and with the process pool. Target: >= 1.5x the
  trainer (data only).
* ``cifar``: CIFAR-like batches of 256 and of 32 through ``Loader`` (shared memory) against
  the store's own ``take`` in this process into reused buffers (in-process Arrow take).
  Targets: batch 256 >= 0.8x, batch 32 >= 0.5x.

Loader rows run with the default ``prefetch`` (credit for about 8 MiB of small batches, which
the server sends several to a message; each row notes the batches per message). Each
row is the best of 3 epochs after a warm-up one (``upt``: of 7, its rows' epochs taken in turn,
so that a change in load lands on the trainer and the Loaders alike). Every row reports the trainer's CPU per batch (``time.process_time`` of this process over
the batches; the server runs in its own process) and, for shardserve rows, the server's CPU
per batch (with a process pool: the server's and its workers'). Writes
``bench/results/small.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _loops import PROCESS_POOL, Contender, Step, measure, measure_together, server_pid
from _small_data import (
    SHOGI_PLANES,
    crystals,
    graphs,
    make_cifar,
    make_crystals,
    make_graphs,
    make_shogi,
    make_upt,
    upt,
)
from torch.utils.data import DataLoader

from shardserve.client import Loader, plan, serve_local
from shardserve.server.store.catalog import Store

RESULTS = Path(__file__).resolve().parent / "results" / "small.json"
ENVS, ENV_BATCH, GRAPH_BATCH, SHOGI_BATCH = 4, 32, 64, 256
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
#: CHGNet's fields do not say which counts the nodes (atom_fea and bond_fea look alike).
CRYSTAL_COLLATE = {"graph": {"node_field": "atom_fea"}}


def storages(step: list[dict[str, torch.Tensor]]) -> list[int]:
    return [t.untyped_storage().data_ptr() for b in step for t in b.values()]


def assert_no_aliasing(epoch: Iterable[Step]) -> int:
    n = 0
    for step in epoch:
        ptrs = storages(step)
        assert len(set(ptrs)) == len(ptrs), "env batches of one step share storage"
        n += 1
    return n


# -- rows ----------------------------------------------------------------------------------
def bench_envs(
    url: str, arrays: dict[str, np.ndarray], store: Path, split: bool
) -> dict[str, dict[str, float]]:
    """``split``: the seed's semantics, one shuffle dealt across the 4 envs (an epoch of
    ``n / 128`` steps); else a shuffle per env (``n / 32`` steps)."""
    n = len(arrays["label"])
    images, labels = torch.from_numpy(arrays["image"]), torch.from_numpy(arrays["label"])
    per_step = ENVS * ENV_BATCH

    def step_ids(e: int) -> Iterator[list[torch.Tensor]]:
        if split:
            p = torch.from_numpy(np.random.default_rng(e).permutation(n))
            for s in range(0, n - per_step + 1, per_step):
                yield list(p[s : s + per_step].split(ENV_BATCH))
            return
        ps = [
            torch.from_numpy(np.random.default_rng([e, env]).permutation(n)) for env in range(ENVS)
        ]
        for s in range(0, n - ENV_BATCH + 1, ENV_BATCH):
            yield [p[s : s + ENV_BATCH] for p in ps]

    def select_stack(e: int) -> Iterator[Step]:
        for idx in step_ids(e):
            yield [
                {
                    "image": torch.stack([images[i] for i in p.tolist()]),
                    "label": torch.stack([labels[i] for i in p.tolist()]),
                }
                for p in idx
            ]

    def index_select(e: int) -> Iterator[Step]:
        for idx in step_ids(e):
            yield [
                {"image": images.index_select(0, i), "label": labels.index_select(0, i)}
                for i in idx
            ]

    rows = {
        "select/stack loop (RAM)": measure(select_stack, per_step),
        "index_select in process (RAM)": measure(index_select, per_step),
    }
    pid = server_pid(store)
    mode = "split" if split else "independent"
    kw = dict(seed=0, rank=0, world_size=1, drop_last=True, envs=ENVS, env_shuffle=mode)
    with Loader(url, "cifar", ENV_BATCH, **kw) as ld:  # type: ignore[arg-type]
        ld.set_epoch(5)
        assert_no_aliasing(ld)
        rows[f"shardserve Loader(envs=4{', split' * split}) streaming"] = measure(
            _epochs(ld), per_step, pid, loader=ld
        )
    with Loader(url, "cifar", ENV_BATCH, resident="cpu", **kw) as ld:  # type: ignore[arg-type]
        ld.set_epoch(5)
        assert_no_aliasing(ld)
        rows[f"shardserve Loader(envs=4{', split' * split}, resident='cpu')"] = measure(
            _epochs(ld), per_step, pid
        )
    with plan(url, "cifar", ENV_BATCH, **kw) as p:  # type: ignore[arg-type]

        def planned(e: int) -> Iterator[Step]:
            p.set_epoch(e)
            for ids in p:
                yield [
                    {"image": images.index_select(0, i), "label": labels.index_select(0, i)}
                    for i in ids
                ]

        rows[f"shardserve plan(envs=4{', split' * split}) + index_select"] = measure(
            planned, per_step, pid
        )
    return rows


def _epochs(loader: Loader) -> Callable[[int], Iterable[Step]]:
    def epoch(e: int) -> Iterable[Step]:
        loader.set_epoch(e)
        return loader

    return epoch


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
    dl = DataLoader(
        held,
        batch_size=GRAPH_BATCH,
        shuffle=True,
        num_workers=0,
        collate_fn=partial(collate_like_pyg, node_field="x"),
    )  # type: ignore[arg-type]

    def dataloader(e: int) -> Iterable[Step]:
        torch.manual_seed(e)
        return dl

    rows = {"DataLoader(list in RAM, workers 0)": measure(dataloader, GRAPH_BATCH)}
    pid = server_pid(store)
    for name in names:
        with Loader(url, name, GRAPH_BATCH, collate="graph", seed=0, rank=0, world_size=1) as ld:
            rows[f"shardserve Loader(collate='graph'), {name}"] = measure(
                _epochs(ld), GRAPH_BATCH, pid, loader=ld
            )
    return rows


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

    def shuffled(dl: DataLoader) -> Callable[[int], Iterable[Step]]:  # type: ignore[type-arg]
        def epoch(e: int) -> Iterable[Step]:
            torch.manual_seed(e)
            return dl

        return epoch

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
            _epochs(ld), GRAPH_BATCH, server_pid(store), loader=ld
        )
    return rows


def bench_upt(url: str, purl: str, store: Path, n: int) -> dict[str, dict[str, float]]:
    held = list(upt(n))

    def trainer(e: int) -> Iterator[Step]:
        """What the trainer does without the sidecar: sample each cloud's queries itself."""
        rng = np.random.default_rng(e)
        order = rng.permutation(n)
        for i in range(0, n - UPT_BATCH + 1, UPT_BATCH):
            items = [held[j] for j in order[i : i + UPT_BATCH]]
            pts = [
                s["points"][rng.choice(len(s["points"]), UPT_QUERIES, replace=False)] for s in items
            ]
            mask = torch.tensor([s["params"] is not None for s in items])
            params = torch.stack(
                [
                    torch.from_numpy(s["params"]) if s["params"] is not None else torch.zeros(4)
                    for s in items
                ]
            )
            bcs = [
                torch.from_numpy(s["bc"])
                if s["bc"] is not None
                else torch.zeros(0, dtype=torch.int32)
                for s in items
            ]
            yield {
                "points": torch.from_numpy(np.stack(pts)),
                "params": params,
                "mask": mask,
                "bc": torch.cat(bcs),
            }

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
                _epochs(ld), SHOGI_BATCH, server_pid(store, where == purl), loader=ld
            )
    return rows


def bench_cifar(url: str, store: Path, n: int, batch: int) -> dict[str, dict[str, float]]:
    ds = Store(store).open("cifar")
    out = {k: np.empty((batch, *s[1]), dtype=s[0]) for k, s in ds.part_shapes(None).items()}  # type: ignore[index]

    def arrow_take(e: int) -> Iterator[Step]:
        perm = np.random.default_rng(e).permutation(n)
        for i in range(0, n, batch):
            idx = perm[i : i + batch]
            views = {k: v[: len(idx)] for k, v in out.items()}
            yield {k: torch.from_numpy(a) for k, a in ds.take(idx, None, out=views).items()}

    rows = {"in-process Arrow take": measure(arrow_take, batch)}
    with Loader(url, "cifar", batch, seed=0, rank=0, world_size=1) as ld:
        rows["shardserve Loader (shm)"] = measure(_epochs(ld), batch, server_pid(store), loader=ld)
    ds.close()
    return rows


# -- report --------------------------------------------------------------------------------
def ratio(rows: dict[str, dict[str, float]], a: str, b: str) -> float:
    return rows[a]["samples_s"] / rows[b]["samples_s"] if a in rows and b in rows else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smaller data, about a minute")
    p.add_argument(
        "--workdir", type=Path, default=None, help="where to write the data (default: a temp dir)"
    )
    p.add_argument(
        "--only", default="", help="run the sections whose title contains one of these (a,b)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    n_cifar, n_graphs = (8_000, 4_000) if args.quick else (50_000, 20_000)
    res: dict[str, Any] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} cpus={os.cpu_count()}",
        "torch": torch.__version__,
        "quick": args.quick,
        "load_before": os.getloadavg(),
        "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="ss-bench-small-", dir=args.workdir) as tmp:
        store = Path(tmp) / "store"
        print(f"writing {n_cifar} CIFAR-like samples and {n_graphs} graphs twice ...", flush=True)
        arrays = make_cifar(store, n_cifar)
        names = [make_graphs(store, n_graphs, s) for s in (2, 15)]
        make_crystals(store, Path(tmp) / "crystal-files", n_graphs)
        n_upt = 1_000 if args.quick else 5_000
        make_upt(store, n_upt)
        shogi = make_shogi(store, 20_000 if args.quick else 100_000)
        with serve_local(store) as url, serve_local(store, *PROCESS_POOL) as purl:
            sections = {
                "envs (4 x 32)": lambda: bench_envs(url, arrays, store, split=False),
                "envs split (4 x 32, one shuffle)": lambda: bench_envs(
                    url, arrays, store, split=True
                ),
                "graphs (batch 64)": lambda: bench_graphs(url, store, names, n_graphs),
                "crystals (batch 64)": lambda: bench_crystals(
                    url, store, Path(tmp) / "crystal-files", n_graphs
                ),
                "upt (batch 16)": lambda: bench_upt(url, purl, store, n_upt),
                "shogi (batch 256)": lambda: bench_shogi(url, purl, store, shogi),
                "cifar batch 256": lambda: bench_cifar(url, store, n_cifar, 256),
                "cifar batch 32": lambda: bench_cifar(url, store, n_cifar, 32),
            }
            only = [w for w in args.only.split(",") if w]
            for title, run in sections.items():
                if only and not any(w in title for w in only):
                    continue
                print(f"\n{title}", flush=True)
                rows = res["rows"][title] = run()
                first = next(iter(rows))
                print(
                    f"  {'configuration':48}{'samples/s':>11}{'steps/s':>9}{'ratio':>7}"
                    f"{'client us/batch':>16}{'server us/batch':>16}{'steps/msg':>10}"
                )
                for label, r in rows.items():
                    print(
                        f"  {label:48}{r['samples_s']:>11,.0f}{r['steps_s']:>9,.0f}"
                        f"{r['samples_s'] / rows[first]['samples_s']:>7.2f}"
                        f"{r['client_cpu_us_per_batch']:>16,.0f}{r['server_cpu_us_per_batch']:>16,.0f}"
                        f"{r.get('steps_per_message', float('nan')):>10.1f}"
                    )
    rows: dict[str, dict[str, dict[str, float]]] = defaultdict(dict, res["rows"])
    g, g2, g15 = (
        rows["graphs (batch 64)"],
        f"shardserve Loader(collate='graph'), {names[0]}",
        f"shardserve Loader(collate='graph'), {names[1]}",
    )
    es = rows["envs split (4 x 32, one shuffle)"]
    c, cs = rows["crystals (batch 64)"], "shardserve Loader(collate=graph, node_field)"
    res["targets"] = [
        (
            "envs streaming / select-stack loop",
            ratio(
                rows["envs (4 x 32)"],
                "shardserve Loader(envs=4) streaming",
                "select/stack loop (RAM)",
            ),
            5.0,
        ),
        (
            "envs split streaming / select-stack loop",
            ratio(es, "shardserve Loader(envs=4, split) streaming", "select/stack loop (RAM)"),
            3.0,
        ),
        (
            "envs split streaming / index_select",
            ratio(
                es, "shardserve Loader(envs=4, split) streaming", "index_select in process (RAM)"
            ),
            0.9,
        ),
        (
            "graphs 2 shards / DataLoader list",
            ratio(g, g2, "DataLoader(list in RAM, workers 0)"),
            1.0,
        ),
        (
            "graphs 15 shards / DataLoader list",
            ratio(g, g15, "DataLoader(list in RAM, workers 0)"),
            1.0,
        ),
        ("graphs 15 shards / 2 shards", ratio(g, g15, g2), 0.8),
        ("crystals / DataLoader list", ratio(c, cs, "DataLoader(list in RAM, workers 0)"), 1.2),
        (
            "crystals / per-file DataLoader w2",
            ratio(c, cs, "DataLoader(per-file .pt, workers 2)"),
            20.0,
        ),
        (
            "upt server query sampling / trainer",
            ratio(
                rows["upt (batch 16)"],
                "shardserve Loader(transforms=[random_subset])",
                "trainer samples its queries (RAM)",
            ),
            1.0,
        ),
        (
            "upt query sampling, process pool / trainer",
            ratio(
                rows["upt (batch 16)"],
                "shardserve Loader(transforms=[random_subset]), process pool",
                "trainer samples its queries (RAM)",
            ),
            1.0,
        ),
        (
            "shogi featurize on the server / trainer",
            ratio(
                rows["shogi (batch 256)"],
                "shardserve Loader(transforms=[unpack_bits])",
                "trainer featurizes in its main thread (RAM)",
            ),
            1.5,
        ),
        (
            "shogi featurize, process pool / trainer",
            ratio(
                rows["shogi (batch 256)"],
                "shardserve Loader(transforms=[unpack_bits]), process pool",
                "trainer featurizes in its main thread (RAM)",
            ),
            1.5,
        ),
        (
            "cifar 256 / Arrow take",
            ratio(rows["cifar batch 256"], "shardserve Loader (shm)", "in-process Arrow take"),
            0.8,
        ),
        (
            "cifar 32 / Arrow take",
            ratio(rows["cifar batch 32"], "shardserve Loader (shm)", "in-process Arrow take"),
            0.5,
        ),
    ]
    res["load_after"] = os.getloadavg()
    print(
        f"\nload average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
        f"({os.cpu_count()} cpus)"
    )
    for name, value, goal in res["targets"]:
        print(f"  target {name} >= {goal}: {value:.2f} {'met' if value >= goal else 'MISSED'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
