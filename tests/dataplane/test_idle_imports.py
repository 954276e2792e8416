"""An idle server keeps the libraries it needs only for work out of memory: it has not imported
pyarrow (the read path loads it with the first job), numpy.random, the ingest readers, Pillow,
tqdm, or the transform worker processes' code."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.support.server import run_server
from tests.support.slowness import scaled

#: Modules (and their submodules) an idle server must not have imported: each is loaded where it
#: is first used (the first job's read, ingest, decoding, the first generator, the first chain
#: run on worker processes).
NOT_IDLE = (
    "pyarrow",
    "numpy.random",
    "shardserve.server.store.ingest",
    "PIL",
    "tqdm",
    "shardserve.server.transforms.pool_processes",
    "shardserve.server.transforms.worker",
    "shardserve.server.transforms.codec",
)


def _imported(log: str) -> set[str]:
    """Module names of ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    return set(re.findall(r"^import time:\s*\d+ \|\s*\d+ \|\s*(\S+)\s*$", log, re.MULTILINE))


def test_an_idle_server_has_not_imported_its_work_libraries(tmp_path: Path) -> None:
    """A server started on an empty store and answering /healthz has none of NOT_IDLE imported."""
    with run_server(tmp_path / "store", env={"PYTHONPROFILEIMPORTTIME": "1"}) as srv:
        health = httpx.get(f"{srv.http_url}/healthz", headers=srv.headers, timeout=scaled(10))
        assert health.status_code == 200
        log = srv.log_path.read_text(errors="replace")
    imported = _imported(log)
    assert "fastapi" in imported, "no import times in the log: the test tests nothing"
    loaded = sorted(m for m in imported if any(m == n or m.startswith(n + ".") for n in NOT_IDLE))
    assert not loaded, f"an idle server imported {loaded}"
