"""How a job is made from arguments (``JobHandle``), shared by ``Loader`` and ``plan``, and the
DataLoader habits of a Loader (``batch_size``, ``dataset``, ``skip_to``...). Real server."""

from __future__ import annotations

import ast
import inspect
import pydoc
import warnings
from pathlib import Path

import httpx
import pytest
import torch

from shardserve.client import BadRequest, Loader, plan
from shardserve.client.habits import gather_remainder
from shardserve.server.planning import plan as server_plan
from tests.client.conftest import N_CIFAR, ids
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
#: Loader arguments about delivery, not about which batches the job holds (``share``: which
#: Loaders are handed one pass's batches).
DELIVERY = {"prefetch", "transport", "pad_variable", "copy", "resident", "devices", "share"}


def test_plan_accepts_every_argument_that_defines_a_loaders_job() -> None:
    """Every Loader argument that is not about delivery is a plan argument, with the same
    default and annotation; both are keyword-only after ``batch_size``."""
    lp = inspect.signature(Loader.__init__).parameters
    pp = inspect.signature(plan).parameters
    job_args = set(lp) - DELIVERY - {"self"}
    assert job_args <= set(pp), job_args - set(pp)
    for name in job_args:
        assert (lp[name].default, str(lp[name].annotation)) == (
            pp[name].default,
            str(pp[name].annotation),
        ), name
    for params in (lp, pp):
        tail = [p for n, p in params.items() if n not in ("self", "url", "dataset", "batch_size")]
        assert all(p.kind is p.KEYWORD_ONLY for p in tail)


def test_help_lists_every_argument_on_a_line_of_its_own() -> None:
    """``help(Loader)`` has an Args section with one entry per argument."""
    assert "Args:" in pydoc.render_doc(Loader, renderer=pydoc.plaintext)
    doc = inspect.getdoc(Loader) or ""
    section = doc[doc.index("Args:") :].split("\n\n")[0].splitlines()[1:]
    entries = [line.split(":")[0].strip() for line in section if not line.startswith("        ")]
    want = [n for n in inspect.signature(Loader.__init__).parameters if n != "self"]
    assert entries == want


def test_no_import_cycle_in_the_client() -> None:
    """No module of shardserve.client imports (even under TYPE_CHECKING) one that imports it
    back, directly or through others."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "client").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "shardserve.client."
            ):
                deps.add(node.module.split(".")[2])  # type: ignore[union-attr]
        graph[path.stem] = {d.split(".")[0] for d in deps}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    assert not [m for m in graph if m in reach(m)]


def test_positional_arguments_after_batch_size_warn_and_still_work(server) -> None:
    """``Loader(url, name, 50, 3, False)`` (seed, shuffle by position, as before) is the
    Loader of ``seed=3, shuffle=False``, with a DeprecationWarning that names them."""
    with pytest.warns(DeprecationWarning, match="seed=, shuffle="):
        old = Loader(server.http_url, "cifar", 50, 3, False, rank=0, world_size=1)
    with (
        old,
        Loader(server.http_url, "cifar", 50, seed=3, shuffle=False, rank=0, world_size=1) as new,
    ):
        assert old.job_id == new.job_id and old.spec.shuffle == "none"
    with pytest.raises(TypeError, match="multiple values"):
        Loader(server.http_url, "cifar", 50, 3, seed=4)  # type: ignore[misc]


def test_plan_takes_transforms_and_is_the_loaders_job(server) -> None:
    """``plan(..., transforms=...)`` makes the Loader's job (same id), so their state dicts
    pass between them; an argument that makes no job is a BadRequest naming it."""
    chain = [{"name": "hflip", "params": {"layout": "CHW"}}]
    kw = dict(seed=2, rank=1, world_size=2, transforms=chain)
    with (
        Loader(server.http_url, "cifar", 64, **kw) as ld,
        plan(server.http_url, "cifar", 64, **kw) as p,
    ):
        assert p.job_id == ld.job_id and len(p) == len(ld)
        ld.load_state_dict(p.state_dict())
    with pytest.raises(BadRequest, match="shuffle"):
        plan(server.http_url, "cifar", 64, shuffle="sideways")  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="batch_size"):
        Loader(server.http_url, "cifar", 0)


def test_dataloader_habits(server) -> None:
    """``batch_size``, ``drop_last``, ``shuffle`` and ``len(dataset)`` read as on a DataLoader;
    ``skip_to(n)`` starts the next pass at batch n of its epoch, and the pass after goes on
    with the next epoch."""
    with Loader(server.http_url, "cifar", 64, seed=4, drop_last=True, rank=0, world_size=2) as ld:
        assert (ld.batch_size, ld.drop_last, ld.shuffle) == (64, True, True)
        assert len(ld.dataset) == N_CIFAR and ld.dataset.name == "cifar"
        assert ld.sampler is None and ld.num_workers == 0 and ld.timeout == 0
        ld.set_epoch(2)
        for bad in (-5, len(ld) + 1, 2.0):
            with pytest.raises(ValueError, match=rf"skip_to\({bad}\): batch must be an integer 0"):
                ld.skip_to(bad)  # type: ignore[arg-type]
        ld.skip_to(5)
        want = [
            tuple(int(i) for i in b)
            for b in server_plan(
                N_CIFAR, seed=4, epoch=2, world_size=2, rank=0, batch_size=64, drop_last=True
            )
        ]
        assert [ids(b) for b in ld] == want[5:]
        assert ld.state_dict()["epoch"] == 3
    with Loader(server.http_url, "cifar", 64, shuffle="block", rank=0, world_size=1) as ld:
        assert ld.shuffle is True and ld.spec.shuffle == "block"
    with Loader(server.http_url, "cifar", 64, shuffle=False, rank=0, world_size=1) as ld:
        assert ld.shuffle is False
        with pytest.raises(TypeError, match="a batch at a time"):
            ld.dataset[0]


def test_without_accelerate_no_framework_is_told(server) -> None:
    """A process that did not import Accelerate iterates without it being imported."""
    import sys

    had = "accelerate" in sys.modules
    with (
        Loader(server.http_url, "cifar", 500, rank=0, world_size=1) as ld,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")
        assert len(list(ld)) == 2
    assert ("accelerate" in sys.modules) == had


@pytest.mark.parametrize(
    ("n", "world", "batch", "drop_last", "want"),
    [
        (1001, 2, 64, False, 105),
        (1001, 2, 1, False, 1),
        (1000, 2, 64, False, 0),
        (1001, 2, 64, True, 0),
        (1000, 3, 64, False, None),
        (1000, 3, 3, False, 1),
        (10, 4, 3, False, None),
        (10, 4, 2, False, 2),
    ],
)
def test_gather_remainder_keeps_exactly_the_real_samples(
    n: int, world: int, batch: int, drop_last: bool, want: int | None
) -> None:
    """Concatenating every rank's last batch of the plan in rank order and keeping the first
    ``remainder`` items keeps every sample of that step once and no padding."""
    plans = [
        server_plan(
            n, seed=1, epoch=0, world_size=world, rank=r, batch_size=batch, drop_last=drop_last
        )
        for r in range(world)
    ]
    got = gather_remainder(n, world, batch, drop_last, len(plans[0]))
    assert got == want
    if got is None:
        return
    every = [int(i) for p in plans for b in list(p)[:-1] for i in b]
    last = [int(i) for p in plans for i in list(p)[-1]]
    kept = last[:got] if got else last
    assert len(set(every + kept)) == len(every + kept)
    if not drop_last:
        assert sorted(every + kept) == list(range(n))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_an_explicit_cuda_device_without_cuda_says_so_in_one_line(server) -> None:
    """``Loader(device="cuda")`` where torch sees no GPU is a BadRequest as the Loader is made,
    before any job is posted: one line saying why, naming device='cpu' and the run-time pick."""

    def job_ids() -> set[str]:
        return {j["id"] for j in httpx.get(f"{server.http_url}/v1/jobs", timeout=scaled(10)).json()}

    before = job_ids()
    with pytest.raises(BadRequest) as e:
        Loader(server.http_url, "cifar", 64, device="cuda")
    msg = str(e.value)
    assert "\n" not in msg and "torch.cuda.is_available() is False" in msg, msg
    assert "device='cpu'" in msg and "'cuda' if torch.cuda.is_available() else 'cpu'" in msg, msg
    assert job_ids() == before
