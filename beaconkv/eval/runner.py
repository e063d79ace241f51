"""The evaluation loop: problems x samples -> generations -> grades -> results JSONL, resumable and sharded.

Work is cut into *units*: the samples of one problem in chunks of ``batch_size`` (sample indices
``[0, b)``, ``[b, 2b)``, ...). Unit ``u`` (in dataset order) belongs to rank ``u % world_size``.
A unit is one ``generate`` call on ``batch_size`` copies of the prompt, seeded with
``derive_seed("sample", seed, problem_id, first_sample_idx)``. Neither the unit boundaries nor the
seeds depend on the number of ranks, so a run split over N processes produces the same samples as
one process. With ``batch_size=1`` (the default) every sample has its own seed.

Each record (one JSON line) holds:

``benchmark, problem_id, sample_idx, policy, budget`` (the resume key), ``model, seed, answer,
reference, correct, grade_detail, finish_reason, prompt_tokens, new_tokens, peak_cache_tokens,
evictions, cache_capacity, seconds, batch_size, text`` and, with ``save_token_ids``, ``token_ids``;
plus ``settings`` (what must match for a resume). ``peak_cache_tokens``, ``evictions`` and
``seconds`` are those of the generate call, shared by the samples of a batch.

The model is loaded only if some sample is still missing, so re-running a finished command just
rebuilds the summary. The generate function is injectable (:class:`GenerationBackend`) so the loop
can be tested without a model.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from beaconkv.eval.datasets import Problem, get_benchmark, load_benchmark
from beaconkv.eval.distributed import (
    DistContext,
    barrier,
    init_distributed,
    shutdown_distributed,
)
from beaconkv.eval.grading import grade_response
from beaconkv.eval.prompts import build_prompt, render_chat
from beaconkv.eval.results import (
    load_done,
    merge_results,
    policy_label,
    rank_file,
    record_key,
    results_stem,
)
from beaconkv.eval.sandbox import SandboxLimits
from beaconkv.eval.seeds import derive_seed
from beaconkv.eval.summary import SummaryRow, write_summary

__all__ = [
    "EvalConfig",
    "EvalReport",
    "GenerationBackend",
    "WorkUnit",
    "load_backend",
    "make_policy_factory",
    "plan_units",
    "run_eval",
]


@dataclass
class EvalConfig:
    """Everything that defines an evaluation run.

    Attributes:
        model: Local checkpoint folder, hub model id, or ``"embedded"`` (the bundled SmolLM2-135M).
        benchmark: Benchmark name (see :data:`beaconkv.eval.datasets.BENCHMARKS`).
        data: Local data file; ``None`` downloads the benchmark's default hub file.
        hub_repo: Hub dataset repository overriding the benchmark's default.
        hub_file: File in the hub repository overriding the default.
        hub_revision: Branch, tag or commit of the hub repository.
        field_map: Column overrides, role -> column(s).
        limit: Evaluate only the first ``limit`` problems.
        policy: KV policy name (``full``, ``beacon``, ``snapkv``, ``rpc``, ``rkv``, ``h2o``,
            ``streaming``, ``initial_recent``).
        budget: KV budget (ignored and recorded as ``None`` for ``full``).
        policy_kwargs: Extra keyword arguments for ``make_policy``.
        tag: Label distinguishing variants of one policy in file names and tables.
        samples: Samples per problem; ``None`` uses the benchmark's default (AIME24 8, others 4).
        max_new_tokens: Generation limit per sample.
        temperature: Sampling temperature (paper: 0.6).
        top_p: Nucleus sampling threshold (paper: 0.95).
        top_k: Top-k (0: off).
        seed: Base seed of every per-sample seed and of the GPQA choice shuffle.
        batch_size: Samples of one problem generated together.
        out_dir: Results folder.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``,
            ``"float16"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (each rank uses ``cuda:<local rank>``).
        enable_thinking: Passed to the chat template when not ``None``.
        save_token_ids: Store the generated token ids in each record.
        code_timeout_s: Wall time limit per code test.
        code_memory_mb: Memory limit per code test.
        progress: Show progress bars.
        dist_timeout_min: Timeout of distributed collectives (the final barrier), in minutes.
    """

    model: str
    benchmark: str
    data: str | Path | None = None
    hub_repo: str | None = None
    hub_file: str | None = None
    hub_revision: str | None = None
    field_map: dict[str, str | list[str]] = field(default_factory=dict)
    limit: int | None = None
    policy: str = "beacon"
    budget: int | None = 1024
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    tag: str | None = None
    samples: int | None = None
    max_new_tokens: int = 32768
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0
    batch_size: int = 1
    out_dir: str | Path = "results"
    dtype: str = "auto"
    device: str = "auto"
    enable_thinking: bool | None = None
    save_token_ids: bool = False
    code_timeout_s: float = 6.0
    code_memory_mb: int = 1024
    progress: bool = True
    dist_timeout_min: float = 24 * 60

    def __post_init__(self) -> None:
        self.policy = self.policy.strip().lower()
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.is_full and (self.budget is None or self.budget < 1):
            raise ValueError(
                f"policy {self.policy!r} needs a budget >= 1, got {self.budget}; "
                f"pass --budget N (or --policy full for no eviction)"
            )

    @property
    def is_full(self) -> bool:
        """Whether the policy is FullKV (no eviction, no budget)."""
        return self.policy.lower() in ("full", "fullkv")

    @property
    def effective_budget(self) -> int | None:
        """The budget as recorded: ``None`` for FullKV."""
        return None if self.is_full else self.budget

    def settings(self) -> dict[str, Any]:
        """The settings that must match for a resume (stored in every record).

        Returns:
            A JSON-serialisable dict.
        """
        return {
            "model": self.model,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "policy_kwargs": json.loads(json.dumps(self.policy_kwargs, sort_keys=True)),
            "enable_thinking": self.enable_thinking,
        }


@dataclass
class GenerationBackend:
    """What the loop needs from a model: a tokenizer with a chat template and a generate function.

    Attributes:
        tokenizer: Has ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``.
        generate: ``generate(prompts, *, max_new_tokens, temperature, top_p, top_k, seed, policy)``
            returning an object with ``token_ids``, ``texts``, ``finish_reasons`` and ``stats``
            (``prompt_tokens``, ``new_tokens``, ``cache_capacity``, ``evictions``,
            ``peak_cache_tokens``, ``wall_time_s``), like :func:`beaconkv.generate`.
    """

    tokenizer: Any
    generate: Callable[..., Any]


@dataclass(frozen=True)
class WorkUnit:
    """One generate call: samples ``[start, stop)`` of one problem.

    Attributes:
        index: Position in the global unit list (decides the rank).
        problem: The problem.
        start: First sample index.
        stop: One past the last sample index.
    """

    index: int
    problem: Problem
    start: int
    stop: int

    @property
    def sample_indices(self) -> range:
        """The sample indices of this unit."""
        return range(self.start, self.stop)


@dataclass
class EvalReport:
    """What a run did.

    Attributes:
        results_file: The merged results file (written by rank 0).
        generated: Samples generated by this rank in this run.
        skipped: Samples of this rank already present from an earlier run.
        rows: Summary rows of the whole results folder (rank 0 only; empty elsewhere).
        table: The summary as a Markdown table (rank 0 only).
        rank: This process's rank.
        world_size: Number of ranks.
    """

    results_file: Path
    generated: int
    skipped: int
    rows: list[SummaryRow]
    table: str
    rank: int = 0
    world_size: int = 1


def plan_units(problems: Sequence[Problem], samples: int, batch_size: int) -> list[WorkUnit]:
    """Cut problems x samples into generate calls, independent of the number of ranks.

    Args:
        problems: The problems, in dataset order.
        samples: Samples per problem.
        batch_size: Samples per generate call.

    Returns:
        The units in order; rank ``r`` of ``n`` takes ``units[r::n]``.
    """
    units = []
    for problem in problems:
        for start in range(0, samples, batch_size):
            units.append(WorkUnit(len(units), problem, start, min(start + batch_size, samples)))
    return units


def make_policy_factory(config: EvalConfig) -> Callable[[], Any]:
    """Return a function building a fresh policy per generate call (``None`` for FullKV).

    The factory is called once here, so an unknown policy or a bad budget fails before the model
    is loaded.

    Args:
        config: The run's configuration.

    Returns:
        A zero-argument callable.
    """
    if config.is_full and not config.policy_kwargs:
        return lambda: None
    from beaconkv.policies import make_policy

    factory = functools.partial(
        make_policy, config.policy, budget=config.budget, **config.policy_kwargs
    )
    factory()
    return factory


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str, device: str) -> Any:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        value = getattr(torch, dtype)
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return value


def load_backend(model: str, *, device: str, dtype: Any) -> GenerationBackend:
    """Load a model and tokenizer with the core library and wrap :func:`beaconkv.generate`.

    Args:
        model: Checkpoint folder, hub id, or ``"embedded"``.
        device: Torch device string.
        dtype: Torch dtype of the weights.

    Returns:
        The :class:`GenerationBackend`.
    """
    import beaconkv

    path = str(beaconkv.embedded_model_path()) if model == "embedded" else model
    loaded = beaconkv.load_model(path, dtype=dtype, device=device)
    tokenizer = beaconkv.load_tokenizer(path)
    return GenerationBackend(tokenizer, functools.partial(beaconkv.generate, loaded, tokenizer))


def _stat(stats: Any, name: str, i: int, default: Any = 0) -> Any:
    value = getattr(stats, name, default) if stats is not None else default
    if isinstance(value, (list, tuple)):
        return value[i]
    return value


def run_eval(
    config: EvalConfig,
    *,
    backend: GenerationBackend | None = None,
    problems: Sequence[Problem] | None = None,
) -> EvalReport:
    """Run (or resume) an evaluation, sharded over the ranks of the process group if any.

    Args:
        config: The run's configuration.
        backend: Generation backend; ``None`` loads ``config.model`` with the core library (only
            if some sample is missing).
        problems: The problems; ``None`` loads them with :func:`load_benchmark`.

    Returns:
        The :class:`EvalReport` of this rank.

    Raises:
        ResultsConflictError: If ``out_dir`` holds results of this benchmark/policy/budget made
            with other settings.
    """
    spec = get_benchmark(config.benchmark)
    samples = config.samples or spec.default_samples
    device = _resolve_device(config.device)
    ctx = init_distributed(device, timeout_min=config.dist_timeout_min)
    try:
        return _run(config, spec.name, samples, device, ctx, backend, problems)
    finally:
        shutdown_distributed(ctx)


def _run(
    config: EvalConfig,
    benchmark: str,
    samples: int,
    device: str,
    ctx: DistContext,
    backend: GenerationBackend | None,
    problems: Sequence[Problem] | None,
) -> EvalReport:
    if device.startswith("cuda") and ctx.world_size > 1:
        import torch

        device = f"cuda:{ctx.local_rank}"
        torch.cuda.set_device(device)
    if problems is None:
        problems = load_benchmark(
            benchmark,
            config.data,
            hub_repo=config.hub_repo,
            hub_file=config.hub_file,
            hub_revision=config.hub_revision,
            field_map=config.field_map,
            limit=config.limit,
        )
    elif config.limit is not None:
        problems = list(problems)[: config.limit]
    policy_factory = make_policy_factory(config)
    label = policy_label(config.policy, config.tag)
    budget = config.effective_budget
    settings = config.settings()
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(benchmark, label, budget)
    done = load_done(out_dir, stem, settings)

    def key(problem: Problem, idx: int) -> tuple:
        return (benchmark, problem.id, idx, label, budget)

    mine = plan_units(problems, samples, config.batch_size)[ctx.rank :: ctx.world_size]
    pending = [u for u in mine if any(key(u.problem, i) not in done for i in u.sample_indices)]
    total_mine = sum(len(u.sample_indices) for u in mine)
    todo = sum(1 for u in pending for i in u.sample_indices if key(u.problem, i) not in done)
    generated = 0
    if pending:
        if backend is None:
            backend = load_backend(
                config.model, device=device, dtype=_resolve_dtype(config.dtype, device)
            )
        limits = SandboxLimits(timeout_s=config.code_timeout_s, memory_mb=config.code_memory_mb)
        part = rank_file(out_dir, stem, ctx.rank)
        desc = f"{benchmark} {label}" + ("" if budget is None else f"@{budget}")
        if ctx.world_size > 1:
            desc += f" [rank {ctx.rank}/{ctx.world_size}]"
        correct = 0
        with (
            part.open("a", encoding="utf-8") as sink,
            tqdm(
                total=todo,
                desc=desc,
                unit="sample",
                disable=not config.progress,
                position=ctx.rank if ctx.world_size > 1 else None,
                file=sys.stderr,
            ) as bar,
        ):
            prompt_cache: dict[str, tuple[str, str | None]] = {}
            for unit in pending:
                problem = unit.problem
                if problem.id not in prompt_cache:
                    built = build_prompt(problem, seed=config.seed)
                    text = render_chat(
                        backend.tokenizer, built.messages, enable_thinking=config.enable_thinking
                    )
                    prompt_cache = {problem.id: (text, built.reference)}
                prompt, reference = prompt_cache[problem.id]
                seed = derive_seed("sample", config.seed, problem.id, unit.start)
                n = len(unit.sample_indices)
                out = backend.generate(
                    [prompt] * n,
                    max_new_tokens=config.max_new_tokens,
                    temperature=config.temperature,
                    top_p=config.top_p,
                    top_k=config.top_k,
                    seed=seed,
                    policy=policy_factory(),
                )
                stats = getattr(out, "stats", None)
                for i, sample_idx in enumerate(unit.sample_indices):
                    if key(problem, sample_idx) in done:
                        continue
                    text_i = out.texts[i]
                    grade = grade_response(problem, reference, text_i, sandbox_limits=limits)
                    record: dict[str, Any] = {
                        "benchmark": benchmark,
                        "problem_id": problem.id,
                        "sample_idx": sample_idx,
                        "policy": label,
                        "budget": budget,
                        "model": config.model,
                        "seed": seed,
                        "answer": grade.answer,
                        "reference": reference,
                        "correct": grade.correct,
                        "grade_detail": grade.detail,
                        "finish_reason": out.finish_reasons[i],
                        "prompt_tokens": _stat(stats, "prompt_tokens", i),
                        "new_tokens": _stat(stats, "new_tokens", i, len(out.token_ids[i])),
                        "peak_cache_tokens": _stat(stats, "peak_cache_tokens", i),
                        "evictions": _stat(stats, "evictions", i),
                        "cache_capacity": _stat(stats, "cache_capacity", i),
                        "seconds": _stat(stats, "wall_time_s", i, 0.0),
                        "batch_size": n,
                        "text": text_i,
                    }
                    if config.save_token_ids:
                        record["token_ids"] = [int(t) for t in out.token_ids[i]]
                    record["settings"] = settings
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    done[record_key(record)] = record
                    generated += 1
                    correct += grade.correct
                    bar.update(1)
                    bar.set_postfix(acc=f"{correct / generated:.3f}")
                sink.flush()
                os.fsync(sink.fileno())
    barrier(ctx)
    rows: list[SummaryRow] = []
    table = ""
    merged = out_dir / f"{stem}.jsonl"
    if ctx.is_main:
        merged = merge_results(out_dir, stem)
        rows, table = write_summary(out_dir)
    return EvalReport(
        results_file=merged,
        generated=generated,
        skipped=total_mine - todo,
        rows=rows,
        table=table,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )



def __getattr__(name: str) -> Any:
    """Expose the command line helpers here too (``beaconkv/cli.py`` looks them up on this module).

    They live in :mod:`beaconkv.eval.cli`, which imports this module, hence the lazy lookup.
    """
    if name in ("add_eval_arguments", "run_eval_from_args"):
        from beaconkv.eval import cli

        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
