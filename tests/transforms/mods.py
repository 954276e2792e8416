"""Transforms the tests name through ``--transforms tests.transforms.mods``.

Each does something a test can check from the bytes it returns, or fails in one documented
way (raises, returns the wrong shape, hangs, kills its worker).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from shardserve.server.transforms import Field, batch_transform, sample_transform


class _Noise(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = 1.0


def _noise_out(p: _Noise, inputs: Any) -> dict[str, Field]:
    """{noise: float64 [4]}"""
    return {"noise": Field("float64", (4,))}


@sample_transform(params=_Noise, outputs=_noise_out, pool="process")
def py_noise(sample: dict[str, Any], p: _Noise, rng: np.random.Generator) -> dict[str, Any]:
    """Pure Python per sample (a process-pool transform): 4 draws from the sample's rng."""
    vals = [rng.random() * p.scale for _ in range(4)]
    return {"noise": np.array(vals, dtype=np.float64)}


class _Fail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Samples whose index is divisible by this raise.
    every: int = 7


@sample_transform(params=_Fail, outputs={"label": Field("int64", ())})
def fail_on(sample: dict[str, Any], p: _Fail, rng: np.random.Generator) -> dict[str, Any]:
    """Raises ValueError on samples whose label (= index % 10 in the test data) ... index."""
    first4 = sample["image"].reshape(-1)[:4].view("<u4")[0]
    if int(first4) % p.every == 0:
        raise ValueError(f"sample {int(first4)} is cursed")
    return {"label": sample["label"]}


@sample_transform(outputs={"label": Field("int64", (2,))})
def wrong_shape(sample: dict[str, Any], p: Any, rng: np.random.Generator) -> dict[str, Any]:
    """Declares label int64[2] but returns a scalar."""
    return {"label": sample["label"]}


class _Hang(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = 3600.0


@sample_transform(params=_Hang, outputs={"label": Field("int64", ())}, pool="process")
def hang(sample: dict[str, Any], p: _Hang, rng: np.random.Generator) -> dict[str, Any]:
    """Sleeps (in a worker process) far past any deadline."""
    time.sleep(p.seconds)
    return {"label": sample["label"]}


@sample_transform(outputs={"label": Field("int64", ())}, pool="process")
def suicide(sample: dict[str, Any], p: Any, rng: np.random.Generator) -> dict[str, Any]:
    """Kills its own worker process."""
    os._exit(3)


class _Slow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = 0.01


@sample_transform(params=_Slow, outputs={"label": Field("int64", ())}, pool="process")
def slow(sample: dict[str, Any], p: _Slow, rng: np.random.Generator) -> dict[str, Any]:
    """A little pure-Python busy work per sample, so a test can kill a worker mid-batch."""
    end = time.perf_counter() + p.seconds
    while time.perf_counter() < end:
        pass
    return {"label": sample["label"]}


@sample_transform(params=_Hang, outputs={"label": Field("int64", ())}, pool="thread")
def hang_thread(sample: dict[str, Any], p: _Hang, rng: np.random.Generator) -> dict[str, Any]:
    """Sleeps on a transform *thread* far past any deadline (a thread cannot be stopped)."""
    time.sleep(p.seconds)
    return {"label": sample["label"]}


class _Grow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mib: int = 64


def _grow_out(p: _Grow, inputs: Any) -> dict[str, Field]:
    """{blob: uint8 [-1]}"""
    return {"blob": Field("uint8", (-1,))}


@sample_transform(params=_Grow, outputs=_grow_out)
def grow(sample: dict[str, Any], p: _Grow, rng: np.random.Generator) -> dict[str, Any]:
    """A variable-size output of ``mib`` MiB per sample (ones: the pages are really touched)."""
    return {"blob": np.ones(p.mib << 20, dtype=np.uint8)}


class _Add(BaseModel):
    model_config = ConfigDict(extra="forbid")
    field: str
    value: float = 1.0


def _add_out(p: _Add, inputs: Any) -> dict[str, Field]:
    """{field: as stored}"""
    return {p.field: inputs[p.field]}


@sample_transform(params=_Add, outputs=_add_out)
def add_const(sample: dict[str, Any], p: _Add, rng: np.random.Generator) -> dict[str, Any]:
    """``value`` added to every element of ``field``, whatever its shape (a graph's nodes)."""
    x = sample[p.field]
    return {p.field: (x + np.asarray(p.value, dtype=x.dtype)).astype(x.dtype)}


class _FailLabels(BaseModel):
    model_config = ConfigDict(extra="forbid")
    labels: list[int]


@sample_transform(params=_FailLabels, outputs={"label": Field("int64", ())})
def fail_labels(sample: dict[str, Any], p: _FailLabels, rng: np.random.Generator) -> dict[str, Any]:
    """Raises ValueError on samples whose label is one of ``labels``."""
    if int(sample["label"]) in p.labels:
        raise ValueError(f"label {int(sample['label'])} is cursed")
    return {"label": sample["label"]}


class _FailOrWait(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fail: int
    wait: int
    seconds: float


#: Set by :func:`fail_or_wait` once its waiting sample runs (tests in one process clear it).
WAITING = threading.Event()


@sample_transform(params=_FailOrWait, outputs={"label": Field("int64", ())})
def fail_or_wait(
    sample: dict[str, Any], p: _FailOrWait, rng: np.random.Generator
) -> dict[str, Any]:
    """Sleeps ``seconds`` on label ``wait``; raises on label ``fail``, but only once the
    waiting sample runs (another thread's), so the failure lands while it sleeps."""
    label = int(sample["label"])
    if label == p.wait:
        WAITING.set()
        time.sleep(p.seconds)
    if label == p.fail:
        if not WAITING.wait(60.0):
            raise RuntimeError("the waiting sample did not start within 60 s")
        raise ValueError(f"label {label} fails")
    return {"label": sample["label"]}


#: What :func:`double_into` was given: whether ``out`` held its field (tests in one process).
GOT_OUT: list[bool] = []


@batch_transform(outputs={"label": Field("int64", ())}, takes_out=True)
def double_into(
    batch: dict[str, Any], p: Any, rng: np.random.Generator, out: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Labels times two, written into ``out`` when it is given (recorded in ``GOT_OUT``)."""
    dest = out.get("label")
    GOT_OUT.append(dest is not None)
    if dest is None:
        return {"label": batch["label"] * 2}
    np.multiply(batch["label"], 2, out=dest)
    return {"label": dest}


class _Head(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = 1


@sample_transform(params=_Head, outputs=lambda p, inputs: {"points": Field("float32", (p.n, 3))})
def head_rows(sample: dict[str, Any], p: _Head, rng: np.random.Generator) -> dict[str, Any]:
    """The first ``n`` rows of ``points`` (a per-sample step with a fixed-size output)."""
    return {"points": np.ascontiguousarray(sample["points"][: p.n])}


@batch_transform(
    outputs={"sid": Field("int64", ()), "noise": Field("float64", (4,))}, takes_keys=True
)
def keyed_noise(batch: dict[str, Any], p: Any, rng: Any, keys: Any) -> dict[str, Any]:
    """Each sample's id as the server sees it, and 4 uniforms from its own keys."""
    return {"sid": keys.ids.astype(np.int64), "noise": keys.uniform(4)}
