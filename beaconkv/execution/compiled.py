"""The compiled strategy: every device function as a ``torch.compile(fullgraph=True)`` graph.

:class:`CompiledExecutor` compiles each function it is handed once per process (per settings and
device type) and calls the graph; dynamo guards on shapes, dtypes and the constant settings the
function reads, so later calls and later generations reuse it. On CUDA the graphs run with
``mode="reduce-overhead"`` (CUDA graphs: the buffers the graphs write in place are marked as static
addresses through :meth:`CompiledExecutor.prepare`, outputs are cloned before the host keeps them).
On CPU they go through inductor; batch-1 matmuls become inductor's own vectorised reductions
(:attr:`CompileConfig.cpu_gemv`).

Nothing falls back silently: a function that cannot be one graph (a host read of a tensor value, an
unsupported op), or that recompiles past :data:`RECOMPILE_LIMIT` times, raises :class:`CompileError`.
Compiling is timed apart from running (:attr:`Executor.compile_s`), and a *re*compile — a new cache
size, batch or policy setting that the graphs compiled so far cannot serve — is announced with a
:class:`RecompileWarning` naming the function and dynamo's reason. Every compile an executor starts is
logged on :data:`compile_logger` (``beaconkv.compile``, level INFO) when it starts (``compiling the decode
step (decode_and_sample)…``) and when it ends, with its seconds; the ``beaconkv`` command shows these lines
on stderr, a library caller sees them once it configures logging.

Trap: a device function must never read host state that changes (a Python list of counts, an
int attribute updated every step) — dynamo would bake it in as a constant and recompile at every
change. Values that change cross into a graph as tensor arguments (or tensors of the state object).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from . import graphs
from .base import EagerExecutor, Executor
from .compile_log import CompileError, compile_logger, compile_subject, describe_call
from .dispatch import MISS, CachedGraphs

CPU_GEMV_LIMITS = {"cpu_max_other_dimension_decomposition": 1 << 20}
"""Size limits of inductor's ``decompose_mm_pass`` on CPU with :attr:`CompileConfig.cpu_gemv`: any matrix
side (an LM head's vocabulary included), batch 1 only (the pass's default)."""

STRATEGIES = ("auto", "graphs", "compile")
"""The values of :attr:`CompileConfig.strategy`."""
RECORDERS = ("cuda", "op_replay")
"""The values of :attr:`CompileConfig.recorder`."""

RECOMPILE_LIMIT = 64
"""Most graphs one compiled function may hold (shapes, dtypes, models, policies) before
:class:`CompileError` is raised instead of dynamo's silent fallback to eager."""


class RecompileWarning(UserWarning):
    """A compiled function had to compile another graph: what it was called with differs from every graph
    compiled so far (a new cache size, batch, dtype or policy setting). The new graph is kept, so the same
    setting runs without compiling again in this process (and, through inductor's on-disk cache, compiles
    faster in the next one)."""


@dataclass(frozen=True)
class CompileConfig:
    """How :func:`beaconkv.generate` compiles its device work (``compile=True`` uses the defaults).

    Attributes:
        strategy: How the device work runs. ``"graphs"``: the eager functions recorded as CUDA graphs and
            replayed (:class:`~beaconkv.execution.GraphExecutor`; no ``torch.compile``, no code generation: a
            decode step records in about the time of two eager steps, where inductor's compile of a 4B
            model's step and eviction took minutes). ``"compile"``: ``torch.compile`` with the settings below
            (:class:`CompiledExecutor`). ``"auto"`` (the default): ``"graphs"`` on CUDA unless this config asks
            ``torch.compile`` for something (a backend other than inductor, a ``mode``, ``freezing``,
            ``regions`` or ``layerwise``), ``"compile"`` on every other device. Inductor stays one setting
            away (``CompileConfig(strategy="compile")``, inductor's CUDA graphs with ``mode="reduce-overhead"``,
            ``regions=True`` to compile one layer); it becomes the CUDA default when it measures faster
            (``python -m beaconkv.measure.speed.graph_decode`` compares them; not yet measured on a GPU).
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` checks tracing quickly).
        mode: ``torch.compile`` mode; None = ``"reduce-overhead"`` (CUDA graphs) on CUDA, inductor's
            default elsewhere.
        freezing: Inductor ``freezing`` (weights folded as constants, GEMMs pre-packed for oneDNN).
            Off by default: on CPUs without AVX-512 it measured no faster for batch-1 decoding and
            makes the first compile slower; ``beaconkv bench --freezing`` measures it on yours.
        dynamic: ``torch.compile(dynamic=...)``; None lets a shape that changed between calls (cache
            capacity, batch, the rows of an eviction) become symbolic after one recompile.
        policy: Compile the policies' device functions too (evictions, BeaconKV's query sampling);
            False compiles the decode step only.
        layerwise: Compile per-layer work for a few layers and call that graph for every group of them —
            the decode step (its inputs, each block of :attr:`layer_block` decoder layers, its logits and
            sampling: one graph each) and an eviction's score + select + compact (one layer) — instead of
            one graph over all layers. Every layer has the same code and shapes, so one block's compile
            serves the whole model: a cold compile of the embedded 30-layer model's decode step takes
            seconds instead of minutes (``beaconkv bench --sections compile``), but every graph call costs
            its guards and wrappers. None = layerwise, except with CUDA graphs (one replay per step and
            per eviction needs one graph).
        regions: Compile the decode step as one graph whose decoder layers are one nested compile region
            (``torch.compiler.nested_compile_region``): dynamo traces and inductor compiles one layer, and the
            step's graph calls it for every layer, so it compiles almost as fast as a layerwise step and runs
            as one graph, without a graph call per layer (measured on the embedded model, 1 thread, bf16:
            ``beaconkv bench --sections compile``). Evictions stay as :attr:`layerwise` says. Off by default:
            a regional step compiles with static shapes, so each new cache size or batch is a full recompile
            (symbolic shapes failed inside dynamo on an earlier torch, ``KeyError`` in ``invoke_subgraph``'s
            ``stamp_out_subgraph``; on torch 2.13 they compile but bring no reuse: the embedded model at batch
            2, then 3, compiled for 42 and 41 s), and on the 2-core AMD EPYC it measured no faster than
            layerwise (27.4 ms/step against 27.8, whole 26.0; first compile 31 s). It suits a pool of one size
            (``beaconkv serve``, the engine); not checked on a GPU.
        layer_block: Most decoder layers per graph of a layerwise decode step: the blocks are the largest
            divisor of the layer count up to this, so that one graph serves every block. Each graph call
            costs its guards and wrappers, each layer in a block adds to the compile. Measured on the
            embedded 30-layer model (this project's 2-core AVX2 CPU, 1 thread, cold inductor cache, FullKV):
            1 layer per graph compiled in 20 s and decoded at 60-67 ms/step, 3 in 27 s at 47-54, 5 in 30 s
            at 45-51, one graph over the whole step in minutes at 46-52. 1 (the default) compiles fastest,
            and a second cache size (another policy's) recompiles only one layer.
        cpu_gemv: On CPU, let inductor turn batch-1 matmuls into its own vectorised reductions
            (its ``decompose_mm_pass``) instead of calling the BLAS: decoding one token is a
            matrix-vector product, memory-bound, and the BLAS's bf16 path is compute-bound on CPUs
            without native bf16 (measured on the embedded model, 1 thread: bf16 42 -> 31 ms/step,
            fp32 44 -> 38; 31 ms with the LM head too, see :func:`lift_cpu_gemv_limit`).
        direct_calls: Once a function has a graph, call it as dynamo would on a cache hit (its guards checked,
            then its code run; :class:`~beaconkv.execution.dispatch.CachedGraphs`) instead of through the
            ``torch.compile`` wrapper, whose entry costs tens of microseconds per call: a layerwise step makes
            32 calls. Measured on the embedded model (2-core AMD EPYC, fp32, 1 thread, BeaconKV budget 64,
            one process alternating): 25.1 ms/step against 26.6 through the wrapper, the same tokens. A call
            no graph serves (and every call under CUDA graphs) goes through the wrapper, which compiles.
        cache_dir: Where inductor keeps its compiled graphs on disk, so that the next process only loads them
            (``TORCHINDUCTOR_CACHE_DIR`` for this process, set when the first executor with this config is made;
            None leaves it as it is: by default a folder under the system's temporary directory). See
            :mod:`beaconkv.execution.compile_cache` for carrying the artifacts to another machine. The graph
            strategy compiles nothing and ignores it.
        recorder: What records the graph strategy's graphs: ``"cuda"`` (``torch.cuda.CUDAGraph``; CUDA only) or
            ``"op_replay"`` (:class:`~beaconkv.execution.OpReplayRecorder`: the recorded operations replayed with a
            CUDA graph's semantics on any device — slow, for checking on a CPU that a policy replays correctly,
            and for the GPU check's CPU rehearsal).
    """

    strategy: str = "auto"
    backend: str = "inductor"
    mode: str | None = None
    freezing: bool | None = None
    dynamic: bool | None = None
    policy: bool = True
    layerwise: bool | None = None
    regions: bool = False
    layer_block: int = 1
    cpu_gemv: bool = True
    direct_calls: bool = True
    cache_dir: str | None = None
    recorder: str = "cuda"

    def __post_init__(self) -> None:
        if isinstance(self.layer_block, bool) or not isinstance(self.layer_block, int) or self.layer_block < 1:
            raise ValueError(f"layer_block={self.layer_block!r} must be a positive int: the most decoder layers "
                             "per graph of a layerwise decode step (1, the default, compiles fastest).")
        if self.recorder not in RECORDERS:
            raise ValueError(f"recorder={self.recorder!r} is not one of {', '.join(map(repr, RECORDERS))}: 'cuda' "
                             "records CUDA graphs, 'op_replay' replays recorded operations on any device (checks).")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {', '.join(map(repr, STRATEGIES))}: 'graphs' "
                             "records the eager step as CUDA graphs, 'compile' runs torch.compile, 'auto' picks.")

    def strategy_on(self, device: torch.device | str) -> str:
        """The strategy that runs on ``device``: ``"graphs"`` or ``"compile"`` (see :attr:`strategy`)."""
        if self.strategy != "auto":
            return self.strategy
        if torch.device(device).type != "cuda":
            return "compile"
        asks_compile = (self.backend != "inductor" or self.mode is not None or self.freezing or self.regions
                        or self.layerwise is not None)
        return "compile" if asks_compile else "graphs"

    def decode_shape(self, device: torch.device) -> str:
        """How the decode step compiles on ``device``: ``"layers"`` (a graph per block of layers, called from
        Python), ``"regions"`` (one graph whose layers are one nested compile region) or ``"whole"`` (one graph,
        every layer traced)."""
        if self.regions and not self.layerwise and hasattr(torch.compiler, "nested_compile_region"):
            return "regions"
        layerwise = self.layerwise if self.layerwise is not None else not self.cuda_graphs(device)
        return "layers" if layerwise else "whole"

    def block_size(self, n_layers: int) -> int:
        """Decoder layers per graph of a layerwise decode step of a model with ``n_layers`` layers: the largest
        divisor of ``n_layers`` up to :attr:`layer_block` (every block the same: one graph)."""
        return max(k for k in range(1, min(self.layer_block, n_layers) + 1) if n_layers % k == 0)

    def options(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments of ``torch.compile`` for a device (``fullgraph=True`` always)."""
        dynamic = False if self.decode_shape(device) == "regions" else self.dynamic  # see `regions`
        kwargs: dict[str, Any] = {"fullgraph": True, "backend": self.backend, "dynamic": dynamic}
        if COMPILE_TAKES_RECOMPILE_LIMIT:
            kwargs["recompile_limit"] = RECOMPILE_LIMIT
        if self.backend != "inductor":
            return kwargs
        options: dict[str, Any] = {}
        mode = self.mode if self.mode is not None else ("reduce-overhead" if device.type == "cuda" else None)
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
        """Whether the steps replay as CUDA graphs on ``device``: recorded from the eager code (the graph
        strategy), or compiled by inductor with ``mode="reduce-overhead"``."""
        if device.type != "cuda":
            return False
        if self.strategy_on(device) == "graphs":
            return True
        if self.backend != "inductor":
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
    raise TypeError(f"compile={compile!r} must be a bool or a beaconkv.CompileConfig.")


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


COMPILE_TAKES_RECOMPILE_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters
"""Whether this torch's ``torch.compile`` takes ``recompile_limit`` per function (2.12 and later); before that,
:func:`compiled` raises dynamo's process-wide ``recompile_limit`` to :data:`RECOMPILE_LIMIT` instead."""


def raise_global_recompile_limit() -> None:
    """For a torch whose ``torch.compile`` has no ``recompile_limit`` argument: lifts dynamo's process-wide
    limit to at least :data:`RECOMPILE_LIMIT` (never lowers a larger one a user set)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)


_COMPILED: dict[tuple[Callable[..., Any], CompileConfig, str], tuple[Callable[..., Any], CachedGraphs]] = {}


def compiled(fn: Callable[..., Any], config: CompileConfig,
             device: torch.device) -> tuple[Callable[..., Any], CachedGraphs]:
    """The ``torch.compile`` wrapper of one function and the graphs it cached, shared by every executor with
    the same settings."""
    key = (fn, config, device.type)
    if key not in _COMPILED:
        if not COMPILE_TAKES_RECOMPILE_LIMIT:
            raise_global_recompile_limit()
        _COMPILED[key] = torch.compile(fn, **config.options(device)), CachedGraphs(fn)
    return _COMPILED[key]


@contextlib.contextmanager
def compile_guard(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> Iterator[None]:
    """Turns a dynamo/inductor failure into :class:`CompileError` naming the function (and the policy).

    Every compiled function holds up to :data:`RECOMPILE_LIMIT` graphs (``torch.compile``'s own
    ``recompile_limit``, read only while compiling: nothing is patched per call); one more raises too,
    since a ``fullgraph`` function never falls back to eager.
    """
    import torch._dynamo as dynamo

    try:
        yield
    except (dynamo.exc.TorchDynamoException, dynamo.exc.FailOnRecompileLimitHit) as err:
        raise CompileError(
            f"torch.compile(fullgraph=True) failed on {describe_call(fn, args)}: {type(err).__name__}: "
            f"{str(err).strip()[:2000]}\nNothing fell back to eager; pass compile=False to decode eagerly."
        ) from err


_COMPILES = [0]  # compiles dynamo started in this process, counted by the callback below
_RUNNING: list[Any] = [None, False]  # [(fn, args) an executor is calling, whether its compile was announced]


def _count_compile(*_: Any) -> None:
    _COMPILES[0] += 1
    if _RUNNING[0] is not None and not _RUNNING[1]:  # the first frame of an executor's call that compiles
        _RUNNING[1] = True
        compile_logger.info("compiling %s…", compile_subject(*_RUNNING[0]))


def _frames_compiled() -> int:
    """Compiles dynamo has started in this process so far (every graph, recompiles included)."""
    from torch._dynamo.callback import callback_handler

    # dynamo calls it at the start of every compile, fullgraph ones too; torch._dynamo.reset() drops every
    # callback, so it is registered again whenever it is missing
    if _count_compile not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_count_compile)
    return _COMPILES[0]


_FAILURES_SEEN: dict[Callable[..., Any], int] = {}
"""Dynamo's recompile reasons per function as last read (after each compile through an executor)."""


def _guard_failures(fn: Callable[..., Any]) -> list[str]:
    """Why dynamo could not reuse the graphs of ``fn`` it had, one entry per recompile (dynamo's record)."""
    from torch._dynamo.utils import guard_failures

    return guard_failures.get(getattr(fn, "__code__", None), [])


def _announce_recompile(fn: Callable[..., Any]) -> None:
    """A :class:`RecompileWarning`: ``fn`` compiled a graph beside others, with dynamo's reason."""
    reason = _guard_failures(fn)[-1].strip().splitlines()[0][:300]
    warnings.warn(f"torch.compile compiled another graph of {fn.__qualname__} ({reason}); it is kept for the next "
                  "call with the same setting.", RecompileWarning, stacklevel=3)


def _tensors(obj: Any) -> Iterator[Tensor]:
    """The tensors an object holds: a module's buffers, or what its ``tensors()`` method yields."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        yield from obj.buffers()
    elif hasattr(obj, "tensors"):
        yield from obj.tensors()


class CompiledExecutor(Executor):
    """Runs every function as a compiled graph (see the module docstring).

    Args:
        config: Compilation settings.
        device: The device the graphs run on.

    Raises:
        CompileError: ``torch.compile`` is unavailable here.
    """

    compiled = True

    def __init__(self, config: CompileConfig, device: torch.device | str) -> None:
        super().__init__()
        check_compile_available()
        if config.cache_dir is not None:
            from .compile_cache import set_compile_cache_dir

            set_compile_cache_dir(config.cache_dir)
        self.config, self.device = config, torch.device(device)
        self.cuda_graphs = config.cuda_graphs(self.device)
        self.layerwise = (not self.cuda_graphs) if config.layerwise is None else config.layerwise
        # a CUDA-graph replay needs the wrapper's step marks and static inputs: it always goes through it
        self.direct_calls = config.direct_calls and not self.cuda_graphs
        self.decode_shape = config.decode_shape(self.device)
        # a layer region is an input of the step's graph, its module floats (attention's scale) with it: dynamo
        # would lift them as unbacked symbolic floats, which a kernel's float argument cannot take
        self._specialize_floats = self.decode_shape == "regions"
        # each function's wrapper and cached graphs, looked up by the function alone on the hot path (the shared
        # table's key hashes the whole config at every call)
        self._graphs: dict[Callable[..., Any], tuple[Callable[..., Any], CachedGraphs]] = {}

    def prepare(self, *objects: Any) -> None:
        """Marks the tensors of ``objects`` (caches, policy states) as static addresses under CUDA graphs.

        ``guard=False``: a new cache (the next generation) makes the CUDA graphs re-record, not recompile.
        """
        if self.cuda_graphs:
            for obj in objects:
                for t in _tensors(obj):
                    torch._dynamo.mark_static_address(t, guard=False)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls[fn.__qualname__] += 1
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        graphs = self._graphs.get(fn)
        if graphs is None:
            graphs = self._graphs[fn] = compiled(fn, self.config, self.device)
        call, cached = graphs
        if self.direct_calls:
            out = cached.call(args)
            if out is not MISS:
                return out
        frames = _frames_compiled()
        t0 = time.perf_counter()
        _RUNNING[0], _RUNNING[1] = (fn, args), False
        try:
            with compile_guard(fn, args):
                if self._specialize_floats:
                    import torch._dynamo.config as dynamo_config

                    with dynamo_config.patch(specialize_float=True):
                        out = call(*args)
                else:
                    out = call(*args)
        finally:
            _RUNNING[0] = None
        if _frames_compiled() != frames:  # this call compiled (dynamo counts every frame it compiles)
            seconds = time.perf_counter() - t0
            compile_logger.info("compiled %s in %.1f s", compile_subject(fn, args), seconds)
            self.compile_s += seconds
            self.compile_seconds[fn.__qualname__] += seconds
            self.compiles += 1
            failures = len(_guard_failures(fn))  # read only after a compile: nothing extra on the hot path
            if failures > _FAILURES_SEEN.get(fn, 0):  # not its first graph: say why another was needed
                _announce_recompile(fn)
            _FAILURES_SEEN[fn] = failures
        if self.direct_calls:
            cached.learn()
        if self.cuda_graphs:  # a CUDA-graph output is overwritten by the next replay
            out = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, out)
        return out


def make_executor(compile: bool | CompileConfig | None, device: torch.device | str) -> tuple[Executor, Executor]:
    """The executors ``generate(..., compile=...)`` asks for: ``(decode step's, policies')``.

    Eager for False/None. Otherwise the strategy :meth:`CompileConfig.strategy_on` the device says: a
    :class:`~beaconkv.execution.GraphExecutor` (CUDA graphs recorded from the eager code: the CUDA default)
    or a :class:`CompiledExecutor` (``torch.compile``: the default everywhere else) — the policies' too unless
    :attr:`CompileConfig.policy` is False.

    Raises:
        TypeError: ``compile`` is not a bool or a :class:`CompileConfig`.
        CompileError: Compilation is asked for and ``torch.compile`` is unavailable, or CUDA graphs are asked
            for on a device without them (:class:`~beaconkv.execution.GraphCaptureError`).
    """
    config = resolve_compile_config(compile)
    if config is None:
        eager = EagerExecutor()
        return eager, eager
    if config.strategy_on(device) == "graphs":
        decode: Executor = graphs.GraphExecutor(graphs.graph_recorder(device, config.recorder))
    else:
        decode = CompiledExecutor(config, device)
    return decode, (decode if config.policy else EagerExecutor())
