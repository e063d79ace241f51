"""The decode step's shape: how one decode step's device work is cut into calls of the executor.

One owner for every shape, so the model, the session and the policies carry no hint of it:

* ``"eager"`` and ``"whole"``: the whole step — every layer, the in-place cache writes, attention, the LM
  head (and sampling) — is one function, :func:`decode_and_sample` or :func:`decode_logits`: called as it is
  (eager), recorded as one CUDA graph (the CUDA default), or compiled whole;
* ``"regions"``: the same one function, its decoder layers each a nested compile region
  (:data:`decode_layer_region`): traced once, reused by every layer;
* ``"layers"``: one call for the inputs (:func:`decode_inputs`), one per block of layers
  (:func:`~beaconkv.models.decoder.decode_layers`, one compiled graph serving every block) and one for the
  logits (:func:`sample_logits` or :func:`last_logits`): the CPU's compiled default, which compiles in
  seconds.

:class:`DecodeStep` picks the shape the executor names (``executor.decode_shape``) once, and a session
calls :meth:`DecodeStep.tokens` (sampled next tokens) or :meth:`DecodeStep.logits` (teacher forcing,
measurement). :data:`DECODE_FUNCTIONS` names the functions, for measurement tools that count them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..models.decoder import CausalLM, decode_layers
from ..observation import LayerObserver
from ..sampling import RowSampling, sample_rows
from .base import Executor

__all__ = ["DECODE_FUNCTIONS", "DecodeStep", "Observers", "decode_and_sample", "decode_inputs", "decode_layer_region",
           "decode_logits", "last_logits", "sample_logits"]

Observers = tuple[LayerObserver | None, ...] | None
"""Each layer's observer in a decode step (None for a layer nobody observes; None: no layer is observed)."""


def _decode_layer(layer: nn.Module, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: Any,
                  observer: LayerObserver | None) -> Tensor:
    return layer(x, positions, (cos, sin), None, cache, True, observer)


_nested_region = getattr(torch.compiler, "nested_compile_region", None)
_layer_region = _nested_region(_decode_layer) if _nested_region is not None else _decode_layer


def decode_layer_region(layer: nn.Module, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: Any,
                        observer: LayerObserver | None) -> Tensor:
    """One decoder layer of a decode step, as a nested compile region.

    Called eagerly it is the layer itself; inside a compiled step dynamo traces it once and every layer's
    call reuses that region (same code, same shapes, the layer's weights and cache as its inputs), so a
    whole-step graph compiles about as fast as one layer (:attr:`~beaconkv.execution.CompileConfig.regions`).

    Args:
        layer: The decoder layer.
        x: Its input hidden states ``(batch, 1, hidden)``.
        positions: The rows' positions ``(batch, 1)``.
        cos: The rotary cosines of the positions.
        sin: The rotary sines of the positions.
        cache: The layer's KV cache.
        observer: The layer's observer (None: nobody observes it).

    Returns:
        The layer's output hidden states.
    """
    return _layer_region(layer, x, positions, cos, sin, cache, observer)


def _hidden(model: CausalLM, cache: Any, observers: Observers, tokens: Tensor, positions: Tensor,
            regions: bool) -> Tensor:
    """Every layer of a decode step: the last hidden states ``(batch, 1, hidden)``."""
    x, positions_2d, rotary = model.decode_inputs(tokens, positions)
    layers = tuple(model.model.layers)
    caches = tuple(cache[i] for i in range(len(layers)))
    if not regions:
        return decode_layers(layers, x, positions_2d, rotary, caches,
                             None if observers is None else tuple(observers[i] for i in range(len(layers))))
    for i, (layer, layer_cache) in enumerate(zip(layers, caches)):
        x = decode_layer_region(layer, x, positions_2d, rotary[0], rotary[1], layer_cache,
                                None if observers is None else observers[i])
    return x


def decode_and_sample(model: CausalLM, cache: Any, observers: Observers, tokens: Tensor, positions: Tensor,
                      sampling: RowSampling, noise: Tensor | None, regions: bool = False) -> Tensor:
    """One whole decode step for the batch and its next tokens (the body of a one-graph step).

    Args:
        model: The model.
        cache: The cache (written in place).
        observers: Each layer's observer (the policy's).
        tokens: ``(batch,)`` newest tokens.
        positions: ``(batch,)`` their positions.
        sampling: Each row's sampling parameters (tensors; its ``mode`` is a constant of the graph).
        noise: Race noise of the sampled rows (None when every row is greedy); drawn outside (a graph
            cannot take a ``torch.Generator``) by the same calls an eager run makes, so seeded runs match.
        regions: Each decoder layer through :data:`decode_layer_region`.

    Returns:
        ``(batch,)`` int64 next tokens.
    """
    return sample_rows(model.decode_logits(_hidden(model, cache, observers, tokens, positions, regions)), sampling,
                       noise)


def decode_logits(model: CausalLM, cache: Any, observers: Observers, tokens: Tensor, positions: Tensor,
                  regions: bool = False) -> Tensor:
    """One whole decode step returning the float32 logits ``(batch, vocab)`` (teacher forcing, measurement)."""
    return model.decode_logits(_hidden(model, cache, observers, tokens, positions, regions))


def decode_inputs(model: CausalLM, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """The first piece of a layer-by-layer decode step (see :meth:`~beaconkv.models.CausalLM.decode_inputs`)."""
    return model.decode_inputs(tokens, positions)


def sample_logits(model: CausalLM, x: Tensor, sampling: RowSampling, noise: Tensor | None) -> Tensor:
    """The last piece of a layer-by-layer decode step: logits of the last hidden states, then the next tokens."""
    return sample_rows(model.decode_logits(x), sampling, noise)


def last_logits(model: CausalLM, x: Tensor) -> Tensor:
    """The last piece of a layer-by-layer decode step that returns logits (teacher forcing)."""
    return model.decode_logits(x)


DECODE_FUNCTIONS: tuple[Callable[..., Any], ...] = (decode_and_sample, decode_logits, decode_inputs, decode_layers,
                                                    sample_logits, last_logits)
"""Every function a decode step hands its executor, in any shape (measurement tools count their calls)."""


class DecodeStep:
    """A session's decode step in the shape its executor asks for (see the module docstring).

    Args:
        executor: Runs the step's functions; its ``decode_shape`` (``"eager"``, ``"whole"``, ``"regions"`` or
            ``"layers"``) picks the shape, and a ``"layers"`` step takes its block size from its config.
        model: The model.
        cache: The session's cache.
        observers: Each layer's observer (None: no layer is observed).

    Attributes:
        shape: The shape chosen.
    """

    def __init__(self, executor: Executor, model: CausalLM, cache: Any, observers: Observers) -> None:
        self.executor, self.model, self.cache, self.observers = executor, model, cache, observers
        self.shape = executor.decode_shape
        self._regions = self.shape == "regions"
        self._blocks = self._layer_blocks() if self.shape == "layers" else []

    def tokens(self, tokens: Tensor, positions: Tensor, sampling: RowSampling, noise: Tensor | None = None) -> Tensor:
        """Decodes ``tokens`` (one per row, at ``positions``) and samples the next ones: ``(batch,)``."""
        run = self.executor.run
        if self._blocks:
            return run(sample_logits, self.model, self._layers(tokens, positions), sampling, noise)
        return run(decode_and_sample, self.model, self.cache, self.observers, tokens, positions, sampling, noise,
                   self._regions)

    def logits(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Decodes ``tokens`` and returns their float32 logits ``(batch, vocab)``."""
        run = self.executor.run
        if self._blocks:
            return run(last_logits, self.model, self._layers(tokens, positions))
        return run(decode_logits, self.model, self.cache, self.observers, tokens, positions, self._regions)

    def _layer_blocks(self) -> list[tuple[tuple, tuple, Observers]]:
        """Each block of a layer-by-layer step: its layers, their caches and observers (made once)."""
        layers = tuple(self.model.model.layers)
        k = self.executor.config.block_size(len(layers))
        return [(layers[i:i + k], tuple(self.cache[j] for j in range(i, min(i + k, len(layers)))),
                 None if self.observers is None else self.observers[i:i + k]) for i in range(0, len(layers), k)]

    def _layers(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """The inputs and every block of a layer-by-layer step; returns the last hidden states."""
        run = self.executor.run
        x, positions_2d, rotary = run(decode_inputs, self.model, tokens, positions)
        for layers, caches, observers in self._blocks:
            x = run(decode_layers, layers, x, positions_2d, rotary, caches, observers)
        return x
