"""PyTorch Lightning: train from a shardserve :class:`Loader` with ``Trainer.fit``.

A :class:`Loader` needs no adapter to work under Lightning: return it from
``train_dataloader()``. Lightning leaves objects that are not a ``torch.utils.data.DataLoader``
alone (no ``DistributedSampler`` injected, nothing re-instantiated), and it saves and restores
anything with ``state_dict``/``load_state_dict`` in its checkpoints, so a mid-epoch checkpoint
resumes at the next batch. Lightning's epoch N streams epoch N with or without a ``set_epoch``
call (see :class:`Loader` on epochs).

:class:`ShardserveDataModule` is the few lines that get the details right once: the Loader is
built in ``train_dataloader()``, after Lightning has started the process group, so each DDP
rank takes its rank and world size from ``torch.distributed``; it is built once and reused
when Lightning asks again (``reload_dataloaders_every_n_epochs``); it is told the trainer's
epoch; and it is closed in ``teardown``::

    from lightning.pytorch import Trainer
    from shardserve.client.lightning import ShardserveDataModule

    dm = ShardserveDataModule("http://127.0.0.1:7070", "cifar10", batch_size=256, seed=0)
    Trainer(max_epochs=10, devices=2, strategy="ddp").fit(model, datamodule=dm)

Needs the ``lightning`` extra (``pip install 'shardserve[lightning]'``).
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import LightningDataModule
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import LightningDataModule  # type: ignore[assignment]
    except ImportError:
        raise ImportError(
            "shardserve.client.lightning needs PyTorch Lightning: pip install 'shardserve[lightning]' "
            "(or `pip install lightning`)"
        ) from None

from .loader import Loader

__all__ = ["ShardserveDataModule"]


class ShardserveDataModule(LightningDataModule):
    """Training (and optionally validation) batches served by shardserve, for ``Trainer.fit``.

    ``url``, ``dataset``, ``batch_size`` and ``loader_kwargs`` (``seed``, ``shuffle``,
    ``fields``, ``prefetch``, ``timeout``, ``token``, ...) are passed to :class:`Loader`;
    ``rank``/``world_size`` are left to ``torch.distributed``. ``val_dataset`` adds a
    validation Loader over that dataset, in order (``shuffle=False``). Without it the module
    has no validation data at all, as a DataModule that does not define ``val_dataloader``:
    Lightning runs no validation loop and has nothing to warn about.
    """

    def __init__(
        self,
        url: str,
        dataset: str,
        batch_size: int,
        val_dataset: str | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__()
        self.url, self.dataset, self.batch_size = url, dataset, batch_size
        self.val_dataset = val_dataset
        self.loader_kwargs = loader_kwargs
        self._train: Loader | None = None
        self._val: Loader | None = None
        if val_dataset is None:
            # Lightning asks whether `val_dataloader` is overridden (it compares the code of
            # the instance's attribute with LightningDataModule's): without a validation set
            # the instance answers with the base class's own, as a module that never
            # defined it would.
            self.val_dataloader = super().val_dataloader  # type: ignore[method-assign]

    def train_dataloader(self) -> Loader:
        """This rank's training Loader, set to the trainer's epoch (a checkpoint's loader
        state, restored by Lightning after this call, takes precedence)."""
        if self._train is None:
            self._train = Loader(self.url, self.dataset, self.batch_size, **self.loader_kwargs)
        trainer = self._trainer_or_none()
        if trainer is not None:
            self._train.set_epoch(trainer.current_epoch)
        return self._train

    def val_dataloader(self) -> Loader:
        """This rank's validation Loader over ``val_dataset``, in order."""
        if self.val_dataset is None:  # not reached through Lightning (see __init__)
            raise RuntimeError("this ShardserveDataModule was made without val_dataset")
        if self._val is None:
            kwargs = {**self.loader_kwargs, "shuffle": False}
            self._val = Loader(self.url, self.val_dataset, self.batch_size, **kwargs)
        return self._val

    def teardown(self, stage: str) -> None:
        """Close the Loaders (their sockets and the server's streams)."""
        for loader in (self._train, self._val):
            if loader is not None:
                loader.close()
        self._train = self._val = None

    def _trainer_or_none(self) -> Any:
        # `self.trainer` is None outside Trainer.fit (a DataModule used on its own).
        return getattr(self, "trainer", None)
