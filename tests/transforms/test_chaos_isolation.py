"""A bounded chaos run: while two healthy jobs stream epoch after epoch, one server is hit in
a loop by the faults a job can bring (a transform hung on a thread, a worker process that
kills itself, a variable-size output past the batch bound, nonsense and oversized chains,
streams that never read). Every healthy epoch arrives exactly, /readyz tells the truth (200)
throughout, every fault ends in its typed error, and SIGTERM still stops the server in time.
Server RSS over the run is printed.

The run is counted, not timed: it ends once every fault has struck ``ROUNDS`` times and each
healthy job has finished ``ROUNDS`` epochs beside them, however fast or loaded the machine."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from shardserve.client import Loader
from shardserve.proto.errors import TransformError
from tests.support.data import make_cifar_like
from tests.support.server import run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import MODS, digest

#: Each fault's strikes, and each healthy job's epochs, before the storm ends.
ROUNDS = 3
#: A storm that has not done its rounds by then is stuck (a healthy epoch is ~1 s here).
STORM_MAX_S = 240.0
EPOCHS = 2
MiB = 1 << 20
HFLIP = [{"name": "hflip", "params": {"layout": "CHW"}}]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _epoch(url: str, dataset: str, epoch: int, chain: list | None, seed: int = 9) -> list[str]:
    with Loader(url, dataset, batch_size=25, seed=seed, timeout=scaled(30), transforms=chain) as ld:
        ld.set_epoch(epoch)
        return [digest(b) for b in ld]


@pytest.mark.slow
def test_healthy_jobs_stream_exactly_through_a_storm_of_faults(tmp_path: Path) -> None:
    """Both healthy jobs get every epoch exactly, every time; /readyz is 200 at every poll;
    each fault is refused or fails typed; SIGTERM exits within --shutdown-timeout-s."""
    make_cifar_like(tmp_path, name="cifar", n=300, shard_bytes=128 << 10)
    make_cifar_like(tmp_path, name="other", n=400, seed=4, shard_bytes=128 << 10)
    with run_server(
        tmp_path,
        *MODS,
        "--transform-timeout-s",
        "3",
        "--shutdown-timeout-s",
        "8",
        "--max-batch-bytes",
        str(64 * MiB),
        "--transform-pool",
        "auto",
        "--transform-workers",
        "2",
    ) as s:
        url, pid = s.http_url, s.proc.pid
        healthy = {"flip": ("other", HFLIP), "plain": ("cifar", None)}
        want = {
            (k, e): _epoch(url, ds, e, ch) for k, (ds, ch) in healthy.items() for e in range(EPOCHS)
        }
        stop = threading.Event()
        done = threading.Event()  # every fault struck and every healthy job streamed ROUNDS times
        problems: list[str] = []
        epochs_ok: dict[str, int] = {k: 0 for k in healthy}
        faults: dict[str, int] = {}
        readyz: list[int] = []
        rss: list[tuple[float, float]] = []
        t_start = time.monotonic()

        def fail(problem: str) -> None:
            problems.append(problem)
            done.set()  # no need to wait out the rounds

        def rounds_done() -> None:
            if min(epochs_ok.values()) >= ROUNDS and min(faults.get(k, 0) for k in kinds) >= ROUNDS:
                done.set()

        def healthy_loop(key: str) -> None:
            ds, chain = healthy[key]
            e = 0
            while not stop.is_set():
                try:
                    got = _epoch(url, ds, e % EPOCHS, chain)
                except Exception as err:
                    fail(f"healthy {key} epoch {e}: {type(err).__name__}: {err}")
                    return
                if got != want[(key, e % EPOCHS)]:
                    fail(f"healthy {key} epoch {e}: batches differ")
                    return
                epochs_ok[key] += 1
                e += 1
                rounds_done()

        def expect_transform_error(chain: list, seed: int = 9) -> Callable[[int], None]:
            def run(i: int) -> None:
                with contextlib.suppress(TransformError):
                    _epoch(url, "cifar", 0, chain, seed)
                    fail(f"fault {chain[0]['name']} did not fail")

            return run

        def expect_422(chain: list, batch_size: int = 8) -> Callable[[int], None]:
            def run(i: int) -> None:
                r = httpx.post(
                    f"{url}/v1/jobs",
                    timeout=scaled(30),
                    json={"dataset": "cifar", "batch_size": batch_size, "transforms": chain},
                )
                if r.status_code != 422:
                    fail(f"fault {chain} answered {r.status_code}: {r.text}")

            return run

        def never_read(i: int) -> None:
            loaders = []
            for r in range(4):
                ld = Loader(
                    url,
                    "cifar",
                    batch_size=25,
                    seed=1000 + i,
                    rank=r,
                    world_size=4,
                    timeout=scaled(30),
                    prefetch=8,
                )
                ld.set_epoch(0)
                next(iter(ld))
                loaders.append(ld)
            for ld in loaders:
                ld.close()

        kinds: dict[str, Callable[[int], None]] = {
            "hang_thread": lambda i: expect_transform_error(
                [{"name": "hang_thread"}], seed=100 + i
            )(i),
            "suicide": expect_transform_error([{"name": "suicide"}]),
            "grow": expect_transform_error([{"name": "grow", "params": {"mib": 16}}]),
            "nonsense": expect_422(
                [{"name": "unpack_bits", "params": {"field": "image", "shape": [2**64]}}]
            ),
            "padding": expect_422(
                [{"name": "random_crop", "params": {"size": 32, "padding": 1024, "layout": "CHW"}}],
                batch_size=128,
            ),
            "never_read": never_read,
        }

        def fault_loop() -> None:
            i = 0
            while not stop.is_set():
                name = list(kinds)[i % len(kinds)]
                try:
                    kinds[name](i)
                except Exception as err:
                    fail(f"fault {name}: {type(err).__name__}: {err}")
                faults[name] = faults.get(name, 0) + 1
                i += 1
                rounds_done()

        def watch() -> None:
            while not stop.is_set():
                try:
                    readyz.append(httpx.get(f"{url}/readyz", timeout=scaled(10)).status_code)
                except httpx.HTTPError as err:
                    fail(f"/readyz: {err}")
                rss.append((time.monotonic() - t_start, _rss_mb(pid)))
                stop.wait(1.0)

        threads = [threading.Thread(target=healthy_loop, args=(k,)) for k in healthy]
        threads += [threading.Thread(target=fault_loop), threading.Thread(target=watch)]
        for t in threads:
            t.start()
        finished = done.wait(scaled(STORM_MAX_S))
        stop.set()
        for t in threads:
            t.join(scaled(120))
        assert not any(t.is_alive() for t in threads), "a chaos thread did not end"
        shown = ", ".join(f"{t:.0f}s {m:.0f}MB" for t, m in rss[:: max(1, len(rss) // 12)])
        print(
            f"\nchaos: healthy epochs {epochs_ok}, faults {faults}, readyz polls "
            f"{len(readyz)}; server RSS {shown}; peak {max(m for _, m in rss):.0f} MB"
        )
        assert not problems, problems
        assert finished, (
            f"the storm did not do {ROUNDS} rounds in {scaled(STORM_MAX_S):.0f} s: "
            f"healthy epochs {epochs_ok}, faults {faults}"
        )
        assert min(epochs_ok.values()) >= ROUNDS, epochs_ok
        assert len(faults) == len(kinds) and min(faults.values()) >= ROUNDS, faults
        assert readyz and set(readyz) == {200}, readyz
        t0 = time.monotonic()
        code = s.terminate(timeout=scaled(20))
        assert time.monotonic() - t0 < 8 + 1 and code in (0, 1), (code, s.log_tail())
