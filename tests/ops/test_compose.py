"""``docker-compose config`` (Debian's 1.29, what CI runs) accepts the real file and rejects
broken copies of it, and the resolved file has the sidecar's shape.

No engine runs here: ``config`` validates schema, interpolation and references between
services, which is as far as a machine without Docker can go.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.ops.sidecar import (
    COMPOSE,
    COMPOSE_BIN,
    ROOT,
    compose_config,
    dockerfile,
    env_pairs,
    run_compose,
)

pytestmark = pytest.mark.skipif(COMPOSE_BIN is None, reason="docker-compose is not on PATH")

# (what is broken, text in the real file, replacement, words the error must contain)
BREAKAGES = [
    ("typo in a service key", "    shm_size: 2gb", "    shm_sise: 2gb", "shm_sise"),
    (
        "depends_on names a missing service",
        "      server:\n        condition",
        "      sever:\n        condition",
        "sever",
    ),
    ("ipc joins a missing service", 'ipc: "service:server"', 'ipc: "service:nosuch"', "nosuch"),
    (
        "unknown depends_on condition",
        "condition: service_healthy",
        "condition: service_healty",
        "service_healty",
    ),
    ("undeclared named volume", "      - state:/data/state", "      - staet:/data/state", "staet"),
]


def test_real_compose_file_validates() -> None:
    """`docker-compose config -q` exits 0 on the real file when SHARDSERVE_TOKEN is set."""
    out = run_compose("config", "-q")
    assert out.returncode == 0, out.stderr


def test_compose_refuses_to_start_without_a_token() -> None:
    """Without SHARDSERVE_TOKEN the file does not interpolate, and the message says to set it."""
    out = run_compose("config", "-q", env={})
    assert out.returncode != 0
    assert "SHARDSERVE_TOKEN" in out.stderr, out.stderr


@pytest.mark.parametrize(("what", "old", "new", "named"), BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_broken_copy_is_rejected(tmp_path: Path, what: str, old: str, new: str, named: str) -> None:
    """A copy of the file with one deliberate mistake fails `docker-compose config -q`, naming the mistake."""
    text = COMPOSE.read_text()
    assert text.count(old) == 1, (
        f"the breakage {what!r} no longer matches the file exactly once: {old!r}"
    )
    # The copy sits in a tree shaped like the repository so build contexts still resolve.
    shutil.copytree(ROOT / "docker", tmp_path / "docker")
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new))
    out = run_compose("config", "-q", file=broken)
    assert out.returncode != 0, f"docker-compose accepted a file with: {what}"
    assert named in out.stderr, out.stderr


# --- the sidecar's shape ------------------------------------------------------------


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return compose_config()["services"]  # type: ignore[no-any-return]


def test_published_ports_bind_to_loopback_only(services: dict[str, Any]) -> None:
    """Every published port is bound to 127.0.0.1, so the sidecar is not reachable from the network."""
    published = [(name, p) for name, svc in services.items() for p in svc.get("ports", [])]
    assert published, "the server should publish its HTTP and data ports on loopback"
    for name, p in published:
        host_ip = p.get("host_ip") if isinstance(p, dict) else str(p).rsplit(":", 2)[0]
        assert host_ip == "127.0.0.1", f"service {name!r} publishes {p} beyond loopback"


def test_trainer_shares_the_servers_ipc_namespace_and_socket_dir(services: dict[str, Any]) -> None:
    """The trainer joins the server's IPC namespace (server shareable, shm_size set) and mounts the folder of its ipc socket."""
    server, trainer = services["server"], services["trainer"]
    assert server.get("ipc") == "shareable", server.get("ipc")
    assert trainer.get("ipc") == "service:server", trainer.get("ipc")
    assert server.get("shm_size"), "the server needs shm_size for its shared-memory slots"
    ipc_env = {}
    for arg in dockerfile(ROOT / "docker" / "Dockerfile")[-1].all("ENV"):
        ipc_env.update(env_pairs(arg))
    ipc_dir = str(Path(ipc_env["SHARDSERVE_IPC"]).parent)

    def volume_at(svc: dict[str, Any]) -> str | None:
        for v in svc.get("volumes", []):
            src, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
            if target == ipc_dir:
                return str(src)
        return None

    assert volume_at(server) is not None, f"the server does not mount a volume at {ipc_dir}"
    assert volume_at(trainer) == volume_at(server), (
        "the trainer does not see the server's ipc socket"
    )


def test_trainer_waits_for_a_healthy_server(services: dict[str, Any]) -> None:
    """The trainer depends on the server with condition service_healthy, and the server image has a HEALTHCHECK."""
    dep = services["trainer"].get("depends_on", {})
    assert dep.get("server", {}).get("condition") == "service_healthy", dep
    assert dockerfile(ROOT / "docker" / "Dockerfile")[-1].last("HEALTHCHECK"), "no HEALTHCHECK"


def _image_uid(dockerfile_path: Path) -> str | None:
    """The uid the final stage runs as: its last USER, resolved through `useradd --uid N NAME`."""
    final = dockerfile(dockerfile_path)[-1]
    user = final.last("USER")
    if user is None:
        return "0"
    if user.split(":")[0].isdigit():
        return user.split(":")[0]
    for run in final.all("RUN"):
        m = re.search(rf"useradd\b[^&;]*--uid[ =](\d+)[^&;]*\b{re.escape(user)}\b", run)
        if m:
            return m.group(1)
    return None


def test_trainer_and_server_run_as_the_same_uid(services: dict[str, Any]) -> None:
    """Trainer and server run as one uid: the server's shared-memory slots are mode 0600 and its ipc socket needs write access."""
    uids = {}
    for name in ("server", "trainer"):
        svc = services[name]
        if "user" in svc:
            uids[name] = str(svc["user"]).split(":")[0]
        else:
            build = svc["build"]
            uids[name] = _image_uid(Path(build["context"]) / build.get("dockerfile", "Dockerfile"))
    assert None not in uids.values(), f"could not resolve a uid: {uids}"
    assert uids["server"] == uids["trainer"], (
        f"server runs as uid {uids['server']}, trainer as uid {uids['trainer']}: the trainer "
        "cannot open the server's 0600 /dev/shm slot rings nor connect to its ipc socket"
    )
