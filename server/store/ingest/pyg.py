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
from typing import Any, TypeGuard

from shardserve.proto.errors import InvalidDataError

#: One graph's attributes as ``torch.load`` left them: tensors and plain values. Open on
#: purpose: torch is never imported by the server, so its tensors cannot be typed here, and
#: what the attributes hold is checked when :mod:`.pt_files` converts them.
Graph = dict[str, Any]

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

    def __setstate__(self, state: object) -> None:
        self.state: dict[str, object] = state if isinstance(state, dict) else {}


def _standin(name: str) -> type[Standin]:
    return type(name.rsplit(".", 1)[1], (Standin,), {"pyg_name": name})


_STANDINS = [(_standin(n), n) for n in PYG_NAMES]
_lock = threading.Lock()
_users = 0
_saved: list[object] = []


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


def _name(g: object) -> str:
    if isinstance(g, tuple):
        return str(g[1])
    return f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}"


def is_stub(value: object) -> TypeGuard[Standin | type[Standin]]:
    return isinstance(value, Standin) or (isinstance(value, type) and issubclass(value, Standin))


def _mapping(store: object) -> Graph:
    if not isinstance(store, Standin):
        return {}
    m = store.state.get("_mapping", {})
    return dict(m) if isinstance(m, dict) else {}


#: The most nodes one graph may declare: node indices are served as int64, but a count past
#: int32 is a corrupt file, not a graph (the batch vector alone would be 16 GB).
MAX_NODES = 2**31 - 1


def _num_nodes(m: Graph, path: Path | str) -> int | None:
    """The graph's node count: stored, else the first dim of ``x`` / ``pos``, else one more
    than the largest node index; a stored count that cannot be right is refused."""
    rows = next(
        (
            int(m[k].shape[0])
            for k in ("x", "pos")
            if m.get(k) is not None and getattr(m[k], "ndim", 0) >= 1
        ),
        None,
    )
    ei = m.get("edge_index")
    top = int(ei.max()) + 1 if ei is not None and getattr(ei, "numel", lambda: 0)() else 0
    stored = m.get("num_nodes")
    if stored is None:
        return rows if rows is not None else (top or None)
    if isinstance(stored, bool) or not isinstance(stored, int):
        stored = getattr(stored, "item", lambda: stored)()
    if not isinstance(stored, int) or not 0 <= stored <= MAX_NODES:
        raise InvalidDataError(
            f"{path}: num_nodes is {stored!r}; a graph's num_nodes must be an integer from 0 to "
            f"{MAX_NODES} (fix or drop it: PyG infers it from x)"
        )
    if rows is not None and stored != rows:
        raise InvalidDataError(
            f"{path}: num_nodes is {stored}, but x / pos has {rows} rows; they must agree"
        )
    if top > stored:
        raise InvalidDataError(
            f"{path}: num_nodes is {stored}, but edge_index refers to node {top - 1}"
        )
    return stored


def as_sample(value: Standin | type[Standin], path: Path | str) -> Graph:
    """A PyG object's tensors as a (nested) dict (see module docstring)."""
    name = getattr(value, "pyg_name", "")
    st = getattr(value, "state", {})
    if name.endswith(".Data"):
        m = _mapping(st.get("_store"))
        n = _num_nodes(m, path)
        if n is not None:
            m["num_nodes"] = n
        return m
    if name.endswith(".HeteroData"):
        out = _mapping(st.get("_global_store"))
        for key, store in dict(st.get("_node_store_dict", {})).items():
            out[str(key)] = _mapping(store)
        for key, store in dict(st.get("_edge_store_dict", {})).items():
            out["__".join(key) if isinstance(key, tuple) else str(key)] = _mapping(store)
        return out
    raise InvalidDataError(
        f"{path}: holds a torch_geometric {name or 'class'} on its own; expected a Data or HeteroData"
    )


def _cat_dim(key: str) -> int:
    """The dimension PyG's ``Data.__cat_dim__`` concatenates ``key`` along."""
    return -1 if "index" in key or key == "face" else 0


def in_memory(obj: object, path: Path | str) -> list[Graph] | None:
    """The graphs of a ``torch_geometric`` ``InMemoryDataset`` file (``processed/data.pt``),
    as PyG's ``dataset[i]`` gives them; ``None`` if ``obj`` is not one.

    Two layouts: ``(Data, slices)`` (PyG before 2.4) and ``(data.to_dict(), slices,
    Data)`` (``InMemoryDataset.save``). ``slices`` maps each attribute to the offsets of every
    graph along its concatenation dimension; ``None`` when the dataset is one graph. As
    PyG's ``separate(..., decrement=False)``: each graph's part of every sliced attribute,
    and its own ``num_nodes`` when the graphs had one."""
    if not isinstance(obj, tuple) or len(obj) not in (2, 3):
        return None
    data, slices = obj[0], obj[1]
    if slices is not None and not isinstance(slices, dict):
        return None
    if len(obj) == 3:
        cls = obj[2]
        if not (isinstance(data, dict) and is_stub(cls)):
            return None
        name = getattr(cls, "pyg_name", "")
        mapping = {k: v for k, v in data.items() if k != "_num_nodes"}
        counts = data.get("_num_nodes")
    elif isinstance(data, Standin):
        name = data.pyg_name
        store = data.state.get("_store")
        mapping = _mapping(store)
        counts = store.state.get("_num_nodes") if isinstance(store, Standin) else None
    else:
        return None
    if not name.endswith(".Data"):
        raise InvalidDataError(
            f"{path}: an InMemoryDataset of {name.rsplit('.', 1)[-1] or 'unknown objects'}; "
            "only Data graphs can be read (convert each graph to a .pt file of its own)"
        )
    if slices is None:
        one = {k: v for k, v in mapping.items()}
        n = _num_nodes(one, path)
        if n is not None:
            one["num_nodes"] = n
        return [one]
    lengths = {len(v) - 1 for v in slices.values() if hasattr(v, "__len__")}
    if len(lengths) != 1:
        raise InvalidDataError(f"{path}: InMemoryDataset slices disagree on the graph count")
    (num,) = lengths
    return [_graph_at(i, num, slices, mapping, counts, path) for i in range(num)]


def _graph_at(
    i: int,
    num: int,
    slices: dict[str, Any],
    mapping: Graph,
    counts: object,
    path: Path | str,
) -> Graph:
    """Graph ``i`` of ``num``: its part of every sliced attribute, and its node count."""
    g: Graph = {}
    for key, sl in slices.items():
        value = mapping.get(key)
        if value is None:
            continue
        start, end = int(sl[i]), int(sl[i + 1])
        if hasattr(value, "narrow"):
            g[key] = value.narrow(_cat_dim(key), start, end - start)
        elif isinstance(value, list) and len(value) == num:
            g[key] = value[i]
        else:
            raise InvalidDataError(
                f"{path}: InMemoryDataset attribute {key!r} is a {type(value).__name__}, "
                "which cannot be split into graphs"
            )
    if isinstance(counts, list) and len(counts) == num:
        g["num_nodes"] = counts[i]
    n = _num_nodes(g, f"{path} graph {i}")
    if n is not None:
        g["num_nodes"] = n
    return g
