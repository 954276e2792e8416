"""docker/podman-stack.sh and docker-compose.yml describe the same containers.

The script runs the compose file's services with plain ``podman run`` because Debian's
podman-compose cannot (health-gated ``depends_on``, ``ipc: "service:..."``). Here each service's
``podman run`` in the script is read back into compose keys and compared with what
``docker-compose config`` resolves, so a change to one that is not made to the other fails.
No engine is needed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.ops.sidecar import COMPOSE, COMPOSE_BIN, COMPOSE_ENV, ROOT, compose_config

STACK_SH = ROOT / "docker" / "podman-stack.sh"
PROJECT = "proj"
#: The script's variables as a default run sees them (images without podman's localhost/).
SCRIPT_VARS = {
    "P": PROJECT,
    "IMAGE": "shardserve:latest",
    "TRAINER_IMAGE": "shardserve-trainer:latest",
}
#: Compose keys the comparison understands; any other key in a service fails the test.
KEYS = {
    "build",
    "image",
    "profiles",
    "entrypoint",
    "command",
    "user",
    "volumes",
    "environment",
    "ipc",
    "shm_size",
    "ports",
    "depends_on",
}
VALUE_OPTS = {
    "--name",
    "--network",
    "--network-alias",
    "--entrypoint",
    "--user",
    "--volume",
    "--env",
    "--ipc",
    "--shm-size",
    "--publish",
}
FLAG_OPTS = {"--rm", "--detach"}

pytestmark = pytest.mark.skipif(COMPOSE_BIN is None, reason="docker-compose is not on PATH")


def _functions(text: str) -> dict[str, list[str]]:
    """Shell function name -> its body lines (functions open with `name() {` and close with `}`)."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = re.match(r"^(\w+)\(\) \{", line)
        if m:
            current = m.group(1)
            out[current] = []
        elif line == "}":
            current = None
        elif current is not None:
            out[current].append(line)
    return out


def _expand(token: str) -> str:
    token = re.sub(
        r"\$\{(\w+):-([^}]*)\}", lambda m: SCRIPT_VARS.get(m.group(1), m.group(2)), token
    )
    return re.sub(r"\$\{?(\w+)\}?", lambda m: SCRIPT_VARS[m.group(1)], token)


def _podman_run(body: list[str]) -> list[str]:
    """The argv of the one `podman run` in a function body, continuation lines joined."""
    start = next(i for i, line in enumerate(body) if line.strip().startswith("podman run"))
    joined = ""
    for line in body[start:]:
        joined += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    words = [w for w in shlex.split(joined, comments=True) if not w.startswith(">")]
    return [w for w in (_expand(w) if w != "$@" else w for w in words) if w]


def _volume(spec: str) -> tuple[str, str, str]:
    parts = spec.split(":")
    return parts[0].removeprefix(f"{PROJECT}-"), parts[1], parts[2] if len(parts) > 2 else "rw"


def script_services(text: str) -> dict[str, dict[str, Any]]:
    """The script's services in compose terms (what `docker-compose config` would print)."""
    fns = _functions(text)
    trainer_cmd = shlex.split(re.search(r"^TRAINER_COMMAND=\((.*)\)$", text, re.M).group(1))  # type: ignore[union-attr]
    services: dict[str, dict[str, Any]] = {}
    for name, body in fns.items():
        if not any(line.strip().startswith("podman run") for line in body):
            continue
        argv = _podman_run(body)[2:]
        svc: dict[str, Any] = {}
        i = 0
        while i < len(argv) and argv[i].startswith("--"):
            opt = argv[i]
            assert opt in VALUE_OPTS | FLAG_OPTS, (
                f"{name}: podman option {opt} has no compose counterpart here"
            )
            if opt in FLAG_OPTS:
                i += 1
                continue
            value = argv[i + 1]
            i += 2
            if opt == "--name":
                assert value == f"{PROJECT}-{name}", f"{name}: container name {value}"
            elif opt == "--network":
                assert value == PROJECT, f"{name}: not on the project's network"
            elif opt == "--network-alias":
                assert value == name, f"{name}: reachable as {value!r}, not by its service name"
            elif opt == "--entrypoint":
                svc["entrypoint"] = json.loads(value)
            elif opt == "--user":
                svc["user"] = value
            elif opt == "--volume":
                svc.setdefault("volumes", set()).add(_volume(value))
            elif opt == "--env":
                k, sep, v = value.partition("=")
                svc.setdefault("environment", {})[k] = v if sep else COMPOSE_ENV[k]
            elif opt == "--ipc":
                svc["ipc"] = re.sub(rf"^container:{PROJECT}-", "service:", value)
            elif opt == "--shm-size":
                svc["shm_size"] = value
            elif opt == "--publish":
                svc.setdefault("ports", []).append(value)
        svc["image"] = argv[i]
        command = [w for w in argv[i + 1 :] if w != "$@"]
        if "$@" in argv[i + 1 :]:
            command = trainer_cmd
        if command:
            svc["command"] = command
        services[name] = svc
    return services


def _compose_terms(svc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in svc.items():
        assert key in KEYS, f"compose key {key!r} has no counterpart in podman-stack.sh yet"
        if key == "volumes":
            out[key] = {
                _volume(v)
                if isinstance(v, str)
                else (v["source"], v["target"], "ro" if v.get("read_only") else "rw")
                for v in value
            }
        elif key == "ports":
            out[key] = [
                p.removesuffix("/tcp")
                if isinstance(p, str)
                else f"{p['host_ip']}:{p['published']}:{p['target']}"
                for p in value
            ]
        elif key == "command" and isinstance(value, str):
            out[key] = shlex.split(value)
        elif key in ("build", "profiles", "depends_on"):
            continue
        else:
            out[key] = value
    return out


def mismatches(compose: dict[str, dict[str, Any]], script_text: str) -> list[str]:
    """What differs between the compose services and the script's, one line each."""
    script = script_services(script_text)
    problems = []
    if set(script) != set(compose):
        problems.append(f"services: compose {sorted(compose)}, script {sorted(script)}")
    fns = _functions(script_text)
    for name in sorted(set(script) & set(compose)):
        want = _compose_terms(compose[name])
        for key in sorted(set(want) | set(script[name])):
            if want.get(key) != script[name].get(key):
                problems.append(
                    f"{name}.{key}: compose {want.get(key)!r}, script {script[name].get(key)!r}"
                )
        for dep, cond in compose[name].get("depends_on", {}).items():
            if cond["condition"] == "service_completed_successfully":
                body = "\n".join(fns[name])
                ok = re.search(rf"^\s*{dep}\b", body, re.M) and body.index(dep) < body.index(
                    "podman run"
                )
            elif cond["condition"] == "service_healthy":
                # `up` waits for the health check before it starts the service.
                up = script_text[script_text.index("\n  up)") :]
                ok = "wait_healthy" in up and up.index("wait_healthy") < up.index(f"\n    {name} ")
            else:
                ok = False
            if not ok:
                problems.append(f"{name}.depends_on.{dep} ({cond['condition']}) is not honoured")
    return problems


def test_script_mirrors_the_compose_file() -> None:
    """Every service, option and dependency of docker-compose.yml is in podman-stack.sh, and nothing else."""
    problems = mismatches(compose_config()["services"], STACK_SH.read_text())
    assert problems == [], "\n".join(problems)


BREAKAGES = [
    ("shm_size", "    shm_size: 2gb", "    shm_size: 1gb", "server.shm_size"),
    (
        "read-only store",
        "      - store:/data/store:ro",
        "      - store:/data/store",
        "server.volumes",
    ),
    (
        "new env",
        "      SHARDSERVE_VERIFY: lazy",
        "      SHARDSERVE_VERIFY: full",
        "server.environment",
    ),
    ("new key", "    shm_size: 2gb", "    shm_size: 2gb\n    read_only: true", "read_only"),
    (
        "health gate",
        "condition: service_healthy",
        "condition: service_started",
        "trainer.depends_on",
    ),
]


@pytest.mark.parametrize(("what", "old", "new", "named"), BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_a_compose_change_not_made_in_the_script_is_caught(
    tmp_path: Path, what: str, old: str, new: str, named: str
) -> None:
    """A copy of the compose file changed in one place no longer matches the script, and the mismatch names it."""
    text = COMPOSE.read_text()
    assert text.count(old) == 1, f"the breakage {what!r} no longer matches the file once: {old!r}"
    shutil.copytree(ROOT / "docker", tmp_path / "docker")
    changed = tmp_path / "docker-compose.yml"
    changed.write_text(text.replace(old, new))
    script = STACK_SH.read_text()
    try:
        problems = mismatches(compose_config(changed)["services"], script)
    except AssertionError as e:
        problems = [str(e)]
    assert any(named in p for p in problems), problems
