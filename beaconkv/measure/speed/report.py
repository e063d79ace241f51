"""The markdown report of a bench result (``bench.md``)."""

from __future__ import annotations

import math
from typing import Any

from ...kernels.choice import KERNEL_LABELS
from .table4 import markdown_table4


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
    if results["settings"].get("quick"):
        out += ["*A `--quick` smoke run: tiny sizes, one run each, curve and policies eager; the figures show that "
                "every section runs, not how fast it is.*", ""]
    if results.get("throughput"):
        s = results["settings"]
        out += [f"**Decode throughput** (FullKV, prompt {s['prompt_tokens']} + {s['new_tokens']} new tokens):", "",
                "| implementation | dtype (kernels) | batch | ms/step | tokens/s | GB/s | roofline |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for r in results["throughput"]:
            if r["error"]:
                out.append(f"| {r['impl']} | {r['dtype']} | {r['batch']} | — | — | — | {r['error'][:60]} |")
            else:
                kernels = r.get("kernels", "model")
                kind = r["dtype"] if kernels == "model" else f"{r['dtype']}: {KERNEL_LABELS[kernels]}"
                out.append(f"| {r['impl']} | {kind} | {r['batch']} | {_fmt(r['ms_per_step'])} | "
                           f"{_fmt(r['tokens_per_s'])} | {_fmt(r['gb_per_s'], 2)} | {100 * r['roofline']:.0f}% |")
        out.append("")
    if results.get("curve"):
        budget = results["settings"]["budget"]
        mode = "eager" if results["settings"].get("eager_sections") else "compiled"
        out += [f"**Cost curve** (batch 1, {mode}; FullKV's cache sized to the context):", "",
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
        out += [markdown_table4(results["table4"]), ""]
    if results.get("targets"):
        out += ["**Targets:**", "", "| target | measured | goal | met | note |", "|---|---:|---:|---|---|"]
        out += [f"| {t['name']} | {t['value']:.2f} | {t['goal']} | {'yes' if t['met'] else 'no'} | {t['note']} |"
                for t in results["targets"]]
        out.append("")
    return "\n".join(out)
