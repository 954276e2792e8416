"""The Dockerfiles and the compose file name only commands, flags and settings that exist.

No Docker engine runs here, so what the image would do is done outside a container: the
wheel the image installs is built from exactly what the Dockerfile copies, and its entry
command is run with the Dockerfile's environment (loopback addresses, free ports, tmp store).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from shardserve.server.cli import build_parser
from shardserve.server.settings import Settings
from tests.ops.sidecar import (
    COMPOSE_BIN,
    DOCKERFILE,
    ROOT,
    SUBPROCESS_TIMEOUT_S,
    commands_of,
    compose_config,
    dockerfile,
    effective_argv,
    env_pairs,
    exec_form,
    healthcheck_cmd,
)
from tests.support.data import make_cifar_like
from tests.support.server import free_port
from tests.support.slowness import scaled

TRAINER_DOCKERFILE = ROOT / "docker" / "Dockerfile.trainer"
#: Variables the client reads (not server settings); each must really be read in client/.
CLIENT_VARS = {"SHARDSERVE_TOKEN"}
needs_compose = pytest.mark.skipif(COMPOSE_BIN is None, reason="docker-compose is not on PATH")


# --- the CLI, walked -----------------------------------------------------------------------


def cli_options() -> dict[str, set[str]]:
    """Every ``shardserve`` subcommand and the option strings it accepts."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {s for act in sp._actions for s in act.option_strings}
        for name, sp in subs.choices.items()
    }


def cli_problems(argv: list[str], where: str) -> list[str]:
    """Why ``argv`` (starting with ``shardserve``) would not parse, as readable lines."""
    assert Path(argv[0]).name == "shardserve", argv
    options = cli_options()
    if len(argv) < 2 or argv[1] not in options:
        return [f"{where}: {argv[1:2]} is not a shardserve subcommand ({sorted(options)})"]
    problems = [
        f"{where}: `shardserve {argv[1]}` has no flag {w.split('=')[0]}"
        for w in argv[2:]
        if w.startswith("--") and w.split("=")[0] not in options[argv[1]]
    ]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        build_parser().parse_args(argv[1:])
        return problems
    return [*problems, f"{where}: {' '.join(argv)} does not parse: {err.getvalue().strip()}"]


def image_env(path: Path) -> dict[str, str]:
    """The ``ENV`` of a Dockerfile's final stage (what the container starts with)."""
    env: dict[str, str] = {}
    for arg in dockerfile(path)[-1].all("ENV"):
        env.update(env_pairs(arg))
    return env


def server_image() -> tuple[list[str], list[str], dict[str, str]]:
    """(ENTRYPOINT + CMD, HEALTHCHECK command, ENV) of the server image."""
    final = dockerfile(DOCKERFILE)[-1]
    ep, cmd, hc = final.last("ENTRYPOINT"), final.last("CMD"), final.last("HEALTHCHECK")
    assert ep and hc, f"{DOCKERFILE}: the final stage needs ENTRYPOINT and HEALTHCHECK"
    argv = exec_form(ep, "ENTRYPOINT") + (exec_form(cmd, "CMD") if cmd else [])
    return argv, healthcheck_cmd(hc), image_env(DOCKERFILE)


@contextlib.contextmanager
def clean_environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with no ``SHARDSERVE_*`` variables but ``env`` (Settings reads it)."""
    saved = dict(os.environ)
    try:
        for k in [k for k in os.environ if k.startswith("SHARDSERVE_")]:
            del os.environ[k]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --- commands and flags --------------------------------------------------------------------


def test_dockerfile_entrypoint_is_a_real_cli_command() -> None:
    """The server image's ENTRYPOINT+CMD is `shardserve serve` and parses with the real CLI parser."""
    argv, health, _ = server_image()
    assert argv[:2] == ["shardserve", "serve"], argv
    problems = cli_problems(argv, "Dockerfile ENTRYPOINT/CMD")
    if Path(health[0]).name == "shardserve":
        problems += cli_problems(health, "Dockerfile HEALTHCHECK")
    assert not problems, "\n".join(problems)


@needs_compose
def test_compose_shardserve_commands_exist_in_cli() -> None:
    """Every `shardserve` command a compose service runs names a real subcommand and real flags."""
    services = compose_config()["services"]
    seen, problems = 0, []
    for name, svc in services.items():
        for cmd in commands_of(effective_argv(svc)):
            if Path(cmd[0]).name == "shardserve":
                seen += 1
                problems += cli_problems(cmd, f"compose service {name!r}")
    assert seen >= 3, f"expected the server and two ingest commands, found {seen}"
    assert not problems, "\n".join(problems)


def _script_and_args(cmd: list[str]) -> tuple[list[str], str, list[str]] | None:
    """(launcher, script, script args) for ``python X.py ...`` or ``torchrun [opts] X.py ...``."""
    for i, w in enumerate(cmd):
        if w.endswith(".py"):
            return cmd[:i], w, cmd[i + 1 :]
    return None


def _help_flags(argv: list[str]) -> set[str]:
    out = subprocess.run(
        argv, capture_output=True, text=True, cwd=ROOT, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert out.returncode == 0, f"{' '.join(argv)} failed:\n{out.stderr[-2000:]}"
    # Only the option list (lines that start with "  -"), not flags quoted in the description.
    option_lines = [ln for ln in out.stdout.splitlines() if re.match(r"^\s{1,8}-", ln)]
    return {f for ln in option_lines for f in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", ln)}


@needs_compose
def test_compose_example_scripts_accept_their_flags() -> None:
    """The example scripts (and torchrun) that compose services run accept every flag they are given."""
    problems, scripts = [], []
    for name, svc in compose_config()["services"].items():
        for cmd in commands_of(effective_argv(svc)):
            found = _script_and_args(cmd)
            if found is None:
                continue
            launcher, script, args = found
            scripts.append(script)
            assert (ROOT / script).is_file(), (
                f"service {name!r} runs {script}, which does not exist"
            )
            flags = _help_flags([sys.executable, str(ROOT / script), "--help"])
            problems += [
                f"service {name!r}: {script} has no flag {a} (it has {sorted(flags)})"
                for a in args
                if a.startswith("--") and a.split("=")[0] not in flags
            ]
            if launcher and Path(launcher[0]).name == "torchrun":
                tr = _help_flags([sys.executable, "-m", "torch.distributed.run", "--help"])
                problems += [
                    f"service {name!r}: torchrun has no flag {a}"
                    for a in launcher[1:]
                    if a.startswith("--") and a.split("=")[0] not in tr
                ]
    assert {"examples/prepare_digits.py", "examples/train_ddp.py"} <= set(scripts), scripts
    assert not problems, "\n".join(problems)


@needs_compose
def test_compose_prepare_then_ingest_runs_outside_a_container(tmp_path: Path) -> None:
    """The `prepare` service's command writes the files the `ingest` service's commands read, and both ingests publish."""
    services = compose_config()["services"]
    mounts = {"/data/source": tmp_path / "source", "/data/store": tmp_path / "store"}
    for p in mounts.values():
        p.mkdir()  # named volumes exist (empty) before a container starts

    def local(cmd: list[str]) -> list[str]:
        out = []
        for w in cmd:
            for inside, here in mounts.items():
                if w == inside or w.startswith(inside + "/"):
                    w = str(here) + w[len(inside) :]
            out.append(w)
        return out

    (prepare,) = commands_of(effective_argv(services["prepare"]))
    assert Path(prepare[0]).name.startswith("python"), prepare
    run = subprocess.run(
        [sys.executable, *local(prepare)[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert run.returncode == 0, f"prepare failed: {run.stderr[-2000:]}"
    ingests = commands_of(effective_argv(services["ingest"]))
    shardserve = Path(sys.executable).with_name("shardserve")
    for cmd in ingests:
        src = Path(local(cmd)[2])
        written = sorted(str(p) for p in tmp_path.rglob("*.npz"))
        assert src.exists(), (
            f"ingest reads {cmd[2]} but prepare ({' '.join(prepare)}) wrote {written} "
            f"(with /data/source = {mounts['/data/source']})"
        )
        out = subprocess.run(
            [str(shardserve), *local(cmd)[1:], "--quiet"],
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert out.returncode == 0, f"{' '.join(cmd)} failed: {out.stderr[-2000:]}"
    names = {
        json.loads(p.read_text())["name"] for p in mounts["/data/store"].glob("*/manifest.json")
    }
    assert names == {"digits-train", "digits-test"}, names


# --- environment variables -----------------------------------------------------------------


def _settings_vars() -> set[str]:
    return {f"SHARDSERVE_{f.upper()}" for f in Settings.model_fields}


@needs_compose
def test_every_shardserve_variable_is_a_setting_or_a_client_variable() -> None:
    """Each SHARDSERVE_* set by a Dockerfile ENV or a compose `environment:` is a Settings field or a variable the client reads."""
    client_src = "".join(p.read_text() for p in (ROOT / "client").rglob("*.py"))
    for var in CLIENT_VARS:
        assert f'"{var}"' in client_src, (
            f"{var} is documented as a client variable but client/ never reads it"
        )
    known = _settings_vars() | CLIENT_VARS
    used: dict[str, str] = {}
    for path in (DOCKERFILE, TRAINER_DOCKERFILE):
        for stage in dockerfile(path):
            for arg in stage.all("ENV"):
                used.update({k: f"{path.name} ENV" for k in env_pairs(arg)})
    for name, svc in compose_config()["services"].items():
        env = svc.get("environment") or {}
        keys = env if isinstance(env, dict) else [e.split("=")[0] for e in env]
        used.update({k: f"compose service {name!r}" for k in keys})
    ours = {k: v for k, v in used.items() if k.startswith("SHARDSERVE_")}
    assert len(ours) >= 5, ours
    unknown = {k: v for k, v in ours.items() if k not in known}
    assert not unknown, f"not a Settings field nor a client variable: {unknown}"


def test_dockerfile_env_validates_with_a_token_and_is_refused_without() -> None:
    """The image's ENV (which binds 0.0.0.0) makes valid Settings with a token, and is refused without one naming --token/--insecure."""
    _, _, env = server_image()
    assert any(k.startswith("SHARDSERVE_") for k in env), env
    with clean_environ({**env, "SHARDSERVE_TOKEN": "s3cret"}):
        s = Settings()
    assert s.http_host_port[0] == "0.0.0.0", "the image must listen beyond loopback"
    assert str(s.store) == env["SHARDSERVE_STORE"]
    assert any(e.startswith("tcp://0.0.0.0:") for e in s.data), s.data
    with clean_environ(env), pytest.raises(ValidationError) as e:
        Settings()
    assert "--token" in str(e.value) and "--insecure" in str(e.value), str(e.value)


@needs_compose
def test_compose_server_environment_validates() -> None:
    """The compose `server` service's environment on top of the image's ENV makes valid Settings."""
    _, _, env = server_image()
    svc_env = compose_config()["services"]["server"].get("environment") or {}
    assert isinstance(svc_env, dict), svc_env
    with clean_environ({**env, **{k: str(v) for k, v in svc_env.items()}}):
        s = Settings()
    assert s.token, "compose must hand the server its token"


def test_dockerignore_keeps_what_the_dockerfiles_copy() -> None:
    """Every COPY source of both Dockerfiles exists and is not excluded by .dockerignore."""
    import fnmatch

    rules = [
        (ln.startswith("!"), ln.lstrip("!").rstrip("/"))
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]

    def excluded(rel: str) -> bool:
        out = False
        for negate, pat in rules:
            if fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat.removeprefix("**/")):
                out = not negate
        return out

    problems = []
    for path in (DOCKERFILE, TRAINER_DOCKERFILE):
        for stage in dockerfile(path):
            for arg in stage.all("COPY"):
                words = [w for w in arg.split() if not w.startswith("--")]
                if "--from" in arg:
                    continue
                for src in words[:-1]:
                    if not (ROOT / src).exists():
                        problems.append(f"{path.name}: COPY {src}: no such file in the context")
                    elif excluded(src):
                        problems.append(f"{path.name}: COPY {src} is excluded by .dockerignore")
    assert not problems, "\n".join(problems)


# --- the image's install and entry command, outside a container ----------------------------


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    version = tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2])
    return version >= (70, 1)


@pytest.fixture(scope="module")
def image_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel the build stage makes from exactly what it COPYs, installed into a folder."""
    build = dockerfile(DOCKERFILE)[0]
    ctx = tmp_path_factory.mktemp("context")
    for arg in build.all("COPY"):
        *srcs, dest = arg.split()
        for src in srcs:
            target = ctx / (src if dest.endswith(("/", "./")) or dest == "./" else dest)
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / src, target)
    run = [a for a in build.all("RUN") if "pip wheel" in a]
    assert run and '".[${EXTRAS}]"' in run[0], (
        f'build stage should `pip wheel ".[${{EXTRAS}}]"`: {run}'
    )
    # The extras default to the server's alone: no image decoder unless asked for.
    assert re.search(r"^ARG EXTRAS=server$", DOCKERFILE.read_text(), re.M), (
        "EXTRAS must default to server"
    )
    wheels = tmp_path_factory.mktemp("wheels")
    site = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # Offline when this venv's setuptools can build wheels itself (>= 70.1 has bdist_wheel);
    # else pip fetches the build backend, as the image's build stage does.
    offline = ["--no-build-isolation", "--no-index"] if _setuptools_builds_wheels() else []
    steps = [
        lambda: [*pip, "wheel", "--no-deps", *offline, "-w", str(wheels), "."],
        lambda: [
            *pip,
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            *map(str, wheels.glob("shardserve-*.whl")),
        ],
    ]
    for step in steps:
        argv = step()
        out = subprocess.run(
            argv,
            cwd=ctx,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert out.returncode == 0, f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}"
    assert (site / "shardserve/server/control/templates/status.html").is_file(), (
        "the wheel lacks the status page template: GET / would fail in the image"
    )
    return site


def _console_script(site: Path, name: str) -> list[str]:
    """argv running the wheel's console script ``name`` from ``site``, like the image's PATH would."""
    (eps,) = site.glob("shardserve-*.dist-info/entry_points.txt")
    m = re.search(rf"^{name}\s*=\s*([\w.]+):(\w+)", eps.read_text(), re.M)
    assert m, f"the wheel has no console script {name!r}:\n{eps.read_text()}"
    code = f"import sys; from {m.group(1)} import {m.group(2)} as f; sys.argv[0] = {name!r}; sys.exit(f())"
    return [sys.executable, "-c", code]


def _run_healthcheck(cmd: list[str], port: int) -> subprocess.CompletedProcess[str]:
    code = cmd[-1]
    assert ":7070/healthz" in code, f"HEALTHCHECK does not probe :7070/healthz: {cmd}"
    argv = [sys.executable if Path(c).name.startswith("python") else c for c in cmd[:-1]]
    return subprocess.run(
        [*argv, code.replace(":7070/", f":{port}/")],
        capture_output=True,
        text=True,
        timeout=scaled(10),
    )


def test_healthcheck_fails_when_nothing_listens() -> None:
    """The HEALTHCHECK command exits non-zero when no server answers, so Docker can mark it unhealthy."""
    _, health, _ = server_image()
    assert _run_healthcheck(health, free_port()).returncode != 0


def test_image_entry_command_serves_and_passes_its_healthcheck(image_site: Path) -> None:
    """The installed wheel's `shardserve serve`, with the image's (and compose's) environment, passes the HEALTHCHECK, logs JSON and exits 0 on SIGTERM."""
    argv, health, env = server_image()
    services = compose_config()["services"] if COMPOSE_BIN else {}
    compose_env = {
        k: str(v) for k, v in (services.get("server", {}).get("environment") or {}).items()
    }
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ss-img-") as tmp:
        d = Path(tmp)
        make_cifar_like(d / "store", "cifar", n=64)
        local = {
            **env,
            **compose_env,
            "SHARDSERVE_TOKEN": "image-test-token",
            "SHARDSERVE_STORE": str(d / "store"),
            "SHARDSERVE_STATE_DIR": str(d / "state"),
            "SHARDSERVE_HTTP": f"127.0.0.1:{port}",
            "SHARDSERVE_DATA": '["tcp://127.0.0.1:0"]',
            "SHARDSERVE_IPC": str(d / "data.sock"),
        }
        assert set(local) == set(env) | set(compose_env) | {"SHARDSERVE_TOKEN"}, (
            "only values change"
        )
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSERVE_")}
        full_env.update(local, PYTHONPATH=str(image_site))
        which = subprocess.run(
            [sys.executable, "-c", "import shardserve.server as s; print(s.__file__)"],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=scaled(30),
        )
        assert which.stdout.startswith(str(image_site)), f"not the wheel's code: {which}"
        log = d / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*_console_script(image_site, argv[0]), *argv[1:]],
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + scaled(20)
            while True:  # Docker's own retry loop, with a deadline
                hc = _run_healthcheck(health, port)
                if hc.returncode == 0 or proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert hc.returncode == 0, (
                f"healthcheck failed ({hc.stderr.strip()[-500:]}); server "
                f"{'exited ' + str(proc.returncode) if proc.poll() is not None else 'running'}; "
                f"log:\n{log.read_text()[-3000:]}"
            )
            r = httpx.get(f"http://127.0.0.1:{port}/v1/datasets", timeout=scaled(5))
            assert r.status_code == 401, "the sidecar's API must require its token"
            r = httpx.get(
                f"http://127.0.0.1:{port}/v1/datasets",
                headers={"Authorization": "Bearer image-test-token"},
                timeout=scaled(5),
            )
            assert r.status_code == 200 and "cifar" in r.text, r.text
        finally:
            proc.terminate()
            code = proc.wait(timeout=scaled(10))
        assert code == 0, f"exit {code} after SIGTERM; log:\n{log.read_text()[-3000:]}"
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        assert lines, "the server logged nothing"
        if local.get("SHARDSERVE_LOG_FORMAT") == "json":
            bad = []
            for ln in lines:
                try:
                    json.loads(ln)
                except json.JSONDecodeError:
                    bad.append(ln)
            assert not bad, f"SHARDSERVE_LOG_FORMAT=json but these lines are not JSON: {bad[:5]}"
