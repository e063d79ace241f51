"""Sync-free decoding and eviction (:mod:`beaconkv.execution.sync`): no step of any policy makes the host wait.

Run on the CPU too: :func:`~beaconkv.execution.sync.no_host_sync` refuses every operation that would
block on a device (``.item()``, ``bool(t)``, ``nonzero``, mask indexing, device-to-host copies), so a
sync cannot hide until a GPU is lent; on a GPU CUDA's own sync debug mode is armed as well.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import beaconkv
from beaconkv.execution import CompileConfig, GraphExecutor
from beaconkv.execution.sync import HostSyncError, no_host_sync
from beaconkv.policies import Buffered, EvictionPolicy, Periodic, make_policy
from beaconkv.policies.registry import policy_names, policy_parameters
from beaconkv.policies.selection import select_keep
from beaconkv.sampling import RowSampling, SamplingParams
from beaconkv.session import Session

from ..dispatch import run_graphs_outside_dispatch_modes

pytestmark = pytest.mark.usefixtures("one_thread")

TRACE = CompileConfig(backend="aot_eager")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 97, (length,), generator=g).tolist() for _ in range(n)]


SYNC_STEPS = 40  # budget 32, prompts of 9: two evictions per row


def _sync_policy(name: str, **settings) -> EvictionPolicy | None:
    if name == "full":
        return None
    kw = {"budget": 32, "n_recent": 4, **settings}
    if "n_beacon" in policy_parameters(name):
        kw["n_beacon"] = 4
    return make_policy(name, **kw)


def _guarded_run(model, policy, kv_storage, compile_config):
    session = Session.for_prompts(model, policy, [9, 9], SYNC_STEPS, kv_storage=kv_storage,
                                  compile=compile_config or False)
    tokens = session.prefill(_prompts(2, 9)).argmax(-1)
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=20)]
    sampling = RowSampling.of(rows, model.device)
    noise = torch.empty(2, model.config.vocab_size).exponential_(generator=torch.Generator().manual_seed(0))
    noise = noise.to(model.device)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    with _sync_checks(model.device):
        for _ in range(SYNC_STEPS):
            tokens = session.step(tokens, sampling, noise)
    return session


@contextlib.contextmanager
def _sync_checks(device: torch.device):
    """The dispatch-mode guard everywhere; on CUDA also CUDA's own sync debug mode."""
    with no_host_sync():
        if device.type != "cuda":
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)


SYNC_POLICIES = [*policy_names(), "rpc@rpc", "rkv@rkv"]  # "@": the policy's own original schedule
# compiled, the host code around the graphs is the executor's and the policy's own (the same for every
# policy, checked eagerly for each): one representative per observation kind and schedule, and int8 once
SYNC_COMPILED = ["full", "beacon", "snapkv", "h2o", "rpc@rpc", "rkv@rkv"]
GRAPHS = CompileConfig(strategy="graphs")  # recorded CUDA graphs of the eager code (the op-replay recorder on a CPU)
SYNC_CASES = ([(name, None, storage) for name in SYNC_POLICIES for storage in ("dense", "int8")]
              + [(name, TRACE, "dense") for name in SYNC_COMPILED] + [("beacon", TRACE, "int8")]
              + [(name, GRAPHS, "dense") for name in SYNC_COMPILED] + [("beacon", GRAPHS, "int8")])
_LABELS = {None: "eager", TRACE: "aot_eager", GRAPHS: "graphs"}


@pytest.mark.cuda
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "compile_config", "kv_storage"), SYNC_CASES,
                         ids=[f"{n}-{_LABELS[c]}-{k}" for n, c, k in SYNC_CASES])
def test_decode_and_eviction_never_wait_for_the_device(tiny_models, llama, name, compile_config, kv_storage, device,
                                                      monkeypatch):
    """Every decode step and every eviction (rows, counts, positions, scores, compaction) of every registered
    policy (and RPC's and R-KV's own schedules), on dense and int8 storage, eager and compiled, runs with no
    operation that would make the host wait for the device: on the CPU a dispatch mode refuses them
    (.item(), bool(t), nonzero, mask indexing, unique, device-to-host copies...), so a sync cannot hide
    until a GPU is lent; on a GPU CUDA's own sync debug mode fails on any stream synchronisation as well.
    Under the graph strategy (CUDA graphs recorded from the eager code) the recordings and every replay are
    checked too: a recording synchronises once per shape by itself (torch.cuda.graph's own), the replays never."""
    model = llama if device == "cpu" else beaconkv.load_model(tiny_models["llama"][0], device=device)
    base, _, cadence = name.partition("@")
    own = {"rpc": {"schedule": Periodic(period=16), "budget": None, "window": 4},
           "rkv": {"schedule": Buffered(buffer=8), "budget": 32}}
    policy = _sync_policy(base, **own.get(cadence, {}))
    graphs = compile_config is GRAPHS
    if graphs and device == "cpu":
        # the recorder that replays with a CUDA graph's semantics on a CPU: its recordings refuse a host wait
        # themselves, and its replays run every operation again under the guard
        compile_config = dataclasses.replace(GRAPHS, recorder="op_replay")
    elif compile_config is not None and not graphs:
        # dynamo runs no frame under a dispatch mode: the graphs run (and compile) outside the guard —
        # fullgraph=True already refuses a sync inside a graph — and the guard checks the host code around them
        run_graphs_outside_dispatch_modes(monkeypatch)
    session = _guarded_run(model, policy, kv_storage, compile_config)
    evictions = session.state.stats.evictions
    assert evictions == [0, 0] if base == "full" else min(evictions) >= 1, evictions
    if compile_config is not None and base != "full":
        assert session.state.executor.compiled
    if graphs:
        executor = session.state.executor
        assert isinstance(executor, GraphExecutor) and executor.replays >= SYNC_STEPS - 2


def test_the_sync_guard_catches_each_kind_of_host_wait():
    t, mask = torch.arange(6.0), torch.arange(6) > 2
    waits = {
        "item": lambda: t.sum().item(), "bool": lambda: bool(t[0]), "if": lambda: 1 if t.any() else 0,
        "tolist": lambda: t.tolist(), "numpy": lambda: t.numpy(), "cpu": lambda: t.cpu(),
        "nonzero": lambda: t.nonzero(), "where": lambda: torch.where(mask), "masked_select": lambda: t[mask.clone()].sum(),
        "mask_put": lambda: t.clone().__setitem__(mask, 0.0), "unique": lambda: torch.unique(t),
        "equal": lambda: torch.equal(t, t), "bincount": lambda: torch.bincount(mask.long()),
        "repeat_interleave": lambda: torch.repeat_interleave(t, mask.long()),
    }
    for what, wait in waits.items():
        with pytest.raises(HostSyncError), no_host_sync():
            wait()
        wait()  # outside the guard it works (and the guard put every method back)
    with no_host_sync():  # device-side work passes
        torch.where(mask, t, 0.0).topk(2).indices.add_(1)
        t[torch.tensor([0, 2])] = 1.0
        torch.repeat_interleave(t, 2)
        torch.tensor([1, 2]).to(t.device, non_blocking=True)


def test_select_keep_with_a_host_known_keep_count_equals_the_device_read():
    g = torch.Generator().manual_seed(0)
    b, h, C = 3, 2, 40
    pos = torch.arange(C).repeat(b, h, 1)
    pos[0, :, 30:] = -1  # a shorter row
    scores = torch.randn(b, h, C, generator=g).round(decimals=1)  # ties
    n_prefix, t = torch.tensor([4, 6, 0]), torch.tensor([29, 39, 39])
    keep_total = torch.tensor([20, 24, 24])
    ref = select_keep(scores, pos, n_prefix, t, 8, keep_total)
    got = select_keep(scores, pos, n_prefix, t, 8, keep_total, keep_max=24)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
