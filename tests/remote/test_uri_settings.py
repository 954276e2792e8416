"""A store URI in settings and on the command line: kept intact, never shown with
credentials, and refused with a clear message when it cannot be served."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from shardserve.server.settings import Settings
from shardserve.server.store.remote.object_fs import StoreOptions, display_uri, scrub, uri_secrets
from tests.support.slowness import scaled


def test_a_uri_stays_a_uri_and_a_folder_a_path(tmp_path: Path) -> None:
    """``s3://b/p`` keeps its double slash (a Path would not); a folder is a Path."""
    s = Settings(store="s3://bucket/prefix", cache_dir=tmp_path)
    assert s.store == "s3://bucket/prefix" and s.store_is_remote
    assert s.state_path == tmp_path / ".shardserve"
    local = Settings(store=str(tmp_path))
    assert local.store == tmp_path and not local.store_is_remote


def test_a_remote_store_without_a_cache_dir_is_refused() -> None:
    """Serving a URI needs --cache-dir; the error says so."""
    with pytest.raises(ValidationError, match="--cache-dir"):
        Settings(store="s3://bucket/prefix")
    r = subprocess.run(
        [sys.executable, "-m", "shardserve.server", "serve", "--store", "s3://bucket/prefix"],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert r.returncode == 2 and "--cache-dir" in r.stderr


def test_credentials_are_cut_from_what_is_shown() -> None:
    """User info and query leave the shown URI; every secret value leaves any message, and
    the options' repr holds none."""
    uri = "s3://AKIAXYZ123:topsecretvalue@bucket/prefix?session_token=tok3n-value-long"
    shown = display_uri(uri)
    assert shown == "s3://bucket/prefix"
    opts = StoreOptions.from_env({"AWS_SECRET_ACCESS_KEY": "topsecretvalue", "AWS_REGION": "x"})
    assert "topsecretvalue" not in repr(opts)
    assert scrub(f"failed with {uri}", opts.secrets) == (
        "failed with s3://AKIAXYZ123:<redacted>@bucket/prefix?session_token=tok3n-value-long"
    )
    # a store opened from that URI also cuts the URI's own secrets
    every = (*opts.secrets, *uri_secrets(uri))
    cleaned = scrub(f"failed with {uri}", every)
    assert "AKIAXYZ123" not in cleaned and "topsecretvalue" not in cleaned
    assert "tok3n-value-long" not in cleaned
