"""Dataset versions on an S3 store: an overwrite in the bucket while a job streams
through a small shard cache never mixes versions; a Loader created after gets the new one."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardserve.client import Loader
from shardserve.server.store.remote.publish import RemotePublisher
from shardserve.server.store.remote.stores import RemoteStore, StoreOptions
from tests.support.data import cifar_images, make_cifar_like, sample_id_of
from tests.support.server import run_server
from tests.support.slowness import scaled

from .conftest import S3

N = 600


def _ids_checked(batch: dict, images: np.ndarray) -> list[int]:
    got = batch["image"].numpy()
    ids = sample_id_of({"image": got, "label": batch["label"].numpy()})
    bad = [int(i) for j, i in enumerate(ids) if not np.array_equal(got[j], images[i])]
    assert not bad, f"samples {bad[:5]} come from another version of the dataset"
    return ids.tolist()


def test_overwrite_in_the_bucket_while_streaming_never_mixes(s3: S3, tmp_path: Path) -> None:
    """The pinned version keeps fetching its own shards (the upload leaves their prefix) through
    a cache smaller than the dataset, for the whole epoch and the next; a new Loader reads the
    new version under another job id."""
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    m = make_cifar_like(old_root, n=N, seed=0, shard_bytes=128 << 10)
    make_cifar_like(new_root, n=N, seed=1, shard_bytes=128 << 10)
    rs = RemoteStore(s3.uri("store"), StoreOptions.from_env(s3.env))
    RemotePublisher(rs).upload(old_root / "cifar", "cifar", overwrite=False)
    old_images, new_images = cifar_images(0, N, 0), cifar_images(0, N, 1)
    with run_server(
        s3.uri("store"),  # type: ignore[arg-type]
        "--cache-dir",
        str(tmp_path / "cache"),
        "--cache-limit-bytes",
        str(m.total_bytes // 3),
        env=s3.env,
    ) as srv:
        ld = Loader(srv.http_url, "cifar", 50, seed=2, prefetch=1, timeout=scaled(30))
        with ld:
            it = iter(ld)
            seen = _ids_checked(next(it), old_images)
            RemotePublisher(rs).upload(new_root / "cifar", "cifar", overwrite=True)
            seen += [i for b in it for i in _ids_checked(b, old_images)]
            assert sorted(seen) == list(range(N))
            ld.set_epoch(1)
            assert sorted(i for b in ld for i in _ids_checked(b, old_images)) == list(range(N))
            with Loader(srv.http_url, "cifar", 50, seed=2, timeout=scaled(30)) as fresh:
                assert fresh.job_id != ld.job_id
                got = [i for b in fresh for i in _ids_checked(b, new_images)]
            assert sorted(got) == list(range(N))
