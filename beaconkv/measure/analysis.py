"""Thought-revisiting analysis of one reasoning trace: where global queries look, where they occur,
what they look like in pre-RoPE space, and which beacons BeaconKV held when they arrived.

The trace is teacher-forced through the real decode path (:class:`~beaconkv.measure.fidelity.LockStep`):
a FullKV reference whose cache keeps every pre-RoPE query (its query ring spans the whole trace)
and whose attention weights are captured each step, in lock-step with one policy (BeaconKV by
default). Every (step, layer, query head) is a query, classified global/local with the SPEC §1 rule.

Figures (paper numbering), written as PNG:

* ``attention_distance.png`` (Fig. 1b): the per-query mean top-K distance, and the attention mass
  per distance bin, for local vs global queries;
* ``global_heatmap.png`` (Fig. 3): global-query counts over layers x heads in a window of steps;
* ``query_similarity.png`` (Fig. 4): the pre-RoPE cosine-similarity matrix of one head's queries over
  the window, and a 2-D PCA of its low-similarity queries with the global ones marked;
* ``beacons.png``: for that head, the positions of the beacons (or, between freezes, the
  observation set) the policy held at every step, with the global queries and their attention.

Plus ``global_queries.csv`` (one line per global query: the beacons held, their similarity to the
query, the policy's recall of it) and ``summary.txt``. Command line: ``beaconkv analyze``
(:func:`add_analyze_arguments`, :func:`run_analyze`) or ``python -m beaconkv.measure.analysis``. The
measurement itself (:class:`~beaconkv.measure.trace_analysis.TraceAnalysis`, the statistics) is
:mod:`beaconkv.measure.trace_analysis`; this module draws and writes it, and runs the command.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from ..arguments import WORKLOAD_BUDGETS, add_policy_arguments, policy_settings
from ..command import module_main
from ..policies.base import EvictionPolicy
from ..policies.registry import make_policy, policy_parameters
from .fidelity.cli import add_trace_arguments, load_model_and_traces
from .fidelity.errors import FidelityError
from .fidelity.metrics import GlobalQueryRule, LengthAwareRule
from .fidelity.traces import forced_tokens
from .trace_analysis import NEIGHBOUR_GAP, TraceAnalysis, analyze_trace, clustering_stats, distance_bin
from .trace_analysis import mixed_head, parse_window, similarity_stats

__all__ = ["TraceAnalysis", "add_analyze_arguments", "analyze_policy", "analyze_trace",
           "clustering_stats", "distance_bin", "mixed_head", "parse_window", "plot_attention_distance", "plot_beacons",
           "plot_global_heatmap", "plot_query_similarity", "run_analyze", "similarity_stats", "summary_text",
           "write_global_queries"]


# ------------------------------------------------------------------------------- figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attention_distance(a: TraceAnalysis, path: str | Path) -> Path:
    """Fig. 1b: histogram of per-query mean top-K distance, and the mean attention mass per distance bin."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    d, g = a.distance.flatten(), a.is_global.flatten()
    bins = torch.linspace(0, float(d.max()) + 1, 60).tolist()
    ax1.hist(d[~g].tolist(), bins=bins, color="tab:blue", alpha=0.7, label=f"local ({int((~g).sum())})")
    ax1.hist(d[g].tolist(), bins=bins, color="tab:red", alpha=0.7, label=f"global ({int(g.sum())})")
    ax1.axvline(a.rule.threshold, color="k", ls="--", lw=1)
    ax1.set_yscale("log")
    ax1.set_xlabel(f"mean distance to the top-{a.rule.top_k} attended keys (tokens)")
    ax1.set_ylabel("queries (step x layer x head)")
    ax1.legend()
    n = torch.stack([(~g).sum(), g.sum()]).clamp(min=1).float()
    per_query = a.mass_by_distance / n[:, None]
    edges = ["0"] + [f"{2 ** (k - 1)}" for k in range(1, per_query.shape[1])]
    x = torch.arange(per_query.shape[1])
    ax2.bar(x - 0.2, per_query[0].tolist(), 0.4, color="tab:blue", label="local")
    ax2.bar(x + 0.2, per_query[1].tolist(), 0.4, color="tab:red", label="global")
    ax2.set_xticks(x.tolist(), edges, rotation=45, fontsize=8)
    ax2.set_xlabel("distance t - position (log2 bins, lower edge)")
    ax2.set_ylabel("mean attention mass per query")
    ax2.legend()
    fig.suptitle(f"trace {a.trace}: attention distance of local vs global queries", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_global_heatmap(a: TraceAnalysis, path: str | Path, window: tuple[int, int]) -> Path:
    """Fig. 3: global-query counts over layers x query heads within the window of steps."""
    plt = _plt()
    counts = a.is_global[window[0] : window[1]].sum(0)  # (L, H)
    fig, ax = plt.subplots(figsize=(4 + 0.35 * counts.shape[1], 0.16 * counts.shape[0] + 2))
    im = ax.imshow(counts.numpy(), aspect="auto", cmap="viridis", origin="lower")
    fig.colorbar(im, ax=ax, label="global queries")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(f"global queries, steps {window[0]}–{window[1]} (positions "
                 f"{a.position(window[0])}–{a.position(window[1])})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_query_similarity(
    a: TraceAnalysis, path: str | Path, layer: int, head: int, window: tuple[int, int], quantile: float = 0.5
) -> Path:
    """Fig. 4: cosine-similarity matrix of one head's pre-RoPE queries over the window, and a 2-D PCA
    of the queries whose mean similarity to the others is below ``quantile``, global ones marked."""
    plt = _plt()
    s0, s1 = window
    q = torch.nn.functional.normalize(a.queries[layer, head, a.position(s0) : a.position(s1)], dim=-1)
    sim = q @ q.T
    g = a.is_global[s0:s1, layer, head]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    lo = float(torch.quantile(sim.flatten(), 0.01))  # contrast: similarities are mostly high
    im = ax1.imshow(sim.numpy(), cmap="magma", vmin=lo, vmax=1, extent=(s0, s1, s1, s0))
    fig.colorbar(im, ax=ax1, fraction=0.046)
    gs = (torch.nonzero(g)[:, 0] + s0).tolist()
    ax1.plot(gs, [s0] * len(gs), "v", color="tab:red", ms=4, clip_on=False, label="global query")
    ax1.set_xlabel("decode step")
    ax1.set_ylabel("decode step")
    ax1.set_title(f"pre-RoPE cosine similarity, layer {layer} head {head}", fontsize=10)
    ax1.legend(loc="lower left", fontsize=8)
    mean_sim = (sim.sum(1) - 1) / max(len(sim) - 1, 1)
    low = mean_sim <= torch.quantile(mean_sim, quantile)
    x = q[low] - q[low].mean(0)
    if x.shape[0] >= 3:
        _, _, v = torch.linalg.svd(x, full_matrices=False)
        xy = x @ v[:2].T
        gl = g[low]
        ax2.scatter(xy[~gl, 0].tolist(), xy[~gl, 1].tolist(), s=12, c="tab:blue", alpha=0.6, label="local")
        ax2.scatter(xy[gl, 0].tolist(), xy[gl, 1].tolist(), s=28, c="tab:red", marker="*", label="global")
        ax2.legend(fontsize=8)
    ax2.set_title(f"PCA of the {int(low.sum())} queries with mean similarity ≤ its {quantile:.0%} quantile",
                  fontsize=10)
    ax2.set_xlabel("PC 1")
    ax2.set_ylabel("PC 2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_beacons(a: TraceAnalysis, path: str | Path, layer: int, head: int) -> Path:
    """Positions of the beacons (or observation set) the policy held at each step for one head, the
    global queries of that head, and the keys they attended most."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 5))
    S = a.steps
    hp = a.held_query_pos[:, layer, head] if a.held_query_pos.shape[-1] else torch.full((S, 0), -1)
    steps = torch.arange(S)[:, None].expand_as(hp)
    ok = hp >= 0
    fr = a.frozen[:, None].expand_as(hp)
    ax.scatter(steps[ok & fr].tolist(), hp[ok & fr].tolist(), s=2, c="tab:green", label="frozen beacons")
    ax.scatter(steps[ok & ~fr].tolist(), hp[ok & ~fr].tolist(), s=2, c="0.6", label="observation set")
    gsteps = torch.nonzero(a.is_global[:, layer, head])[:, 0].tolist()
    for s in gsteps:
        keys = a.top_keys.get((s, layer, head), [])
        ax.scatter([s] * len(keys), keys, s=6, c="tab:orange", marker="_")
    ax.scatter(gsteps, [a.position(s) for s in gsteps], s=14, c="tab:red", marker="v", label="global query")
    ax.scatter([], [], s=12, c="tab:orange", marker="_", label="its 8 most attended keys")
    ax.axhline(a.prompt_len - 0.5, color="k", lw=0.8, ls=":")
    ax.set_xlabel("decode step")
    ax.set_ylabel("position")
    ax.set_title(f"{a.policy}: queries held, layer {layer} head {head}", fontsize=9)
    ax.legend(fontsize=8, markerscale=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_global_queries(a: TraceAnalysis, path: str | Path) -> Path:
    """One CSV line per global query: where it is, how far it looks, the beacons held, the policy's recall."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "position", "layer", "head", "mean_distance", "prompt_mass", "policy_recall",
                    "phase", "max_cos_to_held", "held_query_positions", "top_key_positions"])
        for s, layer, head in a.is_global.nonzero().tolist():
            held = a.held_query_pos[s, layer, head] if a.held_query_pos.shape[-1] else torch.empty(0)
            held = sorted(int(p) for p in held.tolist() if p >= 0)
            cos = float(a.beacon_cos[s, layer, head])
            w.writerow([
                s, a.position(s), layer, head, f"{float(a.distance[s, layer, head]):.1f}",
                f"{float(a.prompt_mass[s, layer, head]):.3f}", f"{float(a.recall[s, layer, head]):.4f}",
                "frozen" if bool(a.frozen[s]) else "accumulating", "" if math.isnan(cos) else f"{cos:.3f}",
                " ".join(map(str, held)), " ".join(map(str, a.top_keys.get((s, layer, head), []))),
            ])
    return path


def summary_text(a: TraceAnalysis, window: tuple[int, int], layer: int, head: int) -> str:
    """A short plain-text summary of the analysis."""
    g = a.is_global
    n, ng = g.numel(), int(g.sum())
    lines = [
        (f"trace {a.trace}: prompt {a.prompt_len} tokens, {a.steps} forced decode steps "
         f"(positions {a.prompt_len}–{a.position(a.steps - 1)})"),
        f"rule: global if the mean distance to the top-{a.rule.top_k} keys > {a.rule.threshold:g}",
        (f"global queries: {ng} of {n} ({100 * ng / n:.2f}%); steps with at least one: "
         f"{int(g.any(-1).any(-1).sum())} of {a.steps}"),
    ]
    if a.steps:
        by_layer = g.sum((0, 2)).float() / max(ng, 1)
        top = by_layer.topk(min(5, len(by_layer)))
        lines.append("layers holding most global queries: " + ", ".join(
            f"{int(i)} ({100 * float(v):.0f}%)" for v, i in zip(top.values, top.indices)))
        lines.append(f"(layer, head) pairs with a global query: {int(g.any(0).sum())} of {g[0].numel()}")

    def mean(x: Tensor, m: Tensor) -> str:
        x = x[m & ~torch.isnan(x)]
        return f"{float(x.mean()):.3f}" if x.numel() else "–"

    lines += [
        f"mean top-K distance: local {mean(a.distance, ~g)}, global {mean(a.distance, g)}",
        f"attention mass on the prompt: local {mean(a.prompt_mass, ~g)}, global {mean(a.prompt_mass, g)}",
        f"{a.policy}",
        (f"  recall (held share of the reference attention mass): local {mean(a.recall, ~g)}, "
         f"global {mean(a.recall, g)}"),
    ]
    if a.held_query_pos.shape[-1]:
        lines.append(f"  global queries arriving with frozen beacons: {int((g.any(-1).any(-1) & a.frozen).sum())} "
                     f"of {int(g.any(-1).any(-1).sum())} steps with a global query")
        lines.append(f"  max pre-RoPE cosine similarity to the held beacons / observation set: "
                     f"local {mean(a.beacon_cos, ~g)}, global {mean(a.beacon_cos, g)}")
    la = a.is_global_la
    n_la = int(la.sum())
    lines += [
        f"length-aware rule: {n_la} of {n} global ({100 * n_la / n:.2f}%); recall local {mean(a.recall, ~la)}, "
        f"global {mean(a.recall, la)}; max cosine to the held beacons: local {mean(a.beacon_cos, ~la)}, "
        f"global {mean(a.beacon_cos, la)}",
    ]
    for name, classes in (("paper rule", a.is_global), ("length-aware rule", la)):
        c = clustering_stats(a, window, classes)
        lines.append(
            f"clustering, {name}, steps {window[0]}–{window[1]}, {int(c['heads'])} heads with both classes "
            f"({100 * c['global_share']:.1f}% global): pre-RoPE cosine global-global {c['global-global']:.3f}, "
            f"global-local {c['global-local']:.3f}, local-local {c['local-local']:.3f}; nearest neighbour of a "
            f"global query ({NEIGHBOUR_GAP}+ steps away) is global {c['purity']:.3f} vs {c['base']:.3f} at random "
            f"(lift {c['lift']:.2f})"
        )
    sims = similarity_stats(a, layer, head, window)
    n_g = int(a.is_global[window[0] : window[1], layer, head].sum())
    lines.append(f"window steps {window[0]}–{window[1]}, layer {layer} head {head} ({n_g} global of "
                 f"{window[1] - window[0]}): mean pre-RoPE cosine "
                 + ", ".join(f"{k} {v:.3f}" for k, v in sims.items()))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- CLI
def add_analyze_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``beaconkv analyze`` options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = "Global vs local queries on one reasoning trace, and the beacons BeaconKV held (PNG + text)."
    add_trace_arguments(parser, num_traces=1, tokens=768)
    p = parser.add_argument_group("policy run alongside")
    add_policy_arguments(p)
    p.add_argument("--n-beacon", type=int, default=None, help="beacons (default = n_recent)")
    v = parser.add_argument_group("figures")
    v.add_argument("--window", default=None,
                   help="decode steps START:END for the heatmap and similarity (default: the last 256)")
    v.add_argument("--layer", type=int, default=None,
                   help="layer of the similarity/beacon plots (default: the head with most of both classes)")
    v.add_argument("--head", type=int, default=None, help="query head of those plots (default: as --layer)")
    v.add_argument("--low-sim-quantile", type=float, default=0.5,
                   help="PCA keeps queries whose mean similarity is at most this quantile (default 0.5)")
    v.add_argument("--out", type=Path, default=Path("results/analysis"),
                   help="output directory (default results/analysis)")
    return parser


def analyze_policy(args: argparse.Namespace) -> EvictionPolicy:
    """The policy ``analyze`` runs alongside: the shared policy options (budget default
    ``WORKLOAD_BUDGETS["analyze"]``), with as many beacons as recent tokens unless ``--n-beacon`` says.

    Raises:
        beaconkv.policies.PolicyConfigError: Bad policy options or settings the policy rejects.
    """
    settings = policy_settings(args, WORKLOAD_BUDGETS["analyze"])
    kwargs = dict(settings.kwargs)
    if settings.budget is not None and "n_beacon" in policy_parameters(settings.name) and "n_beacon" not in kwargs:
        kwargs["n_beacon"] = kwargs.get("n_recent", settings.build().n_recent)  # "auto" resolved by the policy
    return make_policy(settings.name, settings.budget, **kwargs)


def run_analyze(args: argparse.Namespace) -> int:
    """Runs ``beaconkv analyze`` from parsed arguments; writes PNGs, a CSV and ``summary.txt``.

    Returns:
        0 on success.

    Raises:
        FidelityError: Bad settings (policy and ranges checked before the model loads where possible).
    """
    t0 = time.perf_counter()
    rule = GlobalQueryRule(args.attention_top_k, args.global_threshold)
    if not 0 < args.low_sim_quantile <= 1:
        raise FidelityError(f"--low-sim-quantile={args.low_sim_quantile} must lie in (0, 1].")
    policy = analyze_policy(args)
    window = parse_window(args.window, args.tokens)
    model, _, traces = load_model_and_traces(args)
    trace = traces[0]
    forced_tokens([trace], args.tokens)
    cfg = model.config
    limits = (("--layer", args.layer, cfg.num_hidden_layers), ("--head", args.head, cfg.num_attention_heads))
    for name, val, hi in limits:
        if val is not None and not 0 <= val < hi:
            raise FidelityError(f"{name}={val} is out of range; the model has {hi} (0 .. {hi - 1}).")
    sparse_rule = LengthAwareRule(args.attention_top_k, args.la_fraction, args.la_recent, args.la_mass)
    a = analyze_trace(model, trace, args.tokens, rule, policy, progress=not args.no_progress, sparse_rule=sparse_rule)
    layer, head = mixed_head(a, window)
    layer = args.layer if args.layer is not None else layer
    head = args.head if args.head is not None else head
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [
        plot_attention_distance(a, out / "attention_distance.png"),
        plot_global_heatmap(a, out / "global_heatmap.png", window),
        plot_query_similarity(a, out / "query_similarity.png", layer, head, window, args.low_sim_quantile),
        plot_beacons(a, out / "beacons.png", layer, head),
        write_global_queries(a, out / "global_queries.csv"),
    ]
    text = summary_text(a, window, layer, head)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    print(f"wrote {', '.join(f.name for f in files)}, summary.txt in {out} ({time.perf_counter() - t0:.0f}s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(module_main("analyze", add_analyze_arguments, run_analyze))
