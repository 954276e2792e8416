"""Hostile HTTP input: schemathesis over the live OpenAPI schema, body limits, path traversal."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

MAX_EXAMPLES = 20


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/store`` holds ``cifar``; ``root/evil`` (outside the store) is a valid dataset too."""
    root = tmp_path_factory.mktemp("httpfuzz")
    make_cifar_like(root / "store", "cifar", n=100)
    shutil.copytree(root / "store" / "cifar", root / "evil")
    return root


@pytest.fixture(scope="module")
def http_server(layout: Path) -> Iterator[ServerProc]:
    with run_server(layout / "store", "--state-dir", str(layout / "state")) as srv:
        yield srv


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(layout: Path, tmp_path: Path) -> None:
    """Every operation of /openapi.json, fuzzed by schemathesis (coverage, fuzzing, stateful phases), never answers 5xx."""
    with run_server(layout / "store", "--state-dir", str(tmp_path / "state")) as srv:
        _schemathesis(srv, tmp_path)


def _schemathesis(http_server: ServerProc, tmp_path: Path) -> None:
    jid = httpx.post(
        f"{http_server.http_url}/v1/jobs",
        json={"dataset": "cifar", "batch_size": 10},
        timeout=scaled(10),
    ).json()["id"]
    # Real identifiers, so that operations on existing resources are reached too.
    config = tmp_path / "schemathesis.toml"
    config.write_text(f'[parameters]\n"path.job_id" = "{jid}"\n"path.name" = "cifar"\n')
    st = Path(sys.executable).parent / "st"
    cmd = [
        str(st),
        "--config-file",
        str(config),
        "run",
        f"{http_server.http_url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "5",
        "--workers",
        "1",
        "--request-timeout",
        "10",
        "--max-time",
        "15",
        "--no-color",
        "--generation-database",
        "none",
        "--report",
        "json",
        "--report-dir",
        str(tmp_path / "rep"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(100), cwd=tmp_path)
    reports = list((tmp_path / "rep").glob("*.json"))
    assert reports, (
        f"no schemathesis report; exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}"
    )
    report = json.loads(reports[0].read_text())
    cases = report["test_cases"]
    print(
        f"\nschemathesis: {cases['generated']} cases over {report['operations']['tested']} operations, "
        f"{cases['with_failures']} with failures, stop: {report['stop_reason']}, {report['running_time']:.1f} s"
    )
    assert report["operations"]["tested"] == report["operations"]["total"] >= 10
    assert cases["generated"] >= 200
    assert cases["with_failures"] == 0 and not report["failures"], out.stdout[-5000:]
    assert not report["errors"], report["errors"]
    assert out.returncode == 0, out.stdout[-3000:]
    assert "Traceback" not in http_server.log_tail(1 << 20)
    assert httpx.get(f"{http_server.http_url}/healthz", timeout=scaled(5)).status_code == 200


def test_oversized_bodies_are_refused_with_413(http_server: ServerProc) -> None:
    """A 2 MiB body is answered 413 whether its length is declared or it is streamed chunked, and the server keeps serving."""
    url = f"{http_server.http_url}/v1/jobs"
    big = b'{"dataset": "cifar", "batch_size": 1, "pad": "' + b"x" * (2 << 20) + b'"}'
    r = httpx.post(
        url, content=big, headers={"content-type": "application/json"}, timeout=scaled(30)
    )
    assert r.status_code == 413 and r.json()["code"] == "too_large"

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 64 << 10):
            yield big[i : i + 64 << 10]

    r = httpx.post(
        url, content=chunks(), headers={"content-type": "application/json"}, timeout=scaled(30)
    )
    assert r.status_code == 413
    r = httpx.put(f"{url}/0123456789abcdef/epoch", content=big, timeout=scaled(30))
    assert r.status_code == 413
    assert httpx.get(f"{http_server.http_url}/healthz", timeout=scaled(5)).status_code == 200


TRAVERSAL_PATHS = [
    "/v1/datasets/..%2F..%2Fetc",
    "/v1/datasets/..%2F..%2Fetc%2Fpasswd",
    "/v1/datasets/%2e%2e",
    "/v1/datasets/%2e%2e%2fevil",
    "/v1/datasets/..%2fevil",
    "/v1/datasets/..%5cevil",
    "/v1/datasets/%2Fetc%2Fpasswd",
    "/v1/datasets/evil%00",
    "/v1/datasets/cifar%00",
    "/v1/datasets/.shardserve",
    "/v1/datasets/%2e",
    "/v1/datasets/" + "a" * 5000,
]


@pytest.mark.parametrize("path", TRAVERSAL_PATHS)
def test_dataset_path_traversal_is_a_4xx(http_server: ServerProc, layout: Path, path: str) -> None:
    """A dataset name that tries to leave the store (encoded ``..``, ``/``, NUL, hidden, huge) gets a 4xx, never the dataset outside."""
    r = httpx.get(f"{http_server.http_url}{path}", timeout=scaled(10))
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
    assert "num_samples" not in r.text


BAD_NAMES = [
    "../evil",
    "../../etc/passwd",
    "..",
    ".",
    "/etc/passwd",
    str(Path("/") / "tmp" / "x"),
    "cifar/../../evil",
    "cifar/shards",
    "a/b",
    "evil\x00",
    "cifar\x00",
    "..\\evil",
    ".shardserve",
    "a" * 10_000,
    "",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:30] for n in BAD_NAMES])
def test_job_with_traversal_dataset_name_is_a_4xx(
    http_server: ServerProc, layout: Path, name: str
) -> None:
    """POST /v1/jobs with a dataset name containing ``/``, ``..``, NUL or 10k characters is a 4xx and creates no job on data outside the store."""
    before = httpx.get(f"{http_server.http_url}/v1/jobs", timeout=scaled(10)).json()
    r = httpx.post(
        f"{http_server.http_url}/v1/jobs",
        json={"dataset": name, "batch_size": 10},
        timeout=scaled(10),
    )
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
    body = r.json()
    assert body["code"] in ("bad_request", "dataset_not_found") and body["detail"]
    after = httpx.get(f"{http_server.http_url}/v1/jobs", timeout=scaled(10)).json()
    assert len(after) == len(before)
    assert not (layout / "evil" / ".shardserve").exists()


def test_job_status_size_does_not_scale_with_world_size(http_server: ServerProc) -> None:
    """A ~100-byte POST /v1/jobs with the largest allowed world_size gets a reply under 1 MiB (no amplification)."""
    r = httpx.post(
        f"{http_server.http_url}/v1/jobs",
        json={"dataset": "cifar", "batch_size": 1, "seed": 99, "world_size": 1 << 16},
        timeout=scaled(60),
    )
    assert r.status_code == 201
    try:
        assert len(r.content) < 1 << 20, f"{len(r.content)} bytes for one job"
    finally:
        httpx.delete(f"{http_server.http_url}/v1/jobs/{r.json()['id']}", timeout=scaled(60))
