"""The store CLI end to end in subprocesses: ingest, ls, inspect, verify, and a killed ingest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardserve.server.store.catalog import Store
from tests.store.conftest import CliResult, cli_command
from tests.support.data import make_cifar_like
from tests.support.slowness import scaled

Cli = Callable[..., CliResult]


def test_ingest_ls_inspect_verify(tmp_path: Path, store_root: Path, cli: Cli) -> None:
    """A real ingest publishes a dataset that ls, inspect and verify report."""
    np.savez(tmp_path / "d.npz", image=np.zeros((50, 3, 8, 8), np.uint8), label=np.arange(50))
    r = cli(
        "ingest",
        tmp_path / "d.npz",
        "--store",
        store_root,
        "--name",
        "tiny",
        "--shard-size",
        "4KiB",
    )
    assert r.returncode == 0, r.stderr
    assert "ingested tiny: 50 samples" in r.stdout and "shards" in r.stdout
    r = cli("ls", "--store", store_root)
    assert r.returncode == 0 and "tiny" in r.stdout and "image, label" in r.stdout
    r = cli("inspect", "--store", store_root, "tiny")
    assert r.returncode == 0
    assert "uint8    [3, 8, 8]" in r.stdout and "shards/shard-00000.arrow" in r.stdout
    r = cli("verify", "--store", store_root, "tiny")
    assert r.returncode == 0 and "shards ok" in r.stdout, r.stderr


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path, store_root: Path, cli: Cli) -> None:
    """Bad names, missing sources, existing datasets and unknown datasets fail with one clear line."""
    np.savez(tmp_path / "d.npz", v=np.zeros((5, 2)))
    cases = [
        (("ingest", tmp_path / "d.npz", "--store", store_root, "--name", "../up"), "not allowed"),
        (("ingest", tmp_path / "nope", "--store", store_root, "--name", "x"), "does not exist"),
        (("inspect", "--store", store_root, "ghost"), "no dataset 'ghost'"),
        (("ls",), "--store is required"),
        # A mistyped store is named, not listed as an empty one.
        (("ls", "--store", tmp_path / "no-such-store"), "no-such-store does not exist"),
        (("inspect", "--store", tmp_path / "d.npz", "x"), "d.npz is not a folder"),
    ]
    for args, needle in cases:
        r = cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr
    assert (
        cli(
            "ingest", tmp_path / "d.npz", "--store", store_root, "--name", "x", "--quiet"
        ).returncode
        == 0
    )
    r = cli("ingest", tmp_path / "d.npz", "--store", store_root, "--name", "x", "--quiet")
    assert r.returncode == 2 and "--overwrite" in r.stderr
    r = cli(
        "ingest", tmp_path / "d.npz", "--store", store_root, "--name", "x", "--quiet", "--overwrite"
    )
    assert r.returncode == 0, r.stderr


def test_verify_flags_bad_shard_with_exit_1(store_root: Path, cli: Cli) -> None:
    """verify exits 1 naming the shard for a flipped byte and for a truncated file."""
    m = make_cifar_like(store_root, n=300, shard_bytes=256 << 10)
    path = store_root / "cifar" / m.shards[1].path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    r = cli("verify", "--store", store_root, "cifar")
    assert r.returncode == 1 and "shard-00001.arrow failed its checksum" in r.stderr
    path.write_bytes(bytes(data[:1000]))
    r = cli("verify", "--store", store_root, "cifar")
    assert r.returncode == 1 and "shard-00001.arrow is truncated" in r.stderr


def test_verify_checks_block_checksums_too(store_root: Path, cli: Cli) -> None:
    """A manifest whose block checksums disagree with an intact file (a damaged manifest):
    verify exits 1 naming the shard and the block, as a read of that block would fail."""
    m = make_cifar_like(store_root, n=1000, shard_bytes=4 << 20)
    manifest = store_root / "cifar" / "manifest.json"
    doc = json.loads(manifest.read_text())
    blocks = doc["shards"][0]["blocks"]
    assert len(blocks) >= 32 and m.shards[0].block_bytes == 1 << 20
    doc["shards"][0]["blocks"] = blocks[:16] + ("0" if blocks[16] != "0" else "1") + blocks[17:]
    manifest.write_text(json.dumps(doc))
    r = cli("verify", "--store", store_root, "cifar")
    assert r.returncode == 1, r.stderr
    assert "shard-00000.arrow: block 1 does not match its checksum" in r.stderr, r.stderr


def test_killed_ingest_publishes_nothing_and_is_cleaned(
    tmp_path: Path, store_root: Path, cli: Cli
) -> None:
    """kill -9 mid-ingest leaves no listed dataset; the next ingest removes the leftover temp dir."""
    src = np.lib.format.open_memmap(
        tmp_path / "big.npy", mode="w+", dtype=np.uint8, shape=(40_000, 1024)
    )
    src[:, 0] = 1
    src.flush()
    del src
    env = {k: v for k, v in os.environ.items() if k != "SHARDSERVE_STORE"}
    proc = subprocess.Popen(
        [
            *cli_command(),
            "ingest",
            str(tmp_path / "big.npy"),
            "--store",
            str(store_root),
            "--name",
            "big",
            "--shard-size",
            "16KiB",
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    deadline = time.monotonic() + scaled(60)
    try:
        while time.monotonic() < deadline:  # wait until it has written several shards
            temps = list(store_root.glob(".tmp-big-*/shards/*.arrow"))
            if len(temps) >= 5 or proc.poll() is not None:
                break
            time.sleep(0.01)
        assert proc.poll() is None, (
            "ingest finished before it could be killed; make the source bigger"
        )
        assert len(temps) >= 5, "ingest wrote no shards within 60 s"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=scaled(30))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=scaled(30))
    assert Store(store_root).list() == []
    r = cli("ls", "--store", store_root)
    assert r.returncode == 0 and "big" not in r.stdout and "no datasets" in r.stderr
    assert list(store_root.glob(".tmp-big-*"))  # the leftover is still there ...
    np.save(tmp_path / "small.npy", np.zeros((3, 2), np.uint8))
    assert (
        cli(
            "ingest", tmp_path / "small.npy", "--store", store_root, "--name", "small", "--quiet"
        ).returncode
        == 0
    )
    assert not list(store_root.glob(".tmp-*"))  # ... until the next ingest cleans it
    assert [m.name for m in Store(store_root).list()] == ["small"]


def test_store_from_environment(tmp_path: Path, store_root: Path) -> None:
    """SHARDSERVE_STORE supplies --store when it is not given."""
    make_cifar_like(store_root, n=10)
    env = {**os.environ, "SHARDSERVE_STORE": str(store_root)}
    r = subprocess.run(
        [*cli_command(), "ls"], capture_output=True, text=True, env=env, timeout=scaled(60)
    )
    assert r.returncode == 0 and "cifar" in r.stdout


def test_ls_of_an_empty_object_store_never_prints_its_credentials(tmp_path: Path, cli: Cli) -> None:
    """A query or user info in ``--store`` may carry a secret: the message names the store
    without it."""
    (tmp_path / "empty").mkdir()
    r = cli("ls", "--store", (tmp_path / "empty").as_uri() + "?secret=hunter2")
    assert r.returncode == 0, r.stderr
    assert "no datasets in file://" in r.stderr
    assert "hunter2" not in r.stderr + r.stdout
