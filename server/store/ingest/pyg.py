"""Read ``torch_geometric`` graphs from ``.pt`` files without PyG's classes: the adapter.

``torch.save(Data(...))`` pickles PyG's own classes (``Data``, ``GlobalStorage``,
``DataEdgeAttr``...). ``torch.load(weights_only=True)`` refuses them, and PyG itself allows
only some of them, so a saved ``Data`` does not load even with PyG installed. Unpickling them
for real would run whatever those names resolve to. Instead, for exactly the names below,
``torch.load`` builds an inert :class:`Standin` that keeps the pickled state (a dict of
tensors and plain values, which the weights-only unpickler checks as usual); nothing of PyG
is imported or run. Any other class is still refused.

A ``Data`` becomes a dict of its attributes plus ``num_nodes`` (stored, else the first dim of
``x`` or ``pos``, else ``edge_index.max() + 1``), so the graph collation can offset edges
without guessing. A ``HeteroData`` becomes ``{node_type: {...}, "src__rel__dst": {...}}``.

While a load runs, the stand-ins are registered process-wide (torch keeps one list); they are
removed when the last concurrent load ends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from shardserve.proto.errors import InvalidDataError

#: The PyG names a saved ``Data`` / ``HeteroData`` refers to (torch_geometric 2.x).
PYG_NAMES = (
    "torch_geometric.data.data.Data",
    "torch_geometric.data.data.DataEdgeAttr",
    "torch_geometric.data.data.DataTensorAttr",
    "torch_geometric.data.hetero_data.HeteroData",
    "torch_geometric.data.storage.BaseStorage",
    "torch_geometric.data.storage.GlobalStorage",
    "torch_geometric.data.storage.NodeStorage",
    "torch_geometric.data.storage.EdgeStorage",
    "torch_geometric.data.graph_store.EdgeAttr",
    "torch_geometric.data.feature_store.TensorAttr",
)


class Standin:
    """The pickled state of one PyG object; holds data, runs nothing."""

    pyg_name = ""

    def __setstate__(self, state: Any) -> None:
        self.state = state if isinstance(state, dict) else {}


def _standin(name: str) -> type[Standin]:
    return type(name.rsplit(".", 1)[1], (Standin,), {"pyg_name": name})


_STANDINS = [(_standin(n), n) for n in PYG_NAMES]
_lock = threading.Lock()
_users = 0
_saved: list[Any] = []


@contextmanager
def standins(torch: ModuleType) -> Iterator[None]:
    """Let ``torch.load(weights_only=True)`` build :class:`Standin` for :data:`PYG_NAMES`."""
    global _users, _saved
    ser = torch.serialization
    with _lock:
        if _users == 0:
            # Torch keeps a set: a real PyG class registered under the same name (PyG does
            # that for Data) would win or lose at random, so it steps aside meanwhile.
            _saved = list(ser.get_safe_globals())
            ser.clear_safe_globals()
            ser.add_safe_globals([g for g in _saved if _name(g) not in PYG_NAMES] + _STANDINS)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                ser.clear_safe_globals()
                ser.add_safe_globals(_saved)


def _name(g: Any) -> str:
    if isinstance(g, tuple):
        return str(g[1])
    return f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}"


def is_stub(value: object) -> bool:
    return isinstance(value, Standin) or (isinstance(value, type) and issubclass(value, Standin))


def _mapping(store: object) -> dict[str, Any]:
    if not isinstance(store, Standin):
        return {}
    m = store.state.get("_mapping", {})
    return dict(m) if isinstance(m, dict) else {}


def _num_nodes(m: dict[str, Any]) -> int | None:
    if isinstance(m.get("num_nodes"), int):
        return int(m["num_nodes"])
    for key in ("x", "pos"):
        v = m.get(key)
        if v is not None and getattr(v, "ndim", 0) >= 1:
            return int(v.shape[0])
    ei = m.get("edge_index")
    if ei is not None and getattr(ei, "numel", lambda: 0)():
        return int(ei.max()) + 1
    return None


def as_sample(value: Standin, path: Path | str) -> dict[str, Any]:
    """A PyG object's tensors as a (nested) dict (see module docstring)."""
    name = getattr(value, "pyg_name", "")
    st = getattr(value, "state", {})
    if name.endswith(".Data"):
        m = _mapping(st.get("_store"))
        n = _num_nodes(m)
        if n is not None:
            m["num_nodes"] = n
        return m
    if name.endswith(".HeteroData"):
        out: dict[str, Any] = _mapping(st.get("_global_store"))
        for key, store in dict(st.get("_node_store_dict", {})).items():
            out[str(key)] = _mapping(store)
        for key, store in dict(st.get("_edge_store_dict", {})).items():
            out["__".join(key) if isinstance(key, tuple) else str(key)] = _mapping(store)
        return out
    raise InvalidDataError(
        f"{path}: holds a torch_geometric {name or 'class'} on its own; expected a Data or HeteroData"
    )
