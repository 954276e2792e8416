"""The HTTP control plane of a real server subprocess, through httpx."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardserve.proto.api import CreatedJob, DatasetInfo, JobStatus, ServerInfo
from shardserve.proto.messages import SUPPORTED_PROTOCOLS
from tests.server.conftest import CIFAR_N
from tests.server.rawclient import RawStream, zmq_context
from tests.support.server import ServerProc
from tests.support.slowness import scaled


@pytest.fixture
def http(server: ServerProc) -> httpx.Client:
    with httpx.Client(base_url=server.http_url, timeout=scaled(10)) as client:
        yield client


def test_health_ready_and_info(http: httpx.Client, server: ServerProc) -> None:
    """/healthz and /readyz answer 200 and /v1/info lists the endpoints the server actually bound."""
    assert http.get("/healthz").status_code == 200
    assert http.get("/readyz").json() == {"ready": True, "reason": "ready"}
    info = ServerInfo.model_validate(http.get("/v1/info").json())
    assert info.data_endpoints == server.data_endpoints and info.protocols == list(
        SUPPORTED_PROTOCOLS
    )
    assert not info.auth_required and all(":0" not in e for e in info.data_endpoints)


def test_datasets_listed_and_described(http: httpx.Client) -> None:
    """The store's dataset is listed and described; an unknown or unsafe name is a 4xx, never a path outside the store."""
    (listed,) = [DatasetInfo.model_validate(d) for d in http.get("/v1/datasets").json()]
    one = DatasetInfo.model_validate(http.get("/v1/datasets/cifar").json())
    assert (
        listed == one
        and one.num_samples == CIFAR_N
        and [f["name"] for f in one.fields] == ["image", "label"]
    )
    r = http.get("/v1/datasets/nope")
    assert (
        r.status_code == 404
        and r.json()["code"] == "dataset_not_found"
        and "cifar" in r.json()["detail"]
    )
    for bad in ("..", "%2E%2E%2Fetc", ".shardserve", "a%20b"):
        assert http.get(f"/v1/datasets/{bad}").status_code in (404, 422), bad


def test_job_creation_is_idempotent(http: httpx.Client) -> None:
    """The same spec gets the same id: 201 the first time, 200 after, same body shape."""
    spec = {"dataset": "cifar", "batch_size": 32, "seed": 4242, "world_size": 4}
    first, again = (
        http.post("/v1/jobs", json=spec),
        http.post("/v1/jobs", json=dict(reversed(spec.items()))),
    )
    assert (first.status_code, again.status_code) == (201, 200)
    a, b = CreatedJob.model_validate(first.json()), CreatedJob.model_validate(again.json())
    assert a.id == b.id and a.created and not b.created
    status = JobStatus.model_validate(http.get(f"/v1/jobs/{a.id}").json())
    # Ranks appear once they open a stream; a new job has none yet.
    assert status.state == "pending" and status.ranks == [] and status.batches_per_epoch == 8
    assert a.id in {j["id"] for j in http.get("/v1/jobs").json()}


@pytest.mark.parametrize(
    ("spec", "status", "says"),
    [
        ({"dataset": "missing", "batch_size": 8}, 404, "cifar"),
        ({"dataset": "cifar", "batch_size": 0}, 422, "batch_size"),
        ({"dataset": "cifar", "batch_size": 8, "world_size": 0}, 422, "world_size"),
        ({"dataset": "cifar", "batch_size": 8, "fields": ["image", "pixels"]}, 422, "'label'"),
        ({"dataset": "cifar", "batch_size": 8, "shuffle": "sometimes"}, 422, "shuffle"),
        ({"dataset": "cifar", "batch_size": 8, "colour": "red"}, 422, "colour"),
        ({"dataset": "../etc", "batch_size": 8}, 422, "dataset"),
    ],
)
def test_bad_job_specs_say_what_to_change(
    http: httpx.Client, spec: dict, status: int, says: str
) -> None:
    """A spec that cannot be served is a 404/422 ErrorBody naming the offending field."""
    r = http.post("/v1/jobs", json=spec)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"code", "detail"} and says in r.json()["detail"]


def test_unknown_job_is_404(http: httpx.Client) -> None:
    """GET, PUT epoch and DELETE of an unknown job id are 404 with code job_not_found."""
    for method, path, body in [
        ("GET", "/v1/jobs/feedface", None),
        ("PUT", "/v1/jobs/feedface/epoch", {"epoch": 1}),
        ("DELETE", "/v1/jobs/feedface", None),
    ]:
        r = http.request(method, path, json=body)
        assert r.status_code == 404 and r.json()["code"] == "job_not_found", (method, r.text)


def test_put_epoch_validates_and_applies(http: httpx.Client, server: ServerProc) -> None:
    """PUT epoch sets the job's epoch and seed; the next stream is welcomed with that seed; a negative epoch is 422."""
    jid = http.post("/v1/jobs", json={"dataset": "cifar", "batch_size": 100, "seed": 1}).json()[
        "id"
    ]
    assert http.put(f"/v1/jobs/{jid}/epoch", json={"epoch": -1}).status_code == 422
    st = http.put(f"/v1/jobs/{jid}/epoch", json={"epoch": 6, "seed": 99}).json()
    assert (st["epoch"], st["seed"]) == (6, 99)
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(jid, epoch=6)
        from shardserve.proto.messages import Welcome

        assert s.recv_kind(Welcome).seed == 99
        s.close()


def test_metrics_parse_as_prometheus_text(http: httpx.Client, server: ServerProc) -> None:
    """/metrics parses as Prometheus text and counts the batches and bytes a stream received."""
    jid = http.post("/v1/jobs", json={"dataset": "cifar", "batch_size": 250, "seed": 31}).json()[
        "id"
    ]
    with zmq_context() as ctx:
        s = RawStream(ctx, server.tcp_endpoint)
        s.hello(jid, credit=4)
        from shardserve.proto.messages import Welcome

        s.recv_kind(Welcome)
        batches, _ = s.read_epoch()
        s.close()
    fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in (
        "shardserve_batches_sent",
        "shardserve_bytes_sent",
        "shardserve_assembly_seconds",
        "shardserve_streams",
        "shardserve_store_bytes",
    ):
        assert name in fams, name
    sent = {s.name: s.value for s in fams["shardserve_batches_sent"].samples}
    assert sent["shardserve_batches_sent_total"] >= len(batches) == 4
    assert fams["shardserve_store_bytes"].samples[0].value > CIFAR_N * 3072


def test_status_page_lists_datasets_and_jobs(http: httpx.Client) -> None:
    """GET / is an HTML page listing the dataset and a job with one row per rank."""
    jid = http.post(
        "/v1/jobs", json={"dataset": "cifar", "batch_size": 10, "world_size": 2}
    ).json()["id"]
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    # No rank has opened a stream yet: none is listed, and the job says so.
    assert "cifar" in r.text and jid in r.text and "0 of 2 ranks connected" in r.text


def test_oversized_body_is_413(http: httpx.Client) -> None:
    """A request body over the 1 MiB limit is refused with 413, declared or streamed."""
    big = b"x" * (2 << 20)
    assert (
        http.post("/v1/jobs", content=big, headers={"content-type": "application/json"}).status_code
        == 413
    )

    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    assert (
        http.post(
            "/v1/jobs", content=chunks(), headers={"content-type": "application/json"}
        ).status_code
        == 413
    )


def test_openapi_describes_the_models(http: httpx.Client) -> None:
    """The OpenAPI schema names every request and response model of the job routes."""
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert {
        "JobSpec",
        "CreatedJob",
        "JobStatus",
        "RankStatus",
        "EpochUpdate",
        "ErrorBody",
        "DatasetInfo",
    } <= set(schemas)
