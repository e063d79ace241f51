"""Decode attention of float32 queries over a bf16 cache (``beaconkv_cpu::mixed_attention``) and its use
by the dense storage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.kernels import kernels_status, mixed_attention, mixed_attention_applies
from beaconkv.storage import DenseKV

needs_kernels = pytest.mark.skipif(kernels_status() is not None, reason=f"no CPU kernels here: {kernels_status(False)}")


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 5), heads=st.integers(1, 3), group=st.integers(1, 7), slots=st.integers(1, 70),
       dim=st.sampled_from([8, 16, 64, 128]), keep=st.floats(0.05, 1.0), seed=st.integers(0, 2**16))
def test_the_kernel_is_float32_attention_over_the_bf16_slots(batch, heads, group, slots, dim, keep, seed):
    # slot counts around the 8-wide softmax blocks, GQA groups of 1-7, masks from sparse to full
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, group, dim, generator=g)
    k = torch.randn(batch, heads, slots, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(batch, heads, slots, dim, generator=g).to(torch.bfloat16)
    mask = torch.rand(batch, heads, 1, slots, generator=g) < keep
    mask[..., 0] = True  # every (row, head) attends somewhere: the reference is defined
    out = mixed_attention(q, k, v, mask, dim ** -0.5)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=dim ** -0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_a_head_with_no_valid_slot_gets_zeros_and_the_others_are_untouched():
    q = torch.randn(2, 2, 3, 8)
    k, v = torch.randn(2, 2, 5, 8).to(torch.bfloat16), torch.randn(2, 2, 5, 8).to(torch.bfloat16)
    mask = torch.ones(2, 2, 1, 5, dtype=torch.bool)
    mask[1, 0] = False
    out = mixed_attention(q, k, v, mask, 0.3)
    assert torch.equal(out[1, 0], torch.zeros(3, 8))
    ref = F.scaled_dot_product_attention(q[0:1].double(), k[0:1].double(), v[0:1].double(), scale=0.3)
    torch.testing.assert_close(out[0:1].double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_kernel_names_bad_inputs():
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8).to(torch.bfloat16)
    mask = torch.ones(1, 2, 1, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="q must be float32 and k, v bfloat16"):
        mixed_attention(q, kv.float(), kv, mask, 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 8, got 6"):
        mixed_attention(q[..., :6], kv[..., :6], kv[..., :6], mask, 1.0)
    with pytest.raises(RuntimeError, match="q must be \\(batch, kv_heads, group, head_dim\\)"):
        mixed_attention(q[:, :1], kv, kv, mask, 1.0)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        mixed_attention(q, kv, kv, mask.float(), 1.0)


def test_it_applies_only_to_float32_queries_over_a_bf16_cpu_cache():
    cpu = torch.device("cpu")
    assert not mixed_attention_applies(torch.float32, torch.float32, 64, cpu)
    assert not mixed_attention_applies(torch.bfloat16, torch.bfloat16, 64, cpu)
    assert not mixed_attention_applies(torch.float32, torch.bfloat16, 12, cpu)
    assert not mixed_attention_applies(torch.float32, torch.bfloat16, 64, torch.device("meta"))
    assert mixed_attention_applies(torch.float32, torch.bfloat16, 64, cpu) == (kernels_status() is None)


@needs_kernels
def test_a_bf16_dense_cache_under_float32_compute_attends_without_widening_and_agrees():
    storage = DenseKV(3, 2, 9, 16, dtype=torch.float32, storage_dtype=torch.bfloat16)
    assert storage.mixed
    storage.k.copy_(torch.randn_like(storage.k, dtype=torch.float32))
    storage.v.copy_(torch.randn_like(storage.v, dtype=torch.float32))
    q, mask = torch.randn(3, 2, 4, 16), torch.rand(3, 2, 1, 9) < 0.7
    mask[..., 2] = True
    out, weights = storage.attend(q, mask, 0.25)
    widened = F.scaled_dot_product_attention(q, storage.keys(), storage.values(), attn_mask=mask, scale=0.25)
    assert weights is None
    torch.testing.assert_close(out, widened, rtol=1e-5, atol=1e-5)
    # a policy that observes attention still gets the weights (the widening path)
    out_w, weights = storage.attend(q, mask, 0.25, need_weights=True)
    assert weights is not None and weights.shape == (3, 2, 4, 9)
    torch.testing.assert_close(out_w, out, rtol=1e-5, atol=1e-5)
    assert not DenseKV(1, 1, 4, 16, dtype=torch.float32).mixed  # same dtype: nothing to widen
