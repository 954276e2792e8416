"""Client pieces that need no server: rank discovery, endpoint choice, the small types."""

from __future__ import annotations

import pytest
import torch

from shardserve.client import BadRequest, VarTensor
from shardserve.client.connection import choose_endpoint
from shardserve.client.control import server_token
from shardserve.client.distributed import resolve_world
from shardserve.client.job import JobArgs
from shardserve.proto.api import ServerInfo
from shardserve.proto.messages import PROTOCOL_VERSION


def test_world_explicit_beats_env() -> None:
    """Explicit rank/world_size win over RANK/WORLD_SIZE."""
    w = resolve_world(0, 2, env={"RANK": "1", "WORLD_SIZE": "4"})
    assert (w.rank, w.world_size, w.source) == (0, 2, "explicit")


def test_world_from_env_and_default() -> None:
    """RANK/WORLD_SIZE/LOCAL_RANK are read when torch.distributed is not initialised; else 0 of 1."""
    w = resolve_world(env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (w.rank, w.world_size, w.local_rank, w.source) == (3, 4, 1, "env")
    assert resolve_world(env={}).world_size == 1


@pytest.mark.parametrize("have,lack", [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_half_of_the_env_pair_is_refused(have: str, lack: str) -> None:
    """RANK without WORLD_SIZE (or the reverse) is a launch mistake, not rank 0 of 1: every such
    process would read the whole epoch."""
    with pytest.raises(BadRequest, match=f"{have}='1' is set but {lack} is not"):
        resolve_world(env={have: "1"})


@pytest.mark.parametrize("rank,world", [(2, 2), (-1, 2), (0, 0)])
def test_world_out_of_range_is_refused(rank: int, world: int) -> None:
    """A rank outside 0 <= rank < world_size is a BadRequest naming both numbers."""
    with pytest.raises(BadRequest, match=f"rank {rank}"):
        resolve_world(rank, world, env={})


@pytest.mark.parametrize("fields", ["label", "xy"])
def test_fields_as_one_string_is_refused_not_split_into_letters(fields: str) -> None:
    """``fields="xy"`` would otherwise ask for fields ``x`` and ``y``."""
    with pytest.raises(BadRequest, match=rf"fields='{fields}' must be a list of field names"):
        JobArgs(
            dataset="cifar",
            batch_size=8,
            seed=0,
            shuffle=True,
            drop_last=False,
            fields=fields,
            collate=None,
            transforms=None,
            on_error=None,
        ).spec(1)


def test_a_token_with_a_trailing_newline_is_refused_without_showing_it(monkeypatch) -> None:
    """As read from a secret file: refused by name, the secret never in the message (httpx
    would say only "Illegal header value", as if the server were down)."""
    with pytest.raises(BadRequest, match="token has whitespace at its start or end") as e:
        server_token("s3cret\n")
    assert "s3cret" not in str(e.value)
    monkeypatch.setenv("SHARDSERVE_TOKEN", "s3cret\n")
    with pytest.raises(BadRequest, match="SHARDSERVE_TOKEN has whitespace"):
        server_token(None)
    assert server_token("s3cret") == "s3cret"


def test_a_url_without_its_scheme_is_a_bad_request() -> None:
    """``127.0.0.1:7070`` is refused as the typed error every other bad argument is."""
    from shardserve.client.control import ControlClient

    with pytest.raises(BadRequest, match=r"'127\.0\.0\.1:7070' must look like http://HOST:PORT"):
        ControlClient("127.0.0.1:7070")


def _info(*endpoints: str, boot_id: str = "boot-a") -> ServerInfo:
    return ServerInfo(
        version="0",
        protocols=[PROTOCOL_VERSION],
        data_endpoints=list(endpoints),
        host="h",
        boot_id=boot_id,
        auth_required=False,
    )


def test_endpoint_prefers_ipc_on_the_same_host(tmp_path) -> None:
    """Same boot id and a visible socket file -> ipc://; otherwise tcp://."""
    sock = tmp_path / "ss.sock"
    sock.touch()
    info = _info("tcp://127.0.0.1:7071", f"ipc://{sock}")
    assert choose_endpoint(info, "127.0.0.1", boot_id="boot-a") == f"ipc://{sock}"
    assert choose_endpoint(info, "127.0.0.1", boot_id="boot-b") == "tcp://127.0.0.1:7071"
    assert choose_endpoint(info, "127.0.0.1", "tcp", boot_id="boot-a") == "tcp://127.0.0.1:7071"
    sock.unlink()
    assert choose_endpoint(info, "127.0.0.1", boot_id="boot-a") == "tcp://127.0.0.1:7071"


def test_endpoint_rewrites_loopback_for_a_remote_server() -> None:
    """A server bound to loopback/0.0.0.0 is reached at the host of the HTTP URL."""
    assert choose_endpoint(_info("tcp://0.0.0.0:9"), "10.1.2.3", boot_id="x") == "tcp://10.1.2.3:9"
    assert (
        choose_endpoint(_info("tcp://127.0.0.1:9"), "gpu-node", boot_id="x") == "tcp://gpu-node:9"
    )
    assert (
        choose_endpoint(_info("tcp://0.0.0.0:9"), "127.0.0.1", boot_id="x") == "tcp://127.0.0.1:9"
    )
    with pytest.raises(BadRequest, match="ipc"):
        choose_endpoint(_info("tcp://0.0.0.0:9"), "127.0.0.1", "ipc", boot_id="x")


def test_vartensor_unbind_and_pad() -> None:
    """unbind() returns each sample in its shape; pad() fills past each sample's end."""
    values = torch.arange(2 * 2 + 3 * 2, dtype=torch.float32)
    v = VarTensor(values, torch.tensor([0, 4, 10]), torch.tensor([[2, 2], [3, 2]]))
    a, b = v.unbind()
    assert a.shape == (2, 2) and b.shape == (3, 2)
    assert torch.equal(b.flatten(), values[4:])
    dense, shapes = v.pad(value=-1)
    assert dense.shape == (2, 3, 2)
    assert torch.equal(dense[0, :2], a) and (dense[0, 2] == -1).all()
    assert torch.equal(shapes, v.shapes)
    assert len(v) == 2 and v.to("cpu").values.data_ptr() == values.data_ptr()
