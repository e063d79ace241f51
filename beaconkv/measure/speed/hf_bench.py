"""The ``hf`` section of ``beaconkv bench``: BeaconKV inside transformers, against transformers' own cache and
beaconkv's own decoder.

For every generation length (``--hf-tokens``) and batch (``--hf-batches``), three runs decode the same
random prompts greedily, end-of-sequence ignored, eagerly:

* **hf DynamicCache** — transformers' ``generate`` with its growing cache (the reference speed);
* **hf PolicyCache** — the same ``generate`` with a :class:`~beaconkv.hf.PolicyCache` running
  ``BeaconKV(--hf-budget)``;
* **beaconkv native** — :func:`beaconkv.generate` with the same policy (beaconkv's decoder, eager).

Measured: decode tokens per second of the whole batch (prefill excluded: transformers' steps are timed by a
logits processor, beaconkv's by its own stats) and the KV memory at the end of the generation — the
DynamicCache's keys and values (it only grows, so its end is its peak), the PolicyCache's and the native
cache's allocation (fixed from the prefill on). ``PolicyCache / DynamicCache`` is the speed ratio the issue's
target reads (at least 0.85 at equal batch).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...generation import generate as native_generate
from ...policies.beacon import BeaconKV

__all__ = ["HFBenchRow", "add_hf_arguments", "markdown_hf", "measure_hf"]

BACKENDS = ("hf DynamicCache", "hf PolicyCache", "beaconkv native")


@dataclass(frozen=True)
class HFBenchRow:
    """One run of the section.

    Attributes:
        backend: One of ``BACKENDS``.
        batch: Rows decoded together.
        new_tokens: Tokens generated per row.
        tokens_per_s: Decode tokens of the whole batch per second (prefill excluded).
        kv_mib: KV memory at the end of the generation (MiB).
        evictions: Evictions of the first row (0 for the DynamicCache).
    """

    backend: str
    batch: int
    new_tokens: int
    tokens_per_s: float
    kv_mib: float
    evictions: int


def add_hf_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--hf-*`` options of ``beaconkv bench`` (the ``hf`` section)."""
    group.add_argument("--hf-tokens", default="1024,4096", help="generation lengths (default 1024,4096)")
    group.add_argument("--hf-batches", default="1,8", help="batch sizes (default 1,8)")
    group.add_argument("--hf-budget", type=int, default=512, help="BeaconKV's budget (default 512)")
    group.add_argument("--hf-prompt-tokens", type=int, default=64, help="prompt length (default 64)")


def _hf_decode(model: Any, ids: torch.Tensor, new_tokens: int, cache: Any) -> tuple[float, Any]:
    """Decode tokens/s of one greedy ``generate`` into ``cache`` (None: transformers' DynamicCache), and the
    cache it ended with."""
    import transformers

    stamps: list[float] = []

    class _Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)
            stamps.append(time.perf_counter())
            return scores

    kw = {} if cache is None else {"cache": cache}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                             logits_processor=transformers.LogitsProcessorList([_Stamp()]), **kw)
    used = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return ids.shape[0] * (len(stamps) - 1) / (stamps[-1] - stamps[0]), used


def _dynamic_bytes(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def measure_hf(model: Any, native: Any, tokens: Sequence[int], batches: Sequence[int], budget: int,
               prompt_tokens: int, log: Callable[[str], None] = print, seed: int = 0) -> list[HFBenchRow]:
    """Runs the section (see the module docstring).

    Args:
        model: The checkpoint in transformers (sdpa attention).
        native: The same checkpoint loaded by beaconkv.
        tokens: Generation lengths.
        batches: Batch sizes.
        budget: BeaconKV's budget (``n_recent`` 16, the defaults otherwise).
        prompt_tokens: Prompt length (random token ids).
        log: Progress lines.
        seed: Seeds the prompts.

    Returns:
        One row per (length, batch, backend).
    """
    from ...hf import PolicyCache

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    rows = []
    for n in tokens:
        for b in batches:
            ids = torch.randint(3, vocab, (b, prompt_tokens), generator=g).to(next(model.parameters()).device)
            log(f"  {n} tokens, batch {b}: hf DynamicCache…")
            tps, dynamic = _hf_decode(model, ids, n, None)
            rows.append(HFBenchRow("hf DynamicCache", b, n, tps, _dynamic_bytes(dynamic) / 2**20, 0))
            log(f"  {n} tokens, batch {b}: hf PolicyCache(BeaconKV({budget}))…")
            cache = PolicyCache(model, BeaconKV(budget), max_new_tokens=n)
            tps, _ = _hf_decode(model, ids, n, cache)
            rows.append(HFBenchRow("hf PolicyCache", b, n, tps, cache.store.nbytes() / 2**20,
                                   cache.state.stats.evictions[0]))
            log(f"  {n} tokens, batch {b}: beaconkv native…")
            out = native_generate(native, None, ids.tolist(), max_new_tokens=n, eos_token_ids=[],
                                  policy=BeaconKV(budget))
            rows.append(HFBenchRow("beaconkv native", b, n, out.stats.tokens_per_s, out.stats.cache_bytes / 2**20,
                                   out.stats.evictions[0]))
            for r in rows[-3:]:
                log(f"    {r.backend}: {r.tokens_per_s:.1f} tok/s, KV {r.kv_mib:.1f} MiB, evictions {r.evictions}")
    return rows


def markdown_hf(rows: Sequence[HFBenchRow], budget: int) -> str:
    """The section's table: one line per (length, batch, backend), with PolicyCache's speed over DynamicCache's."""
    lines = [f"### BeaconKV inside transformers (BeaconKV budget {budget}, eager, greedy)", "",
             "| new tokens | batch | backend | decode tok/s | vs hf DynamicCache | KV MiB at the end | evictions |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    base = {(r.new_tokens, r.batch): r.tokens_per_s for r in rows if r.backend == "hf DynamicCache"}
    for r in rows:
        ratio = r.tokens_per_s / base[(r.new_tokens, r.batch)] if (r.new_tokens, r.batch) in base else float("nan")
        lines.append(f"| {r.new_tokens} | {r.batch} | {r.backend} | {r.tokens_per_s:.1f} | {ratio:.2f}x | "
                     f"{r.kv_mib:.1f} | {r.evictions} |")
    return "\n".join(lines)
