"""Crop, flip and normalize, alone and fused into one kernel, give the bytes of the earlier
step-by-step numpy code on random batches of every layout, dtype, padding and randomness
scheme (the draws are :mod:`~shardserve.server.transforms.draws`' either way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.client import Loader
from shardserve.server.transforms.draws import crop_offsets, flips
from shardserve.server.transforms.keys import SampleKeys
from shardserve.server.transforms.registry import TransformRegistry
from shardserve.server.transforms.rng import CURRENT_SCHEME, LEGACY_SCHEME, batch_rng
from shardserve.server.transforms.runner import Where, run_chain
from shardserve.server.transforms.schema import Field
from shardserve.server.transforms.spec import compile_chain
from tests.support.data import cifar_images
from tests.support.server import run_server
from tests.support.slowness import scaled
from tests.transforms.conftest import CIFAR_CHAIN, N

REG = TransformRegistry.load(use_entry_points=False)
W = Where(seed=7, epoch=2, rank=1, batch=5)


# -- the step-by-step code these transforms had before they shared kernels and fused --------
def _axes(x: np.ndarray, layout: str) -> tuple[int, int]:
    return (2, 3) if x.ndim == 4 and layout == "CHW" else (1, 2)


def ref_crop(x: np.ndarray, p: dict[str, Any], keys: SampleKeys) -> np.ndarray:
    ah, aw = _axes(x, p.get("layout", "HWC"))
    h = w = p["size"]
    pad_n = p.get("padding", 0)
    if pad_n:
        pad = [(0, 0)] * x.ndim
        pad[ah] = pad[aw] = (pad_n, pad_n)
        x = np.pad(x, pad, constant_values=np.asarray(p.get("fill", 0)).astype(x.dtype))
    b = x.shape[0]
    oy, ox = crop_offsets(keys, x.shape[ah] - h, x.shape[aw] - w)
    windows = np.lib.stride_tricks.sliding_window_view(x, (h, w), axis=(ah, aw))
    moved = np.moveaxis(windows, (ah, aw), (1, 2))[np.arange(b), oy, ox]
    rest = [a for a in range(1, x.ndim) if a not in (ah, aw)]
    order = [0] * x.ndim
    for dst, src in zip(rest, range(1, 1 + len(rest)), strict=True):
        order[dst] = src
    order[ah], order[aw] = x.ndim - 2, x.ndim - 1
    return np.ascontiguousarray(np.transpose(moved, order))


def ref_flip(x: np.ndarray, p: dict[str, Any], keys: SampleKeys) -> np.ndarray:
    aw = _axes(x, p.get("layout", "HWC"))[1]
    flip = flips(keys, p.get("p", 0.5))
    out = x.copy()
    out[flip] = np.flip(x[flip], axis=aw)
    return out


def ref_norm(x: np.ndarray, p: dict[str, Any], keys: SampleKeys) -> np.ndarray:
    if p.get("to_chw"):
        x = np.transpose(x, (0, 3, 1, 2))
    chw = p.get("to_chw") or p.get("layout") == "CHW"
    dt = np.dtype(p.get("dtype", "float32"))
    y = np.empty(x.shape, dt)
    np.copyto(y, x, casting="unsafe")
    if p.get("scale", 1.0) != 1.0:
        y *= dt.type(p["scale"])
    view = [1] * y.ndim
    if y.ndim == 4:
        view[1 if chw else 3] = -1
    for key, op in (("mean", np.subtract), ("std", np.divide)):
        v = p.get(key)
        if v is not None:
            op(y, np.asarray(v, dtype=dt).reshape(view if len(v) > 1 else [1]), out=y)
    return y


REF = {"random_crop": ref_crop, "hflip": ref_flip, "normalize": ref_norm}


def reference(
    chain: list[dict[str, Any]], x: np.ndarray, where: Where = W, first: int = 0
) -> np.ndarray:
    """The chain step by step on samples ``first...``, step ``i`` drawing from the keys of
    position ``i`` (scheme 1: from the batch generator of position ``i``)."""
    ids = np.arange(first, first + len(x))
    for i, step in enumerate(chain):
        old = batch_rng(where.seed, where.epoch, where.rank, where.batch, i)
        legacy = old if where.scheme == LEGACY_SCHEME else None
        x = REF[step["name"]](
            x, step["params"], SampleKeys(where.seed, where.epoch, i, ids, legacy=legacy)
        )
    return x


def served(
    chain: list[dict[str, Any]], x: np.ndarray, into_out: bool, where: Where = W
) -> tuple[np.ndarray, list]:
    """The chain as the server runs it (compiled, fused); ``into_out``: given the slot."""
    inputs = {"image": Field(str(x.dtype), x.shape[1:])}
    c = compile_chain(chain, REG, inputs, "t", scheme=where.scheme)
    f = c.outputs["image"]
    out = {"image": np.full((len(x), *f.shape), 7, f.dtype)} if into_out else None
    parts, _ = run_chain(c, {"image": x}, np.arange(len(x)), where, ["image"], out)
    return parts["image"], c.names


# -- random chains ------------------------------------------------------------------------------
@st.composite
def cases(draw: st.DrawFn) -> tuple[list[dict[str, Any]], np.ndarray]:
    layout = draw(st.sampled_from(["HWC", "CHW", "HW"]))
    dtype = draw(st.sampled_from(["uint8", "int16", "float32", "float64", "bool"]))
    b = draw(st.integers(1, 9))
    h, w, c = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.sampled_from([1, 3]))
    shape = {"HWC": (b, h, w, c), "CHW": (b, c, h, w), "HW": (b, h, w)}[layout]
    seed = draw(st.integers(0, 2**32 - 1))
    gen = np.random.default_rng(seed)
    x = (gen.integers(0, 256, shape) if dtype != "bool" else gen.random(shape) < 0.5).astype(dtype)
    lay = {"layout": "CHW" if layout == "CHW" else "HWC"}
    chain: list[dict[str, Any]] = []
    if draw(st.booleans()):
        pad = draw(st.integers(0, 3))
        size = draw(st.integers(1, min(h, w) + 2 * pad))
        fill = 1 if dtype == "bool" else draw(st.sampled_from([0, 1, 9]))
        chain.append(
            {
                "name": "random_crop",
                "params": {**lay, "field": "image", "size": size, "padding": pad, "fill": fill},
            }
        )
        c_h = c_w = size
    else:
        c_h, c_w = h, w
    if draw(st.booleans()):
        chain.append(
            {
                "name": "hflip",
                "params": {**lay, "field": "image", "p": draw(st.sampled_from([0, 0.5, 1]))},
            }
        )
    if draw(st.booleans()) or len(chain) < 2:
        chans = c if layout != "HW" else 1
        n = draw(st.sampled_from([1, chans]))
        norm: dict[str, Any] = {
            **lay,
            "field": "image",
            "dtype": draw(st.sampled_from(["float32", "float16", "float64"])),
            "scale": draw(st.sampled_from([1.0, 1 / 255, 0.37])),
            "mean": draw(st.sampled_from([None, [0.1, 0.45, 0.9][:n]])),
            "std": draw(st.sampled_from([None, [0.2, 0.3, 0.7][:n]])),
        }
        if layout == "HWC" and draw(st.booleans()):
            norm["to_chw"] = True
            if n > 1:
                norm["mean"] = norm["mean"] and norm["mean"][:c]
                norm["std"] = norm["std"] and norm["std"][:c]
        chain.append({"name": "normalize", "params": norm})
    del c_h, c_w
    return chain, x


@settings(max_examples=300, deadline=None)
@given(cases(), st.booleans(), st.sampled_from([LEGACY_SCHEME, CURRENT_SCHEME]))
def test_fused_chain_gives_the_bytes_of_the_steps_one_by_one(
    case: tuple[list[dict[str, Any]], np.ndarray], into_out: bool, scheme: int
) -> None:
    """Any chain of crop, flip and normalize, fused or not, equals the step-by-step reference."""
    chain, x = case
    where = Where(seed=W.seed, epoch=W.epoch, rank=W.rank, batch=W.batch, scheme=scheme)
    want = reference(chain, x, where)
    got, names = served(chain, x, into_out, where)
    assert got.dtype == want.dtype and got.shape == want.shape, (names, got.shape, want.shape)
    assert got.tobytes() == want.tobytes(), names


@pytest.mark.parametrize("name", ["random_crop", "hflip", "normalize"])
def test_each_step_alone_gives_its_earlier_bytes(name: str) -> None:
    """Each built-in alone (not fused) gives the bytes of its earlier numpy code."""
    x = np.random.default_rng(3).integers(0, 256, (64, 3, 32, 32)).astype(np.uint8)
    params = {
        "random_crop": {"size": 32, "padding": 4},
        "hflip": {},
        "normalize": {"scale": 1 / 255, "mean": [0.5, 0.4, 0.3], "std": [0.2] * 3},
    }
    chain = [{"name": name, "params": {"field": "image", "layout": "CHW", **params[name]}}]
    got, names = served(chain, x, into_out=True)
    assert names == [name]
    assert got.tobytes() == reference(chain, x).tobytes()


def test_the_cifar_chain_compiles_to_one_fused_step() -> None:
    """crop, flip, normalize on one field become one step that draws as the three did."""
    chain = [
        {
            "name": "random_crop",
            "params": {"field": "image", "size": 32, "padding": 4, "layout": "CHW"},
        },
        {"name": "hflip", "params": {"field": "image", "layout": "CHW"}},
        {"name": "normalize", "params": {"field": "image", "layout": "CHW", "scale": 1 / 255}},
    ]
    inputs = {"image": Field("uint8", (3, 32, 32)), "label": Field("int64", ())}
    c = compile_chain(chain, REG, inputs, "t")
    assert c.names == ["random_crop+hflip+normalize"]
    assert c.steps[0].origin == (0, 1, 2)
    assert c.outputs["image"] == Field("float32", (3, 32, 32))
    # Another field or layout in between breaks the run: those steps stay apart.
    apart = [chain[0], {"name": "hflip", "params": {"field": "image", "layout": "HWC"}}]
    assert compile_chain(apart, REG, inputs, "t").names == ["random_crop", "hflip"]


def test_a_fused_step_sent_by_name_compiles_to_itself() -> None:
    """A compiled chain named step by step (as worker processes get it) compiles to the same."""
    chain = [
        {"name": "resize", "params": {"field": "image", "size": 36, "layout": "CHW"}},
        {"name": "random_crop", "params": {"field": "image", "size": 32, "layout": "CHW"}},
        {"name": "normalize", "params": {"field": "image", "layout": "CHW", "scale": 0.5}},
    ]
    inputs = {"image": Field("uint8", (3, 40, 40))}
    c = compile_chain(chain, REG, inputs, "t")
    sent = [{"name": s.transform.name, "params": s.params.model_dump(mode="json")} for s in c.steps]
    again = compile_chain(sent, REG, inputs, "t")
    assert again.names == c.names == ["resize", "random_crop+normalize"]
    assert [s.origin for s in again.steps] == [(0,), (1, 2)]
    x = np.random.default_rng(1).integers(0, 256, (4, 3, 40, 40)).astype(np.uint8)
    one, _ = run_chain(c, {"image": x}, np.arange(4), W, ["image"])
    two, _ = run_chain(again, {"image": x}, np.arange(4), W, ["image"])
    assert one["image"].tobytes() == two["image"].tobytes()


def test_a_server_serves_the_fused_chain_with_the_bytes_of_the_steps_one_by_one(
    store: Path,
) -> None:
    """A real server's batches of crop, flip and normalize equal the step-by-step reference."""
    with (
        run_server(store) as srv,
        Loader(
            srv.http_url,
            "cifar",
            batch_size=50,
            seed=3,
            shuffle=False,
            transforms=CIFAR_CHAIN,
            timeout=scaled(30),
        ) as ld,
    ):
        ld.set_epoch(2)
        batches = [b["image"].numpy() for b in ld]
    images = cifar_images(0, N)
    assert len(batches) == N // 50
    for k, got in enumerate(batches):
        want = reference(CIFAR_CHAIN, images[k * 50 : (k + 1) * 50], Where(3, 2, 0, k), k * 50)
        assert got.tobytes() == want.tobytes(), f"batch {k}"


@pytest.mark.parametrize("names", [["random_crop"], ["random_crop", "hflip"], ["hflip"]])
def test_outputs_keep_their_bytes_after_the_next_batch(names: list[str]) -> None:
    """A batch's output is its own: the next batch on the same thread leaves it as it was."""
    params = {"random_crop": {"size": 30, "padding": 2}, "hflip": {}}
    chain = [{"name": n, "params": {"field": "image", "layout": "CHW", **params[n]}} for n in names]
    gen = np.random.default_rng(5)
    first, second = (gen.integers(0, 256, (16, 3, 32, 32)).astype(np.uint8) for _ in range(2))
    got, _ = served(chain, first, into_out=False)
    kept = got.copy()
    served(chain, second, into_out=False)
    assert got.tobytes() == kept.tobytes() == reference(chain, first).tobytes()
