"""``VarTensor.pad`` (vectorised) against padding sample by sample, for any shapes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.client import VarTensor


def _var(samples: list[torch.Tensor]) -> VarTensor:
    lens = torch.tensor([s.numel() for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    values = torch.cat([s.reshape(-1) for s in samples]) if samples else torch.empty(0)
    shapes = torch.tensor([list(s.shape) for s in samples], dtype=torch.int64)
    return VarTensor(values, offsets, shapes.reshape(len(samples), -1))


def _reference(samples: list[torch.Tensor], value: float) -> torch.Tensor:
    ndim = samples[0].dim()
    big = [max(s.shape[d] for s in samples) for d in range(ndim)]
    out = torch.full((len(samples), *big), value, dtype=samples[0].dtype)
    for i, s in enumerate(samples):
        out[(i, *(slice(0, d) for d in s.shape))] = s
    return out


@st.composite
def batches(draw: st.DrawFn) -> list[torch.Tensor]:
    ndim = draw(st.integers(1, 3))
    fixed = draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim))
    base = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
    out = []
    for i in range(draw(st.integers(1, 9))):
        shape = [b if f else draw(st.integers(0, 5)) for b, f in zip(base, fixed, strict=True)]
        out.append(
            torch.arange(i * 1000, i * 1000 + int(torch.tensor(shape).prod())).reshape(shape)
        )
    return out


@settings(max_examples=200, deadline=None)
@given(samples=batches(), value=st.integers(-3, 3))
def test_pad_equals_padding_each_sample(samples: list[torch.Tensor], value: int) -> None:
    """Dense tensor and true shapes equal the per-sample reference, fixed or varying dims, empty samples too."""
    dense, shapes = _var(samples).pad(value)
    torch.testing.assert_close(dense, _reference(samples, value), rtol=0, atol=0)
    assert shapes.tolist() == [list(s.shape) for s in samples]


def test_pad_graph_features_and_edge_lists() -> None:
    """x[N, 16] (rows moved whole) and edge_index[2, E] (the last dim varies)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(int(n), 16, generator=g) for n in torch.randint(1, 40, (20,), generator=g)]
    es = [
        torch.randint(0, 9, (2, int(e)), generator=g)
        for e in torch.randint(0, 30, (20,), generator=g)
    ]
    for samples in (xs, es):
        torch.testing.assert_close(
            _var(samples).pad(-1)[0], _reference(samples, -1), rtol=0, atol=0
        )
    empty = VarTensor(
        torch.empty(0), torch.zeros(1, dtype=torch.int64), torch.empty(0, 2, dtype=torch.int64)
    )
    assert empty.pad()[0].shape == (0, 0, 0)
