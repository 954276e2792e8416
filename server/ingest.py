"""Write a dataset from Python: for data produced by code rather than read from files.

:class:`DatasetWriter` is what ``shardserve ingest`` writes with: the same field inference
(shapes that vary become variable fields, ``None`` makes a field nullable, nested dicts and
tuples keep their tree), the same checks (``max_sample_bytes``, one field name per input,
names a store can hold) and the same atomic publish: nothing is visible under the name until
:meth:`DatasetWriter.close` returns, and an exception inside the ``with`` block (or a crash)
publishes nothing.

>>> import numpy as np
>>> from shardserve.server.ingest import DatasetWriter
>>> with DatasetWriter("/data/store", "squares") as w:  # doctest: +SKIP
...     for i in range(1000):
...         w.add({"x": np.full(3, i, np.float32), "y": i * i, "name": f"s{i}"})
>>> w.manifest.num_samples  # doctest: +SKIP
1000
"""

from __future__ import annotations

import os
import types
from collections.abc import Collection, Iterable, Mapping

from shardserve.proto.errors import InvalidDataError
from shardserve.proto.manifest import Manifest

from .store.ingest.source import MAX_SAMPLE_BYTES
from .store.write.writer import ShardWriter

__all__ = ["DatasetWriter"]


class DatasetWriter:
    """Write samples into dataset ``name`` of the store folder ``store``.

    ``add(sample)`` takes one sample: a dict (nested to any depth), a tuple or a bare array,
    of numpy arrays (or anything ``np.asarray`` takes: torch tensors on the CPU), numbers,
    ``str`` (served back as ``str``), ``bytes`` (encoded images: ``decode_image`` reads them),
    and ``None`` (missing). ``close()`` publishes and returns the manifest; ``abort()``
    drops everything. As a context manager it closes on a clean exit and aborts on an error.

    ``metadata`` (str -> str) goes into the manifest's ``source``, as ingest's facts do;
    ``classes`` (label names) is what ``GET /v1/datasets/{name}`` shows as ``classes``.
    """

    def __init__(
        self,
        store: str | os.PathLike[str],
        name: str,
        *,
        overwrite: bool = False,
        shard_bytes: int = 256 << 20,
        max_sample_bytes: int = MAX_SAMPLE_BYTES,
        variable: Collection[str] = (),
        metadata: Mapping[str, str] | None = None,
        classes: Iterable[str] | None = None,
    ) -> None:
        if "://" in os.fspath(store):
            raise InvalidDataError(
                f"DatasetWriter writes to a store folder, not {os.fspath(store)!r}; write to a "
                "folder and publish it with `shardserve ingest` or copy it to the object store"
            )
        source = {"format": "python", **dict(metadata or {})}
        if classes is not None:
            import json

            source["classes"] = json.dumps([str(c) for c in classes])
        self._writer = ShardWriter(
            store,
            name,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
            source=source,
            variable=variable,
            max_sample_bytes=max_sample_bytes,
        )
        #: The published manifest, once :meth:`close` returned.
        self.manifest: Manifest | None = None

    @property
    def num_samples(self) -> int:
        """Samples added so far."""
        return self._writer.num_samples

    def add(self, sample: object) -> None:
        """Append one sample (see the class docstring); a sample that does not fit the
        earlier ones raises ``InvalidDataError`` naming it and the field."""
        self._writer.add(_plain(sample), where=f"sample {self._writer.num_samples}")

    def add_many(self, samples: Iterable[object]) -> None:
        """:meth:`add` each of ``samples``."""
        for s in samples:
            self.add(s)

    def close(self) -> Manifest:
        """Publish the dataset (atomically) and return its manifest."""
        self.manifest = self._writer.finish()
        return self.manifest

    def abort(self) -> None:
        """Drop everything written; nothing is published."""
        self._writer.abort()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if et is None:
            self.close()
        else:
            self.abort()


def _plain(value: object) -> object:
    """Array-likes that are not numpy (torch tensors) as numpy arrays; trees kept."""
    import numpy as np

    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.ndarray, np.generic)):
        return value
    if hasattr(value, "__array__"):  # a torch tensor, without importing torch here
        return np.asarray(value)
    return value
