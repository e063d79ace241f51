"""The fidelity study: every policy x budget against FullKV, in lock-step on the same forced tokens.

At every decode step we compare, per run: the next-token distributions (``KL(full ‖ policy)`` and
top-1 agreement) and the attention recall — the share of the *reference* query's attention mass that
falls on positions the compressed cache still holds — for global and local queries (see
:mod:`.metrics`), pooled over steps, layers, heads and traces.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...models.decoder import CausalLM
from ...policies.base import EvictionPolicy
from ...policies.config import PolicyConfigError
from ...policies.registry import auto_n_recent, make_policy, policy_parameters
from ...policies.query_selection import KMeans
from .errors import FidelityError
from .lockstep import LockStep, StepOutput
from .metrics import GlobalQueryRule, LengthAwareRule, held_attention_masses, kl_divergence, prompt_mass
from .traces import Trace, forced_tokens


@dataclass(frozen=True)
class Run:
    """One compressed run of a study: a label (the registry name) and the policy.

    Attributes:
        name: Registry name, used as the label of its rows.
        policy: The policy (its settings give the rows' budget, ``n_recent``, ``n_beacon``).
    """

    name: str
    policy: EvictionPolicy


def beacon_count(n_beacon: int | str | None, n_recent: int) -> int:
    """Resolves a study's ``n_beacon`` setting for one budget's ``n_recent``.

    Args:
        n_beacon: A count; ``"<k>x"`` for ``k * n_recent``; or None for ``n_recent``.
        n_recent: The budget's recent tokens.

    Raises:
        FidelityError: A string that is not ``"<k>x"`` with an integer ``k >= 0``.
    """
    if n_beacon is None:
        return n_recent
    if isinstance(n_beacon, str):
        head = n_beacon.strip().lower().removesuffix("x")
        if not n_beacon.strip().lower().endswith("x") or not head.isdigit():
            raise FidelityError(f"n_beacon={n_beacon!r}: use a count (16) or a multiple of n_recent ('8x').")
        return int(head) * n_recent
    return n_beacon


def study_runs(
    policies: Iterable[str],
    budgets: Iterable[int],
    n_recent: int | None = None,
    n_beacon: int | str | None = None,
    n_prefix: int | None = None,
    extra: dict[str, dict[str, Any]] | None = None,
) -> list[Run]:
    """The policy x budget grid of a study, built (and so validated) through the policy registry.

    Args:
        policies: Registry names (``full`` is the reference and is skipped).
        budgets: Budgets (``B_max``).
        n_recent: Recent tokens kept; None = :func:`auto_n_recent` per budget.
        n_beacon: Beacons of BeaconKV-like policies: a count, ``"<k>x"`` for ``k * n_recent`` at each
            budget (e.g. ``"8x"``), or None = ``n_recent`` (the paper's 16/16 split).
        n_prefix: Protected prefix; None = the whole prompt (SPEC default).
        extra: Per-policy extra constructor arguments.

    Returns:
        One run per (policy, budget), in the given order.

    Raises:
        FidelityError: A budget < 1, an unknown policy, or settings the policy rejects.
    """
    out = []
    for name in policies:
        if name in ("full", "fullkv"):
            continue
        for budget in budgets:
            if budget < 1:
                raise FidelityError(f"budget={budget} must be >= 1.")
            nr = auto_n_recent(budget) if n_recent is None else n_recent
            kw: dict[str, Any] = {"n_recent": nr}
            if n_prefix is not None:
                kw["n_prefix"] = n_prefix
            try:
                if "n_beacon" in policy_parameters(name):
                    kw["n_beacon"] = beacon_count(n_beacon, nr)
                kw.update((extra or {}).get(name, {}))
                out.append(Run(name, make_policy(name, budget, **kw)))  # validated now, not after an hour
            except PolicyConfigError as err:
                raise FidelityError(f"{name} at budget {budget} with {kw}: {err}") from err
    return out


def ablation_runs(budget: int = 256) -> list[Run]:
    """The paper's ablations as runs of one study, at one budget (256: valid for every split).

    (n_beacon, n_recent) = (16, 16) [the default], (1, 31), (28, 4), (0, 32) ≈ RPC-like; ``max`` vs
    ``mean`` aggregation; Continual FPS vs Naive FPS vs K-Means over the whole history (paper Fig. 7;
    the rows' ``query_memory`` column gives what each holds).
    """
    specs = [
        ("beacon", {}),
        ("beacon(1,31)", {"n_beacon": 1, "n_recent": 31}),
        ("beacon(28,4)", {"n_beacon": 28, "n_recent": 4}),
        ("beacon(0,32)", {"n_beacon": 0, "n_recent": 32}),
        ("beacon[mean]", {"aggregation": "mean"}),
        ("beacon[naive_fps]", {"query_memory": "history"}),
        ("beacon[kmeans]", {"sampler": KMeans(n_iter=10), "query_memory": "history"}),
    ]
    runs = []
    for label, kw in specs:
        settings = {"n_beacon": 16, "n_recent": 16, **kw}
        try:
            runs.append(Run(label, make_policy("beacon", budget, **settings)))
        except PolicyConfigError as err:
            raise FidelityError(f"ablation {label} at budget {budget}: {err}") from err
    return runs


@dataclass
class FidelityRow:
    """The measured figures of one policy at one budget, over one trace or all of them.

    Attributes:
        policy: The run's label (its registry name, or a variant's label).
        budget: ``B_max``.
        n_recent: Recent tokens kept.
        n_beacon: Beacons (BeaconKV-like policies), else None.
        trace: Trace name, or ``"all"``.
        steps: Decode steps compared (per trace, summed over traces for ``"all"``).
        kl: Mean ``KL(full ‖ policy)`` of the next-token distribution (nats).
        top1: Share of steps whose argmax equals FullKV's.
        recall: Mean attention recall over all queries.
        recall_global: Mean recall over the paper rule's global queries (NaN if none).
        recall_local: Mean recall over its local queries.
        n_global: The paper rule's global queries (steps x layers x query heads).
        n_queries: All queries.
        evictions: Evictions per trace (mean for ``"all"``).
        recall_global_la: Mean recall over the length-aware rule's global queries (NaN if none).
        recall_local_la: Mean recall over its local queries.
        n_global_la: The length-aware rule's global queries.
        prompt_mass: Mean share of the reference queries' attention on the protected prompt.
        prompt_mass_global: The same over the paper rule's global queries.
        query_memory: Mean pre-RoPE query vectors held per head (BeaconKV-like policies; NaN otherwise).
        query_memory_max: The most held at any step.
    """

    policy: str
    budget: int | None
    n_recent: int
    n_beacon: int | None
    trace: str
    steps: int
    kl: float
    top1: float
    recall: float
    recall_global: float
    recall_local: float
    n_global: int
    n_queries: int
    evictions: float
    recall_global_la: float = float("nan")
    recall_local_la: float = float("nan")
    n_global_la: int = 0
    prompt_mass: float = float("nan")
    prompt_mass_global: float = float("nan")
    query_memory: float = float("nan")
    query_memory_max: float = float("nan")


_SUMS = ("kl", "top1", "mass", "mass_global", "n_global", "n_queries", "mass_global_la", "n_global_la",
         "prompt_mass", "prompt_mass_global", "memory", "memory_max")


@dataclass
class _Tally:
    """Per-trace running sums of one run's metrics (float64)."""

    batch: int
    sums: dict[str, Tensor] = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        self.sums = {name: torch.zeros(self.batch, dtype=torch.float64) for name in _SUMS}

    def add(self, kl: Tensor, agree: Tensor, mass: Tensor, classes: StepClasses, memory: list[int] | None) -> None:
        """Adds one step: ``kl``/``agree`` ``(batch,)``; ``mass`` and the classes ``(layers, batch, kv, group)``."""
        dims = (0, 2, 3)
        m = mass.double()
        s = self.sums
        s["kl"] += kl.double()
        s["top1"] += agree.double()
        s["mass"] += m.sum(dims)
        s["mass_global"] += (m * classes.paper).sum(dims)
        s["n_global"] += classes.paper.double().sum(dims)
        s["mass_global_la"] += (m * classes.length_aware).sum(dims)
        s["n_global_la"] += classes.length_aware.double().sum(dims)
        s["n_queries"] += mass.numel() // self.batch  # layers x query heads per trace
        s["prompt_mass"] += classes.prompt_mass.double().sum(dims)
        s["prompt_mass_global"] += (classes.prompt_mass.double() * classes.paper).sum(dims)
        if memory is not None:
            held = torch.tensor(memory[: self.batch], dtype=torch.float64)
            s["memory"] += held
            s["memory_max"] = torch.maximum(s["memory_max"], held)
        else:
            s["memory"].fill_(float("nan"))
        self.steps += 1

    def row(self, run: Run, trace: str, b: slice, evictions: float) -> FidelityRow:
        """Summarises traces ``b`` into a :class:`FidelityRow`."""
        n_traces = len(range(*b.indices(self.batch)))
        n_steps = self.steps * n_traces
        v = {k: float(t[b].sum()) for k, t in self.sums.items()}
        n_g, n_q, n_la = v["n_global"], v["n_queries"], v["n_global_la"]

        def share(num: float, den: float) -> float:
            return num / den if den else float("nan")

        return FidelityRow(
            policy=run.name, budget=run.policy.budget, n_recent=run.policy.n_recent,
            n_beacon=getattr(run.policy, "n_beacon", None), trace=trace, steps=n_steps,
            kl=v["kl"] / max(n_steps, 1), top1=v["top1"] / max(n_steps, 1), recall=v["mass"] / max(n_q, 1),
            recall_global=share(v["mass_global"], n_g), recall_local=share(v["mass"] - v["mass_global"], n_q - n_g),
            n_global=int(n_g), n_queries=int(n_q), evictions=evictions,
            recall_global_la=share(v["mass_global_la"], n_la),
            recall_local_la=share(v["mass"] - v["mass_global_la"], n_q - n_la), n_global_la=int(n_la),
            prompt_mass=share(v["prompt_mass"], n_q), prompt_mass_global=share(v["prompt_mass_global"], n_g),
            query_memory=share(v["memory"], n_steps),
            query_memory_max=float(self.sums["memory_max"][b].max()) if v["memory"] == v["memory"] else float("nan"),
        )


@dataclass
class StepClasses:
    """The reference queries of one step, classified (every tensor ``(layers, batch, kv, group)``).

    Attributes:
        paper: Global under the paper's rule.
        length_aware: Global under the length-aware rule.
        prompt_mass: Share of each query's attention on the protected prompt.
    """

    paper: Tensor
    length_aware: Tensor
    prompt_mass: Tensor


def classify(out: StepOutput, rule: GlobalQueryRule, sparse_rule: LengthAwareRule, prompt_len: Tensor) -> StepClasses:
    """Classifies the reference queries of one lock-step step under both rules."""
    B = out.query_pos.shape[0]
    qpos, plen = out.query_pos.view(1, B, 1), prompt_len.view(1, B, 1)
    dist = rule.distance(out.weights, out.key_pos, qpos)
    shared = dist if sparse_rule.top_k == rule.top_k else None  # one top-K for both rules
    return StepClasses(
        rule.is_global(out.weights, out.key_pos, qpos, distance=dist),
        sparse_rule.is_global(out.weights, out.key_pos, qpos, plen, distance=shared),
        prompt_mass(out.weights, out.key_pos, plen),
    )


def measure_fidelity(
    model: CausalLM,
    traces: Sequence[Trace],
    runs: Sequence[Run],
    n_tokens: int,
    rule: GlobalQueryRule | None = None,
    stack: bool = True,
    progress: bool = True,
    kv_storage: str = "dense",
    sparse_rule: LengthAwareRule | None = None,
    packed: bool = True,
    backend: str = "native",
) -> list[FidelityRow]:
    """Runs the lock-step study and returns one row per (policy, budget) x (each trace, ``"all"``).

    Args:
        model: The model.
        traces: Token streams (batched together; each forces its first ``n_tokens`` output tokens).
        runs: Compressed runs (see :func:`study_runs`).
        n_tokens: Decode steps per trace.
        rule: The paper's global/local rule (default: SPEC §1, K = 150, threshold 200).
        stack: Batch the dense layers of all runs (see :class:`LockStep`).
        progress: Show a tqdm progress bar.
        kv_storage: Storage of the compressed runs' caches (``"dense"`` or ``"int8"``).
        sparse_rule: The length-aware global/local rule (default :class:`LengthAwareRule`).
        packed: On a CPU, run the stacked dense layers with oneDNN-prepacked weights (see :class:`LockStep`).
        backend: ``"native"``: ``model`` is beaconkv's decoder (:class:`LockStep`); ``"hf"``: a transformers
            model, every run a :class:`~beaconkv.hf.PolicyCache`
            (:class:`~beaconkv.measure.fidelity.hf_lockstep.HFLockStep`; ``stack``, ``kv_storage`` and
            ``packed`` do not apply).

    Returns:
        The rows, ``"all"`` rows first in run order, then per-trace rows.

    Raises:
        FidelityError: No run, no trace, or a trace shorter than ``n_tokens``.
    """
    rule = rule or GlobalQueryRule()
    sparse_rule = sparse_rule or LengthAwareRule(top_k=rule.top_k)
    if not runs:
        raise FidelityError("no policy/budget to measure; pass --policies and --budgets.")
    if not traces:
        raise FidelityError("no trace to force; check --traces / --trace-ids / --num-traces.")
    tokens = forced_tokens(traces, n_tokens)
    if backend == "hf":
        from .hf_lockstep import HFLockStep

        lock = HFLockStep(model, [r.policy for r in runs], [t.prompt_ids for t in traces], n_tokens)
    else:
        lock = LockStep(model, [r.policy for r in runs], [t.prompt_ids for t in traces], n_tokens, stack=stack,
                        kv_storage=kv_storage, packed=packed)
    B = len(traces)
    prompt_len = torch.tensor([len(t.prompt_ids) for t in traces], device=lock.device)
    tallies = [_Tally(B) for _ in runs]
    n_positions = max(len(t.prompt_ids) for t in traces) + n_tokens  # every position is below this
    lock.prefill()
    bar = tqdm(range(n_tokens), desc=f"fidelity ({len(runs)} runs x {B} traces)", unit="tok", disable=not progress)
    for s in bar:
        out = lock.step(tokens[:, s])
        classes = classify(out, rule, sparse_rule, prompt_len)
        ref = out.logits[0]
        ref_top = ref.argmax(-1)
        masses = held_attention_masses(out.weights, out.key_pos, out.held_pos, n_positions)
        for r, (tally, session, mass) in enumerate(zip(tallies, lock.sessions[1:], masses), start=1):
            held = getattr(session.policy, "held_queries", None)
            tally.add(kl_divergence(ref, out.logits[r]), out.logits[r].argmax(-1) == ref_top, mass, classes,
                      held(session.state) if held is not None else None)
        if progress and s % 32 == 0:
            bar.set_postfix(global_share=f"{float(classes.paper.float().mean()):.3f}",
                            la_share=f"{float(classes.length_aware.float().mean()):.3f}")
    rows = []
    evictions = [s.state.stats.evictions for s in lock.sessions[1:]]
    for run, tally, ev in zip(runs, tallies, evictions):
        rows.append(tally.row(run, "all", slice(None), sum(ev) / len(ev)))
    for b, trace in enumerate(traces):
        for run, tally, ev in zip(runs, tallies, evictions):
            rows.append(tally.row(run, trace.name, slice(b, b + 1), float(ev[b])))
    return rows
