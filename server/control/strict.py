"""JSON bodies checked for their types exactly as they arrive, before pydantic reads them.

The request models (``JobSpec``, ``MixtureUpdate``...) are also built by the client from Python
values, where a tuple for a list, a numpy integer for an ``int`` or a string for a ``Literal``
are meant, so the models stay lax. JSON has no such excuse: ``"0.5"`` where a weight goes,
``true`` where a batch size goes, ``"7"`` where a sample id goes are mistakes that lax
validation would turn into numbers. :class:`StrictJson` walks the raw body alongside the
model's JSON schema and refuses every scalar of the wrong JSON type with a 422 naming the field
and what to send; everything else (ranges, patterns, cross-field rules) is left to the model.

Pydantic's own strict mode cannot do this here: a model with a ``mode="before"`` validator
(``JobSpec`` fills in a mixture's name) is validated as Python objects even from JSON, and
strict Python refuses a JSON array for a tuple field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

#: What each JSON schema type accepts, by the JSON kind of the value (see :func:`_kind`).
_ACCEPTS: dict[str, frozenset[str]] = {
    "integer": frozenset({"integer"}),
    "number": frozenset({"integer", "number"}),
    "boolean": frozenset({"boolean"}),
    "string": frozenset({"string"}),
    "null": frozenset({"null"}),
    "array": frozenset({"array"}),
    "object": frozenset({"object"}),
}
#: What to send instead, per expected type: appended to the field's name in the 422.
_SEND = {
    "integer": "must be a JSON integer: a number without quotes or decimals (not true/false)",
    "number": "must be a JSON number: without quotes (not true/false)",
    "boolean": "must be true or false (not a string or a number)",
    "string": "must be a JSON string (in quotes)",
    "null": "must be null",
    "array": "must be a JSON array",
    "object": "must be a JSON object",
}
#: Nesting deeper than this is not walked (pydantic still validates it); bodies are small.
_MAX_DEPTH = 32


def _kind(value: object) -> str:
    """The JSON type of a value ``json.loads`` made (bool before int: ``True`` is an int)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


@dataclass
class _Walk:
    """One body's check against one schema: the problems found, as FastAPI error dicts."""

    defs: dict[str, Any]

    def check(
        self, value: object, schema: dict[str, Any], loc: tuple[str | int, ...]
    ) -> list[dict[str, Any]]:
        if len(loc) > _MAX_DEPTH:
            return []
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.check(value, self.defs.get(ref.rsplit("/", 1)[-1], {}), loc)
        branches = schema.get("anyOf") or schema.get("oneOf")
        if branches:
            return self._any(value, branches, loc)
        types = schema.get("type")
        if types is None:
            return []  # Any: no type to hold it to
        wanted = [types] if isinstance(types, str) else list(types)
        kind = _kind(value)
        if not any(kind in _ACCEPTS.get(t, frozenset({kind})) for t in wanted):
            msg = "; or ".join(_SEND.get(t, f"must be a JSON {t}") for t in wanted)
            return [{"loc": ("body", *loc), "msg": msg, "input": value, "type": "json_type"}]
        if isinstance(value, list):
            return self._items(value, schema, loc)
        if isinstance(value, dict):
            return self._members(value, schema, loc)
        return []

    def _any(
        self, value: object, branches: list[dict[str, Any]], loc: tuple[str | int, ...]
    ) -> list[dict[str, Any]]:
        found = [self.check(value, b, loc) for b in branches]
        if any(not f for f in found):
            return []
        # No branch fits: the problems inside the branch of the value's own JSON kind say
        # the most (a wrong weight inside a list), else one line listing what fits.
        kind = _kind(value)
        for branch, problems in zip(branches, found, strict=True):
            types = branch.get("type")
            if isinstance(types, str) and kind in _ACCEPTS.get(types, frozenset()):
                return problems
        merged = "; or ".join(p["msg"] for f in found for p in f if p["loc"] == ("body", *loc))
        return [
            {
                "loc": ("body", *loc),
                "msg": merged or "has the wrong JSON type",
                "input": value,
                "type": "json_type",
            }
        ]

    def _items(
        self, value: list[object], schema: dict[str, Any], loc: tuple[str | int, ...]
    ) -> list[dict[str, Any]]:
        prefix = schema.get("prefixItems") or []
        rest = schema.get("items")
        out: list[dict[str, Any]] = []
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else rest
            if isinstance(sub, dict):
                out += self.check(item, sub, (*loc, i))
        return out

    def _members(
        self, value: dict[str, object], schema: dict[str, Any], loc: tuple[str | int, ...]
    ) -> list[dict[str, Any]]:
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out: list[dict[str, Any]] = []
        for key, item in value.items():
            sub = props.get(key, extra)
            if isinstance(sub, dict):
                out += self.check(item, sub, (*loc, key))
        return out


class StrictJson:
    """A route dependency refusing a JSON body whose scalars are not of the JSON type
    ``model``'s schema gives them (a 422 naming each such field and what to send).

    A body that is not JSON at all is left to FastAPI's own parsing and its 422."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.schema = model.model_json_schema()
        self.defs: dict[str, Any] = self.schema.get("$defs", {})

    async def __call__(self, request: Request) -> None:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return
        problems = _Walk(self.defs).check(body, self.schema, ())
        if problems:
            raise RequestValidationError(problems)
