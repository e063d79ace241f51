"""Device placement of the whole decode path, checked without a GPU.

A tensor left on the host (an index built with ``torch.tensor(...)`` and no ``device=``, a mask
from ``torch.arange``) works on a CPU-only machine, where every tensor is a host tensor, and fails
(or silently syncs) only on a GPU. Here the model, the cache and the policy state live on the
``meta`` device, a stand-in accelerator with no data, and a dispatch mode refuses every operation
that mixes a host tensor (anything but a 0-dim scalar) with a device tensor — stricter than CUDA,
which also accepts host index tensors, at the price of a copy and a sync. Explicit transfers
(``.to(device)``) are allowed. On ``meta`` any read of a value (``.item()``, ``.tolist()``,
``nonzero``) fails as well, so the pass also proves that prefill, decode, eviction and admission
never need a tensor's value on the host.

What it cannot check: pinned host memory (``pin_memory=True`` needs an accelerator runtime, absent
from a CPU-only PyTorch build) and CUDA streams; ``scripts/gpu_check.sh`` covers those on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from beaconkv.models.random_weights import qwen3_tiny_config
from beaconkv.models.decoder import build_model, default_rope
from beaconkv.policies import SnapKV, make_policy
from beaconkv.policies.registry import policy_names, policy_parameters
from beaconkv.sampling import RowSampling, SamplingParams
from beaconkv.session import Session

_TRANSFERS = {torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.lift_fresh}


class DeviceMixError(RuntimeError):
    """A host tensor met a device tensor in one operation."""


class OneDevicePerOp(TorchDispatchMode):
    """Refuses any operation (but an explicit transfer) whose non-scalar tensors are on several devices."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in _TRANSFERS:
            flat, _ = tree_flatten((args, kwargs))
            devices = {t.device.type for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
            if len(devices) > 1:
                raise DeviceMixError(f"{func} mixes tensors on {sorted(devices)}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def meta_model():
    """A tiny Qwen3-shaped model (q/k norms, head_dim != hidden / heads) on the meta device."""
    config = dataclasses.replace(qwen3_tiny_config(), vocab_size=128)
    with torch.device("meta"):
        model = build_model(config, rope=default_rope(config))
    assert model.device.type == "meta" and all(b.device.type == "meta" for b in model.buffers())
    return model


BUDGET = 16  # with an evictable prompt (n_prefix=0) and n_recent 2: an eviction every 2 steps, few steps


def _policy(name: str):
    if name == "full":
        return None
    kw = {"budget": BUDGET, "n_recent": 2, "n_prefix": 0}
    if "n_beacon" in policy_parameters(name):
        kw["n_beacon"] = 2
    return make_policy(name, **kw)


def _serve(model, policy, kv_storage="dense"):
    """Prefill two ragged rows (row 0 over the budget: it evicts in the prefill), decode with evictions,
    end row 0, admit a new prompt there (into a busy pool), decode on."""
    session = Session.for_prompts(model, policy, [BUDGET + 1, BUDGET - 3], 12, kv_storage=kv_storage)
    tokens = session.prefill([[1] * (BUDGET + 1), [2] * (BUDGET - 3)]).argmax(-1)
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)]
    sampling = RowSampling.of(rows, model.device)
    noise = torch.empty(2, model.config.vocab_size, device=model.device)
    for _ in range(6):
        tokens = session.step(tokens, sampling, noise)
    session.release([0])
    session.prefill([[3] * (BUDGET - 1)], rows=[0])
    for _ in range(6):
        tokens = session.step(tokens, sampling, noise)
    return session


@pytest.mark.parametrize("name,kv_storage", [(name, "dense") for name in policy_names()]
                         + [("beacon", "int8"), ("snapkv", "int8")])
def test_prefill_decode_eviction_and_admission_keep_every_tensor_on_the_device(meta_model, name, kv_storage):
    with OneDevicePerOp():
        session = _serve(meta_model, _policy(name), kv_storage)
    assert session.cache.layers[0].pos.device.type == "meta"
    if name != "full":  # the admitted prompt evicted in row 0 (its count restarted); row 1 throughout
        assert session.state.stats.evictions[0] >= 2 and session.state.stats.evictions[1] >= 4, \
            session.state.stats.evictions


class _HostIndexSnapKV(SnapKV):
    """A policy bug that only a GPU would show: a host tensor in the score."""

    def score(self, layer, rows, t):
        scores = super().score(layer, rows, t)
        return scores + torch.zeros(scores.shape[-1])  # no device=: a host tensor


def test_a_host_tensor_meeting_the_cache_is_caught(meta_model):
    with pytest.raises(DeviceMixError, match=r"mixes tensors on \['cpu', 'meta'\]"), OneDevicePerOp():
        _serve(meta_model, _HostIndexSnapKV(BUDGET, n_recent=2, n_prefix=0))
