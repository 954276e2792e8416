"""What code written for ``torch.utils.data.DataLoader`` expects of a Loader, and no more.

- ``loader.dataset`` (:class:`LoaderDataset`): ``len()`` is the dataset's sample count (of
  the version the job pinned), ``name`` its name. Frameworks check ``len(loader.dataset)``.
- Accelerate's ``skip_first_batches(loader, n)`` builds a plain DataLoader from
  ``loader.dataset``, ``loader.batch_sampler`` and ``loader.collate_fn``; here the batch
  sampler yields batch numbers, the dataset hands out the Loader's batch of that number
  (streamed from batch ``n``, never the skipped ones), and the collate function unwraps it.
  So the first pass of that DataLoader is the rest of the Loader's epoch.
- Accelerate's ``gather_for_metrics`` drops the padding of the last batch when its
  ``GradientState`` knows the active dataloader's ``end_of_dataloader`` and ``remainder``:
  :class:`AccelerateWatcher` tells it, for every pass of a Loader while Accelerate is loaded.

>>> keys = BatchKeys(lambda: 3, lambda: None)
>>> list(keys), len(keys)
([[0], [1], [2]], 3)
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from shardserve.proto.errors import BadRequest


class SkippableBatches(Protocol):
    """What :class:`LoaderDataset` uses of a Loader: start the next pass at a batch, iterate."""

    def skip_to(self, batch: int) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...


class LoaderDataset:
    """``loader.dataset``: the dataset a Loader serves, as DataLoader-shaped code sees it.

    ``len()`` is its number of samples; items are read a batch at a time through the
    Loader (``__getitems__([i])`` is batch ``i`` of the epoch), as ``skip_first_batches``
    does; there is no per-sample ``dataset[i]``.
    """

    def __init__(
        self, name: str, num_samples: int, loader: Callable[[], SkippableBatches | None]
    ) -> None:
        """``loader``: a weak reference to the Loader (it holds this dataset)."""
        self.name, self.num_samples = name, num_samples
        self._loader_ref = loader
        self._it: Iterator[Any] | None = None
        self._next = -1

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Any:
        raise TypeError(
            f"a Loader's dataset ({self.name!r}) is read a batch at a time: iterate the Loader "
            "(or use accelerate's skip_first_batches), there is no dataset[i]"
        )

    def __getitems__(self, keys: Sequence[int]) -> list[Any]:
        """``[batch keys[0]]`` of the epoch (keys from :class:`BatchKeys`, one per batch)."""
        if len(keys) != 1:
            raise BadRequest(f"a Loader's dataset hands out one batch per key list, got {keys}")
        index = int(keys[0])
        loader = self._loader_ref()
        if loader is None:
            raise RuntimeError(f"the Loader of dataset {self.name!r} is gone")
        if self._it is None or index != self._next:
            loader.skip_to(index)
            self._it = iter(loader)
        batch = next(self._it)
        self._next = index + 1
        if self._next >= len(loader):
            # The last batch: nobody asks for the end of this pass, so let it go now (it
            # stops being the framework's current dataloader).
            self._it = None
        return [batch]

    def rewind(self) -> None:
        """A new pass of batch keys began: the next batch asked for starts a new stream."""
        self._it, self._next = None, -1

    def __repr__(self) -> str:
        return f"LoaderDataset({self.name!r}, {self.num_samples} samples)"


class BatchKeys:
    """``loader.batch_sampler``: ``[i]`` for every batch ``i`` of an epoch; ``len`` batches."""

    def __init__(self, num_batches: Callable[[], int], rewind: Callable[[], None]) -> None:
        self._num_batches, self._rewind = num_batches, rewind

    def __iter__(self) -> Iterator[list[int]]:
        self._rewind()
        for i in range(self._num_batches()):
            yield [i]

    def __len__(self) -> int:
        return self._num_batches()


def one_batch(items: Sequence[Any]) -> Any:
    """``loader.collate_fn``: the batch a :class:`LoaderDataset` handed out, already collated."""
    return items[0]


def gather_remainder(
    num_samples: int, world_size: int, batch_size: int, drop_last: bool, num_batches: int
) -> int | None:
    """How many items of the last step, gathered across ranks in rank order, are real samples
    (Accelerate's ``remainder``: it keeps that many): ``0`` when none is padding, ``None``
    when the padding is not at the end of the gathered step (more than one padded rank and
    more than one sample a rank in the last batch), which no remainder can drop.

    The plan pads like ``DistributedSampler``: ranks from ``num_samples % world_size`` on
    end with one repeated sample each.

    >>> gather_remainder(1001, 2, 64, False, 8)   # 501 a rank: last batches of 53, 1 padding
    105
    >>> gather_remainder(1000, 2, 64, False, 8), gather_remainder(1001, 2, 64, True, 7)
    (0, 0)
    >>> print(gather_remainder(1000, 3, 64, False, 6))
    None
    """
    if drop_last or num_batches == 0:
        return 0
    per_rank = -(-num_samples // world_size)
    padding = per_rank * world_size - num_samples
    if padding == 0:
        return 0
    last = per_rank - (num_batches - 1) * batch_size
    if padding > 1 and last > 1:
        return None
    return last * world_size - padding


class AccelerateWatcher:
    """One pass of a Loader as Accelerate's ``GradientState`` sees a prepared DataLoader:
    registered while it runs, ``end_of_dataloader`` set when it hands out the epoch's last
    batch, ``remainder`` the real samples of that last gathered step (``-1``: unknown). So
    ``accelerator.gather_for_metrics`` returns exactly the dataset's samples, and gradient
    accumulation syncs at the end of the epoch, as with a prepared DataLoader."""

    def __init__(self, state: Any, remainder: int) -> None:
        self._state = state
        self.end_of_dataloader = False
        self.remainder = remainder

    def begin(self) -> None:
        # Accelerate's own loaders register through this method; it keeps a weak reference.
        self._state._add_dataloader(self)

    def last_batch(self) -> None:
        self.end_of_dataloader = True

    def end(self) -> None:
        self._state._remove_dataloader(self)


def accelerate_watcher(remainder: Callable[[], int | None]) -> AccelerateWatcher | None:
    """A watcher for a new pass when this process made an ``Accelerator``, else ``None``.

    Accelerate is never imported here: a process that did not load it has no
    ``GradientState`` to tell, and one that imported it without making an ``Accelerator``
    (another library did) does not gather this Loader's batches through it.
    """
    module = sys.modules.get("accelerate.state")
    if module is None or not module.is_initialized():
        return None
    rem = remainder()
    if rem is None:
        warnings.warn(
            "accelerate's gather_for_metrics cannot drop this Loader's padding (more than one "
            "rank ends with a padded sample): the gathered last step repeats samples; use "
            "drop_last=True, or a batch size that divides the samples per rank",
            stacklevel=3,
        )
        rem = -1
    return AccelerateWatcher(module.GradientState(), rem)
