"""One rule for loopback and endpoints, shared by server and client; one dtype table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardserve.proto.dtypes import BINARY, DTYPE_CODES, DTYPE_NAMES, ITEMSIZE, NUMERIC_DTYPES
from shardserve.proto.endpoints import (
    endpoint_scheme,
    is_loopback_host,
    is_wildcard_host,
    reaches_this_host,
    split_host_port,
    tcp_host,
)
from shardserve.proto.host import read_boot_id


@pytest.mark.parametrize(
    ("host", "loopback", "wildcard"),
    [
        ("127.0.0.1", True, False),
        ("127.3.2.1", True, False),
        ("::1", True, False),
        ("[::1]", True, False),
        ("localhost", True, False),
        ("LocalHost", True, False),
        ("ip6-localhost", True, False),
        ("0.0.0.0", False, True),
        ("::", False, True),
        ("*", False, True),
        ("10.0.0.5", False, False),
        ("trainer.example", False, False),
    ],
)
def test_loopback_and_wildcard_hosts(host: str, loopback: bool, wildcard: bool) -> None:
    """A wildcard bind address is not loopback (it listens everywhere) but connecting to it
    stays on this host; only loopback addresses and names are loopback."""
    assert is_loopback_host(host) is loopback
    assert is_wildcard_host(host) is wildcard
    assert reaches_this_host(host) is (loopback or wildcard)


def test_endpoints_parse_or_say_what_to_write() -> None:
    """tcp:// and ipc:// endpoints parse; anything else is refused naming both schemes."""
    assert endpoint_scheme("tcp://127.0.0.1:7071") == "tcp"
    assert endpoint_scheme("ipc:///run/ss.sock") == "ipc"
    assert tcp_host("tcp://[::1]:7071") == "::1" and tcp_host("ipc:///x") is None
    assert split_host_port("10.0.0.5:80") == ("10.0.0.5", 80)
    for bad in ("udp://127.0.0.1:1", "127.0.0.1:7071", "tcp:/x"):
        with pytest.raises(ValueError, match=r"tcp:// or ipc://"):
            endpoint_scheme(bad)
    with pytest.raises(ValueError, match="HOST:PORT"):
        tcp_host("tcp://nohost")
    with pytest.raises(ValueError, match=r"outside 0\.\.65535"):
        split_host_port("h:70000")


def test_boot_id_reads_the_file_or_is_empty(tmp_path: Path) -> None:
    """The boot id is the file's stripped text, and '' where the file is missing."""
    f = tmp_path / "boot_id"
    f.write_text("abc-123\n")
    assert read_boot_id(f) == "abc-123"
    assert read_boot_id(tmp_path / "missing") == ""


def test_one_dtype_table_agrees_with_numpy() -> None:
    """Wire codes are unique and invert; item sizes are numpy's; binary has no wire code."""
    assert set(DTYPE_CODES) == set(NUMERIC_DTYPES) == set(ITEMSIZE)
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)
    assert {DTYPE_NAMES[c]: c for c in DTYPE_NAMES} == DTYPE_CODES
    assert all(np.dtype(n).itemsize == ITEMSIZE[n] for n in NUMERIC_DTYPES)
    assert BINARY not in DTYPE_CODES
