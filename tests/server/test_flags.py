"""`shardserve serve` flags come from the Settings fields: every field has one, every flag
name of earlier releases still works, flags beat SHARDSERVE_* variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ByteSize

from shardserve.server.cli import build_parser
from shardserve.server.flags import flag_name, given_settings
from shardserve.server.settings import Settings, StoreDefaults
from tests.support.slowness import scaled

#: Every serve flag before flags were derived from Settings, with a value and the field it set.
OLD_FLAGS: list[tuple[list[str], str, object]] = [
    (["--http", "127.0.0.1:0"], "http", "127.0.0.1:0"),
    (
        ["--data", "tcp://127.0.0.1:1", "--data", "ipc:///tmp/x"],
        "data",
        ["tcp://127.0.0.1:1", "ipc:///tmp/x"],
    ),
    (["--ipc", "/tmp/ss.sock"], "ipc", Path("/tmp/ss.sock")),
    (["--token", "t0ken"], "token", "t0ken"),
    (["--insecure"], "insecure", True),
    (["--verify", "full"], "verify", "full"),
    (["--state-dir", "/tmp/st"], "state_dir", Path("/tmp/st")),
    (["--ready-file", "/tmp/r.json"], "ready_file", Path("/tmp/r.json")),
    (["--log-format", "json"], "log_format", "json"),
    (["--log-level", "debug"], "log_level", "debug"),
    (["--assembly-threads", "3"], "assembly_threads", 3),
    (["--heartbeat-s", "0.5"], "heartbeat_s", 0.5),
    (["--stream-timeout-s", "7"], "stream_timeout_s", 7.0),
    (["--no-shm"], "shm", False),
    (["--shm"], "shm", True),
    (["--shm-limit-bytes", "512MiB"], "shm_limit_bytes", 512 << 20),
    (["--max-batch-bytes", "4096"], "max_batch_bytes", 4096),
    (
        ["--allowed-host", "a.example", "--allowed-host", "b.example"],
        "allowed_hosts",
        ["a.example", "b.example"],
    ),
    (["--http-idle-timeout-s", "3"], "http_idle_timeout_s", 3.0),
    (["--idle-after-s", "5"], "idle_after_s", 5.0),
    (["--job-ttl-s", "0"], "job_ttl_s", 0.0),
    (["--max-jobs", "9"], "max_jobs", 9),
    (["--cache-dir", "/tmp/c"], "cache_dir", Path("/tmp/c")),
    (["--cache-limit-bytes", "1000"], "cache_limit_bytes", 1000),
    (["--store-endpoint", "http://127.0.0.1:9000"], "store_endpoint", "http://127.0.0.1:9000"),
    (["--store-timeout-s", "2"], "store_timeout_s", 2.0),
]


def _settings(argv: list[str]) -> Settings:
    args = build_parser().parse_args(["serve", *argv])
    return Settings(**given_settings(args))


@pytest.mark.parametrize(("argv", "field", "value"), OLD_FLAGS, ids=lambda x: str(x)[:30])
def test_every_old_flag_sets_its_field(
    tmp_path: Path, argv: list[str], field: str, value: object
) -> None:
    """Each flag name serve took before still parses, to the same setting and value."""
    s = _settings(["--store", str(tmp_path), *argv])
    assert getattr(s, field) == value
    if field == "shm_limit_bytes":
        assert isinstance(s.shm_limit_bytes, ByteSize)


def test_every_setting_has_one_flag_with_its_description() -> None:
    """Each Settings field is a flag, named from the field, whose help is its description."""
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    by_dest = {a.dest: a for a in serve._actions if a.dest != "help"}
    assert set(by_dest) == set(Settings.model_fields)
    for name, info in Settings.model_fields.items():
        action = by_dest[name]
        assert flag_name(name, info) in action.option_strings
        assert info.description and action.help and action.help.startswith(info.description)


def test_flags_beat_the_environment_and_absent_flags_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flag overrides its SHARDSERVE_* variable; a flag left out leaves the variable in force."""
    monkeypatch.setenv("SHARDSERVE_HEARTBEAT_S", "4")
    monkeypatch.setenv("SHARDSERVE_MAX_JOBS", "11")
    monkeypatch.setenv("SHARDSERVE_SHM", "false")
    s = _settings(["--store", str(tmp_path), "--heartbeat-s", "2"])
    assert (s.heartbeat_s, s.max_jobs, s.shm) == (2.0, 11, False)
    assert _settings(["--store", str(tmp_path), "--shm"]).shm is True


def test_store_commands_take_the_store_from_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ls` and friends default --store to SHARDSERVE_STORE, read through settings."""
    monkeypatch.setenv("SHARDSERVE_STORE", str(tmp_path))
    assert StoreDefaults().store == str(tmp_path)
    assert build_parser().parse_args(["ls"]).store == str(tmp_path)


def test_a_bad_value_exits_2_naming_the_setting(tmp_path: Path) -> None:
    """serve refuses an out-of-range flag before starting anything, naming the setting."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardserve.server",
            "serve",
            "--store",
            str(tmp_path),
            "--heartbeat-s",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert r.returncode == 2, r.stderr
    assert "heartbeat_s" in r.stderr and "greater than 0" in r.stderr
