"""How the data plane's parts are made from the settings: the store, the streamer's
configuration. The main process (:mod:`.service`) and each streaming process
(:mod:`.processes.plane`) make theirs here, so both serve alike."""

from __future__ import annotations

import dataclasses
import os

from prometheus_client import CollectorRegistry

from shardserve.proto.host import read_boot_id

from .runtime.rings import DEFAULT_DIR as SHM_DIR
from .settings import Settings
from .store.backend import StoreBackend, open_store
from .store.remote.object_fs import StoreOptions
from .streaming.streamer import StreamerConfig


def open_store_of(settings: Settings, registry: CollectorRegistry) -> StoreBackend:
    """The store of ``settings``: a folder, or a remote store with its local shard cache."""
    if not settings.store_is_remote:
        return open_store(
            settings.store, verify=settings.verify, read_ahead_bytes=settings.read_ahead_bytes
        )
    # The object store's own client reads its credentials from the environment; we read the
    # same variables only to keep their values out of every message we write.
    options = dataclasses.replace(
        StoreOptions.from_env(os.environ, settings.store_endpoint),
        request_timeout_s=settings.store_timeout_s,
        connect_timeout_s=min(5.0, settings.store_timeout_s),
        min_bytes_per_s=settings.store_min_bytes_per_s,
    )
    return open_store(
        settings.store,
        options=options,
        cache_dir=settings.cache_dir,
        cache_limit_bytes=settings.cache_limit_bytes,
        registry=registry,
        verify=settings.verify,
    )


def streamer_config(settings: Settings, endpoints: list[str]) -> StreamerConfig:
    """The data plane's settings, for the main process and each streaming process alike."""
    return StreamerConfig(
        endpoints=endpoints,
        token=settings.token,
        heartbeat_s=settings.heartbeat_s,
        stream_timeout_s=settings.stream_timeout_s,
        # Clients map rings from their own /dev/shm, so the server makes them there too.
        shm_dir=SHM_DIR if settings.shm else None,
        shm_limit_bytes=settings.shm_limit_bytes,
        shm_ring_bytes=settings.shm_ring_bytes or None,  # 0: no cap
        boot_id=read_boot_id(),
        max_batch_bytes=settings.max_batch_bytes,
        max_streams=settings.max_streams,
        max_streams_per_job=settings.max_streams_per_job,
        share_subscribers=settings.share_subscribers,
        share_window=settings.share_window,
        share_window_bytes=settings.share_window_bytes,
        share_bytes=settings.share_bytes,
        max_hellos_per_s=settings.max_hellos_per_s,
        shm_unproven_rings=settings.shm_unproven_rings,
        unread_stream_bytes=settings.unread_stream_bytes,
        unread_bytes=settings.unread_bytes,
    )
