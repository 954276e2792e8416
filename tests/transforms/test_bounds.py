"""Chains are checked at job creation and every byte a chain makes the server hold is bounded:
nonsense params are a 422 naming the parameter (never 201 then an internal error, never a
500); a chain whose worst case does not fit --max-batch-bytes is a 422 naming the transform
and the bytes; a decode bomb is refused from its header naming the sample; variable-size
outputs stop at the batch bound. Server memory is read from /proc/<pid>/status."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from shardserve.client import Loader
from shardserve.proto.errors import TransformError
from tests.support.server import ServerProc, run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import MODS

MiB = 1 << 20


def proc_kib(pid: int, key: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of ``pid`` in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


@pytest.fixture(scope="module")
def srv(store: Path) -> Iterator[ServerProc]:
    with run_server(store, *MODS) as s:
        yield s


def _post(srv: ServerProc, chain: list, batch_size: int = 8) -> httpx.Response:
    return httpx.post(
        f"{srv.http_url}/v1/jobs",
        timeout=scaled(10),
        json={"dataset": "cifar", "batch_size": batch_size, "transforms": chain},
    )


# fmt: off
#: (chain, the parameter the 422 must name): 13 kinds of nonsense on CIFAR (uint8 [3, 32, 32]).
NONSENSE = [
    ([{"name": "random_crop", "params": {"size": "32", "layout": "CHW"}}], "size"),  # str
    ([{"name": "random_crop", "params": {"size": -3, "layout": "CHW"}}], "size"),  # negative
    ([{"name": "random_crop", "params": {"size": 10**9, "layout": "CHW"}}], "size"),  # huge
    ([{"name": "random_crop", "params": {"size": 32, "padding": True}}], "padding"),  # bool
    ([{"name": "random_crop", "params": {"size": 32, "colour": 1}}], "colour"),  # unknown key
    ([{"name": "random_crop", "params": {"size": 32, "fill": 300, "layout": "CHW"}}], "fill"),
    ([{"name": "hflip", "params": {"p": 1.5, "layout": "CHW"}}], "p"),  # out of range
    ([{"name": "normalize", "params": {"dtype": "int8", "layout": "CHW"}}], "dtype"),  # dtype
    ([{"name": "normalize", "params": {"mean": [], "layout": "CHW"}}], "mean"),  # empty list
    ([{"name": "resize", "params": {"size": [32], "layout": "CHW"}}], "size"),  # wrong length
    (
        [
            {
                "name": "random_resized_crop",
                "params": {"size": 8, "scale": [1.0, 0.5], "layout": "CHW"},
            }
        ],
        "scale",
    ),
    (
        [{"name": "random_resized_crop", "params": {"size": 8, "ratio": [-1, 2], "layout": "CHW"}}],
        "ratio",
    ),
    ([{"name": "unpack_bits", "params": {"field": "image", "shape": [2**64]}}], "shape"),
    ([{"name": "unpack_bits", "params": {"field": "image", "shape": []}}], "shape"),
    (
        [
            {
                "name": "unpack_bits",
                "params": {"field": "image", "shape": [8], "dtype": "complex128"},
            }
        ],
        "dtype",
    ),
    ([{"name": "random_subset", "params": {"field": "image", "n": 2**40}}], "n"),
    ([{"name": "hflip", "params": {"field": "", "layout": "CHW"}}], "field"),
    ([{"name": "hflip", "params": {"field": "nope", "layout": "CHW"}}], "nope"),

]
# fmt: on


@pytest.mark.parametrize(
    ("chain", "param"),
    NONSENSE,
    ids=[f"{c[0]['name']}-{p}-{i}" for i, (c, p) in enumerate(NONSENSE)],
)
def test_nonsense_chain_is_a_422_naming_the_parameter(
    srv: ServerProc, chain: list, param: str
) -> None:
    """Every nonsense chain is refused at POST /v1/jobs with 422 naming the parameter."""
    r = _post(srv, chain)
    assert r.status_code == 422, (r.status_code, r.text)
    assert param in r.json()["detail"], r.text


def test_padding_that_cannot_fit_is_a_422_naming_transform_and_bytes(srv: ServerProc) -> None:
    """random_crop padding 1024 on 0.4 MB CIFAR batches (128 x 3 KB) holds a 2080 x 2080
    padded copy per sample, 1.66 GB a batch: refused at creation, not grown into at stream time."""
    chain = [{"name": "random_crop", "params": {"size": 32, "padding": 1024, "layout": "CHW"}}]
    r = _post(srv, chain, batch_size=128)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    m = re.search(r"'random_crop' holds up to (\d+) bytes", detail)
    # the padded copy (2080 x 2080 x 3), the sample read (image, label), the crop written
    assert m is not None and int(m.group(1)) == (2080 * 2080 * 3 + 3072 + 8 + 3072) * 128, detail
    assert "--max-batch-bytes" in detail
    ok = [{"name": "random_crop", "params": {"size": 32, "padding": 4, "layout": "CHW"}}]
    assert _post(srv, ok, batch_size=128).status_code in (200, 201)


def test_variable_size_output_stops_at_the_batch_bound(store: Path) -> None:
    """A transform writing 16 MiB per sample, batch 32 (512 MiB) under --max-batch-bytes
    64 MiB fails its job naming the transform and the bound; the server's peak RSS grows by
    less than 200 MiB (it would be over 1 GiB unbounded)."""
    with run_server(
        store, *MODS, "--max-batch-bytes", str(64 * MiB), "--transform-pool", "thread"
    ) as s:
        hwm0 = proc_kib(s.proc.pid, "VmHWM")
        grow = [{"name": "grow", "params": {"mib": 16}}]
        with (
            pytest.raises(TransformError, match=r"grow.*more than --max-batch-bytes"),
            Loader(
                s.http_url, "cifar", batch_size=32, seed=0, timeout=scaled(30), transforms=grow
            ) as ld,
        ):
            ld.set_epoch(0)
            list(ld)
        grown = (proc_kib(s.proc.pid, "VmHWM") - hwm0) / 1024
        print(
            f"variable-size output: peak RSS grew {grown:.0f} MiB (start peak {hwm0 // 1024} MiB)"
        )
        assert grown < 200, grown


def _bomb_store(tmp: Path) -> Path:
    """An image folder with one PNG of 8000 x 8000 pixels in ~70 kB (192 MB as RGB), ingested."""
    src, store = tmp / "src", tmp / "store"
    (src / "a_bomb").mkdir(parents=True)
    (src / "b_ok").mkdir()
    Image.new("L", (8000, 8000)).save(src / "a_bomb" / "bomb.png", optimize=False)
    rng = np.random.default_rng(0)
    for i in range(7):
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(
            src / "b_ok" / f"{i}.png"
        )
    cmd = [
        sys.executable,
        "-m",
        "shardserve.server",
        "ingest",
        str(src),
        "--store",
        str(store),
        "--name",
        "pics",
        "--quiet",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(120))
    assert r.returncode == 0, r.stderr
    return store


def test_decode_bomb_is_refused_from_its_header_naming_the_sample(tmp_path: Path) -> None:
    """The bomb (sample 0: its class folder sorts first) fails the job naming the sample and
    --max-decoded-pixels; the server's peak RSS grows by less than 128 MiB, streaming included
    (decoding it would take 64 MB grey plus 192 MB RGB)."""
    store = _bomb_store(tmp_path)
    assert (tmp_path / "src" / "a_bomb" / "bomb.png").stat().st_size < 300_000
    chain = [{"name": "decode_image"}, {"name": "resize", "params": {"size": 16}}]
    # On threads: the server's own memory is what the bound must keep (workers decode elsewhere).
    with run_server(
        store, "--max-decoded-pixels", str(4_000_000), "--transform-pool", "thread"
    ) as s:
        hwm0 = proc_kib(s.proc.pid, "VmHWM")
        with (
            pytest.raises(TransformError) as err,
            Loader(
                s.http_url, "pics", batch_size=4, seed=0, timeout=scaled(30), transforms=chain
            ) as ld,
        ):
            ld.set_epoch(0)
            list(ld)
        text = str(err.value)
        assert "sample 0" in text and "8000 x 8000 = 64000000 pixels" in text, text
        assert "--max-decoded-pixels 4000000" in text, text
        grown = (proc_kib(s.proc.pid, "VmHWM") - hwm0) / 1024
        print(f"decode bomb: peak RSS grew {grown:.0f} MiB (start peak {hwm0 // 1024} MiB)")
        assert grown < 128, grown
        # Images within the bound still decode.
        with Loader(
            s.http_url,
            "pics",
            batch_size=4,
            seed=0,
            timeout=scaled(30),
            shuffle="none",
            transforms=chain,
            on_error="replace",
        ) as ld:
            ld.set_epoch(0)
            assert sum(len(b["image"]) for b in ld) == 8


def test_the_default_prefetch_is_sized_by_the_samples_as_served(srv: ServerProc) -> None:
    """A chain that makes samples 4x bigger (uint8 to float32) gets a 4x smaller default
    prefetch than the stored samples would: the credit holds what is delivered."""
    from shardserve.client._credit import AUTO_PREFETCH_BYTES
    from tests.transforms.conftest import CIFAR_CHAIN

    with (
        Loader(srv.http_url, "cifar", 32) as stored,
        Loader(srv.http_url, "cifar", 32, transforms=CIFAR_CHAIN) as grown,
    ):
        served = 3 * 32 * 32 * 4 + 8  # float32 image, int64 label
        assert grown.prefetch == AUTO_PREFETCH_BYTES // (served * 32)
        assert stored.prefetch == 64 > grown.prefetch
