"""The Grafana dashboard shipped in docker/ asks for series a real server exports.

A real server (its store served through the object-store path, ``file://``, so the shard
cache's metrics exist too) streams a job with a transform to a real Loader while a real
Prometheus scrapes it; every query of every panel must parse in Prometheus, every metric name
in it must be one the server's ``/metrics`` has, and the throughput panels must show data.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardserve.client import Loader
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, free_port, run_server
from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "shardserve.json"
_NAME = re.compile(r"\bshardserve_[a-z0-9_]+")
_SUFFIXES = ("_bucket", "_sum", "_count")
#: Panels that must show data while a job streams (the others may be 0-free: no errors).
MUST_HAVE_DATA = {"Batches/s per job", "Bytes/s", "Data stall per rank"}


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_covers_what_operators_ask() -> None:
    titles = {title for title, _ in queries()}
    for want in ("Data stall per rank", "Batches/s per job", "Bytes/s", "Errors"):
        assert want in titles
    exprs = " ".join(e for _, e in queries())
    for metric in ("shardserve_transform_seconds", "shardserve_cache_hits_total"):
        assert metric in exprs


def exported_names(metrics_text: str) -> set[str]:
    """Every name a query may use: sample names and family names (with ``_total`` for
    counters, and the histogram series)."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(metrics_text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        if fam.type == "histogram":
            names.update(fam.name + s for s in _SUFFIXES)
    return names


@pytest.fixture(scope="module")
def remote_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("bucket")
    make_cifar_like(root, "cifar", n=2000, seed=0)
    cache = tmp_path_factory.mktemp("cache")
    with run_server(
        root, "--store", root.as_uri(), "--cache-dir", str(cache), "--heartbeat-s", "0.2"
    ) as srv:
        yield srv


def _prometheus(tmp: Path, target: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: shardserve\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    log = tmp / "prometheus.log"
    with log.open("wb") as out:
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return prom, f"http://127.0.0.1:{port}", log


def _query(url: str, expr: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=scaled(10))
    return dict(r.json())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_every_dashboard_query_parses_and_names_exported_metrics(
    remote_server: ServerProc, tmp_path: Path
) -> None:
    chain = [{"name": "hflip", "params": {"layout": "CHW"}}]
    prom, url, log = _prometheus(tmp_path, remote_server.http_url.removeprefix("http://"))
    try:
        with Loader(
            remote_server.http_url,
            "cifar",
            batch_size=20,
            seed=0,
            prefetch=2,
            timeout=scaled(30.0),
            transforms=chain,
            transport="socket",
        ) as loader:
            loader.set_epoch(0)
            it = iter(loader)
            missing_data: set[str] = set(MUST_HAVE_DATA)
            deadline = time.monotonic() + scaled(60.0)
            while missing_data:  # keep the job streaming until every throughput panel has data
                assert prom.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, (
                    f"no data for {sorted(missing_data)} within the deadline"
                )
                next(it)
                time.sleep(0.1)  # a loop with compute, so the stall is below 1
                try:
                    for title, expr in queries():
                        if title in missing_data:
                            res = _query(url, expr)
                            if res.get("status") == "success" and res["data"]["result"]:
                                missing_data.discard(title)
                except httpx.TransportError:
                    continue  # Prometheus is still starting
            metrics = httpx.get(f"{remote_server.http_url}/metrics", timeout=scaled(10)).text
            exported = exported_names(metrics)
            problems = []
            for title, expr in queries():
                res = _query(url, expr)
                if res.get("status") != "success":
                    problems.append(f"{title}: {expr!r} does not parse: {res.get('error')}")
                for name in _NAME.findall(expr):
                    if name not in exported:
                        problems.append(f"{title}: {name} is not in /metrics")
            assert problems == []
    finally:
        prom.terminate()
        prom.wait(timeout=scaled(15))
