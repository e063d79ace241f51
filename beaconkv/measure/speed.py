"""Decode-speed benchmark (``beaconkv bench``): throughput, bandwidth roofline, cost curve, memory.

One process, one run, side by side on one model (default: the embedded SmolLM2-135M):

1. **throughput** — decode ms/step and tokens/s of beaconkv eager, beaconkv compiled
   (:mod:`beaconkv.compile`), transformers' ``generate`` eager and with its static cache compiled,
   per batch and dtype (FullKV everywhere: the same work as transformers);
2. **roofline** — achieved bandwidth (weight bytes + KV bytes read per step ÷ step time) next to
   the machine's streaming-read bandwidth measured here (:func:`streaming_bandwidth`);
3. **cost curve** — ms/step as the context grows: FullKV (a cache sized to the context, which is
   what decoding that far needs) vs BeaconKV(budget) decoding from a short prompt (a cache of
   ``prompt + budget`` whatever the length), as a PNG;
4. **policies** — KV-cache bytes, peak process memory (CUDA: peak allocated) and, in the steady
   state (after the first eviction), ms/step and the shares of decode time spent in the eviction
   step and in the rest of the policy's between-step work, for FullKV and every policy at one budget;
5. optionally the paper's Table 4 (:mod:`beaconkv.measure.table4`).

Every figure is the best of ``--repeats`` runs (a shared machine only ever adds time). Timings of
steps come from the generation's own stats (no extra host syncs), or, where single steps matter
(cost curve, steady state), from :class:`StepRecorder`, which wraps the policy's between-step hook
(and synchronises CUDA there). Outputs: ``bench.json``, ``bench.md`` and ``cost_curve.png`` in
``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import beaconkv
from beaconkv.compile import CompileConfig
from beaconkv.generation import GenerationOutput
from beaconkv.models.config import ModelConfig
from beaconkv.models.decoder import CausalLM
from beaconkv.policies import EvictionPolicy, make_policy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_POLICIES = ("beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming")
IMPLEMENTATIONS = ("beaconkv eager", "beaconkv compiled", "transformers eager", "transformers static+compile")


class BenchError(ValueError):
    """Inconsistent benchmark settings."""


# ------------------------------------------------------------------------------------------ machine
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def streaming_bandwidth(device: torch.device | str = "cpu", nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's streaming bandwidth in GB/s, the roofline a decode step is compared with.

    A decode step streams the weights and the KV cache once, so the reference is the faster of two
    passes over a buffer far larger than the caches: a read-only reduction (``sum``) and a copy
    (STREAM's *copy*, read + write bytes). Best of ``repeats`` each.

    Args:
        device: Where to measure.
        nbytes: Buffer size (default 1 GiB).
        repeats: Passes per kernel; the fastest counts.
    """
    device = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    best = 0.0
    for kernel, moved in ((lambda: x.sum(), x.nbytes), (lambda: y.copy_(x), 2 * x.nbytes)):
        kernel()
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            kernel()
            _sync(device)
            best = max(best, moved / (time.perf_counter() - t0) / 1e9)
    return best


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Context manager measuring peak memory: CUDA peak allocated, else the peak process RSS.

    On CPU a thread samples ``/proc/self/statm`` every millisecond (freed heap is first returned to
    the system with ``malloc_trim`` so the baseline is honest).

    Attributes:
        peak: Peak bytes (allocated on CUDA, resident on CPU) during the block.
        baseline: Bytes at entry.
    """

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.001) -> None:
        self.device, self.interval = torch.device(device), interval_s
        self.peak = self.baseline = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> PeakMemory:  # noqa: PYI034 - Python 3.10 has no typing.Self
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = self.peak = torch.cuda.memory_allocated(self.device)
        elif os.path.exists("/proc/self/statm"):
            _malloc_trim()
            self.baseline = self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())

    @property
    def increase(self) -> int:
        """Peak minus baseline bytes."""
        return self.peak - self.baseline


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys + values one token occupies in every layer's cache."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * elem


def weight_bytes_per_step(model: CausalLM, batch: int) -> int:
    """Weight bytes a decode step reads: every parameter once (a tied embedding through the LM head);
    an untied embedding only for the ``batch`` looked-up rows."""
    seen: dict[int, torch.Tensor] = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.nbytes for p in seen.values())
    emb = model.model.embed_tokens.weight
    if emb.data_ptr() != model.lm_head.weight.data_ptr():
        total -= emb.nbytes - batch * emb.shape[1] * emb.element_size()
    return total


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``length`` random ids (ids 0-2 avoided: special tokens of most vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


# ------------------------------------------------------------------------------------------ timing
class StepRecorder:
    """Times single decode steps by wrapping a policy's between-step hook (``after_decode_step``).

    Step ``i`` spans from the end of hook ``i - 1`` to the end of hook ``i``: the decode step, the
    host's bookkeeping and the policy's work (evictions included). CUDA is synchronised around the
    hook so the times are device times.

    Args:
        policy: The generation's policy (its ``after_decode_step`` is wrapped until :meth:`close`).
        device: The model's device.
        on_step: Called with the step index after each hook (e.g. to start measuring at some step).
    """

    def __init__(self, policy: EvictionPolicy, device: torch.device,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.policy, self.device, self.on_step = policy, device, on_step
        self.ends: list[float] = []
        self.policy_s: list[float] = []
        self.eviction_s: list[float] = []
        self._inner = policy.after_decode_step
        policy.after_decode_step = self._hook  # type: ignore[method-assign]

    def _hook(self) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        evicted = self.policy.stats.eviction_seconds
        self._inner()
        _sync(self.device)
        if self.on_step is not None:  # before the clock stops: its own time counts in this hook
            self.on_step(len(self.ends))
        t1 = time.perf_counter()
        self.ends.append(t1)
        self.policy_s.append(t1 - t0)
        self.eviction_s.append(self.policy.stats.eviction_seconds - evicted)

    def close(self) -> None:
        """Restores the policy's own hook."""
        self.policy.__dict__.pop("after_decode_step", None)

    def step_seconds(self) -> list[float]:
        """Duration of steps ``1 ..`` (step 0 has no predecessor)."""
        return [b - a for a, b in zip(self.ends, self.ends[1:])]

    def window(self, first: int, last: int | None = None) -> tuple[list[float], list[float], list[float]]:
        """Step durations, eviction seconds and policy seconds of steps ``first .. last`` (``first >= 1``).

        Step ``j`` lasts from the end of hook ``j - 1`` to the end of hook ``j``.
        """
        end = len(self.ends) if last is None else last + 1
        first = max(first, 1)
        return (self.step_seconds()[first - 1 : end - 1], self.eviction_s[first:end], self.policy_s[first:end])


def _policy(name: str, budget: int | None) -> EvictionPolicy:
    return make_policy(name, budget=None if name == "full" else budget)


def _generate(model: CausalLM, prompts: list[list[int]], new_tokens: int, policy: EvictionPolicy | None,
              compile_config: CompileConfig | None) -> GenerationOutput:
    return beaconkv.generate(model, None, prompts, max_new_tokens=new_tokens, eos_token_ids=[], policy=policy,
                             compile=compile_config or False)


def decode_ms_per_step(out: GenerationOutput) -> float:
    """Mean decode ms/step of a generation, from its stats (prefill excluded)."""
    s = out.stats
    return 1e3 * (s.wall_time_s - s.prefill_s) / max(s.decode_steps, 1)


@dataclass
class ThroughputRow:
    """One implementation x dtype x batch of the throughput section.

    Attributes:
        impl: One of :data:`IMPLEMENTATIONS`.
        dtype: ``fp32``/``bf16``/``fp16``.
        batch: Sequences decoded together.
        ms_per_step: Best mean decode step time.
        tokens_per_s: ``batch * 1000 / ms_per_step``.
        bytes_per_step: Weight + KV bytes a step reads.
        gb_per_s: Achieved bandwidth.
        roofline: ``gb_per_s`` / the measured streaming bandwidth.
        error: Why the implementation could not run (then the figures are NaN).
    """

    impl: str
    dtype: str
    batch: int
    ms_per_step: float = math.nan
    tokens_per_s: float = math.nan
    bytes_per_step: int = 0
    gb_per_s: float = math.nan
    roofline: float = math.nan
    error: str = ""

    def fill(self, ms: float, nbytes: int, stream_gbps: float) -> ThroughputRow:
        """Sets the derived figures from a step time and the bytes a step reads."""
        self.ms_per_step, self.bytes_per_step = ms, nbytes
        self.tokens_per_s = self.batch * 1e3 / ms
        self.gb_per_s = nbytes / ms / 1e6
        self.roofline = self.gb_per_s / stream_gbps
        return self


def _hf_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_ms_per_step(hf_model: Any, prompts: list[list[int]], new_tokens: int, static_compile: bool) -> float:
    """Mean decode ms/step of transformers' ``generate`` (greedy, no early stop), prefill excluded.

    Steps are timed by a logits processor, which ``generate`` calls once per new token.

    Args:
        hf_model: A transformers causal LM.
        prompts: Equal-length prompts.
        new_tokens: Tokens to generate (>= 2).
        static_compile: ``cache_implementation="static"`` with transformers' own ``torch.compile`` of the
            forward (``fullgraph=True``; CUDA graphs on CUDA, forced on other devices).
    """
    import transformers

    stamps: list[float] = []
    device = hf_model.device

    class _Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            _sync(device)
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts, device=device)
    kw: dict[str, Any] = {}
    if static_compile:
        cc = transformers.CompileConfig(fullgraph=True)
        cc._compile_all_devices = True  # transformers compiles only on accelerators unless told
        kw = {"cache_implementation": "static", "compile_config": cc}
    with torch.inference_mode():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          logits_processor=transformers.LogitsProcessorList([_Stamp()]), **kw)
    return 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def _time_impl(impl: str, model: CausalLM, hf_model: Any, prompts: list[list[int]], new_tokens: int,
               compile_config: CompileConfig, repeats: int) -> float:
    """Best decode ms/step of one implementation after one untimed run (which compiles, warms caches)."""
    if impl.startswith("beaconkv"):
        cc = compile_config if impl == "beaconkv compiled" else None
        runs = [decode_ms_per_step(_generate(model, prompts, new_tokens, None, cc)) for _ in range(repeats + 1)]
    else:
        runs = [hf_ms_per_step(hf_model, prompts, new_tokens, impl != "transformers eager") for _ in range(repeats + 1)]
    return min(runs[1:])


def measure_throughput(
    model_path: Path, dtypes: Sequence[str], batches: Sequence[int], prompt_tokens: int, new_tokens: int,
    device: torch.device, stream_gbps: float, compile_config: CompileConfig, repeats: int, hf: bool,
    hf_compile: bool, log: Callable[[str], None] = print,
) -> list[ThroughputRow]:
    """Sections 1-2: decode speed and achieved bandwidth of every implementation (FullKV).

    Each implementation runs once untimed (compiles, warms caches) and then ``repeats`` times; the
    fastest counts. An implementation that fails is reported with its error; the others still run.
    Bytes per step: the weights, plus the KV cache each implementation reads — the whole static
    capacity for beaconkv and transformers' static cache, the mean filled length for transformers'
    growing (dynamic) cache.
    """
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        model = beaconkv.load_model(model_path, dtype=dtype, device=device)
        hf_model = None
        if hf:
            try:
                hf_model = _hf_model(model_path, dtype, device)
            except (ImportError, OSError, ValueError) as err:  # transformers missing or cannot read the checkpoint
                log(f"transformers unavailable: {type(err).__name__}: {err}")
        impls = list(IMPLEMENTATIONS[: 2 if hf_model is None else (4 if hf_compile else 3)])
        per_token_kv = kv_bytes_per_token(model.config, dtype)
        for batch in batches:
            prompts = random_prompts(batch, prompt_tokens, model.config.vocab_size)
            weights = weight_bytes_per_step(model, batch)
            static_bytes = weights + batch * (prompt_tokens + new_tokens) * per_token_kv
            mean_len = prompt_tokens + (new_tokens + 1) / 2  # a growing cache, on average over the run
            for impl in impls:
                row = ThroughputRow(impl, dname, batch)
                nbytes = weights + int(batch * mean_len * per_token_kv) if impl == "transformers eager" else static_bytes
                try:
                    row.fill(_time_impl(impl, model, hf_model, prompts, new_tokens, compile_config, repeats),
                             nbytes, stream_gbps)
                except Exception as err:  # noqa: BLE001 - one failing mode must not hide the others
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    row.error = f"{type(err).__name__}: {first[:200]}"
                log(f"  {impl:28s} {dname} batch {batch}: " + (row.error or
                    f"{row.ms_per_step:.1f} ms/step, {row.tokens_per_s:.1f} tok/s, {row.gb_per_s:.2f} GB/s"))
                rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- cost curve
@dataclass
class CurvePoint:
    """ms/step at one context length for FullKV and BeaconKV.

    Attributes:
        context: Tokens in the sequence (prompt + generated) at the end of the measured window.
        full_ms: FullKV ms/step with a cache sized to ``context``.
        beacon_ms: BeaconKV ms/step over the window ending at ``context`` (evictions included).
        full_capacity: FullKV cache slots.
        beacon_capacity: BeaconKV cache slots.
    """

    context: int
    full_ms: float
    beacon_ms: float
    full_capacity: int
    beacon_capacity: int


def measure_cost_curve(
    model: CausalLM, contexts: Sequence[int], budget: int, window: int, prompt_tokens: int,
    compile_config: CompileConfig | None, repeats: int, log: Callable[[str], None] = print,
) -> list[CurvePoint]:
    """Section 3: ms/step as the context grows, FullKV vs BeaconKV(``budget``), batch 1.

    FullKV at context N: a prompt of ``N - window`` tokens, then ``window`` decode steps, so its cache
    holds ``N`` slots — what decoding to N tokens needs (its graphs are compiled first by a run with
    the same capacity and a one-token prompt). BeaconKV: one generation from a ``prompt_tokens``
    prompt to the largest context, its steps timed singly (the best of ``repeats`` runs per step);
    the point at N averages the ``window`` steps that end at N. ``window`` should be a multiple of
    ``budget - B_min`` so that evictions count in proportion; the compilations happen in the first
    steps and at the first eviction, before the first window when ``contexts[0] - window`` exceeds
    ``prompt_tokens + budget``.
    """
    device = model.lm_head.weight.device
    vocab = model.config.vocab_size
    top = max(contexts)
    if min(contexts) < prompt_tokens + window:
        raise BenchError(f"contexts {list(contexts)} must be at least prompt_tokens + window = {prompt_tokens + window}.")
    best: list[float] | None = None
    capacity_b = 0
    for r in range(repeats):
        policy = make_policy("beacon", budget=budget)
        rec = StepRecorder(policy, device)
        try:
            out = _generate(model, random_prompts(1, prompt_tokens, vocab), top - prompt_tokens + 1, policy,
                            compile_config)
        finally:
            rec.close()
        capacity_b = out.stats.cache_capacity
        steps = rec.step_seconds()  # steps[i] wrote position prompt_tokens + i + 1: context prompt_tokens + i + 2
        best = steps if best is None else [min(a, b) for a, b in zip(best, steps)]
        log(f"  BeaconKV({budget}) to {top} tokens, run {r + 1}: {1e3 * sum(steps) / len(steps):.1f} ms/step mean")
    assert best is not None
    points = []
    for n in contexts:
        sel = [s for i, s in enumerate(best) if n - window < prompt_tokens + i + 2 <= n]
        beacon_ms = 1e3 * sum(sel) / len(sel)
        if compile_config is not None:  # compile for capacity n: a 1-token prompt, a cache sized for n
            beaconkv.generate(model, None, [[3]], max_new_tokens=2, capacity_tokens=n - 1, eos_token_ids=[],
                              compile=compile_config)
        prompts = random_prompts(1, n - window, vocab)
        full_ms = min(decode_ms_per_step(_generate(model, prompts, window, None, compile_config))
                      for _ in range(repeats))
        points.append(CurvePoint(n, full_ms, beacon_ms, n, capacity_b))  # FullKV capacity: prompt + new = n
        log(f"  context {n}: FullKV {full_ms:.1f} ms/step (capacity {n}), BeaconKV({budget}) {beacon_ms:.1f} ms/step "
            f"(capacity {capacity_b})")
    return points


def plot_cost_curve(points: Sequence[CurvePoint], budget: int, title: str, path: Path) -> Path:
    """Draws ms/step against context length for FullKV and BeaconKV into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p.context for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(x, [p.full_ms for p in points], marker="o", label="FullKV (cache = context)")
    ax.plot(x, [p.beacon_ms for p in points], marker="o", lw=2.5, label=f"BeaconKV(budget={budget})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (prompt + generated tokens)")
    ax.set_ylabel("ms / decode step")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- policies
@dataclass
class PolicyRow:
    """Memory and steady-state step time of one policy at the bench budget.

    Attributes:
        policy: Registry name (``full`` for FullKV).
        budget: The budget (None for FullKV).
        batch: Sequences decoded together.
        cache_capacity: Slots per (sequence, KV head).
        kv_cache_bytes: Bytes of keys and values allocated.
        peak_bytes: Peak process RSS (CPU) or peak allocated (CUDA) during the generation.
        ms_per_step: Steady-state ms/step (steps after the first eviction; all steps for FullKV).
        tokens_per_s: ``batch * 1000 / ms_per_step``.
        eviction_share: Share of steady-state decode time spent in the eviction step.
        policy_share: Share spent in the policy's between-step work (evictions included).
        evictions: Evictions per sequence.
        compiled_evictions: Evictions that ran as the compiled graph.
        policy_ms: Policy time per step (eviction step + maintenance), ms.
        decode_ms: ``ms_per_step - policy_ms``: the decode step and the loop's own bookkeeping.
    """

    policy: str
    budget: int | None
    batch: int
    cache_capacity: int
    kv_cache_bytes: int
    peak_bytes: int
    ms_per_step: float
    tokens_per_s: float
    eviction_share: float
    policy_share: float
    evictions: int
    compiled_evictions: int
    policy_ms: float = 0.0
    decode_ms: float = 0.0


def measure_policies(
    model: CausalLM, names: Sequence[str], budget: int, batch: int, prompt_tokens: int, cycles: int,
    compile_config: CompileConfig | None, repeats: int, log: Callable[[str], None] = print,
) -> list[PolicyRow]:
    """Section 4: KV bytes, peak memory, steady-state ms/step and eviction share per policy.

    Each policy decodes from a fully protected prompt: the budget fills, the first eviction happens
    (and compiles), and then ``cycles`` whole eviction cycles (``budget - B_min`` steps each) are
    timed — FullKV times the same steps. Peak memory: CUDA peak allocated over the whole run; on CPU
    the peak resident memory over the timed steps (the in-process compiler's memory would swamp the
    rest). The best of ``repeats`` runs counts.
    """
    device = model.lm_head.weight.device
    prompts = random_prompts(batch, prompt_tokens, model.config.vocab_size)
    gap = budget - math.floor(7 / 8 * budget)
    first = budget - 1 + gap  # the step of the second eviction: timing starts after the first one
    new_tokens = first + cycles * gap + 1
    cpu_window = device.type != "cuda"
    rows = []
    for name in ["full", *[n for n in names if n != "full"]]:
        best: PolicyRow | None = None
        for _ in range(repeats):
            policy = _policy(name, budget)
            mem = PeakMemory(device)
            rec = StepRecorder(policy, device, (lambda j, m=mem: m.__enter__() if cpu_window and j == first - 1 else None))
            with contextlib.ExitStack() as stack:
                stack.callback(rec.close)
                if not cpu_window:
                    stack.enter_context(mem)
                out = _generate(model, prompts, new_tokens, policy, compile_config)
            if cpu_window:
                mem.__exit__()
            durations, evict_s, policy_s = rec.window(first)
            total = sum(durations)
            s = out.stats
            ms, pol_ms = 1e3 * total / len(durations), 1e3 * sum(policy_s) / len(durations)
            row = PolicyRow(
                name, None if name == "full" else budget, batch, s.cache_capacity, s.cache_bytes, mem.peak, ms,
                batch * len(durations) / total, sum(evict_s) / total, sum(policy_s) / total, s.evictions[0],
                s.compiled_evictions, pol_ms, ms - pol_ms,
            )
            if best is None or row.ms_per_step < best.ms_per_step:
                best = row
        assert best is not None
        log(f"  {name:15s} capacity {best.cache_capacity}, KV {best.kv_cache_bytes / 2**20:.1f} MiB, peak "
            f"{best.peak_bytes / 2**20:.0f} MiB, {best.ms_per_step:.1f} ms/step, eviction {100 * best.eviction_share:.2f}%"
            f", policy {100 * best.policy_share:.2f}% ({best.evictions} evictions, {best.compiled_evictions} compiled)")
        rows.append(best)
    return rows


# ---------------------------------------------------------------------------------------- reporting
@dataclass
class Target:
    """One stated target, its measured value and whether it is met.

    Attributes:
        name: What is compared.
        value: The measured ratio.
        goal: The threshold, as text (``">= 1.5"``).
        met: Whether the value satisfies it.
        note: How the value was obtained, where it is not a plain ratio of two measurements.
    """

    name: str
    value: float
    goal: str
    met: bool
    note: str = ""


def evaluate_targets(results: dict[str, Any]) -> list[Target]:
    """Checks the issue's targets against the measured results (batch 1, bf16 where measured)."""
    targets = []
    thr = [ThroughputRow(**r) for r in results.get("throughput", [])]

    def find(impl: str, dtype: str, batch: int) -> ThroughputRow | None:
        return next((r for r in thr if r.impl == impl and r.dtype == dtype and r.batch == batch and not r.error), None)

    dtype = "bf16" if any(r.dtype == "bf16" for r in thr) else (thr[0].dtype if thr else "")
    ours, theirs = find("beaconkv compiled", dtype, 1), find("transformers eager", dtype, 1)
    if ours and theirs:
        v = ours.tokens_per_s / theirs.tokens_per_s
        targets.append(Target(f"compiled / transformers eager tok/s (batch 1, {dtype})", v, ">= 1.5", v >= 1.5))
    if ours:
        targets.append(Target(f"compiled roofline ratio (batch 1, {dtype})", ours.roofline, ">= 0.40",
                              ours.roofline >= 0.40))
    curve = [CurvePoint(**p) for p in results.get("curve", [])]
    lo = next((p for p in curve if p.context == 512), curve[0] if curve else None)
    if curve and lo is not None:
        v = curve[-1].beacon_ms / lo.beacon_ms
        targets.append(Target(f"BeaconKV step time at {curve[-1].context} / at {lo.context}", v, "<= 1.10", v <= 1.10))
    pol = {r["policy"]: r for r in results.get("policies", [])}
    if "beacon" in pol:
        # every evicting policy runs the same decode graph on the same cache shape: their decode-only
        # times differ by machine noise alone, so compare the policies' own time on their median
        evicting = sorted(r.get("decode_ms", r["ms_per_step"]) for r in pol.values() if r["budget"] is not None)
        decode = evicting[len(evicting) // 2]
        for other in ("snapkv", "rpc"):
            if other in pol:
                b, o = pol["beacon"], pol[other]
                v = (decode + b.get("policy_ms", 0.0)) / (decode + o.get("policy_ms", 0.0))
                raw = b["ms_per_step"] / o["ms_per_step"]
                targets.append(Target(
                    f"BeaconKV / {other} ms/step, eviction + maintenance included (equal budget)", v, "<= 1.05",
                    v <= 1.05, f"policy time on the median decode time {decode:.1f} ms; raw ratio {raw:.2f}"))
    return targets


def _fmt(x: float, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_report(results: dict[str, Any]) -> str:
    """The markdown tables of a bench result (as written to ``bench.md``)."""
    m = results["machine"]
    out = [f"`{results['command']}`", "",
           (f"{m['device_name']}, {m['threads']} thread(s), torch {m['torch']}; streaming read bandwidth "
            f"**{m['stream_gbps']:.1f} GB/s**. Model: {results['model']['name']} "
            f"({results['model']['parameters'] / 1e6:.1f}M parameters). Best of {results['settings']['repeats']} runs."),
           ""]
    if results.get("throughput"):
        s = results["settings"]
        out += [f"**Decode throughput** (FullKV, prompt {s['prompt_tokens']} + {s['new_tokens']} new tokens):", "",
                "| implementation | dtype | batch | ms/step | tokens/s | GB/s | roofline |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for r in results["throughput"]:
            if r["error"]:
                out.append(f"| {r['impl']} | {r['dtype']} | {r['batch']} | — | — | — | {r['error'][:60]} |")
            else:
                out.append(f"| {r['impl']} | {r['dtype']} | {r['batch']} | {_fmt(r['ms_per_step'])} | "
                           f"{_fmt(r['tokens_per_s'])} | {_fmt(r['gb_per_s'], 2)} | {100 * r['roofline']:.0f}% |")
        out.append("")
    if results.get("curve"):
        budget = results["settings"]["budget"]
        out += ["**Cost curve** (batch 1, compiled; FullKV's cache sized to the context):", "",
                f"| context | FullKV ms/step | BeaconKV({budget}) ms/step |", "|---:|---:|---:|"]
        out += [f"| {p['context']} | {_fmt(p['full_ms'])} | {_fmt(p['beacon_ms'])} |" for p in results["curve"]]
        out.append("")
    if results.get("policies"):
        s = results["settings"]
        out += [(f"**Policies at budget {s['budget']}** (batch {s['policy_batch']}, {s['policy_dtype']}; step "
                 f"times, shares and CPU peak memory over {s['policy_cycles']} eviction cycles after the first "
                 "eviction):"), "",
                ("| policy | cache slots | KV cache MiB | peak memory MiB | ms/step | policy ms/step | eviction share "
                 "| policy share |"),
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in results["policies"]:
            out.append(f"| {r['policy']} | {r['cache_capacity']} | {r['kv_cache_bytes'] / 2**20:.1f} | "
                       f"{r['peak_bytes'] / 2**20:.0f} | {_fmt(r['ms_per_step'])} | {r.get('policy_ms', 0.0):.2f} | "
                       f"{100 * r['eviction_share']:.2f}% | {100 * r['policy_share']:.2f}% |")
        out.append("")
    if results.get("table4"):
        from .table4 import markdown_table4

        out += [markdown_table4(results["table4"]), ""]
    if results.get("targets"):
        out += ["**Targets:**", "", "| target | measured | goal | met | note |", "|---|---:|---:|---|---|"]
        out += [f"| {t['name']} | {t['value']:.2f} | {t['goal']} | {'yes' if t['met'] else 'no'} | {t['note']} |"
                for t in results["targets"]]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- CLI
def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


SECTIONS = ("throughput", "curve", "policies", "table4")


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``beaconkv bench`` options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = "Decode speed, bandwidth roofline, cost curve and memory of beaconkv vs transformers."
    g = parser.add_argument_group("model and machine")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the embedded SmolLM2-135M)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--sections", type=_str_list, default=["throughput", "curve", "policies"],
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but table4)")
    g.add_argument("--repeats", type=int, default=2, help="timed runs per figure; the best counts (default 2)")
    g.add_argument("--quick", action="store_true",
                   help="a seconds-long smoke run: fp32, batch 1, few tokens, short curve, two policies, no table4")
    t = parser.add_argument_group("throughput")
    t.add_argument("--dtypes", type=_str_list, default=["fp32", "bf16"], help="comma-separated (default fp32,bf16)")
    t.add_argument("--batches", type=_int_list, default=[1, 8], help="comma-separated (default 1,8)")
    t.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    t.add_argument("--new-tokens", type=int, default=64, help="decode steps timed (default 64)")
    t.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    t.add_argument("--no-transformers-compile", action="store_true", help="skip transformers' static-cache compile")
    c = parser.add_argument_group("compilation")
    c.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    c.add_argument("--freezing", action="store_true", help="inductor freezing (CPU: measures whether it helps)")
    c.add_argument("--eager-sections", action="store_true",
                   help="run the curve and policy sections eagerly instead of compiled")
    k = parser.add_argument_group("cost curve and policies")
    k.add_argument("--budget", type=int, default=256, help="budget of BeaconKV and the policies (default 256)")
    k.add_argument("--contexts", type=_int_list, default=[512, 1024, 2048, 4096],
                   help="context lengths of the cost curve (default 512,1024,2048,4096)")
    k.add_argument("--curve-window", type=int, default=64, help="steps averaged per curve point (default 64)")
    k.add_argument("--policies", type=_str_list, default=list(DEFAULT_POLICIES),
                   help=f"comma-separated (default {','.join(DEFAULT_POLICIES)}; FullKV always runs)")
    k.add_argument("--policy-batch", type=int, default=1, help="batch of the policy section (default 1)")
    k.add_argument("--policy-cycles", type=int, default=8,
                   help="eviction cycles timed per policy, after the first eviction (default 8)")
    k.add_argument("--policy-dtype", default=None,
                   help="dtype of the curve and policy sections (default: bf16 on CUDA, fp32 on CPU, where bf16 "
                        "prefill of 4K-token prompts takes minutes)")
    from .table4 import add_table4_arguments

    add_table4_arguments(parser.add_argument_group("table 4 (--sections ...,table4)"), prefix="table4-")
    parser.add_argument("--out", type=Path, default=Path("results/bench"), help="output directory (default results/bench)")
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    args.dtypes, args.batches = args.dtypes[:1] if args.dtypes != ["fp32", "bf16"] else ["fp32"], args.batches[:1]
    args.new_tokens, args.prompt_tokens, args.repeats = 8, 16, 1
    args.budget, args.curve_window = 128, 16
    args.contexts = [64, 128]
    args.policies = [p for p in args.policies if p in ("beacon", "snapkv")] or ["beacon"]
    args.policy_cycles, args.policy_dtype = 2, "fp32"
    args.sections = [s for s in args.sections if s != "table4"]


def run_bench(args: argparse.Namespace) -> int:
    """Runs ``beaconkv bench`` from parsed arguments; writes ``bench.json``, ``bench.md``, ``cost_curve.png``.

    Returns:
        The exit status (0 on success, 2 on bad settings).
    """
    t0 = time.perf_counter()
    if args.quick:
        _apply_quick(args)
    unknown = [s for s in args.sections if s not in SECTIONS] + [d for d in args.dtypes if d not in DTYPES]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.policy_dtype = args.policy_dtype or ("bf16" if device.type == "cuda" else "fp32")
    if unknown or args.repeats < 1 or args.policy_dtype not in DTYPES:
        print(f"beaconkv bench: unknown section/dtype {unknown or args.policy_dtype} or repeats < 1", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else Path(beaconkv.embedded_model_path())
    compile_config = CompileConfig(backend=args.compile_backend, freezing=args.freezing or None)
    section_compile = None if args.eager_sections else compile_config
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    stream = streaming_bandwidth(device, nbytes=(1 << 28) if args.quick else (1 << 30))
    config = ModelConfig.from_file(path)
    name = "SmolLM2-135M-Instruct (embedded)" if not args.model else path.name
    params = sum(p.numel() for p in {id(p): p for p in beaconkv.load_model(path).parameters()}.values())
    results: dict[str, Any] = {
        "command": _command_line(args),
        "machine": {
            "device": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
            "stream_gbps": stream, "python": platform.python_version(),
        },
        "model": {"name": name, "path": str(path), "parameters": params, "config": asdict(config)},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)
                     and not k.startswith("_")},
    }
    log(f"bench: {results['machine']['device_name']}, {results['machine']['threads']} thread(s), "
        f"streaming read {stream:.1f} GB/s; model {name}")
    try:
        if "throughput" in args.sections:
            log("throughput:")
            rows = measure_throughput(path, args.dtypes, args.batches, args.prompt_tokens, args.new_tokens, device,
                                      stream, compile_config, args.repeats, not args.no_transformers,
                                      not args.no_transformers_compile, log)
            results["throughput"] = [asdict(r) for r in rows]
        if "curve" in args.sections or "policies" in args.sections:
            model = beaconkv.load_model(path, dtype=DTYPES[args.policy_dtype], device=device)
            if "curve" in args.sections:
                log("cost curve:")
                points = measure_cost_curve(model, args.contexts, args.budget, args.curve_window, args.prompt_tokens,
                                            section_compile, args.repeats, log)
                results["curve"] = [asdict(p) for p in points]
                plot_cost_curve(points, args.budget, f"{name}, {args.policy_dtype}, batch 1, "
                                f"{'eager' if section_compile is None else 'compiled'}", args.out / "cost_curve.png")
            if "policies" in args.sections:
                log(f"policies at budget {args.budget}:")
                rows_p = measure_policies(model, args.policies, args.budget, args.policy_batch, args.prompt_tokens,
                                          args.policy_cycles, section_compile, args.repeats, log)
                results["policies"] = [asdict(r) for r in rows_p]
            del model
        if "table4" in args.sections:
            from .table4 import run_table4_section

            log("table 4:")
            results["table4"] = run_table4_section(args, device, compile_config, log, prefix="table4_")
    except BenchError as err:
        print(f"beaconkv bench: {err}", file=sys.stderr)
        return 2
    results["targets"] = [asdict(t) for t in evaluate_targets(results)]
    results["wall_time_s"] = time.perf_counter() - t0
    (args.out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    report = markdown_report(results)
    (args.out / "bench.md").write_text(report + "\n")
    print(report)
    log(f"wrote {args.out}/bench.json, bench.md" + (", cost_curve.png" if "curve" in results else "")
        + f" in {results['wall_time_s'] / 60:.1f} min")
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed, when this process is ``beaconkv bench`` / ``python -m ...speed``."""
    argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    elif not sys.argv[0].endswith(("speed.py", "beaconkv")):
        return "beaconkv bench (called from Python" + (", --quick)" if args.quick else ")")
    return " ".join(["beaconkv bench", *argv])


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "CPU"


def main(argv: list[str] | None = None) -> int:
    """``python -m beaconkv.measure.speed``: the same as ``beaconkv bench``."""
    return run_bench(add_bench_arguments(argparse.ArgumentParser(prog="beaconkv bench")).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
