"""Small batches, many environments and graphs: shardserve against in-process loops.

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
import json
import os
import platform
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _loops import PROCESS_POOL, Step, loader_epochs, measure, server_pid
from _small_data import make_cifar, make_crystals, make_graphs, make_shogi, make_upt
from _small_graphs import bench_crystals, bench_graphs
from _small_transforms import bench_shogi, bench_upt

from shardserve.client import Loader, plan, serve_local
from shardserve.server.store.catalog import Store

RESULTS = Path(__file__).resolve().parent / "results" / "small.json"
ENVS, ENV_BATCH = 4, 32
Rows = dict[str, dict[str, float]]
_LIST = "DataLoader(list in RAM, workers 0)"
_GRAPH = "shardserve Loader(collate='graph'), "
_CRYSTAL = "shardserve Loader(collate=graph, node_field)"
_UPT = "shardserve Loader(transforms=[random_subset])"
_SHOGI = "shardserve Loader(transforms=[unpack_bits])"
_ENVS_SPLIT = "shardserve Loader(envs=4, split) streaming"
#: (target, section title, numerator row, denominator row, goal): each target is the ratio of
#: the two rows' samples/s in one run. The graph rows name the datasets ``make_graphs`` writes.
TARGETS: tuple[tuple[str, str, str, str, float], ...] = (
    (
        "envs streaming / select-stack loop",
        "envs (4 x 32)",
        "shardserve Loader(envs=4) streaming",
        "select/stack loop (RAM)",
        5.0,
    ),
    (
        "envs split streaming / select-stack loop",
        "envs split (4 x 32, one shuffle)",
        _ENVS_SPLIT,
        "select/stack loop (RAM)",
        3.0,
    ),
    (
        "envs split streaming / index_select",
        "envs split (4 x 32, one shuffle)",
        _ENVS_SPLIT,
        "index_select in process (RAM)",
        0.9,
    ),
    ("graphs 2 shards / DataLoader list", "graphs (batch 64)", _GRAPH + "graphs2", _LIST, 1.0),
    ("graphs 15 shards / DataLoader list", "graphs (batch 64)", _GRAPH + "graphs15", _LIST, 1.0),
    (
        "graphs 15 shards / 2 shards",
        "graphs (batch 64)",
        _GRAPH + "graphs15",
        _GRAPH + "graphs2",
        0.8,
    ),
    ("crystals / DataLoader list", "crystals (batch 64)", _CRYSTAL, _LIST, 1.2),
    (
        "crystals / per-file DataLoader w2",
        "crystals (batch 64)",
        _CRYSTAL,
        "DataLoader(per-file .pt, workers 2)",
        20.0,
    ),
    (
        "upt server query sampling / trainer",
        "upt (batch 16)",
        _UPT,
        "trainer samples its queries (RAM)",
        1.0,
    ),
    (
        "upt query sampling, process pool / trainer",
        "upt (batch 16)",
        _UPT + ", process pool",
        "trainer samples its queries (RAM)",
        1.0,
    ),
    (
        "shogi featurize on the server / trainer",
        "shogi (batch 256)",
        _SHOGI,
        "trainer featurizes in its main thread (RAM)",
        1.5,
    ),
    (
        "shogi featurize, process pool / trainer",
        "shogi (batch 256)",
        _SHOGI + ", process pool",
        "trainer featurizes in its main thread (RAM)",
        1.5,
    ),
    (
        "cifar 256 / Arrow take",
        "cifar batch 256",
        "shardserve Loader (shm)",
        "in-process Arrow take",
        0.8,
    ),
    (
        "cifar 32 / Arrow take",
        "cifar batch 32",
        "shardserve Loader (shm)",
        "in-process Arrow take",
        0.5,
    ),
)


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
def env_step_ids(n: int, split: bool, e: int) -> Iterator[list[torch.Tensor]]:
    """Epoch ``e``'s sample ids, a tensor per env a step: one shuffle dealt across the envs
    (``split``) or a shuffle per env."""
    per_step = ENVS * ENV_BATCH
    if split:
        p = torch.from_numpy(np.random.default_rng(e).permutation(n))
        for s in range(0, n - per_step + 1, per_step):
            yield list(p[s : s + per_step].split(ENV_BATCH))
        return
    ps = [torch.from_numpy(np.random.default_rng([e, env]).permutation(n)) for env in range(ENVS)]
    for s in range(0, n - ENV_BATCH + 1, ENV_BATCH):
        yield [p[s : s + ENV_BATCH] for p in ps]


def bench_envs(url: str, arrays: dict[str, np.ndarray], store: Path, split: bool) -> Rows:
    """``split``: the seed's semantics, one shuffle dealt across the 4 envs (an epoch of
    ``n / 128`` steps); else a shuffle per env (``n / 32`` steps)."""
    n = len(arrays["label"])
    images, labels = torch.from_numpy(arrays["image"]), torch.from_numpy(arrays["label"])

    def select_stack(e: int) -> Iterator[Step]:
        for idx in env_step_ids(n, split, e):
            yield [
                {
                    "image": torch.stack([images[i] for i in p.tolist()]),
                    "label": torch.stack([labels[i] for i in p.tolist()]),
                }
                for p in idx
            ]

    def index_select(e: int) -> Iterator[Step]:
        for idx in env_step_ids(n, split, e):
            yield [
                {"image": images.index_select(0, i), "label": labels.index_select(0, i)}
                for i in idx
            ]

    rows = {
        "select/stack loop (RAM)": measure(select_stack, ENVS * ENV_BATCH),
        "index_select in process (RAM)": measure(index_select, ENVS * ENV_BATCH),
    }
    return rows | envs_shardserve_rows(url, images, labels, store, split)


def envs_shardserve_rows(
    url: str, images: torch.Tensor, labels: torch.Tensor, store: Path, split: bool
) -> Rows:
    """``Loader(envs=4)`` streaming and resident, and ``plan(envs=4)`` + ``index_select``."""
    per_step, pid, rows = ENVS * ENV_BATCH, server_pid(store), {}
    mode = "split" if split else "independent"
    kw = dict(seed=0, rank=0, world_size=1, drop_last=True, envs=ENVS, env_shuffle=mode)
    with Loader(url, "cifar", ENV_BATCH, **kw) as ld:  # type: ignore[arg-type]
        ld.set_epoch(5)
        assert_no_aliasing(ld)
        rows[f"shardserve Loader(envs=4{', split' * split}) streaming"] = measure(
            loader_epochs(ld), per_step, pid, loader=ld
        )
    with Loader(url, "cifar", ENV_BATCH, resident="cpu", **kw) as ld:  # type: ignore[arg-type]
        ld.set_epoch(5)
        assert_no_aliasing(ld)
        rows[f"shardserve Loader(envs=4{', split' * split}, resident='cpu')"] = measure(
            loader_epochs(ld), per_step, pid
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


def bench_cifar(url: str, store: Path, n: int, batch: int) -> Rows:
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
        rows["shardserve Loader (shm)"] = measure(
            loader_epochs(ld), batch, server_pid(store), loader=ld
        )
    ds.close()
    return rows


# -- report --------------------------------------------------------------------------------
def ratio(rows: Rows, a: str, b: str) -> float:
    return rows[a]["samples_s"] / rows[b]["samples_s"] if a in rows and b in rows else float("nan")


def targets(sections: dict[str, Rows]) -> list[tuple[str, float, float]]:
    """``(target, ratio, goal)`` for each of ``TARGETS``; NaN where a row did not run."""
    return [
        (name, ratio(sections.get(title, {}), a, b), goal) for name, title, a, b, goal in TARGETS
    ]


def print_rows(rows: Rows) -> None:
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


def print_targets(res: dict[str, Any]) -> None:
    print(
        f"\nload average before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f} "
        f"({os.cpu_count()} cpus)"
    )
    for name, value, goal in res["targets"]:
        print(f"  target {name} >= {goal}: {value:.2f} {'met' if value >= goal else 'MISSED'}")


# -- run -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    """The datasets one run wrote: where, how many samples, and what the RAM baselines hold."""

    store: Path
    crystal_files: Path
    cifar: dict[str, np.ndarray]
    graph_names: list[str]
    shogi: dict[str, np.ndarray]
    n_cifar: int
    n_graphs: int
    n_upt: int


def write_data(tmp: Path, quick: bool) -> Written:
    n_cifar, n_graphs = (8_000, 4_000) if quick else (50_000, 20_000)
    store, files = tmp / "store", tmp / "crystal-files"
    print(f"writing {n_cifar} CIFAR-like samples and {n_graphs} graphs twice ...", flush=True)
    cifar = make_cifar(store, n_cifar)
    names = [make_graphs(store, n_graphs, s) for s in (2, 15)]
    make_crystals(store, files, n_graphs)
    n_upt = 1_000 if quick else 5_000
    make_upt(store, n_upt)
    shogi = make_shogi(store, 20_000 if quick else 100_000)
    return Written(store, files, cifar, names, shogi, n_cifar, n_graphs, n_upt)


def sections(url: str, purl: str, d: Written) -> dict[str, Callable[[], Rows]]:
    """Each section's title and its rows (``purl``: the server with a process pool)."""
    s = d.store
    return {
        "envs (4 x 32)": lambda: bench_envs(url, d.cifar, s, split=False),
        "envs split (4 x 32, one shuffle)": lambda: bench_envs(url, d.cifar, s, split=True),
        "graphs (batch 64)": lambda: bench_graphs(url, s, d.graph_names, d.n_graphs),
        "crystals (batch 64)": lambda: bench_crystals(url, s, d.crystal_files, d.n_graphs),
        "upt (batch 16)": lambda: bench_upt(url, purl, s, d.n_upt),
        "shogi (batch 256)": lambda: bench_shogi(url, purl, s, d.shogi),
        "cifar batch 256": lambda: bench_cifar(url, s, d.n_cifar, 256),
        "cifar batch 32": lambda: bench_cifar(url, s, d.n_cifar, 32),
    }


def run_sections(d: Written, only: list[str]) -> dict[str, Rows]:
    """The sections whose title contains one of ``only`` (all when empty), printed as they end."""
    out: dict[str, Rows] = {}
    with serve_local(d.store) as url, serve_local(d.store, *PROCESS_POOL) as purl:
        for title, run in sections(url, purl, d).items():
            if only and not any(w in title for w in only):
                continue
            print(f"\n{title}", flush=True)
            out[title] = run()
            print_rows(out[title])
    return out


def parse_args() -> argparse.Namespace:
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
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    res: dict[str, Any] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} cpus={os.cpu_count()}",
        "torch": torch.__version__,
        "quick": args.quick,
        "load_before": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="ss-bench-small-", dir=args.workdir) as tmp:
        written = write_data(Path(tmp), args.quick)
        res["rows"] = run_sections(written, [w for w in args.only.split(",") if w])
    res["targets"] = targets(res["rows"])
    res["load_after"] = os.getloadavg()
    print_targets(res)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
