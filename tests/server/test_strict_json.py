"""JSON bodies are held to their JSON types at the HTTP routes: a string or a boolean where a
number goes is a 422 naming the field and what to send, never coerced; the client, which
builds the same models from Python values (numpy integers, tuples), still works."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from shardserve.client import Loader
from shardserve.client.control import ControlClient
from tests.support.data import make_cifar_like
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

MIX = {"mixture": [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}], "batch_size": 8}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("strict")
    make_cifar_like(root, "a", n=64, seed=0)
    make_cifar_like(root, "b", n=64, seed=1)
    with run_server(root, "--state-dir", str(tmp_path_factory.mktemp("state"))) as s:
        yield s


def _send(srv: ServerProc, method: str, path: str, body: object) -> httpx.Response:
    return httpx.request(
        method, f"{srv.http_url}{path}", json=body, headers=srv.headers, timeout=scaled(30)
    )


def _mixture_job(srv: ServerProc) -> str:
    r = _send(srv, "POST", "/v1/jobs", MIX)
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


@pytest.mark.parametrize(
    ("body", "field", "send"),
    [
        ({"dataset": "a", "batch_size": True}, "batch_size", "must be a JSON integer"),
        ({"dataset": "a", "batch_size": "8"}, "batch_size", "must be a JSON integer"),
        ({"dataset": "a", "batch_size": 8.0}, "batch_size", "must be a JSON integer"),
        (
            {"dataset": "a", "batch_size": 8, "drop_last": "yes"},
            "drop_last",
            "must be true or false",
        ),
        ({"dataset": "a", "batch_size": 8, "fields": ["image", 3]}, "fields.1", "JSON string"),
        ({**MIX, "mixture": [{"name": "a", "weight": "0.5"}]}, "mixture.0.weight", "JSON number"),
        ({**MIX, "mixture": [{"name": "a", "weight": True}]}, "mixture.0.weight", "JSON number"),
        (
            {**MIX, "schedule": [{"at_step": 4, "weights": [1, "0"]}]},
            "schedule.0.weights.1",
            "JSON number",
        ),
    ],
    ids=[
        "bool-batch",
        "str-batch",
        "float-batch",
        "str-bool",
        "int-field",
        "str-weight",
        "bool-weight",
        "str-scheduled-weight",
    ],
)
def test_job_bodies_of_the_wrong_json_type_are_422(
    srv: ServerProc, body: dict, field: str, send: str
) -> None:
    r = _send(srv, "POST", "/v1/jobs", body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert f"{field}: must be " in detail and send in detail, detail


def test_mixture_weights_and_quarantine_ids_of_the_wrong_json_type_are_422(
    srv: ServerProc,
) -> None:
    job = _mixture_job(srv)
    for weights, field in (({"a": "0.5", "b": 1}, "weights.a"), ([True, 1], "weights.0")):
        r = _send(srv, "PUT", f"/v1/jobs/{job}/mixture", {"weights": weights})
        assert r.status_code == 422, r.text
        assert f"{field}: must be a JSON number" in r.json()["detail"], r.text
    r = _send(srv, "PUT", f"/v1/jobs/{job}/mixture", {"weights": {"a": 1, "b": 0}, "at_step": "9"})
    assert r.status_code == 422 and "at_step: must be a JSON integer" in r.text, r.text
    r = _send(srv, "POST", "/v1/datasets/a/quarantine", {"ids": ["3", 4], "reason": "bad"})
    assert r.status_code == 422, r.text
    assert "ids.0: must be a JSON integer" in r.json()["detail"], r.text
    r = _send(srv, "POST", "/v1/datasets/a/quarantine", {"ids": [True], "reason": "bad"})
    assert r.status_code == 422 and "ids.0: must be a JSON integer" in r.text, r.text
    listed = _send(srv, "GET", "/v1/datasets/a/quarantine", None).json()
    assert listed["total_ids"] == 0, listed
    r = _send(srv, "PUT", f"/v1/jobs/{job}/epoch", {"epoch": "1"})
    assert r.status_code == 422 and "epoch: must be a JSON integer" in r.text, r.text


def test_a_bad_share_name_says_what_a_share_name_may_be(srv: ServerProc) -> None:
    r = _send(srv, "POST", "/v1/jobs", {"dataset": "a", "batch_size": 8, "share": "my sweep"})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "share: " in detail and "a letter or digit first" in detail, detail
    assert "should match pattern" not in detail, detail


def test_the_same_values_sent_right_are_taken(srv: ServerProc) -> None:
    """Integers for weights, and every type as its schema says: the strict check refuses
    nothing valid."""
    r = _send(
        srv,
        "POST",
        "/v1/jobs",
        {
            "dataset": "a",
            "batch_size": 8,
            "drop_last": True,
            "fields": ["image"],
            "share": "sweep-3",
        },
    )
    assert r.status_code in (200, 201), r.text
    job = _mixture_job(srv)
    r = _send(srv, "PUT", f"/v1/jobs/{job}/mixture", {"weights": [0.5, 1], "at_step": 100})
    assert r.status_code == 200, r.text


def test_the_client_still_sends_numpy_integers_and_tuples(srv: ServerProc) -> None:
    """The Loader and the control client build the models from Python values: numpy
    integers (a batch size too, as ``range`` takes one), tuples and numpy floats go through."""
    with Loader(
        srv.http_url,
        dataset="a",
        batch_size=np.int64(8),
        seed=np.int64(3),
        fields=("image", "label"),
        timeout=60,
    ) as loader:
        batch = next(iter(loader))
        assert tuple(batch["label"].shape) == (8,)
    with Loader(
        srv.http_url, dataset={"a": np.float32(0.5), "b": 1}, batch_size=8, timeout=60
    ) as mixed:
        mixed.set_mixture({"a": np.float64(1.0), "b": np.int64(0)}, at_step=np.int64(40))
    with ControlClient(srv.http_url, token=srv.token) as control:
        listed = control.quarantine("b", np.arange(3, dtype=np.int64), reason="np ids")
    assert listed.total_ids == 3
