"""Every Python block of the docs and the README runs, against a real server holding the
datasets they name.

A page's blocks run in order in one fresh process, as a reader would paste them into one
session: a later block may use what an earlier one imported or made. Each page's process is
forked from one that imported torch and the client once (``tests/support/zygote.py``). Before them, a prelude
gives the names the pages leave to the reader's own code (``model``, ``opt``, ``act``, ...);
see :data:`PRELUDE`. Three rules map the page to this machine:

* the node-local address ``http://127.0.0.1:7070`` (and ``$SHARDSERVE_URL``) is the test's server;
* ``"cuda"`` devices are ``"cpu"`` where torch sees no GPU;
* the working directory holds the store as ``store`` (the folder the pages ingest into).

Anything else a block needs changed is said on the page, above the block, as a
``docs-test replace`` or ``docs-test skip`` directive (``tests/docs/pages.py``). A block that
only includes an example file runs in that example's own test.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shardserve.proto.manifest import FieldSpec
from shardserve.server.store.ingest.run import ingest
from shardserve.server.store.write.writer import ShardWriter
from tests.docs.pages import ROOT, Block, page_blocks, pages
from tests.docs.test_docs import digits_store
from tests.support.data import make_cifar_like, make_graph_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled
from tests.support.zygote import Zygote

LOCAL_URL = "http://127.0.0.1:7070"
CIFAR10 = 512
#: Big enough for the ids the mixtures guide quarantines.
MIXED = 100_000

#: The reader's own code that the pages leave out: a model that takes any tensors, its
#: optimizer, a loss, an environment step, a training step, and the in-memory images a plan's
#: ids index.
PRELUDE = f"""
import os
import torch
from torch import nn

url = os.environ["SHARDSERVE_URL"]


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, *tensors):
        return self.w * sum(t.float().mean() for t in tensors)


model = _Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
epochs = 2


def loss_fn(out, target):
    return (out - target.float().mean()) ** 2


def act(env, *tensors):
    assert all(t.shape[0] == tensors[0].shape[0] for t in tensors), [t.shape for t in tensors]


def train_step(*tensors):
    act(0, *tensors)


images = torch.zeros({CIFAR10}, 3, 32, 32)
"""


def _pt_folder(folder: Path, samples: list[object]) -> Path:
    folder.mkdir()
    for i, s in enumerate(samples):
        torch.save(s, folder / f"{i:04d}.pt")
    return folder


def _pde(i: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(i)
    params = None if i % 4 == 0 else {"nu": torch.tensor(0.01 * i)}
    return {"latent": torch.randn(4, 3, generator=g), "params": params}


def _molecule(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    atoms = int(torch.randint(2, 20, (1,), generator=g))
    return {
        "x": torch.randn(atoms, 8, generator=g),
        "edge_index": torch.randint(0, atoms, (2, 2 * atoms), generator=g),
        "y": torch.randn((), generator=g),
    }


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    rgb = np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(buf, format="JPEG")
    return buf.getvalue()


def build_store(tmp: Path) -> Path:
    """The datasets the pages name, written as users write them (``.pt`` files ingested, the
    digits example, the store's writer)."""
    store = digits_store(tmp)  # digits-train, and beside it the held-out split:
    ingest(tmp / "test.npz", store, "digits-test", progress=False)
    src = tmp / "src"
    src.mkdir()
    ingest(_pt_folder(src / "pde", [_pde(i) for i in range(128)]), store, "pde", progress=False)
    tuples = [(torch.full((3, 32, 32), i, dtype=torch.uint8), i % 10) for i in range(256)]
    ingest(_pt_folder(src / "tuples", tuples), store, "cifar", progress=False)
    make_cifar_like(store, "cifar10", n=CIFAR10)
    ingest(
        _pt_folder(src / "mols", [_molecule(i) for i in range(256)]), store, "mols", progress=False
    )
    make_graph_like(store, "qm9", n=256)
    small = (
        FieldSpec(name="image", dtype="uint8", shape=(4,)),
        FieldSpec(name="label", dtype="int64", shape=()),
    )
    for k, name in enumerate(["web", "code", "math"]):
        n = MIXED // (k + 1)
        with ShardWriter(store, name, fields=small, shard_bytes=1 << 20) as w:
            ids = np.arange(n, dtype=np.int64)
            w.add_batch(
                {"image": (ids[:, None] + np.arange(4)).astype(np.uint8), "label": ids % 10}
            )
    encoded = (
        FieldSpec(name="image", dtype="binary", shape=()),
        FieldSpec(name="label", dtype="int64", shape=()),
    )
    with ShardWriter(store, "imagenet", fields=encoded) as w:
        for i in range(256):
            w.add({"image": _jpeg(i), "label": np.int64(i % 10)})
    return store


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, Path]]:
    store = build_store(tmp_path_factory.mktemp("docs"))
    with run_server(store) as srv:
        yield srv, store


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    with Zygote(["torch", "numpy", "shardserve.client"]) as z:
        yield z


def _for_here(code: str) -> str:
    """The three rules of the module docstring, less the working directory."""
    if not torch.cuda.is_available():
        code = re.sub(r'"cuda(:\d+)?"', '"cpu"', code)
    return code.replace(f'"{LOCAL_URL}"', "url")


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.lang == "python" and b.skip is None and not b.included]


#: The README's loop runs too: it is the first code a user reads.
WITH_README = [ROOT / "README.md", *pages()]
PAGES = [p for p in WITH_README if runnable(page_blocks(p))]


def test_every_python_block_runs_or_says_why_not() -> None:
    """A block the test leaves out says why on its page; most blocks run."""
    every = [b for p in WITH_README for b in page_blocks(p) if b.lang == "python"]
    run = [b for p in PAGES for b in runnable(page_blocks(p))]
    left_out = [b for b in every if b.skip is not None]
    assert all(b.skip and len(b.skip) > 20 for b in left_out), [b.where for b in left_out]
    assert len(run) >= 2 * len(left_out), (len(run), [b.where for b in left_out])


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_pages_python_runs(
    docs_server: tuple[ServerProc, Path], zygote: Zygote, page: Path, tmp_path: Path
) -> None:
    """The page's blocks, in order, in one interpreter, against the docs' datasets."""
    srv, store = docs_server
    (tmp_path / "store").symlink_to(store)
    script = [PRELUDE]
    for b in runnable(page_blocks(page)):
        script.append(
            f"exec(compile({json.dumps(_for_here(b.runnable()))}, {json.dumps(b.where)}, "
            '"exec"), globals())'
        )
    (tmp_path / "page.py").write_text("\n".join(script))
    env = {**os.environ, "SHARDSERVE_URL": srv.http_url}
    out = zygote.run(["page.py"], cwd=tmp_path, env=env, timeout=scaled(240.0))
    assert out.returncode == 0, f"{page.relative_to(ROOT)}:\n{out.stdout}\n{out.stderr[-6000:]}"


def test_the_readme_loop_runs_as_written(
    docs_server: tuple[ServerProc, Path], zygote: Zygote, tmp_path: Path
) -> None:
    """The README's Python runs with nothing of the test's own: no prelude defining ``model``,
    no ``"cuda"`` rewritten to ``"cpu"``; only the server's address is this test's server."""
    srv, _ = docs_server
    blocks = runnable(page_blocks(ROOT / "README.md"))
    assert blocks, "the README has no Python block"
    code = "\n".join(b.runnable() for b in blocks).replace(f'"{LOCAL_URL}"', repr(srv.http_url))
    (tmp_path / "readme.py").write_text(code)
    out = zygote.run(["readme.py"], cwd=tmp_path, env=dict(os.environ), timeout=scaled(240.0))
    assert out.returncode == 0, f"README.md:\n{out.stdout}\n{out.stderr[-6000:]}"
