"""Sections 1-2 of ``beaconkv bench``: decode throughput of beaconkv (eager, compiled) and transformers,
and the bandwidth each achieves against the machine's roofline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...execution import CompileConfig
from ...kernels.choice import KERNEL_LABELS
from ...models.decoder import CausalLM
from ...models.loading import load_model
from .machine import (
    DTYPES,
    kv_bytes_per_token,
    random_prompts,
    sync,
    weight_bytes_per_step,
)
from .timing import decode_ms_per_step, generate_ids

#: The implementations the throughput section compares.
IMPLEMENTATIONS = ("beaconkv eager", "beaconkv compiled", "transformers eager", "transformers static+compile")


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
        kernels: The matmul kernels beaconkv chose (``"model"``, ``"packed"``: oneDNN-prepacked fp32
            linears, or ``"bf16w"``: bf16 weights with fp32 arithmetic; see
            :func:`~beaconkv.kernels.choice.choose_kernels`); ``"model"`` for transformers.
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
    kernels: str = "model"
    error: str = ""

    def fill(self, ms: float, nbytes: int, stream_gbps: float) -> ThroughputRow:
        """Sets the derived figures from a step time and the bytes a step reads."""
        self.ms_per_step, self.bytes_per_step = ms, nbytes
        self.tokens_per_s = self.batch * 1e3 / ms
        self.gb_per_s = nbytes / ms / 1e6
        self.roofline = self.gb_per_s / stream_gbps
        return self


def load_hf_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The same checkpoint as a transformers model (the reference implementation of the bench)."""
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
            sync(device)
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
               compile_config: CompileConfig, repeats: int) -> tuple[float, str]:
    """Best decode ms/step of one implementation after one untimed run (which compiles, warms caches),
    and the kernels it ran (beaconkv's automatic choice for the batch)."""
    if impl.startswith("beaconkv"):
        cc = compile_config if impl == "beaconkv compiled" else None
        outs = [generate_ids(model, prompts, new_tokens, None, cc) for _ in range(repeats + 1)]
        return min(decode_ms_per_step(o) for o in outs[1:]), outs[-1].stats.kernels
    runs = [hf_ms_per_step(hf_model, prompts, new_tokens, impl != "transformers eager") for _ in range(repeats + 1)]
    return min(runs[1:]), "model"


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
        model = load_model(model_path, dtype=dtype, device=device)
        hf_model = None
        if hf:
            log(f"  loading the transformers model ({dname})…")
            try:
                hf_model = load_hf_model(model_path, dtype, device)
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
                compiles = impl in ("beaconkv compiled", "transformers static+compile")
                log(f"  {impl:28s} {dname} batch {batch}: {repeats + 1} run(s) of {new_tokens} steps"
                    + (" (the first compiles)" if compiles else "") + "…")
                row = ThroughputRow(impl, dname, batch)
                nbytes = weights + int(batch * mean_len * per_token_kv) if impl == "transformers eager" else static_bytes
                try:
                    ms, row.kernels = _time_impl(impl, model, hf_model, prompts, new_tokens, compile_config, repeats)
                    if row.kernels == "packed":  # the packed copy reads fp32 weights
                        nbytes += weights * (4 - model.dtype.itemsize) // model.dtype.itemsize
                    row.fill(ms, nbytes, stream_gbps)
                except Exception as err:  # noqa: BLE001 - one failing mode must not hide the others
                    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    row.error = f"{type(err).__name__}: {first[:200]}"
                log(f"  {impl:28s} {dname} batch {batch}: " + (row.error or
                    f"{row.ms_per_step:.1f} ms/step, {row.tokens_per_s:.1f} tok/s, {row.gb_per_s:.2f} GB/s"
                    + ("" if row.kernels == "model" else f" ({KERNEL_LABELS.get(row.kernels, row.kernels)})")))
                rows.append(row)
    return rows
