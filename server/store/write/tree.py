"""Flatten nested samples (dicts to any depth, tuples, lists, ``None``) into named fields, and
keep the tree they came from for the manifest (:data:`shardserve.proto.manifest.Tree`).

One :class:`TreeBuilder` sees every sample of an ingest, in order. The first sample that
has a value at a place decides its kind; later samples must agree, except that ``None`` fits
anywhere (every field below it is missing in that sample) and a place that was ``None`` so
far may take a value later (its new fields were missing in every earlier sample). Dict keys
must match the earlier samples' keys, as before nesting was accepted.

Field names are the path of keys and positions joined by ``.`` (``params.nu``; a tuple's
items are ``_0``, ``_1``...). Characters a field name cannot hold become ``_``, with a
numbered suffix on a clash; the tree maps every original key to its field, so the client
gets the original keys back.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from typing import TypeAlias, TypeVar

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import Tree
from shardserve.proto.parts import COMPANION_SUFFIXES

_BAD = re.compile(r"[^A-Za-z0-9_]")
#: Marks a leaf value of a flattened sample that is missing (``None``).
MISSING = None


def _segment(key: str, first: bool) -> str:
    seg = _BAD.sub("_", key) or "_"
    if first and seg[0].isdigit():
        seg = "_" + seg
    return seg


def is_trivial(tree: Tree) -> bool:
    """True when ``tree`` is a flat dict whose keys are its field names (no manifest entry)."""
    if not (isinstance(tree, dict) and "dict" in tree):
        return False
    return all(isinstance(v, str) and v == k for k, v in tree["dict"].items())


def _is_leaf(value: object) -> bool:
    return not isinstance(value, (Mapping, tuple, list)) or isinstance(value, (bytes, str))


class TreeBuilder:
    """Flattens samples against the tree seen so far (see module docstring)."""

    def __init__(self) -> None:
        self.tree: Tree = None
        self._taken: set[str] = set()
        #: For :meth:`_fast`: key -> field of a one-level dict tree, or the fields of a
        #: one-level tuple tree; ``None`` for any other tree.
        self._flat: dict[str, str] | list[str] | None = None

    def _name(self, prefix: str, seg: str) -> str:
        base = f"{prefix}.{seg}" if prefix else seg
        if base.rsplit(".", 1)[-1] in COMPANION_SUFFIXES:
            base += "_"
        name, k = base, 1
        while name in self._taken:
            k += 1
            name = f"{base}_{k}"
        self._taken.add(name)
        return name

    def flatten(self, sample: object, where: str) -> dict[str, object]:
        """``{field: value}`` for one sample; fields below a ``None`` map to :data:`MISSING`."""
        if _is_leaf(sample) and sample is not None:
            sample = {"data": sample}  # a bare tensor: one field, as before nesting
        fast = self._fast(sample)
        if fast is not None:
            return fast
        out: dict[str, object] = {}
        self.tree = self._merge(self.tree, sample, "", out, where)
        self._flat = _flat_names(self.tree)
        return out

    def _fast(self, sample: object) -> dict[str, object] | None:
        """The common case without a walk: a one-level dict or tuple whose keys and leaves
        are the ones already known, none ``None``. ``None`` when the walk is needed."""
        flat = self._flat
        if flat is None:
            return None
        out: dict[str, object] = {}
        if isinstance(sample, dict) and isinstance(flat, dict):
            if len(sample) != len(flat):
                return None
            for k, v in sample.items():
                name = flat.get(k)
                if name is None or v is None or not _is_leaf(v):
                    return None
                out[name] = v
            return out
        if isinstance(sample, tuple) and isinstance(flat, list):
            if len(sample) != len(flat):
                return None
            for name, v in zip(flat, sample, strict=True):
                if v is None or not _is_leaf(v):
                    return None
                out[name] = v
            return out
        return None

    def _merge(
        self, node: Tree, value: object, prefix: str, out: dict[str, object], where: str
    ) -> Tree:
        if value is None:
            self._missing(node, out)
            return node
        if node is None or (isinstance(node, dict) and "none" in node):
            return self._new(value, prefix, out, where)
        path = prefix or "the sample"
        if isinstance(node, str):
            if not _is_leaf(value):
                raise InvalidDataError(
                    f"{where}: {path!s} holds a {type(value).__name__}, but earlier samples hold a "
                    "value there"
                )
            out[node] = value
            return node
        kind, items = next(iter(node.items()))
        if kind == "dict":
            return self._merge_dict(items, value, prefix, out, where)
        return self._merge_sequence(kind, items, value, prefix, out, where)

    def _merge_dict(
        self, items: dict[str, Tree], value: object, prefix: str, out: dict[str, object], where: str
    ) -> Tree:
        """Merge ``value`` into a dict node of ``items``: the same keys, each merged."""
        if not isinstance(value, Mapping):
            path = prefix or "the sample"
            raise InvalidDataError(
                f"{where}: {path} holds a {type(value).__name__}, but earlier samples hold a dict"
            )
        keys = [str(k) for k in value]
        if set(keys) != set(items):
            missing = [k for k in items if k not in keys]
            extra = [k for k in keys if k not in items]
            raise InvalidDataError(
                f"{where}: fields differ from the first sample's {list(items)}"
                f"{' under ' + prefix if prefix else ''}: missing {missing}, unexpected {extra}"
            )
        return {
            "dict": {
                k: self._merge(
                    items[k],
                    value[k] if k in value else value[_orig(value, k)],
                    _child_prefix(items[k], prefix, k),
                    out,
                    where,
                )
                for k in items
            }
        }

    def _merge_sequence(
        self,
        kind: str,
        items: list[Tree],
        value: object,
        prefix: str,
        out: dict[str, object],
        where: str,
    ) -> Tree:
        """Merge ``value`` into a ``kind`` (tuple or list) node of ``items``: the same kind
        and length, each item merged."""
        path = prefix or "the sample"
        if not isinstance(value, (tuple, list)) or (kind == "tuple") != isinstance(value, tuple):
            raise InvalidDataError(
                f"{where}: {path} holds a {type(value).__name__}, but earlier samples hold a {kind}"
            )
        if len(value) != len(items):
            raise InvalidDataError(
                f"{where}: {path} holds a {kind} of {len(value)} items, earlier samples {len(items)}"
            )
        return {
            kind: [
                self._merge(n, v, _child_prefix(n, prefix, f"_{i}"), out, where)
                for i, (n, v) in enumerate(zip(items, value, strict=True))
            ]
        }

    def _new(self, value: object, prefix: str, out: dict[str, object], where: str) -> Tree:
        if _is_leaf(value):
            name = self._name(*_split(prefix))
            out[name] = value
            return name
        if isinstance(value, Mapping):
            sub: dict[str, Tree] = {}
            for k, v in value.items():
                key = str(k)
                seg = _segment(key, not prefix)
                sub[key] = self._new_child(v, prefix, seg, out, where)
            return {"dict": sub}
        kind = "tuple" if isinstance(value, tuple) else "list"
        seq: tuple[object, ...] | list[object] = value  # type: ignore[assignment]
        return {kind: [self._new_child(v, prefix, f"_{i}", out, where) for i, v in enumerate(seq)]}

    def _new_child(
        self, value: object, prefix: str, seg: str, out: dict[str, object], where: str
    ) -> Tree:
        if value is None:
            # A place seen only as None so far: its kind (and field names) come later.
            return {"none": f"{prefix}.{seg}" if prefix else seg}
        if _is_leaf(value):
            name = self._name(prefix, seg)
            out[name] = value
            return name
        path = f"{prefix}.{seg}" if prefix else seg
        return self._new(value, path, out, where)

    def _missing(self, node: Tree, out: dict[str, object]) -> None:
        if node is None:
            return
        if isinstance(node, str):
            out[node] = MISSING
            return
        kind, items = next(iter(node.items()))
        if kind == "none":
            return
        for sub in items.values() if kind == "dict" else items:
            self._missing(sub, out)

    def final(self) -> Tree:
        """The tree for the manifest: places never given a value become ``None``."""
        return _strip(self.tree)


def _flat_names(tree: Tree) -> dict[str, str] | list[str] | None:
    if not isinstance(tree, dict):
        return None
    kind, items = next(iter(tree.items()))
    if kind == "dict" and all(isinstance(v, str) for v in items.values()):
        return dict(items)
    if kind == "tuple" and all(isinstance(v, str) for v in items):
        return list(items)
    return None


K = TypeVar("K", bound=Hashable)


def _orig(value: Mapping[K, object], key: str) -> K:
    for k in value:
        if str(k) == key:
            return k
    raise KeyError(key)


def _split(prefix: str) -> tuple[str, str]:
    head, _, last = prefix.rpartition(".")
    return head, last


def _child_prefix(node: Tree, prefix: str, seg: str) -> str:
    if isinstance(node, dict) and "none" in node:
        return str(node["none"])
    return f"{prefix}.{seg}" if prefix else seg


def _strip(tree: Tree) -> Tree:
    if tree is None or isinstance(tree, str):
        return tree
    kind, items = next(iter(tree.items()))
    if kind == "none":
        return None
    if kind == "dict":
        return {"dict": {k: _strip(v) for k, v in items.items()}}
    return {kind: [_strip(v) for v in items]}


#: Dotted field names as nested groups: a name at a leaf, ``{"dict": {...}}`` for a group.
_Names: TypeAlias = "dict[str, str | dict[str, _Names]]"


def tree_of_names(names: list[str]) -> Tree:
    """The dict tree that dotted field names (``game.board``) spell; ``None`` if all are flat."""
    if not any("." in n for n in names):
        return None
    root: _Names = {}
    for n in names:
        node = root
        parts = n.split(".")
        for p in parts[:-1]:
            child = node.setdefault(p, {"dict": {}})
            if isinstance(child, str):
                raise InvalidDataError(f"field {child!r} is both a value and a group of fields")
            node = child["dict"]
        if parts[-1] in node:
            raise InvalidDataError(f"field {n!r} is both a value and a group of fields")
        node[parts[-1]] = n
    return {"dict": root}
