"""Which transforms a server has: the built-ins, modules named in settings, and the
``shardserve.transforms`` entry-point group. Loaded once at start; nothing global.

A transform is a function marked by :func:`sample_transform` or :func:`batch_transform`;
loading a module collects every marked function among its attributes. Two transforms with
one name refuse to start, naming both homes.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .schema import Field, Schema

ENTRY_POINT_GROUP = "shardserve.transforms"
#: Built-in transform modules, always loaded.
BUILTIN_MODULES = (
    "shardserve.server.transforms.builtins",
    "shardserve.server.transforms.images",
    "shardserve.server.transforms.rows",
)

#: A sample's or a batch's fields as a transform's function gets and returns them: numpy
#: arrays, a scalar field's value as a numpy scalar, a batch's variable field as a list of
#: arrays. Open (``Any``) on purpose: each function reads the fields its step declared, and
#: the runner checks every field it returns against the declared outputs.
Columns = dict[str, Any]
Shape = Literal["sample", "batch"]
PoolKind = Literal["thread", "process"]
#: ``outputs(params, inputs) -> fields written`` (or a fixed mapping when params do not matter).
Outputs = Callable[[Any, Schema], Mapping[str, Field]] | Mapping[str, Field]


class NoParams(BaseModel):
    """The parameters of a transform that takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Transform:
    """A named transform: its function, parameter model, declared outputs, pool kind."""

    name: str
    shape: Shape
    fn: Callable[..., Mapping[str, Any]]
    params: type[BaseModel]
    outputs: Outputs
    pool: PoolKind
    module: str
    doc: str
    #: Whether ``fn`` takes a fourth argument, the server's :class:`~.runner.Limits`.
    takes_limits: bool = False
    #: ``peak(params, inputs) -> bytes per sample`` a step holds beyond the fields it reads
    #: and writes (a padded copy, say), checked against ``--max-batch-bytes`` at job creation.
    peak: Callable[[Any, Schema], int] | None = None
    #: Whether ``fn`` (a batch transform) takes ``out=``: see :func:`batch_transform`.
    takes_out: bool = False
    #: Whether ``fn`` (a batch transform) takes ``keys=``, the batch's per-sample
    #: :class:`~.keys.SampleKeys`: see :func:`batch_transform`.
    takes_keys: bool = False

    def __call__(self, *args: Any) -> Mapping[str, Any]:
        return self.fn(*args)

    def output_fields(self, params: BaseModel, inputs: Schema) -> dict[str, Field]:
        """Fields this step writes for ``params`` on ``inputs`` (ValueError: does not fit)."""
        out = self.outputs(params, inputs) if callable(self.outputs) else self.outputs
        return dict(out)

    def describe(self) -> dict[str, Any]:
        """What ``GET /v1/transforms`` shows of it."""
        outputs: Any
        if callable(self.outputs):
            outputs = inspect.getdoc(self.outputs) or "depends on the parameters"
        else:
            outputs = {n: f.to_json() for n, f in self.outputs.items()}
        return {
            "name": self.name,
            "shape": self.shape,
            "pool": self.pool,
            "module": self.module,
            "doc": self.doc,
            "params": self.params.model_json_schema(),
            "outputs": outputs,
        }


def _marker(
    shape: Shape,
    name: str | None,
    params: type[BaseModel] | None,
    outputs: Outputs,
    pool: PoolKind,
    takes_limits: bool = False,
    peak: Callable[[Any, Schema], int] | None = None,
    takes_out: bool = False,
    takes_keys: bool = False,
) -> Callable[[Callable[..., Any]], Transform]:
    def mark(fn: Callable[..., Any]) -> Transform:
        return Transform(
            name=name or fn.__name__,
            shape=shape,
            fn=fn,
            params=params or NoParams,
            outputs=outputs,
            pool=pool,
            module=fn.__module__,
            doc=(inspect.getdoc(fn) or "").split("\n\n")[0],
            takes_limits=takes_limits,
            peak=peak,
            takes_out=takes_out,
            takes_keys=takes_keys,
        )

    return mark


def sample_transform(
    *,
    outputs: Outputs,
    params: type[BaseModel] | None = None,
    name: str | None = None,
    pool: PoolKind = "thread",
    takes_limits: bool = False,
    peak: Callable[[Any, Schema], int] | None = None,
) -> Callable[[Callable[..., Any]], Transform]:
    """Mark ``fn(sample, params, rng) -> dict`` as a sample transform.

    ``sample`` maps field name to that sample's array; the result holds the fields it writes
    (every one declared in ``outputs``; fields it leaves out pass through). ``rng`` is a
    ``numpy.random.Generator`` from (seed, epoch, global sample index, step). ``pool="process"``
    runs it in worker processes (pure-Python work that holds the GIL). ``takes_limits``: ``fn``
    also gets the server's limits (``fn(sample, params, rng, limits)``); ``peak``: bytes per
    sample it holds beyond its inputs and outputs.
    """
    return _marker("sample", name, params, outputs, pool, takes_limits, peak)


def batch_transform(
    *,
    outputs: Outputs,
    params: type[BaseModel] | None = None,
    name: str | None = None,
    pool: PoolKind = "thread",
    takes_limits: bool = False,
    peak: Callable[[Any, Schema], int] | None = None,
    takes_out: bool = False,
    takes_keys: bool = False,
) -> Callable[[Callable[..., Any]], Transform]:
    """Mark ``fn(batch, params, rng) -> dict`` as a batch transform: arrays ``[B, ...]`` in
    (variable fields as lists of arrays), the fields it writes out, ``rng`` from (seed, epoch,
    rank, batch index, step); ``takes_limits`` and ``peak`` as for :func:`sample_transform`.

    ``takes_out``: ``fn`` also gets ``out=``, a mapping from some of the fixed-size fields it
    writes to the arrays the batch is sent from (``[B, *shape]``, the declared dtype; often
    empty: only the last step of a chain run on threads gets them). Writing a result into its
    ``out`` array and returning that array saves the copy into the stream's memory (8 MiB of
    float32 planes a batch is ~1 ms); a field not in ``out`` is returned as usual. An ``out``
    array holds an earlier batch's bytes: write every element of it.

    ``takes_keys``: ``fn`` also gets ``keys=``, a :class:`~.keys.SampleKeys` of the batch's
    samples (``keys.ids``: their global indices) whose draws depend on each sample alone,
    never on the batch (:mod:`.draws` has the built-ins' draws). Such a transform promises
    that a sample's output depends only on that sample and its keys (``rng`` is then
    ``None``, except in jobs of randomness scheme 1, see :mod:`.rng`): its batches may then be cut into pieces run on several workers, and a sample is
    augmented the same in any batch, on any rank and world size.

    >>> import numpy as np
    >>> @batch_transform(outputs={"x": Field("float32", (4,))}, takes_out=True)
    ... def as_float(batch, params, rng, out):
    ...     dest = out.get("x")
    ...     if dest is None:
    ...         return {"x": batch["x"].astype(np.float32)}
    ...     np.copyto(dest, batch["x"], casting="unsafe")
    ...     return {"x": dest}
    >>> as_float.takes_out
    True
    """
    return _marker("batch", name, params, outputs, pool, takes_limits, peak, takes_out, takes_keys)


class TransformRegistry:
    """Transforms by name."""

    def __init__(self, transforms: Iterable[Transform] = ()) -> None:
        self._by_name: dict[str, Transform] = {}
        for t in transforms:
            self.add(t)

    def add(self, t: Transform) -> None:
        old = self._by_name.get(t.name)
        if old is not None and old is not t:
            raise ValueError(
                f"two transforms are named {t.name!r}: one in {old.module}, one in {t.module}; "
                "rename one (name=...) or load only one of the modules"
            )
        self._by_name[t.name] = t

    def add_module(self, mod: ModuleType) -> int:
        found = [v for v in vars(mod).values() if isinstance(v, Transform)]
        for t in found:
            self.add(t)
        return len(found)

    @classmethod
    def load(cls, modules: Iterable[str] = (), use_entry_points: bool = True) -> TransformRegistry:
        """Built-ins, then ``modules``, then the entry-point group; an import that fails
        raises ``ValueError`` naming the module and why."""
        reg = cls()
        for name in (*BUILTIN_MODULES, *modules):
            try:
                mod = importlib.import_module(name)
            except Exception as e:
                raise ValueError(
                    f"cannot import transform module {name!r}: {e} (it must be importable "
                    "where the server runs: a module in the directory serve was started from, "
                    "an installed package, or a folder on PYTHONPATH)"
                ) from e
            if reg.add_module(mod) == 0 and name not in BUILTIN_MODULES:
                raise ValueError(
                    f"transform module {name!r} defines no transform (mark functions with "
                    "@sample_transform or @batch_transform)"
                )
        if use_entry_points:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                try:
                    obj = ep.load()
                except Exception as e:
                    raise ValueError(f"cannot load transform entry point {ep.value!r}: {e}") from e
                if isinstance(obj, Transform):
                    reg.add(obj)
                elif isinstance(obj, ModuleType):
                    reg.add_module(obj)
        return reg

    def get(self, name: str) -> Transform | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def describe(self) -> list[dict[str, Any]]:
        return [self._by_name[n].describe() for n in self.names()]
