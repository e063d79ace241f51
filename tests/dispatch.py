"""Compiled graphs under the host-sync guard: dynamo runs no frame while a dispatch mode is active, so the
graphs run (and compile) with the modes suspended — ``fullgraph=True`` already refuses a sync inside a
graph — and the guard checks the host code around them."""

from __future__ import annotations

from beaconkv.execution import compiled as compiled_module


def run_graphs_outside_dispatch_modes(monkeypatch) -> None:
    """Makes every compiled function of beaconkv run with the active dispatch modes suspended, through its
    ``torch.compile`` wrapper or called directly (:mod:`beaconkv.execution.dispatch`)."""
    from torch.utils._python_dispatch import _disable_current_modes

    compiled = compiled_module.compiled

    def outside(run):
        def call(*args):
            with _disable_current_modes():
                return run(*args)

        return call

    class Outside:  # the cached graphs, called with the modes suspended
        def __init__(self, cached):
            self.call, self.learn = outside(cached.call), cached.learn

    def make(fn, config, device):
        graph, cached = compiled(fn, config, device)
        return outside(graph), Outside(cached)

    monkeypatch.setattr(compiled_module, "compiled", make)
