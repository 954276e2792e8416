"""examples/train_lightning.py, run as a user would against a real server."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def digits_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """The README's steps: prepare the digits, ingest both splits, serve."""
    work = tmp_path_factory.mktemp("digits")
    store = work / "store"
    train, test = work / "digits-train.npz", work / "digits-test.npz"
    steps = [
        [sys.executable, "examples/prepare_digits.py", str(train), str(test)],
        *(
            [
                sys.executable,
                "-m",
                "shardserve.server",
                "ingest",
                str(src),
                "--store",
                str(store),
                "--name",
                src.stem,
                "--quiet",
            ]
            for src in (train, test)
        ),
    ]
    for cmd in steps:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
        assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    with run_server(store) as srv:
        yield srv


def test_train_lightning_example_learns(digits_server: ServerProc) -> None:
    """The Lightning example trains the digits CNN on one device and reaches a real accuracy."""
    cmd = [
        sys.executable,
        "examples/train_lightning.py",
        "--url",
        digits_server.http_url,
        "--epochs",
        "3",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=scaled(180))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = re.search(r"val accuracy ([0-9.]+) after 3 epochs on 1 device", r.stdout)
    assert m and float(m.group(1)) > 0.8, r.stdout[-2000:]
