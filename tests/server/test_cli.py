"""The ``shardserve`` command as a new user meets it: help, version, mistakes, missing extras.

Each test runs the real command in a fresh interpreter (its imports and its exit status are
what a user sees). Speed is measured in ``bench/bench_cli.py``, not asserted here: what is
asserted is that ``--help`` loads nothing heavy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

from shardserve.server.cli import COMMANDS, INSTALL_SERVER, build_parser
from shardserve.server.settings import unknown_env
from shardserve.server.store.ingest.registry import READERS
from tests.support.slowness import scaled

CLI = [sys.executable, "-m", "shardserve.server"]
#: How the top-level help names the formats that have no file suffix.
_FOLDER_FORMATS = {
    "hf": "Hugging Face",
    "lmdb": "LMDB",
    "mds": "MosaicML MDS",
    "litdata": "LitData",
    "imagefolder": "image folder",
}


def _run(
    *argv: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *argv],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def test_top_level_help_lists_every_command_and_every_ingest_format() -> None:
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    for name in COMMANDS:
        assert f"    {name} " in out.stdout, name
    text = " ".join(out.stdout.split())  # a name argparse wrapped over two lines counts
    for r in READERS:
        named = [s for s in r.suffixes if s in text] or (
            [_FOLDER_FORMATS[r.name]] if _FOLDER_FORMATS.get(r.name, "\0") in text else []
        )
        assert named, f"`shardserve --help` does not mention format {r.name} ({r.suffixes})"


def _help_loads(argv: list[str], heavy: list[str]) -> tuple[str, str]:
    """``shardserve ARGV`` run in a fresh interpreter: its output, and which of ``heavy``
    it imported (as a printed sorted list)."""
    code = (
        "import sys\n"
        "from shardserve.server.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60)
    )
    assert out.returncode == 0, out.stderr
    *shown, loaded = out.stdout.strip().splitlines()
    return "\n".join(shown), loaded


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["ls", "--help"]])
def test_help_imports_nothing_it_does_not_show(argv: list[str]) -> None:
    """--help loads neither pyarrow (which pulls pandas) nor numpy nor the server's machinery;
    the top-level help not even pydantic."""
    heavy = ["pyarrow", "pandas", "numpy", "zmq", "fastapi", "uvicorn", "pydantic"]
    _, loaded = _help_loads(argv, heavy)
    assert loaded == ("[]" if argv == ["--help"] else "['pydantic']"), loaded


def test_ingest_help_loads_the_readers_but_not_pandas() -> None:
    """`shardserve ingest --help` lists the formats, so it imports the reader modules (numpy
    and pyarrow come with them); `pyarrow.dataset`, which pulls pandas, waits for an ingest."""
    shown, loaded = _help_loads(
        ["ingest", "--help"], ["pandas", "pyarrow.dataset", "zmq", "fastapi"]
    )
    assert "--format" in shown
    assert loaded == "[]", loaded


def test_every_flag_of_every_command_has_help() -> None:
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {act.option_strings or act.dest}"
        for name, sp in subs.choices.items()
        for act in sp._actions
        if not act.help and not isinstance(act, argparse._HelpAction)
    ]
    assert missing == []


def test_version_comes_from_the_installed_metadata() -> None:
    out = _run("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"shardserve {version('shardserve')}")
    import shardserve.client
    import shardserve.proto

    assert shardserve.proto.__version__ == shardserve.client.__version__ == version("shardserve")


def test_serve_refuses_a_store_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "typo"
    out = _run("serve", "--store", str(missing), "--http", "127.0.0.1:0")
    assert out.returncode == 2
    assert f"store {missing} does not exist" in out.stderr and "--create" in out.stderr
    assert not missing.exists()


def test_serve_on_a_port_in_use_names_the_flag_without_a_traceback(tmp_path: Path) -> None:
    """A data or HTTP port another program holds: exit 1, one line naming the endpoint and
    the flag that picks another, no traceback."""
    import socket

    (tmp_path / "store").mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for flags, needle in (
            (
                ["--http", "127.0.0.1:0", "--data", f"tcp://127.0.0.1:{port}"],
                f"cannot bind the data endpoint tcp://127.0.0.1:{port}",
            ),
            (["--http", f"127.0.0.1:{port}", "--data", "tcp://127.0.0.1:0"], "--http (HOST:0"),
        ):
            out = _run("serve", "--store", str(tmp_path / "store"), *flags)
            assert out.returncode == 1, out.stderr[-2000:]
            assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_serve_port_says_which_flags_take_its_place(tmp_path: Path) -> None:
    """``--port`` (other servers' flag) is refused naming ``--http`` and ``--data``."""
    out = _run("serve", "--store", str(tmp_path), "--port", "7070")
    assert out.returncode == 2
    assert "unrecognized arguments: --port 7070" in out.stderr
    assert "--http HOST:PORT" in out.stderr and "--data tcp://HOST:PORT" in out.stderr


def test_serve_create_makes_the_store_and_starts(tmp_path: Path) -> None:
    from tests.support.server import run_server

    store = tmp_path / "new" / "store"
    with run_server(store) as srv:  # run_server passes --create
        import httpx

        assert httpx.get(f"{srv.http_url}/v1/datasets", timeout=scaled(30)).json() == []
    assert store.is_dir()


def test_a_misspelled_variable_is_warned_with_the_closest_name(tmp_path: Path) -> None:
    out = _run("ls", "--store", str(tmp_path), env={"SHARDSERVE_MAX_STREAM": "8"})
    assert out.returncode == 0, out.stderr
    assert "SHARDSERVE_MAX_STREAM is not a shardserve setting" in out.stderr
    assert "did you mean SHARDSERVE_MAX_STREAMS?" in out.stderr
    assert unknown_env({"SHARDSERVE_STORE": "x", "SHARDSERVE_URL": "y", "HOME": "z"}) == []


def test_a_missing_server_extra_is_one_line_naming_the_install(tmp_path: Path) -> None:
    """Where pyarrow is not installed (a client-only install), a store command that writes
    shards says what to install instead of printing a traceback."""
    np.savez(tmp_path / "d.npz", x=np.arange(4))
    args = ["ingest", str(tmp_path / "d.npz"), "--store", str(tmp_path / "store"), "--name", "d"]
    code = (
        "import sys\n"
        "sys.modules['pyarrow'] = None  # what a client-only install lacks\n"
        "from shardserve.server.cli import main\n"
        f"sys.exit(main({args!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60)
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"shardserve: this command needs the server extra (pyarrow is missing): {INSTALL_SERVER}"
    ]


def test_a_map_module_in_the_current_directory_is_found(tmp_path: Path) -> None:
    """The console script (whose sys.path starts at its own folder) finds `--map mymod:fn`
    next to the user, as `python -m` would."""
    script = Path(sys.executable).parent / "shardserve"
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymod_i33.py").write_text(
        "def double(sample):\n    return {k: v * 2 for k, v in sample.items()}\n"
    )
    np.savez(work / "x.npz", x=np.arange(6, dtype=np.float32).reshape(3, 2))
    out = subprocess.run(
        [
            str(script),
            "ingest",
            "x.npz",
            "--store",
            str(tmp_path / "store"),
            "--name",
            "d",
            "--map",
            "mymod_i33:double",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        cwd=work,
    )
    assert out.returncode == 0, out.stderr
    assert "3 samples" in out.stdout or "3" in out.stdout, out.stdout


def test_the_demo_without_its_extra_says_what_to_install() -> None:
    """Where scikit-learn (or torch, or the server's packages) is missing, `shardserve demo`
    names the demo extra in one line."""
    code = (
        "import sys\n"
        "sys.modules['sklearn'] = None  # what an install without the demo extra lacks\n"
        "from shardserve.server.cli import main\n"
        "sys.exit(main(['demo']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60)
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "shardserve demo: needs the demo extra (sklearn missing): "
        "pip install '.[demo]' in a clone of shardserve"
    ]
