"""Compiled decoding: the decode step and the eviction step as ``torch.compile(fullgraph=True)`` graphs.

:func:`beaconkv.generate` with ``compile=True`` runs:

* **the decode step** — one token for the whole batch through every layer: projections, RoPE, the
  in-place cache write, attention over the fixed-capacity cache with its validity mask, the LM head
  and sampling, as one graph (:func:`decode_and_sample`). Static shapes, no host sync, cache buffers
  mutated in place. Sampling noise is drawn outside the graph (a graph cannot take a
  ``torch.Generator``) by the same generator calls the eager path makes, so a seeded run samples the
  same tokens compiled or not.
* **the eviction step** — score, choose the kept slots (:func:`select_keep_static`: the keep count
  ``K`` comes from the host's schedule, so shapes are static) and compact in place
  (:func:`evict_layer`). The host triggers it at steps it computes from Python integers (the
  policy's schedule), never by reading the device. On CPU one layer's graph is compiled once and
  called per layer (every layer has the same shapes: seconds to compile instead of minutes); with
  CUDA graphs one graph covers all layers (:func:`evict_model`), so an eviction is one replay.
* **BeaconKV's maintenance** between steps (FPS compression every ``n_recent`` steps, beacon freeze,
  roll): BeaconKV already samples the query sets of all layers in one call
  (:meth:`BeaconKV.select_queries`); that call runs as one compiled graph (:func:`select_queries`),
  its host bookkeeping stays the policy's own.

On CUDA the graphs run with ``mode="reduce-overhead"`` (CUDA graphs; cache buffers and BeaconKV's
query sets are marked as static addresses, outputs are cloned before the host keeps them). On CPU
they go through inductor; batch-1 matmuls become inductor's own vectorised reductions
(:attr:`CompileConfig.cpu_gemv`), and ``freezing`` is available (measured no faster here).

What stays eager, by design: the prefill (one call per generation); evictions of only *some* rows
of the batch (ragged schedules, e.g. an int ``n_prefix`` with prompts of different lengths, whose
rows reach the budget at different steps), of policies that override
:meth:`~beaconkv.policies.EvictionPolicy.evict_layers`, or with telemetry on (it reads the device).
Only the cache work of an eviction is compiled: the policy's own ``evict`` (its schedule, keep
counts, BeaconKV's freeze and roll) runs as always and calls it. :class:`CompiledDecoding` counts the evictions that took the
graph (``GenerationStats.compiled_evictions``). Nothing falls back silently: a step that fails to
compile raises :class:`CompileError`.

Trap: the policy's host state (Python lists of counts and positions) must never be read inside a
graph — it would be baked in as a constant and recompile at the next change — so every such value
crosses into a graph as a tensor argument: :meth:`BeaconKV.score` takes them as arguments, and only
the sampler call of the maintenance is compiled; the tests check that compiled and eager runs keep
the same tokens and evictions.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .cache import KVCache, LayerKVCache
from .models.decoder import CausalLM
from .policies.base import EvictionPolicy, select_keep
from .policies.beacon import BeaconKV, QuerySet
from .sampling import SamplingParams, race_noise, sample_next

#: Size limits of inductor's ``decompose_mm_pass`` on CPU with :attr:`CompileConfig.cpu_gemv`: any matrix
#: side (an LM head's vocabulary included), batch 1 only (the pass's default).
CPU_GEMV_LIMITS = {"cpu_max_other_dimension_decomposition": 1 << 20}

#: Most graphs one compiled function may hold (shapes, dtypes, models, policies) before
#: :class:`CompileError` is raised instead of dynamo's silent fallback to eager.
RECOMPILE_LIMIT = 64


class CompileError(RuntimeError):
    """``torch.compile`` is unavailable here or failed to compile a step; nothing fell back to eager."""


@dataclass(frozen=True)
class CompileConfig:
    """How :func:`beaconkv.generate` compiles its steps (``compile=True`` uses the defaults).

    Attributes:
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` checks tracing quickly).
        mode: ``torch.compile`` mode; None = ``"reduce-overhead"`` (CUDA graphs) on CUDA, inductor's
            default elsewhere.
        freezing: Inductor ``freezing`` (weights folded as constants, GEMMs pre-packed for oneDNN).
            Off by default: on CPUs without AVX-512 it measured no faster for batch-1 decoding and
            makes the first compile slower; ``beaconkv bench --freezing`` measures it on yours.
        dynamic: ``torch.compile(dynamic=...)``; None lets a shape that changed between calls (cache
            capacity, batch) become symbolic after one recompile.
        eviction: Compile full-batch evictions (else they run eagerly).
        layerwise_eviction: Compile the eviction of *one* layer and call it per layer (compiles in
            seconds, since every layer has the same shapes) instead of one graph over all layers;
            None = per layer, except with CUDA graphs (one replay per eviction needs one graph).
        maintenance: Compile BeaconKV's between-step sampler call (FPS compression, freeze, roll; one
            call for all layers) for full-batch schedules.
        cpu_gemv: On CPU, let inductor turn batch-1 matmuls into its own vectorised reductions
            (its ``decompose_mm_pass``) instead of calling the BLAS: decoding one token is a
            matrix-vector product, memory-bound, and the BLAS's bf16 path is compute-bound on CPUs
            without native bf16 (measured on the embedded model, 1 thread: bf16 42 -> 31 ms/step,
            fp32 44 -> 38; 31 ms with the LM head too, see :func:`lift_cpu_gemv_limit`).
    """

    backend: str = "inductor"
    mode: str | None = None
    freezing: bool | None = None
    dynamic: bool | None = None
    eviction: bool = True
    layerwise_eviction: bool | None = None
    maintenance: bool = True
    cpu_gemv: bool = True

    def options(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments of ``torch.compile`` for a device (``fullgraph=True`` always)."""
        kwargs: dict[str, Any] = {"fullgraph": True, "backend": self.backend, "dynamic": self.dynamic}
        if self.backend != "inductor":
            return kwargs
        mode = self.mode if self.mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
        options: dict[str, Any] = {}
        if self.freezing:
            options["freezing"] = True
        if self.cpu_gemv and device.type == "cpu":
            # the limit takes effect through lift_cpu_gemv_limit(); stating it here also keys inductor's
            # on-disk graph cache apart from graphs compiled without it
            options["post_grad_fusion_options"] = {"decompose_mm_pass": dict(CPU_GEMV_LIMITS)}
            if not lift_cpu_gemv_limit():
                options["post_grad_fusion_options"] = {"decompose_mm_pass": {}}
        if not options:
            kwargs["mode"] = mode
            return kwargs
        # torch.compile takes either a mode or inductor options: spell the mode as options
        if mode == "reduce-overhead":
            options["triton.cudagraphs"] = True
        elif mode not in (None, "default"):
            raise CompileError(f"mode={mode!r} cannot be combined with freezing/cpu_gemv; pass freezing=False.")
        kwargs["options"] = options
        return kwargs

    def cuda_graphs(self, device: torch.device) -> bool:
        """Whether the compiled steps replay as CUDA graphs on ``device``."""
        if device.type != "cuda" or self.backend != "inductor":
            return False
        return (self.mode if self.mode is not None else "reduce-overhead") == "reduce-overhead"


def resolve_compile_config(compile: bool | CompileConfig | None) -> CompileConfig | None:
    """``True`` -> the default :class:`CompileConfig`; ``False``/None -> None (eager).

    Raises:
        TypeError: Anything else.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return CompileConfig()
    if isinstance(compile, CompileConfig):
        return compile
    raise TypeError(f"compile={compile!r} must be a bool or a beaconkv.compile.CompileConfig.")


def check_compile_available() -> None:
    """Raises :class:`CompileError` when ``torch.compile`` cannot run in this interpreter."""
    if not hasattr(torch, "compile"):
        raise CompileError(f"torch {torch.__version__} has no torch.compile; install torch>=2.4 or pass compile=False.")
    try:
        import torch._dynamo as dynamo

        supported = dynamo.is_dynamo_supported()
    except Exception as err:  # pragma: no cover - broken installs
        raise CompileError(f"torch.compile cannot be imported ({err}); pass compile=False.") from err
    if not supported:  # pragma: no cover - e.g. a Python newer than this torch supports
        raise CompileError(
            f"torch.compile does not support this Python with torch {torch.__version__}; pass compile=False."
        )


# ----------------------------------------------------------------------------- graph bodies
def decode_and_sample(
    model: CausalLM, cache: KVCache, tokens: Tensor, positions: Tensor, noise: Tensor | None, params: SamplingParams
) -> Tensor:
    """One decode step for the whole batch and the next tokens (the body of the compiled decode step).

    Args:
        model: The model.
        cache: The generation's cache (written in place).
        tokens: ``(batch,)`` newest tokens.
        positions: ``(batch,)`` their positions.
        noise: Race noise for sampling (None when greedy).
        params: Sampling parameters (constants of the graph).

    Returns:
        ``(batch,)`` int64 next tokens.
    """
    logits = model.decode_step(tokens, positions, cache)
    return sample_next(logits, params, noise=noise)


def select_keep_static(
    scores: Tensor, pos: Tensor, n_prefix: Tensor, t: Tensor, n_recent: int, keep_total: Tensor, K: int
) -> tuple[Tensor, Tensor]:
    """:func:`beaconkv.policies.select_keep` with the keep count ``K = max(keep_total)`` given by the host,
    so the function has static shapes and no device read. Same arguments and results."""
    return select_keep(scores, pos, n_prefix, t, n_recent, keep_total, keep_max=K)


def evict_layer(
    policy: EvictionPolicy, layer_idx: int, cache: LayerKVCache, rows: Tensor, t: Tensor, n_prefix: Tensor,
    keep_total: Tensor, recent_lo: Tensor, beacons: QuerySet | None, K: int,
) -> None:
    """Scores, selects and compacts some rows of one layer (the body of the per-layer eviction step).

    Args:
        policy: The policy (its ``score`` must be free of host reads; BeaconKV goes through
            :meth:`BeaconKV.score` with ``recent_lo`` and ``beacons`` passed in).
        layer_idx: Layer index (handed to ``policy.score``).
        cache: The layer's cache (compacted in place).
        rows: ``(b,)`` batch indices.
        t: ``(b,)`` newest positions.
        n_prefix: ``(b,)`` protected prefix lengths.
        keep_total: ``(b,)`` slots each row keeps.
        recent_lo: ``(b,)`` BeaconKV's recent-window bound (unused by other policies).
        beacons: BeaconKV's beacons of this layer; None for other policies.
        K: ``max(keep_total)``, known on the host.
    """
    if beacons is not None:
        scores = policy.score(layer_idx, cache, rows, t, recent_lo=recent_lo, beacons=beacons)  # type: ignore[call-arg]
    else:
        scores = policy.score(layer_idx, cache, rows, t)
    keep, keep_valid = select_keep_static(scores, cache.pos[rows], n_prefix, t, policy.n_recent, keep_total, K)
    cache.compact(rows, keep, keep_valid)


def evict_model(
    policy: EvictionPolicy, cache: KVCache, rows: Tensor, t: Tensor, n_prefix: Tensor, keep_total: Tensor,
    recent_lo: Tensor, K: int,
) -> None:
    """:func:`evict_layer` over every layer, as one graph (what a CUDA graph replays in one launch)."""
    for i, layer in enumerate(cache.layers):
        beacons = policy.beacons[i] if isinstance(policy, BeaconKV) else None
        evict_layer(policy, i, layer, rows, t, n_prefix, keep_total, recent_lo, beacons, K)


def select_queries(sampler: Any, queries: QuerySet, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """:meth:`QuerySet.select` (the body of the compiled sampler step).

    BeaconKV's maintenance hands it the sets of *all* layers stacked, ``(layers, b, heads, S, head_dim)``,
    so one FPS call (``k`` iterations) serves every layer.

    Returns:
        ``(q, pos, valid)`` of the ``k`` chosen entries per leading index.
    """
    chosen = queries.select(sampler, k)
    return chosen.q, chosen.pos, chosen.valid


# ----------------------------------------------------------------------------- driver
_COMPILED: dict[tuple[str, CompileConfig, str], Callable[..., Any]] = {}


def lift_cpu_gemv_limit() -> bool:
    """Lets inductor's ``decompose_mm_pass`` take an LM head's ``vocab x hidden`` matrix on CPU too.

    The pass keeps its CPU size limit (2048 per side) in a module global, read from the inductor
    config when the module is first imported; this sets that global to :data:`CPU_GEMV_LIMITS`
    whatever the import order, for the whole process. It only matters to graphs compiled with the
    pass on (:attr:`CompileConfig.cpu_gemv`; inductor leaves it off by default).

    Returns:
        Whether the limit is lifted (False if this torch has no such global: the LM head then
        keeps calling the BLAS).
    """
    module = importlib.import_module("torch._inductor.fx_passes.decompose_mem_bound_mm")
    for name, value in CPU_GEMV_LIMITS.items():
        if not hasattr(module, name):
            return False
        setattr(module, name, max(getattr(module, name), value))
    return True


def compiled(fn: Callable[..., Any], config: CompileConfig, device: torch.device) -> Callable[..., Any]:
    """The ``torch.compile`` wrapper of one graph body, shared by every generation with the same settings.

    Dynamo keeps one set of graphs per body and guards on shapes, dtypes and the policy's settings,
    so later generations with the same shapes reuse the compiled code.
    """
    key = (fn.__name__, config, device.type)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, **config.options(device))
    return _COMPILED[key]


@contextlib.contextmanager
def compile_guard(what: str) -> Iterator[None]:
    """Turns a dynamo/inductor failure into :class:`CompileError` naming the step.

    Dynamo's recompile limit is raised to :data:`RECOMPILE_LIMIT`, and hitting it raises too, instead
    of silently running the step eagerly.
    """
    import torch._dynamo as dynamo

    try:
        with dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            yield
    except (dynamo.exc.TorchDynamoException, dynamo.exc.FailOnRecompileLimitHit) as err:
        raise CompileError(
            f"torch.compile(fullgraph=True) failed on the {what}: {type(err).__name__}: {str(err).strip()[:2000]}\n"
            "Nothing fell back to eager; pass compile=False to decode eagerly."
        ) from err


def mark_static(cache: KVCache, policy: EvictionPolicy) -> None:
    """Marks the buffers the graphs write in place as static addresses, so CUDA graphs write them in place.

    That is every buffer of ``cache`` and, for BeaconKV, its per-layer query sets. ``guard=False``: a
    new cache (the next generation) makes the CUDA graphs re-record, not recompile.
    """
    tensors: list[Tensor] = []
    for layer in cache.layers:
        tensors += [layer.k, layer.v, layer.pos, layer.length, layer.queries, layer.query_pos,
                    *layer.slot_buffers.values()]
    if isinstance(policy, BeaconKV) and policy.sampler.bounded:
        for sets in (policy.obs, policy.beacons):
            tensors += [t for s in sets for t in (s.q, s.pos, s.valid)]
    for t in tensors:
        torch._dynamo.mark_static_address(t, guard=False)


class CompiledDecoding:
    """The compiled steps of one generation, bound to its model, cache and policy.

    Construct after :meth:`EvictionPolicy.start`; call :meth:`step` once per decode step and
    :meth:`close` at the end. While bound, the policy's ``evict_layers`` (and BeaconKV's
    :meth:`~beaconkv.policies.BeaconKV.select_queries`) are routed through the compiled steps for
    full-batch schedules and back to the policy's own methods otherwise; :meth:`close` removes the
    routing.

    Args:
        config: Compilation settings.
        model: The model.
        cache: The generation's cache.
        policy: The generation's policy (its ``evict_layers`` is routed through the compiled eviction step).
        params: Sampling parameters.

    Attributes:
        compiled_evictions: Evictions that ran as the compiled step.
        eager_evictions: Evictions that ran eagerly (partial rows of the batch).
    """

    def __init__(
        self, config: CompileConfig, model: CausalLM, cache: KVCache, policy: EvictionPolicy, params: SamplingParams
    ) -> None:
        check_compile_available()
        self.config, self.model, self.cache, self.policy, self.params = config, model, cache, policy, params
        self.device = cache[0].pos.device
        self.batch = cache[0].batch
        self.vocab = model.lm_head.weight.shape[0]
        self.cuda_graphs = config.cuda_graphs(self.device)
        if self.cuda_graphs:
            mark_static(cache, policy)
        self._decode = compiled(decode_and_sample, config, self.device)
        layerwise = config.layerwise_eviction
        self._layerwise = (not self.cuda_graphs) if layerwise is None else layerwise
        self.compiled_evictions = 0
        self.eager_evictions = 0
        self._policy_evict_layers = policy.evict_layers  # the policy's own (bound), for the eager cases
        self._beacon = isinstance(policy, BeaconKV)
        known = type(policy).evict_layers is EvictionPolicy.evict_layers
        self._evict_compiled = config.eviction and policy.budget is not None and known and not policy.telemetry
        if self._evict_compiled:
            policy.evict_layers = self._evict_layers  # type: ignore[method-assign]
        self._maintain = (isinstance(policy, BeaconKV) and type(policy).select_queries is BeaconKV.select_queries
                          and config.maintenance and policy.sampler.bounded and not policy.telemetry)
        if self._maintain:
            policy.select_queries = self._select_queries  # type: ignore[method-assign]

    def close(self) -> None:
        """Restores the policy's own methods."""
        for name in ("evict_layers", "select_queries"):
            self.policy.__dict__.pop(name, None)

    # ------------------------------------------------------------------ decode
    def step(self, tokens: Tensor, positions: Tensor, generator: torch.Generator | None) -> Tensor:
        """Runs the compiled decode step; returns the next tokens ``(batch,)`` (a fresh tensor).

        Args:
            tokens: ``(batch,)`` newest tokens.
            positions: ``(batch,)`` their positions.
            generator: Sampling generator (race noise is drawn from it outside the graph).
        """
        noise = None if self.params.greedy else race_noise(self.batch, self.vocab, self.device, generator)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with compile_guard("decode step"):
            out = self._decode(self.model, self.cache, tokens, positions, noise, self.params)
        return out.clone() if self.cuda_graphs else out  # a CUDA-graph output is overwritten by the next replay

    # ---------------------------------------------------------------- eviction
    def _full_batch(self, rows: list[int]) -> bool:
        return len(rows) == self.batch and list(rows) == list(range(self.batch))

    def _host(self, values: list[int]) -> Tensor:
        return torch.tensor(values, device=self.device)

    def _evict_layers(self, rows: list[int], rows_t: Tensor, t: Tensor, n_prefix: Tensor, keep_total: Tensor,
                      keep_max: int) -> None:
        """The policy's :meth:`~beaconkv.policies.EvictionPolicy.evict_layers` as compiled graphs (full-batch
        evictions); same arguments."""
        p = self.policy
        if not self._full_batch(rows):
            self.eager_evictions += 1
            return self._policy_evict_layers(rows, rows_t, t, n_prefix, keep_total, keep_max)
        recent = self._host([p.recent_since[b] for b in rows] if self._beacon else [0] * len(rows))
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with compile_guard(f"eviction step of {type(p).__name__}"):
            if self._layerwise:
                step = compiled(evict_layer, self.config, self.device)
                for i, layer in enumerate(self.cache.layers):
                    step(p, i, layer, rows_t, t, n_prefix, keep_total, recent, p.beacons[i] if self._beacon else None,
                         keep_max)
            else:
                compiled(evict_model, self.config, self.device)(p, self.cache, rows_t, t, n_prefix, keep_total, recent,
                                                                keep_max)
        self.compiled_evictions += 1

    # ------------------------------------------------------------- maintenance
    def _select_queries(self, queries: QuerySet, k: int) -> QuerySet:
        """BeaconKV's sampler call over all layers as one compiled graph (full-batch sets)."""
        p = self.policy
        if queries.q.shape[1] != self.batch:
            return BeaconKV.select_queries(p, queries, k)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with compile_guard("BeaconKV maintenance (query sampler)"):
            q, pos, valid = compiled(select_queries, self.config, self.device)(p.sampler, queries, k)
        return QuerySet(q.clone(), pos.clone(), valid.clone())  # a CUDA-graph output is overwritten by the next replay
