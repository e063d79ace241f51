"""One reasoning trace measured: every query of every step classified global or local, with its attention
distance, its pre-RoPE geometry and what the policy held when it arrived (:func:`analyze_trace`), and the
statistics read off it (:func:`similarity_stats`, :func:`clustering_stats`).

:mod:`beaconkv.measure.analysis` draws the figures from a :class:`TraceAnalysis` and runs ``beaconkv analyze``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..models.decoder import CausalLM
from ..policies.base import EvictionPolicy
from ..policies.registry import make_policy
from ..policies.state import PolicyState
from .fidelity.errors import FidelityError
from .fidelity.lockstep import LockStep
from .fidelity.metrics import GlobalQueryRule, LengthAwareRule, held_attention_mass
from .fidelity.metrics import prompt_mass as on_prompt
from .fidelity.traces import Trace, forced_tokens

__all__ = ["NEIGHBOUR_GAP", "TraceAnalysis", "analyze_trace", "clustering_stats", "distance_bin", "mixed_head",
           "parse_window", "similarity_stats"]


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


NEIGHBOUR_GAP = 16
"""Default smallest step distance of a nearest neighbour in :func:`clustering_stats`."""


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
