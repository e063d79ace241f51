"""`beaconkv.inplace.scatter_`: the same writes as `Tensor.scatter_`, eager and compiled, and in place when compiled."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.inplace import scatter_


@st.composite
def scatter_case(draw):
    """A buffer, a dim, a permutation-based index (each entry written once) and a source."""
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    d = dim % ndim
    index_shape = [draw(st.integers(1, n)) for n in shape]
    seed = draw(st.integers(0, 2**31 - 1))
    scalar = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(shape, generator=g)
    # Distinct indices along `dim` for every line, so the result does not depend on write order.
    lines = torch.rand(*index_shape[:d], shape[d], *index_shape[d + 1 :], generator=g)
    index = lines.argsort(dim=d).narrow(d, 0, index_shape[d])
    src = 2.5 if scalar else torch.randn(index_shape, generator=g)
    return buf, dim, index, src


@settings(max_examples=40, deadline=None)
@given(scatter_case())
def test_eager_matches_tensor_scatter(case):
    buf, dim, index, src = case
    expected = buf.clone().scatter_(dim, index, src)
    out = scatter_(buf, dim, index, src)
    assert out is buf
    assert torch.equal(buf, expected)


def _compiled_write(buf, index, src, fill_index):
    scatter_(buf, 2, index, src)
    scatter_(buf, 2, fill_index, 0.0)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_tensor_scatter(src_dtype):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, 3, 37, 4, generator=g).to(src_dtype)
    index = torch.tensor([5, 11]).view(2, 1, 1, 1).expand(2, 3, 1, 4)
    fill_index = torch.tensor([6, 12]).view(2, 1, 1, 1).expand(2, 3, 1, 4)
    src = torch.randn(2, 3, 1, 4, generator=g).to(src_dtype)
    expected = buf.clone().scatter_(2, index, src).scatter_(2, fill_index, 0.0)
    torch.compile(_compiled_write, fullgraph=True)(buf, index, src, fill_index)
    assert torch.equal(buf, expected)


def _allocations(codes: list[str]) -> list[str]:
    """The lines of inductor's generated code that allocate a buffer."""
    return [line.strip() for code in codes for line in code.splitlines() if "= empty_strided" in line]


def test_compiled_write_does_not_copy_the_buffer():
    """Compiled, a one-slot write into a cache-sized buffer allocates nothing (no functionalised copy)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    buf = torch.zeros(2, 3, 113, 8)
    index = torch.tensor([5, 11]).view(2, 1, 1, 1).expand(2, 3, 1, 8)
    fill_index = torch.tensor([6, 12]).view(2, 1, 1, 1).expand(2, 3, 1, 8)
    src = torch.ones(2, 3, 1, 8)
    _, codes = run_and_get_code(torch.compile(_compiled_write, fullgraph=True), buf, index, src, fill_index)
    assert _allocations(codes) == [], codes
    assert float(buf.sum()) == 2 * 3 * 8
    # The oracle: the same function written with Tensor.scatter_ does allocate a copy of the buffer,
    # so the assertion above can fail (if inductor ever reinplaces scatter_, this module can go).
    torch._dynamo.reset()

    def tensor_scatter(b, i, s):
        b.scatter_(2, i, s)

    _, codes = run_and_get_code(torch.compile(tensor_scatter, fullgraph=True), buf, index, src)
    assert any("113" in line for line in _allocations(codes)), codes
