"""Direct calls of cached graphs (:mod:`beaconkv.execution.dispatch`): served only where dynamo's guards hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import beaconkv
from beaconkv.execution import CompileConfig
from beaconkv.execution.compiled import CompiledExecutor, compiled
from beaconkv.execution.dispatch import MISS, CachedGraphs

SCALE = 2.0  # a module global the functions below read: dynamo guards on its value
# Each test compiles functions of its own (a code object of its own): dynamo keeps graphs per code object.


def _wrapped(fn):
    """A ``torch.compile`` wrapper of ``fn`` (eager backend, static shapes) and its cached graphs."""
    return torch.compile(fn, fullgraph=True, backend="eager", dynamic=False), CachedGraphs(fn)


def test_a_call_is_served_only_after_the_wrapper_compiled_and_only_while_the_guards_hold(monkeypatch):
    def scaled(x: torch.Tensor, shift: float = 1.0) -> torch.Tensor:
        return x * SCALE + shift

    wrapper, cached = _wrapped(scaled)
    x = torch.arange(4.0)
    assert cached.enabled and cached.call((x,)) is MISS  # nothing compiled yet
    wrapper(x)
    cached.learn()
    assert torch.equal(cached.call((x,)), x * 2 + 1) and cached.hits == 1
    assert cached.call((x, 3.0)) is MISS  # a float argument is a constant of the graph, guarded like the global
    monkeypatch.setattr(__import__(__name__, fromlist=["SCALE"]), "SCALE", 5.0)
    assert cached.call((x,)) is MISS  # the guard on the global's value fails: no stale graph runs
    assert torch.equal(wrapper(x), x * 5 + 1)  # the wrapper recompiles for the new value
    assert torch.equal(cached.call((x,)), x * 5 + 1)
    assert cached.call((torch.arange(5.0),)) is MISS  # a new shape (static shapes): the wrapper's to compile
    assert cached.call((x.double(),)) is MISS
    assert cached.call(()) is MISS and cached.call((x, 1.0, 2)) is MISS  # arguments the function cannot take


def test_omitted_trailing_arguments_take_their_defaults():
    def affine(x: torch.Tensor, scale: float = 2.0, shift: float = 1.0) -> torch.Tensor:
        return x * scale + shift

    wrapper, cached = _wrapped(affine)
    x = torch.arange(3.0)
    for args in [(x,), (x, 2.0), (x, 2.0, 1.0)]:  # one graph (the same constants) serves all three spellings
        wrapper(*args)
        cached.learn()
        assert torch.equal(cached.call(args), x * 2 + 1)
    assert cached.hits == 3
    assert cached.call((x, 3.0)) is MISS  # the second argument, not the third, took the explicit value


def test_a_miss_runs_nothing_and_the_served_call_mutates_like_the_wrapper():
    def add_into(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out.add_(x)
        return out

    wrapper, cached = _wrapped(add_into)
    out, x = torch.zeros(3), torch.ones(3)
    wrapper(out, x)
    cached.learn()
    assert cached.call((out, x)) is out and out.tolist() == [2.0, 2.0, 2.0]
    wide = torch.zeros(4)
    assert cached.call((wide, torch.ones(4))) is MISS and wide.tolist() == [0.0] * 4


def test_dynamo_stances_other_settings_and_a_reset_all_go_through_the_wrapper():
    def scaled(x):
        return x * SCALE

    wrapper, cached = _wrapped(scaled)
    x = torch.ones(2)
    wrapper(x)
    cached.learn()
    assert cached.call((x,)) is not MISS
    with torch.compiler.set_stance("force_eager"):
        assert cached.call((x,)) is MISS
    with torch.no_grad():  # grad mode is part of dynamo's global-state guard
        assert cached.call((x,)) is MISS
    assert cached.call((x.clone().requires_grad_(),)) is MISS
    torch._dynamo.reset()  # forgets every graph: nothing left to serve until the wrapper compiles again
    assert cached.call((torch.ones(2),)) is MISS
    wrapper(torch.ones(2))
    assert cached.call((torch.ones(2),)) is not MISS


def test_compiles_are_still_counted_after_dynamo_is_reset():
    """``torch._dynamo.reset()`` drops dynamo's compile callbacks: the executor's count registers again."""
    def halved(x):
        return x / 2

    executor = CompiledExecutor(CompileConfig(backend="eager", dynamic=False), "cpu")
    executor.run(halved, torch.ones(2))
    torch._dynamo.reset()
    executor.run(halved, torch.ones(2))  # compiled again: reset forgot the graph
    assert executor.compiles == 2 and executor.compile_s > 0


def test_graphs_of_a_wrapper_with_other_settings_are_not_served():
    def scaled(x):
        return x * SCALE

    runs = []

    def counting(gm, example_inputs):  # another backend: its graph counts its runs
        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    x = torch.ones(2)
    torch.compile(scaled, fullgraph=True, backend=counting, dynamic=False)(x)
    wrapper, cached = _wrapped(scaled)
    wrapper(x)
    cached.learn()
    assert len(runs) == 1
    for _ in range(3):
        assert torch.equal(cached.call((x,)), x * 2)
    assert len(runs) == 1 and cached.hits == 3  # served by the eager backend's graph, never the other one


def test_functions_it_cannot_bind_like_dynamo_are_left_to_the_wrapper():
    bound = 3

    def closure(x):
        return x + bound

    def star(*xs):
        return xs[0]

    def keyword_only(x, *, k=1):
        return x * k

    assert not any(CachedGraphs(fn).enabled for fn in (closure, star, keyword_only, torch.sin))


def test_the_executor_serves_repeated_calls_directly_with_the_wrappers_results():
    def scaled(x):
        return x * SCALE + 1

    executor = CompiledExecutor(CompileConfig(backend="eager", dynamic=False), "cpu")
    x = torch.arange(3.0)
    assert torch.equal(executor.run(scaled, x), x * 2 + 1) and executor.compiles == 1
    cached = compiled(scaled, executor.config, executor.device)[1]
    hits = cached.hits
    for _ in range(3):
        assert torch.equal(executor.run(scaled, x), x * 2 + 1)
    assert cached.hits == hits + 3 and executor.calls[scaled.__qualname__] == 4 and executor.compiles == 1
    off = CompiledExecutor(CompileConfig(backend="eager", dynamic=False, direct_calls=False), "cpu")
    hits = compiled(scaled, off.config, off.device)[1].hits
    assert torch.equal(off.run(scaled, x), x * 2 + 1) and compiled(scaled, off.config, off.device)[1].hits == hits


@pytest.mark.parametrize("name", ["full", "beacon"])
def test_direct_calls_decode_the_same_tokens_as_the_wrapper(llama, name):
    """A layerwise step (a graph call per layer) and an eviction per layer, served directly after the first
    step: the same tokens, kept positions and graph calls as through the wrapper, and most calls served."""
    prompts = [[5, 9, 2, 7, 11, 3], [4, 4, 8]]
    config = CompileConfig(backend="aot_eager", layerwise=True)
    outs = {}
    for direct in (True, False):
        policy = beaconkv.make_policy(name, budget=32, n_recent=4) if name != "full" else None
        outs[direct] = beaconkv.generate(llama, None, prompts, max_new_tokens=56, eos_token_ids=[], policy=policy,
                                         compile=dataclasses.replace(config, direct_calls=direct))
    assert outs[True].token_ids == outs[False].token_ids
    assert outs[True].stats.evictions == outs[False].stats.evictions
    assert name == "full" or sum(outs[True].stats.evictions) > 0  # the eviction graphs ran too
    assert outs[True].policy_state.executor.calls == outs[False].policy_state.executor.calls
    from beaconkv.models.decoder import decode_layers

    cached = compiled(decode_layers, config, torch.device("cpu"))[1]
    steps = outs[True].stats.decode_steps
    assert cached.hits >= (steps - 2) * llama.config.num_hidden_layers
