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
(:func:`add_analyze_arguments`, :func:`run_analyze`) or ``python -m beaconkv.measure.analysis``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..arguments import WORKLOAD_BUDGETS, add_policy_arguments, policy_settings
from ..command import module_main
from ..models.decoder import CausalLM
from ..policies.base import EvictionPolicy
from ..policies.registry import make_policy, policy_parameters
from ..policies.state import PolicyState
from .fidelity.cli import add_trace_arguments, load_model_and_traces
from .fidelity.errors import FidelityError
from .fidelity.lockstep import LockStep
from .fidelity.metrics import GlobalQueryRule, LengthAwareRule, held_attention_mass
from .fidelity.metrics import prompt_mass as on_prompt
from .fidelity.traces import Trace, forced_tokens


@dataclass
class TraceAnalysis:
    """Everything measured on one trace (``S`` steps, ``L`` layers, ``H`` query heads).

    Attributes:
        trace: Trace name.
        prompt_len: Prompt tokens.
        rule: The global/local rule used.
        policy: ``repr`` of the policy run alongside.
        distance: ``(S, L, H)`` mean distance of each query to its top-K keys.
        is_global: ``(S, L, H)`` bool, the paper's rule.
        is_global_la: ``(S, L, H)`` bool, the length-aware rule (:class:`~.fidelity.metrics.LengthAwareRule`).
        recall: ``(S, L, H)`` the policy's held share of each query's reference attention mass.
        prompt_mass: ``(S, L, H)`` share of each query's attention mass on prompt positions.
        beacon_cos: ``(S, L, H)`` max cosine similarity of each pre-RoPE query to the beacons (or
            observation set) the policy held when it arrived; NaN when the policy holds none.
        mass_by_distance: ``(2, n_bins)`` summed attention mass per distance bin, local (0) and global (1).
        queries: ``(L, H, P, head_dim)`` pre-RoPE reference queries of positions ``0 .. P-1``.
        held_query_pos: ``(S, L, H, n)`` positions of the beacons / observation queries held at
            each step (``-1`` empty).
        frozen: ``(S,)`` whether the policy's beacons were frozen (else: accumulating) at each step.
        top_keys: Per global query ``(step, layer, head)``: positions of its 8 most attended keys.
    """

    trace: str
    prompt_len: int
    rule: GlobalQueryRule
    policy: str
    distance: Tensor
    is_global: Tensor
    is_global_la: Tensor
    recall: Tensor
    prompt_mass: Tensor
    beacon_cos: Tensor
    mass_by_distance: Tensor
    queries: Tensor
    held_query_pos: Tensor
    frozen: Tensor
    top_keys: dict[tuple[int, int, int], list[int]] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Decode steps analysed."""
        return self.distance.shape[0]

    def position(self, step: int) -> int:
        """Absolute position of the query decoded at ``step``."""
        return self.prompt_len + step


def distance_bin(distance: Tensor) -> Tensor:
    """Log2 distance bins: 0 for distance 0, ``k`` for ``2**(k-1) <= d < 2**k``."""
    d = distance.clamp(min=0).float()
    return torch.where(d > 0, torch.floor(torch.log2(d.clamp(min=1))).long() + 1, 0)


def _held_queries(state: PolicyState) -> tuple[Tensor, Tensor, bool] | None:
    """The pre-RoPE queries a BeaconKV-like policy would score a global query with now, for sequence 0:
    ``(q (L, H, n, D), pos (L, H, n), frozen)`` — the frozen beacons, else the observation set."""
    if getattr(state, "beacons", None) is None or getattr(state, "obs", None) is None:
        return None
    frozen = state.phase[0] in ("frozen", "static")
    sets = state.beacons if frozen else state.obs  # stacked over layers
    return sets.q[:, 0], torch.where(sets.valid[:, 0], sets.pos[:, 0], -1), frozen


def analyze_trace(
    model: CausalLM,
    trace: Trace,
    n_tokens: int,
    rule: GlobalQueryRule | None = None,
    policy: EvictionPolicy | None = None,
    progress: bool = True,
    sparse_rule: LengthAwareRule | None = None,
) -> TraceAnalysis:
    """Teacher-forces one trace with FullKV and one policy in lock-step and records every query.

    Args:
        model: The model.
        trace: The trace.
        n_tokens: Decode steps.
        rule: Global/local classification (default: SPEC §1, K = 150, threshold 200).
        policy: The policy run alongside (default: BeaconKV at budget 128).
        progress: Show a tqdm progress bar.
        sparse_rule: The length-aware global/local rule (default :class:`LengthAwareRule` with the
            paper rule's K).

    Returns:
        The measurements (see :class:`TraceAnalysis`).
    """
    from tqdm.auto import tqdm

    rule = rule or GlobalQueryRule()
    sparse_rule = sparse_rule or LengthAwareRule(top_k=rule.top_k)
    shared_k = sparse_rule.top_k == rule.top_k  # one top-K serves both rules
    prompt_len = torch.tensor(len(trace.prompt_ids)).view(1, 1)
    pol = policy or make_policy("beacon", 128, n_beacon=16, n_recent=16)
    tokens = forced_tokens([trace], n_tokens)
    P = len(trace.prompt_ids) + n_tokens
    run = LockStep(model, [pol], [trace.prompt_ids], n_tokens, reference_query_window=P)
    state = run.sessions[1].state
    cfg = model.config
    Lyr, H = cfg.num_hidden_layers, cfg.num_attention_heads
    n_bins = int(math.log2(P)) + 2
    distance = torch.zeros(n_tokens, Lyr, H)
    is_global = torch.zeros(n_tokens, Lyr, H, dtype=torch.bool)
    is_global_la = torch.zeros(n_tokens, Lyr, H, dtype=torch.bool)
    recall = torch.zeros(n_tokens, Lyr, H)
    prompt_mass = torch.zeros(n_tokens, Lyr, H)
    beacon_cos = torch.full((n_tokens, Lyr, H), float("nan"))
    mass_by_distance = torch.zeros(2 * n_bins, dtype=torch.float64)
    held_pos: list[Tensor] = []
    frozen = torch.zeros(n_tokens, dtype=torch.bool)
    top_keys: dict[tuple[int, int, int], list[int]] = {}
    ref = [o.ring_buffer for o in run.reference.state.observers]  # the reference's rings hold every query
    run.prefill()
    for s in tqdm(range(n_tokens), desc=f"analyze {trace.name}", unit="tok", disable=not progress):
        held = _held_queries(state)
        if held is not None:
            hq, hp, frozen[s] = held[0].clone(), held[1].clone(), held[2]  # (L, H, n, D), (L, H, n)
            held_pos.append(hp)
        out = run.step(tokens[:, s])
        w, kp = out.weights[:, 0], out.key_pos[:, 0]  # (L, kv, G, C), (L, kv, C)
        t = int(out.query_pos[0])
        dist = rule.distance(w, kp, out.query_pos.view(1, 1)).reshape(Lyr, H)
        glob = dist > rule.threshold
        distance[s], is_global[s] = dist, glob
        is_global_la[s] = sparse_rule.is_global(w, kp, out.query_pos.view(1, 1), prompt_len,
                                                distance=dist.view(w.shape[:-1]) if shared_k else None).reshape(Lyr, H)
        recall[s] = held_attention_mass(w, kp, out.held_pos[0][:, 0]).reshape(Lyr, H)
        prompt_mass[s] = on_prompt(w, kp, prompt_len).reshape(Lyr, H)
        # attention mass per distance bin, split by the query's class
        bins = distance_bin(t - kp).unsqueeze(-2).expand_as(w)  # (L, kv, G, C)
        cls = glob.view(*w.shape[:-1], 1).expand_as(w).long()
        valid = (kp >= 0).unsqueeze(-2).expand_as(w)
        mass_by_distance.scatter_add_(0, (cls * n_bins + bins)[valid], w[valid].double())
        q_now = torch.stack([ring.queries[0, :, t] for ring in ref])  # (L, H, D) pre-RoPE
        if held is not None:
            cos = torch.nn.functional.cosine_similarity(q_now.unsqueeze(2), hq.float(), dim=-1)  # (L, H, n)
            cos = cos.masked_fill(hp < 0, -float("inf")).amax(-1)
            beacon_cos[s] = torch.where(torch.isinf(cos), float("nan"), cos)
        if bool(glob.any()):
            top = w.reshape(Lyr, H, -1).topk(min(8, w.shape[-1]), dim=-1).indices  # (L, H, 8)
            kp_h = kp.repeat_interleave(w.shape[2], dim=1)  # (L, H, C)
            for layer, head in glob.nonzero().tolist():
                top_keys[(s, layer, head)] = sorted(kp_h[layer, head, top[layer, head]].tolist())
    queries = torch.stack([ring.queries[0, :, :P] for ring in ref]).float()  # (L, H, P, D)
    return TraceAnalysis(
        trace=trace.name, prompt_len=len(trace.prompt_ids), rule=rule, policy=repr(pol), distance=distance,
        is_global=is_global, is_global_la=is_global_la, recall=recall, prompt_mass=prompt_mass, beacon_cos=beacon_cos,
        mass_by_distance=mass_by_distance.view(2, n_bins).float(), queries=queries,
        held_query_pos=torch.stack(held_pos) if held_pos else torch.full((n_tokens, Lyr, H, 0), -1),
        frozen=frozen, top_keys=top_keys,
    )


# ---------------------------------------------------------------------------- selections
def parse_window(text: str | None, steps: int) -> tuple[int, int]:
    """``"START:END"`` (steps, END exclusive, either may be empty) -> a clipped ``(start, end)``.

    Default (None): the last 256 steps.

    Raises:
        FidelityError: Malformed or empty window.
    """
    if text is None:
        return max(0, steps - 256), steps
    try:
        a, b = text.split(":")
        start, end = int(a) if a else 0, int(b) if b else steps
    except ValueError as err:
        raise FidelityError(f"--window={text!r} must look like START:END (decode steps), e.g. 256:512.") from err
    start, end = max(0, start), min(steps, end)
    if end - start < 2:
        raise FidelityError(f"--window={text!r} leaves {max(end - start, 0)} steps of {steps}; widen it.")
    return start, end


def mixed_head(a: TraceAnalysis, window: tuple[int, int]) -> tuple[int, int]:
    """The (layer, head) whose window holds the most of its rarer class, ``min(#global, #local)``, so
    that its similarity plot compares both (ties: the lowest index)."""
    g = a.is_global[window[0] : window[1]]
    n_global = g.sum(0)  # (L, H)
    score = torch.minimum(n_global, g.shape[0] - n_global)
    flat = int(score.flatten().argmax())
    return divmod(flat, score.shape[1])


def similarity_stats(a: TraceAnalysis, layer: int, head: int, window: tuple[int, int]) -> dict[str, float]:
    """Mean pre-RoPE cosine similarity within the window: global-global, global-local, local-local."""
    s0, s1 = window
    q = a.queries[layer, head, a.position(s0) : a.position(s1)]
    q = torch.nn.functional.normalize(q, dim=-1)
    sim = q @ q.T
    g = a.is_global[s0:s1, layer, head]
    off = ~torch.eye(len(g), dtype=torch.bool)

    def mean(mask: Tensor) -> float:
        m = mask & off
        return float(sim[m].mean()) if bool(m.any()) else float("nan")

    return {"global-global": mean(g[:, None] & g[None]), "global-local": mean(g[:, None] & ~g[None]),
            "local-local": mean(~g[:, None] & ~g[None])}


#: Default smallest step distance of a nearest neighbour in :func:`clustering_stats`.
NEIGHBOUR_GAP = 16


def clustering_stats(
    a: TraceAnalysis, window: tuple[int, int], is_global: Tensor | None = None, min_gap: int = NEIGHBOUR_GAP
) -> dict[str, float]:
    """Do global queries cluster in pre-RoPE space? Measured over every (layer, head) in a window.

    For each head, the pre-RoPE queries of the window's steps are compared by cosine similarity. Two
    measures, pooled over the heads that hold both classes:

    * mean similarity global–global, global–local and local–local (pairs weighted equally);
    * nearest-neighbour purity: the share of global queries whose most similar query in the window,
      at least ``min_gap`` steps away, is global too (the gap keeps a query's immediate neighbours —
      similar because adjacent, and often of the same class because classes come in runs — from
      counting as a cluster), against ``base``, the share a neighbour drawn at random from the same
      eligible queries would give. ``lift = purity / base``: 1 means no clustering; the paper's
      premise (global queries resemble each other and differ from local ones) predicts well above 1.

    Args:
        a: The analysis.
        window: ``(start, end)`` decode steps.
        is_global: ``(S, L, H)`` the classes to test (default: the paper rule's, ``a.is_global``).
        min_gap: Smallest step distance of a neighbour (>= 1; the similarity means use every pair).

    Returns:
        ``global-global``, ``global-local``, ``local-local``, ``purity``, ``base``, ``lift``, ``heads``
        (heads with both classes) and ``global_share`` (of the window's queries).
    """
    if min_gap < 1:
        raise FidelityError(f"min_gap={min_gap} must be >= 1 (1 = any other query).")
    g_all = (a.is_global if is_global is None else is_global)[window[0] : window[1]]  # (W, L, H)
    sums = dict.fromkeys(("gg", "gl", "ll", "n_gg", "n_gl", "n_ll", "hits", "base", "n_g"), 0.0)
    heads = 0
    W, n_layers, n_heads = g_all.shape
    steps = torch.arange(W)
    near = (steps[:, None] - steps[None]).abs() < min_gap  # (W, W) too close to be a neighbour
    eligible = (~near).float()
    for layer in range(n_layers):
        q = a.queries[layer, :, a.position(window[0]) : a.position(window[1])]  # (H, W, D)
        unit = torch.nn.functional.normalize(q.float(), dim=-1)
        sim = unit @ unit.mT
        sim.diagonal(dim1=-2, dim2=-1).fill_(float("nan"))  # a query is not its own neighbour
        for head in range(n_heads):
            g = g_all[:, layer, head]
            n_g = int(g.sum())
            if n_g < 2 or n_g == W:
                continue
            heads += 1
            m = sim[head]
            pairs = {"gg": g[:, None] & g[None], "gl": g[:, None] & ~g[None], "ll": ~g[:, None] & ~g[None]}
            for key, mask in pairs.items():
                vals = m[mask]
                vals = vals[~torch.isnan(vals)]
                sums[key] += float(vals.sum())
                sums["n_" + key] += vals.numel()
            rows = g & (eligible.sum(-1) > 0)
            nearest = m[rows].masked_fill(near[rows], float("nan")).nan_to_num(-2.0).argmax(-1)
            sums["hits"] += float(g[nearest].sum())
            # chance: the global share among each such query's eligible neighbours
            sums["base"] += float(((eligible[rows] @ g.float()) / eligible[rows].sum(-1)).sum())
            sums["n_g"] += int(rows.sum())

    def ratio(num: float, den: float) -> float:
        return num / den if den else float("nan")

    purity, base = ratio(sums["hits"], sums["n_g"]), ratio(sums["base"], sums["n_g"])
    return {
        "global-global": ratio(sums["gg"], sums["n_gg"]), "global-local": ratio(sums["gl"], sums["n_gl"]),
        "local-local": ratio(sums["ll"], sums["n_ll"]), "purity": purity, "base": base,
        "lift": ratio(purity, base), "heads": float(heads), "global_share": float(g_all.float().mean()),
    }


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
