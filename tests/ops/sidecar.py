"""Read the sidecar's deployment files the way Docker does, for tests that hold them to the code.

* :func:`dockerfile` parses a Dockerfile into stages of ``(INSTRUCTION, argument)`` with line
  continuations and comments handled; :func:`exec_form` reads a JSON-array argument and
  :func:`env_pairs` an ``ENV`` line.
* :func:`compose_config` runs the real ``docker-compose config`` (so anchors, merge keys,
  interpolation and defaults are resolved by the tool CI uses) and returns it as a dict.
* :func:`effective_argv` is what a compose service's container would exec: its ``entrypoint``
  (or the image's ``ENTRYPOINT``) plus its ``command`` (or the image's ``CMD``).
* :func:`shell_commands` splits an ``sh -c`` script into its simple commands.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.slowness import scaled

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_BIN = shutil.which("docker-compose")
#: docker-compose refuses to interpolate the file without it (``${SHARDSERVE_TOKEN:?...}``).
COMPOSE_ENV = {"SHARDSERVE_TOKEN": "ops-test-token"}
SUBPROCESS_TIMEOUT_S = 60


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def last(self, op: str) -> str | None:
        found = self.all(op)
        return found[-1] if found else None


def dockerfile(path: Path) -> list[Stage]:
    """The stages of a Dockerfile, each with its instructions in order (comments dropped)."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continuation are dropped by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    stages: list[Stage] = []
    for line in logical:
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "FROM":
            words = arg.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif op == "ARG" and not stages:
            continue  # global ARGs before the first FROM
        else:
            assert stages, f"{path}: {op} before any FROM"
            stages[-1].instructions.append((op, arg))
    return stages


def exec_form(arg: str, where: str) -> list[str]:
    """The JSON array of an ENTRYPOINT/CMD (shell form is refused: no signals reach PID 1)."""
    try:
        value = json.loads(arg)
    except json.JSONDecodeError:
        raise AssertionError(f"{where} is not in exec (JSON array) form: {arg!r}") from None
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), (where, arg)
    return value


def env_pairs(arg: str) -> dict[str, str]:
    """``ENV A=1 B='x y'`` -> ``{"A": "1", "B": "x y"}`` (the legacy ``ENV A 1`` form too)."""
    words = shlex.split(arg)
    if words and "=" not in words[0]:
        return {words[0]: arg.split(None, 1)[1] if len(words) > 1 else ""}
    out = {}
    for w in words:
        k, sep, v = w.partition("=")
        assert sep, f"ENV word {w!r} is not KEY=VALUE"
        out[k] = v
    return out


def healthcheck_cmd(arg: str) -> list[str]:
    """The exec-form command of ``HEALTHCHECK [--options] CMD [...]``."""
    _opts, sep, cmd = arg.partition("CMD")
    assert sep, f"HEALTHCHECK without CMD: {arg!r}"
    return exec_form(cmd.strip(), "HEALTHCHECK CMD")


def _yaml_to_json_program() -> list[str]:
    """A Python that can read YAML: ours if PyYAML is installed, else docker-compose's own."""
    try:
        import yaml  # noqa: F401

        return [sys.executable]
    except ImportError:
        pass
    assert COMPOSE_BIN is not None
    shebang = Path(COMPOSE_BIN).read_text(errors="replace").splitlines()[0]
    assert shebang.startswith("#!"), f"{COMPOSE_BIN} is not a script; cannot find its Python"
    return shebang[2:].split()


def run_compose(
    *args: str, file: Path = COMPOSE, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``docker-compose -f FILE ARGS`` with the project's directory as working directory."""
    assert COMPOSE_BIN is not None
    full_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SHARDSERVE_", "COMPOSE_"))
    }
    full_env.update(COMPOSE_ENV if env is None else env)
    return subprocess.run(
        [COMPOSE_BIN, "-f", str(file), *args],
        cwd=file.parent,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=scaled(SUBPROCESS_TIMEOUT_S),
    )


def compose_config(file: Path = COMPOSE) -> dict[str, Any]:
    """The file as ``docker-compose config`` resolves it, as a dict."""
    out = run_compose("config", file=file)
    assert out.returncode == 0, f"docker-compose config failed:\n{out.stderr}"
    conv = subprocess.run(
        [
            *_yaml_to_json_program(),
            "-c",
            "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)",
        ],
        input=out.stdout,
        capture_output=True,
        text=True,
        timeout=scaled(SUBPROCESS_TIMEOUT_S),
    )
    assert conv.returncode == 0, f"could not read docker-compose's YAML:\n{conv.stderr}"
    return json.loads(conv.stdout)  # type: ignore[no-any-return]


def image_of(service: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of the final stage of the Dockerfile a compose service builds."""
    build = service.get("build")
    assert build, f"service has no build section: {service}"
    path = Path(build["context"]) / build.get("dockerfile", "Dockerfile")
    final = dockerfile(path)[-1]
    ep, cmd = final.last("ENTRYPOINT"), final.last("CMD")
    return (
        exec_form(ep, f"{path} ENTRYPOINT") if ep else [],
        exec_form(cmd, f"{path} CMD") if cmd else [],
    )


def _as_list(v: str | list[str]) -> list[str]:
    return shlex.split(v) if isinstance(v, str) else list(v)


def effective_argv(service: dict[str, Any]) -> list[str]:
    """What the service's container runs; an overridden entrypoint drops the image's CMD."""
    ep, cmd = image_of(service)
    if "entrypoint" in service:
        ep, cmd = _as_list(service["entrypoint"]), []
    if "command" in service:
        cmd = _as_list(service["command"])
    return [*ep, *cmd]


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script joined by ``&&``, ``||``, ``;`` or newlines."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for tok in lexer:
        if tok in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(tok)
    return [c for c in commands if c]


def commands_of(argv: list[str]) -> list[list[str]]:
    """``sh -c SCRIPT`` expanded to its commands; anything else is one command."""
    if len(argv) >= 3 and Path(argv[0]).name in ("sh", "bash") and argv[1] == "-c":
        return shell_commands(argv[2])
    return [argv]
