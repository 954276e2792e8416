"""``shardserve serve``'s flags, derived from the :class:`~.settings.Settings` fields.

A setting is declared once, in ``Settings``, with its type, default, bounds and a
``description``; this module turns each field into a flag (``assembly_threads`` ->
``--assembly-threads``) whose help is that description. A field's ``json_schema_extra`` may
name the flag (``"flag"``) or its metavar (``"metavar"``). Flags left out are not passed on,
so ``SHARDSERVE_*`` variables and then the defaults apply.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, TypedDict

from pydantic import ByteSize
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .settings import Settings


class _FlagKwargs(TypedDict, total=False):
    """The ``add_argument`` keywords a settings field turns into."""

    dest: str
    default: None
    action: str | type[argparse.Action]
    help: str
    choices: list[object]
    type: type[float] | type[int]
    metavar: str


def _unwrap(annotation: object) -> object:
    """``X | None`` -> ``X``; other annotations unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _shown_default(name: str, info: FieldInfo) -> str | None:
    default = info.get_default(call_default_factory=True)
    if default is PydanticUndefined or default is None or default is False or default == []:
        return None
    if isinstance(default, int) and not isinstance(default, bool) and name.endswith("_bytes"):
        return ByteSize(default).human_readable(separator="")
    if isinstance(default, list):
        return ", ".join(map(str, default))
    return str(default)


def _flag_kwargs(name: str, info: FieldInfo) -> _FlagKwargs:
    """argparse keywords for one field: its action or type, choices, metavar and help."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    kind = _unwrap(info.annotation)
    # A sized setting's default is the machine's (its description says how), not the field's.
    shown = None if extra.get("sized") is True else _shown_default(name, info)
    help_text = info.description or ""
    kw: _FlagKwargs = {"dest": name, "default": None}
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction if info.default else "store_true"
        return {**kw, "help": help_text + (" (default on)" if info.default else "")}
    if shown is not None:
        help_text += f" (default {shown})"
    kw["help"] = help_text
    if typing.get_origin(kind) is list:
        kw["action"] = "append"
    elif typing.get_origin(kind) is typing.Literal:
        kw["choices"] = list(typing.get_args(kind))
    elif isinstance(kind, type) and issubclass(kind, (float, int)) and kind is not ByteSize:
        kw["type"] = kind  # ByteSize stays text: pydantic parses units such as 512MiB
    if "metavar" in extra:
        kw["metavar"] = str(extra["metavar"])
    elif "choices" not in kw:
        kw["metavar"] = _metavar(name, kind)
    return kw


def _metavar(name: str, kind: object) -> str:
    if name.endswith("_s"):
        return "S"
    if kind is int:
        return "N"
    if kind is Path:
        return "PATH"
    return name.upper()


def flag_name(name: str, info: FieldInfo) -> str:
    """The flag of a settings field: its ``json_schema_extra["flag"]``, else ``--kebab-name``."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    flag = extra.get("flag")
    return flag if isinstance(flag, str) else "--" + name.replace("_", "-")


#: How ``serve --help`` groups the settings; a field named in no group lands in the last one.
GROUPS: dict[str, tuple[str, ...]] = {
    "store": (
        "store",
        "create",
        "verify",
        "state_dir",
        "cache_dir",
        "cache_limit_bytes",
        "store_endpoint",
        "store_timeout_s",
    ),
    "addresses and access": (
        "http",
        "data",
        "ipc",
        "token",
        "insecure",
        "allowed_hosts",
        "ready_file",
    ),
    "streams, memory and limits": (
        "assembly_threads",
        "stream_processes",
        "shm",
        "shm_limit_bytes",
        "shm_ring_bytes",
        "shm_unproven_rings",
        "max_batch_bytes",
        "max_streams",
        "max_streams_per_job",
        "max_hellos_per_s",
        "heartbeat_s",
        "share_subscribers",
        "share_window",
        "share_window_bytes",
        "share_bytes",
        "unread_stream_bytes",
        "unread_bytes",
        "plan_cache_bytes",
        "read_ahead_bytes",
        "stream_timeout_s",
        "max_body_bytes",
        "http_idle_timeout_s",
    ),
    "jobs and shutdown": ("idle_after_s", "job_ttl_s", "max_jobs", "shutdown_timeout_s"),
    "transforms": (
        "transforms",
        "transform_workers",
        "transform_pool",
        "transform_timeout_s",
        "max_decoded_pixels",
    ),
    "logging": ("log_format", "log_level"),
}
OTHER_GROUP = "other settings"


def grouped_fields() -> dict[str, list[str]]:
    """:class:`Settings` field names by :data:`GROUPS` title, in ``Settings`` order; fields in
    no group under :data:`OTHER_GROUP` (only groups with fields)."""
    group_of = {f: title for title, fields in GROUPS.items() for f in fields}
    out: dict[str, list[str]] = {title: [] for title in [*GROUPS, OTHER_GROUP]}
    for name in Settings.model_fields:
        out[group_of.get(name, OTHER_GROUP)].append(name)
    return {title: names for title, names in out.items() if names}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`Settings` field, in :func:`grouped_fields` groups; each defaults
    to ``None`` (not given)."""
    fields = Settings.model_fields
    for title, names in grouped_fields().items():
        group = parser.add_argument_group(title)
        for name in names:
            group.add_argument(flag_name(name, fields[name]), **_flag_kwargs(name, fields[name]))


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (those left out fall back to the environment, then the
    defaults)."""
    # Left open: the flags' raw values (text such as 512MiB for a ByteSize), which ``Settings(...)``
    # validates; its typed keywords would otherwise refuse them.
    return {k: v for k in Settings.model_fields if (v := getattr(args, k, None)) is not None}
