"""Transform settings come from flags or SHARDSERVE_TRANSFORMS (comma-separated or JSON)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shardserve.server.settings import Settings


def test_transform_modules_from_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A comma-separated or JSON list in the environment names the modules; bad values refuse."""
    monkeypatch.setenv("SHARDSERVE_TRANSFORMS", "mypkg.transforms, other.mod")
    monkeypatch.setenv("SHARDSERVE_TRANSFORM_WORKERS", "3")
    s = Settings(store=tmp_path)
    assert s.transforms == ["mypkg.transforms", "other.mod"] and s.transform_workers == 3
    monkeypatch.setenv("SHARDSERVE_TRANSFORMS", '["a.b"]')
    assert Settings(store=tmp_path).transforms == ["a.b"]
    with pytest.raises(ValidationError, match="transform_pool"):
        Settings(store=tmp_path, transform_pool="fork")
    with pytest.raises(ValidationError, match="transform_workers"):
        Settings(store=tmp_path, transform_workers=0)
