"""Give a batch back in the shape its samples were saved in, and mark what is missing.

A dataset ingested from nested samples records their tree (``{"latent", "params": {"nu"}}``,
``(image, label)``...) with its fields stored flat (``params.nu``). :class:`Rebuild` turns a
flat batch into that tree, as ``torch.utils.data.default_collate`` would have collated it:
``batch["params"]["nu"]``, or a tuple ``(images, labels)``.

A field that was ``None`` in some samples arrives as :class:`Masked`: its values and a bool
mask, ``True`` where the sample has a value. The values of a missing sample are not data
(the store keeps zeros there); read them through the mask, or use :meth:`Masked.unbind`.

A text field (a string column, a ``str`` in a saved sample: the manifest marks it with an
``encoding``) arrives as :class:`Texts`, a ``list`` of one ``str`` per sample (``None``
where missing), or of one ``list[str]`` per sample for a list of strings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardserve.proto.errors import BadRequest
from shardserve.proto.jobs import JobSpec
from shardserve.proto.parts import MASK

from .control import ControlClient
from .types import VarTensor


@dataclass(frozen=True)
class Masked:
    """A field some samples of the batch do not have.

    Examples:
        >>> m = Masked(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([True, False, True]))
        >>> m.unbind()
        [tensor(1.), None, tensor(3.)]
    """

    #: ``[B, ...]`` (or a :class:`VarTensor`); rows where ``mask`` is False are not data.
    values: torch.Tensor | VarTensor
    #: bool ``[B]``: True where the sample has a value.
    mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.mask.numel())

    def unbind(self) -> list[torch.Tensor | None]:
        """One tensor per sample, ``None`` where it is missing."""
        rows = self.values.unbind() if isinstance(self.values, VarTensor) else list(self.values)
        return [r if ok else None for r, ok in zip(rows, self.mask.tolist(), strict=True)]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Masked:
        return Masked(
            self.values.to(device, non_blocking=non_blocking),
            self.mask.to(device, non_blocking=non_blocking),
        )


class Texts(list[Any]):
    """A batch of a text field: one ``str`` (or ``list[str]``, or ``None``) per sample.

    >>> Texts(["a", "b"])[1]
    'b'
    """


def _texts(value: Any, encoding: str) -> Any:
    """A binary field's batch (``VarTensor``, or ``Masked`` of one) decoded as text; bytes
    padded by ``pad_variable`` stay as they are."""
    mask: list[bool] | None = None
    inner = value.values if isinstance(value, Masked) else value
    if not isinstance(inner, VarTensor):
        return value
    if isinstance(value, Masked):
        mask = value.mask.tolist()
    value = inner
    data = value.values.cpu().numpy().tobytes()
    offs = value.offsets.tolist()
    out: list[Any] = []
    for i in range(len(offs) - 1):
        raw = data[offs[i] : offs[i + 1]]
        if mask is not None and not mask[i]:
            out.append(None)
        elif encoding == "utf-8-list":
            out.append([p.decode("utf-8") for p in raw.split(b"\0")[:-1]])
        else:
            out.append(raw.decode("utf-8"))
    return Texts(out)


def _leaves(tree: Any) -> Iterable[str]:
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, dict):
        ((kind, items),) = tree.items()
        for sub in items.values() if kind == "dict" else items:
            yield from _leaves(sub)


class Rebuild:
    """Flat batch -> the tree of the dataset's samples (see module docstring).

    >>> r = Rebuild({"tuple": ["_0", "_1"]})
    >>> r({"_0": torch.zeros(2, 3), "_1": torch.tensor([4, 5])})[1]
    tensor([4, 5])
    """

    def __init__(
        self,
        tree: Any,
        served: Iterable[str] | None = None,
        encodings: Mapping[str, str] | None = None,
    ) -> None:
        self.tree = tree if tree is not None else None
        self._served = set(served) if served is not None else set(_leaves(tree))
        self._present: Iterable[str] = self._served
        #: Text fields and their encoding: decoded to :class:`Texts`.
        self._encodings = dict(encodings or {})

    @classmethod
    def for_dataset(
        cls, structure: Any, fields: Iterable[Mapping[str, Any]], served: Iterable[str] | None
    ) -> Rebuild | None:
        """What a Loader applies, or ``None`` when batches stay flat dicts as they come."""
        fields = list(fields)
        names = [str(f["name"]) for f in fields]
        nullable = any(f.get("nullable") for f in fields)
        encodings = {str(f["name"]): str(f["encoding"]) for f in fields if f.get("encoding")}
        if structure is None and not nullable and not encodings:
            return None
        if structure is None:  # flat, but with masks to attach or text to decode
            structure = {"dict": {n: n for n in names}}
        return cls(structure, served if served is not None else names, encodings)

    @property
    def is_dict(self) -> bool:
        return isinstance(self.tree, dict) and "dict" in self.tree

    def __call__(self, batch: Mapping[str, Any]) -> Any:
        used: set[str] = set()
        self._present = batch.keys()
        out = self._build(self.tree, batch, used)
        extra = {k: v for k, v in batch.items() if k not in used}
        if isinstance(out, dict):
            out.update(extra)  # e.g. ``x.lengths`` (pad_variable), a graph's ``batch`` / ``ptr``
        return out

    def _build(self, node: Any, batch: Mapping[str, Any], used: set[str]) -> Any:
        if node is None:
            return None
        if isinstance(node, str):
            value = batch[node]
            used.add(node)
            mask = batch.get(node + MASK)
            if mask is not None:
                used.add(node + MASK)
                value = Masked(value, mask)
            enc = self._encodings.get(node)
            return _texts(value, enc) if enc is not None else value
        ((kind, items),) = node.items()
        if kind == "dict":
            return {
                k: self._build(sub, batch, used) for k, sub in items.items() if self._wanted(sub)
            }
        built = [self._build(sub, batch, used) for sub in items if self._wanted(sub)]
        return tuple(built) if kind == "tuple" else built

    def _wanted(self, node: Any) -> bool:
        """Whether a subtree has a field in this batch (``fields=`` or a graph collation may
        leave some out)."""
        if node is None:
            return True
        return any(n in self._served and n in self._present for n in _leaves(node))


def rebuild_for(api: ControlClient, spec: JobSpec, pad_variable: bool) -> Rebuild | None:
    """The :class:`Rebuild` a Loader of ``spec`` applies (one ``GET /v1/datasets/{name}``)."""
    info = api.dataset(spec.described_by)
    rebuild = Rebuild.for_dataset(info.structure, info.fields, spec.fields)
    if rebuild is not None and pad_variable and not rebuild.is_dict:
        raise BadRequest(
            f"dataset {spec.dataset!r} holds tuples, which have no key for pad_variable's "
            "lengths; leave pad_variable off and call .pad() on the VarTensor fields"
        )
    return rebuild
