"""The images and the compose stack, run for real with podman.

``bash docker/ci-engine.sh`` builds ``shardserve`` and ``shardserve-trainer`` and leaves
``docker/.engine-ready``; without it (no root, no apt, or the script not run) every test here
skips with one line. The stack is started the way the README's podman path says, with
``docker/podman-stack.sh`` (the compose file's services as ``podman run``), under a project
name of its own, free loopback ports and a random token, and removed afterwards with its volumes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.ops.sidecar import ROOT
from tests.support.server import free_port
from tests.support.slowness import scaled

READY = ROOT / "docker" / ".engine-ready"
STACK_SH = ROOT / "docker" / "podman-stack.sh"
PROBE = ROOT / "tests" / "ops" / "container_probe.py"
CONTAINERS_CONF = ROOT / "docker" / "podman" / "containers.conf"
#: Sizes stated in the README (podman on a Debian bookworm base; Docker's python:3.11-slim is
#: about 70 MB smaller): the server image is ~475 MB, the CPU trainer ~1.4 GB.
SERVER_IMAGE_MAX_BYTES = 520_000_000
TRAINER_IMAGE_MAX_BYTES = 1_500_000_000
IDS = 2000  # samples of the `ids` dataset: idx = 0..IDS-1, so each delivery can be counted
UID = "10001"
STEP_TIMEOUT_S = 120


def _engine_skip_reason() -> str | None:
    if not READY.exists():
        return "container images not built: run `bash docker/ci-engine.sh` (root + apt) first"
    if shutil.which("podman") is None:
        return "podman is not on PATH"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(300)]
_reason = _engine_skip_reason()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)  # one line in the summary, not one per test


@dataclass
class Stack:
    """One project of the compose stack, run by docker/podman-stack.sh."""

    name: str
    env: dict[str, str]
    http_url: str
    image: str
    trainer_image: str

    @property
    def server(self) -> str:
        return f"{self.name}-server"

    def script(
        self, *args: str, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(STACK_SH), *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=scaled(STEP_TIMEOUT_S) if timeout is None else timeout,
        )

    def podman(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=scaled(STEP_TIMEOUT_S) if timeout is None else timeout,
        )

    def probe_cmd(
        self, *probe_args: str, podman_opts: str = ""
    ) -> tuple[list[str], dict[str, str]]:
        """The trainer service running tests/ops/container_probe.py instead of torchrun."""
        opts = f"--entrypoint python --volume {PROBE}:/probe.py:ro {podman_opts}"
        argv = [
            "bash",
            str(STACK_SH),
            "trainer",
            "/probe.py",
            "http://server:7070",
            *probe_args,
            "--timeout",
            str(scaled(60.0)),
        ]
        return argv, {**self.env, "SHARDSERVE_TRAINER_OPTS": opts}

    def probe(self, *probe_args: str, podman_opts: str = "") -> tuple[dict, str]:
        argv, env = self.probe_cmd(*probe_args, podman_opts=podman_opts)
        out = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=scaled(STEP_TIMEOUT_S)
        )
        assert out.returncode == 0, (
            f"probe failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        )
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _check(out: subprocess.CompletedProcess[str], what: str) -> str:
    assert out.returncode == 0, (
        f"{what} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    images = dict(line.split("=", 1) for line in READY.read_text().split())
    http_port, data_port = free_port(), free_port()
    name = f"sstest{os.getpid()}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SHARDSERVE_")},
        "CONTAINERS_CONF": str(CONTAINERS_CONF),
        "SHARDSERVE_STACK": name,
        "SHARDSERVE_TOKEN": secrets.token_hex(16),
        "SHARDSERVE_HTTP_PORT": str(http_port),
        "SHARDSERVE_DATA_PORT": str(data_port),
        **images,
    }
    s = Stack(
        name,
        env,
        f"http://127.0.0.1:{http_port}",
        images["SHARDSERVE_IMAGE"],
        images["SHARDSERVE_TRAINER_IMAGE"],
    )
    s.script("down", "-v")
    try:
        _check(s.script("ingest"), "podman-stack.sh ingest")
        # A dataset whose `idx` field numbers the samples, ingested by the image's own uid from a
        # folder it can read, into the same store volume.
        src = Path(tempfile.mkdtemp(prefix="shardserve-ids-"))
        try:
            src.chmod(0o755)
            np.savez(
                src / "ids.npz",
                idx=np.arange(IDS, dtype=np.int64),
                x=np.arange(IDS * 4, dtype=np.float32).reshape(IDS, 4),
            )
            (src / "ids.npz").chmod(0o644)
            _check(
                s.podman(
                    "run",
                    "--rm",
                    "--volume",
                    f"{src}:/data/in:ro",
                    "--volume",
                    f"{name}-store:/data/store",
                    "--entrypoint",
                    "shardserve",
                    s.image,
                    "ingest",
                    "/data/in/ids.npz",
                    "--store",
                    "/data/store",
                    "--name",
                    "ids",
                ),
                "ingest of the ids dataset",
            )
        finally:
            shutil.rmtree(src)
        _check(s.script("server"), "podman-stack.sh server")
        yield s
    finally:
        if os.environ.get("SHARDSERVE_KEEP_STACK") != "1":
            s.script("down", "-v")


def _headers(stack: Stack) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.env['SHARDSERVE_TOKEN']}"}


# --- the images ------------------------------------------------------------------------------


def _image_size(image: str) -> int:
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", image],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env={**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)},
    )
    return int(_check(out, f"podman image inspect {image}").strip())


def test_server_image_has_no_torch_and_stays_small(stack: Stack) -> None:
    """The server image carries no torch (nor CUDA) and is under SERVER_IMAGE_MAX_BYTES."""
    code = "import importlib.util as u; print([m for m in ('torch', 'nvidia') if u.find_spec(m)])"
    found = _check(
        stack.podman("run", "--rm", "--entrypoint", "python", stack.image, "-c", code),
        "python in the server image",
    )
    assert found.strip() == "[]", f"the server image has {found.strip()}"
    size = _image_size(stack.image)
    assert size < SERVER_IMAGE_MAX_BYTES, f"server image is {size / 1e6:.0f} MB"


def test_server_image_has_the_compiled_kernels(stack: Stack) -> None:
    """The wheel stage compiles the transforms' C kernels: the server image runs them, not
    their numpy fallback."""
    code = "from shardserve.server.transforms.compiled import MISSING; print(MISSING)"
    missing = _check(
        stack.podman("run", "--rm", "--entrypoint", "python", stack.image, "-c", code),
        "python in the server image",
    )
    assert missing.strip() == "[]", missing


def test_trainer_image_has_a_cpu_torch(stack: Stack) -> None:
    """The trainer's torch is the CPU build (no CUDA wheels pulled) and the image stays under TRAINER_IMAGE_MAX_BYTES."""
    code = (
        "import importlib.metadata as m, torch; "
        "print(torch.__version__, torch.version.cuda, "
        "sorted(d.metadata['Name'] for d in m.distributions() if 'nvidia' in d.metadata['Name'].lower()))"
    )
    out = _check(
        stack.podman("run", "--rm", "--entrypoint", "python", stack.trainer_image, "-c", code),
        "python in the trainer image",
    ).split()
    assert out[0].endswith("+cpu") and out[1] == "None" and out[2] == "[]", out
    size = _image_size(stack.trainer_image)
    assert size < TRAINER_IMAGE_MAX_BYTES, f"trainer image is {size / 1e6:.0f} MB"


def test_missing_token_refuses_a_public_bind(stack: Stack) -> None:
    """The image listens on 0.0.0.0, so without SHARDSERVE_TOKEN the server exits saying to set it; the stack script refuses too."""
    out = stack.podman(
        "run", "--rm", "--name", f"{stack.name}-notoken", stack.image, timeout=scaled(60)
    )
    assert out.returncode != 0, out.stdout
    assert (
        "SHARDSERVE_TOKEN" in out.stderr + out.stdout and "refusing" in out.stderr + out.stdout
    ), out.stderr
    env = {k: v for k, v in stack.env.items() if k != "SHARDSERVE_TOKEN"}
    script = subprocess.run(
        ["bash", str(STACK_SH), "up"], env=env, capture_output=True, text=True, timeout=scaled(60)
    )
    assert script.returncode != 0 and "set SHARDSERVE_TOKEN" in script.stderr, script.stderr


# --- the running stack -----------------------------------------------------------------------


def test_healthcheck_turns_healthy(stack: Stack) -> None:
    """The image's HEALTHCHECK (kept by the docker image format) passes on the server and fails on a container whose server is not up."""
    status = _check(
        stack.podman("inspect", "--format", "{{.State.Health.Status}}", stack.server),
        "podman inspect",
    )
    assert status.strip() == "healthy"
    assert httpx.get(f"{stack.http_url}/healthz", timeout=scaled(5)).status_code == 200
    idle = f"{stack.name}-idle"
    _check(
        stack.podman("run", "--detach", "--name", idle, "--entrypoint", "sleep", stack.image, "60"),
        "podman run (idle)",
    )
    try:
        out = stack.podman("healthcheck", "run", idle)
        assert out.returncode != 0 and "unhealthy" in out.stdout + out.stderr, out
    finally:
        stack.podman("rm", "--force", "--volumes", "--time", "0", idle)


def test_store_volume_is_read_only_to_the_server_and_readable_by_its_uid(stack: Stack) -> None:
    """The server runs as uid 10001, cannot write the store volume, reads every file in it, and serves what ingest put there."""
    assert _check(stack.podman("exec", stack.server, "id", "-u"), "id").strip() == UID
    touch = stack.podman("exec", stack.server, "touch", "/data/store/written-by-server")
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr, touch
    read_all = (
        "import pathlib; fs = [p for p in pathlib.Path('/data/store').rglob('*') if p.is_file()]; "
        "print(len(fs), sum(len(p.read_bytes()) for p in fs))"
    )
    files, size = _check(
        stack.podman("exec", stack.server, "python", "-c", read_all), "read store"
    ).split()
    assert int(files) > 0 and int(size) > 0
    names = {
        d["name"]
        for d in httpx.get(
            f"{stack.http_url}/v1/datasets", headers=_headers(stack), timeout=scaled(10)
        ).json()
    }
    assert {"digits-train", "digits-test", "ids"} <= names, names


def test_readme_stack_trains(stack: Stack) -> None:
    """`podman-stack.sh up` (= `docker compose up trainer`) trains the digits CNN on 2 ranks to a useful accuracy."""
    out = _check(stack.script("up", timeout=scaled(240)), "podman-stack.sh up")
    last = out.strip().splitlines()[-1]
    assert "test accuracy" in last, out[-2000:]
    accuracy = float(last.split("test accuracy")[1].split(",")[0])
    assert accuracy > 0.8, last


def test_trainer_sharing_the_ipc_namespace_reads_shared_memory(stack: Stack) -> None:
    """The trainer container in the server's IPC namespace gets its batches through shared-memory slots, each sample once."""
    report, stderr = stack.probe("ids")
    assert report["transport"] == "shm", (report["transport"], stderr[-2000:])
    assert sorted(report["seen"]) == list(range(IDS))
    assert "cannot map the server's shared memory" not in stderr


def test_trainer_in_its_own_ipc_namespace_falls_back_to_the_socket(stack: Stack) -> None:
    """Without the shared IPC namespace the slots cannot be mapped: the client logs the fallback line and reads over the socket."""
    report, stderr = stack.probe("ids", podman_opts="--ipc private")
    assert report["transport"] in ("ipc", "tcp"), report["transport"]
    assert "cannot map the server's shared memory" in stderr and "using the socket" in stderr, (
        stderr[-2000:]
    )
    assert sorted(report["seen"]) == list(range(IDS))


def test_server_container_killed_mid_epoch_and_restarted(stack: Stack) -> None:
    """`podman kill` of the server mid-epoch, then `podman start`: the trainer finishes the epoch with every sample exactly once."""
    argv, env = stack.probe_cmd("ids", "--sleep", "0.05")
    # As a context manager the pipes are closed however the test ends: a Popen left to the
    # garbage collector warns, and pytest pins that warning on whichever test runs then.
    with subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + scaled(STEP_TIMEOUT_S)
            for line in proc.stdout:
                if line.strip() == "batch 20":
                    break
                assert time.monotonic() < deadline, "the probe did not reach batch 20"
            else:
                pytest.fail(
                    f"the probe ended before batch 20: {proc.stderr.read() if proc.stderr else ''}"
                )
            _check(stack.podman("kill", stack.server), "podman kill")
            _check(stack.podman("start", stack.server), "podman start")
            rest, stderr = proc.communicate(timeout=scaled(STEP_TIMEOUT_S))
        finally:
            if proc.poll() is None:
                proc.kill()
    if proc.returncode != 0:
        server_log = stack.podman("logs", "--tail", "40", stack.server)
        pytest.fail(
            f"the probe failed ({proc.returncode}):\n{stderr[-6000:]}\n--- the server's last "
            f"log lines:\n{server_log.stdout[-6000:]}{server_log.stderr[-3000:]}"
        )
    report = json.loads(rest.strip().splitlines()[-1])
    assert report["reconnects"] >= 1, report
    assert len(report["seen"]) == IDS and sorted(report["seen"]) == list(range(IDS)), (
        f"{len(report['seen'])} deliveries, {len(set(report['seen']))} distinct of {IDS}"
    )
    deadline = time.monotonic() + scaled(30)
    while stack.podman("healthcheck", "run", stack.server).returncode != 0:
        assert time.monotonic() < deadline, "the restarted server did not turn healthy in 30 s"
        time.sleep(1)
