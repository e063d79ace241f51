"""The evaluation loop: problems x samples -> one engine -> grades -> results JSONL, resumable and sharded.

Every sample is planned on its own (:func:`plan_samples`): sample ``i`` of problem ``j`` is global
sample ``j * samples + i`` and belongs to rank ``(j * samples + i) % world_size``, and its seed is
``derive_seed("sample", seed, problem_id, i)``. Neither depends on the number of ranks, so a run
split over N processes produces the same samples as one process.

A rank submits all its pending samples (those not already in the results, after a resume) as
requests to ONE continuous-batching engine (:class:`~beaconkv.eval.backend.EvalEngine`, a
:class:`~beaconkv.engine.Engine` with ``max_batch`` cache slots, room for the longest pending
prompt, and the run's ``max_new_tokens``). A sample leaves its slot as soon as it ends and the next
pending sample takes it, so a long chain of thought holds back no other sample. Each request
carries its sample's seed (its own noise generator): its tokens do not depend on which samples share
the pool, so results do not depend on ``max_batch`` either. Every completion is graded and its
record appended (flushed and synced) to the rank's part file the moment it finishes: a killed run
keeps every finished sample, and the next run generates only the others (a record torn by the kill
is set aside, see :mod:`~beaconkv.eval.results`).

Each record (one JSON line) holds:

``benchmark, problem_id, sample_idx, policy, budget`` (the resume key), ``model, seed, answer,
reference, correct, grade_detail, grade_error, containment, finish_reason, prompt_tokens, new_tokens, peak_cache_tokens,
evictions, cache_capacity, seconds, text`` and, with ``save_token_ids``, ``token_ids``; plus
``settings`` (what must match for a resume). ``evictions`` are the request's own;
``peak_cache_tokens`` and ``cache_capacity`` come from
:meth:`~beaconkv.eval.backend.EvalEngine.cache_figures` (the policy's figures for this prompt and
these new tokens); ``seconds`` is the time the sample spent in its slot, from admission to its last
token (the completion's ``wall_s`` less its ``queued_s``: time waiting for a free slot is not the
sample's). Only ``seconds`` depends on the run's timing. ``grade_error`` is ``None``, or names what
failed when the response could not be judged (:func:`~beaconkv.eval.response_grading.grade_response`
never raises: one sample's grader failure is that sample's record, the run goes on, and a resume
finds the sample done instead of meeting the failure again); the summary counts those samples.

The policy is built and checked (:meth:`~beaconkv.eval.config.EvalConfig.make_policy`) before
anything is loaded; one policy object serves every slot. The model is loaded only if some sample is
still missing, so re-running a finished command just rebuilds the summary, and the results folder
is made only once the model is loaded: beaconkv's own decoder, or with ``config.backend == "hf"`` the
model in transformers (:mod:`~beaconkv.eval.hf_backend`). The backend is injectable
(:class:`~beaconkv.eval.backend.GenerationBackend`) so the loop can be tested without a model.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from tqdm.auto import tqdm

from ..engine import Request
from ..policies import EvictionPolicy
from ..policies.registry import policy_display_name
from ..sampling import SamplingParams
from .backend import (
    GenerationBackend,
    load_backend,
    resolve_device,
    resolve_eval_dtype,
    run_requests,
)
from .benchmarks import Problem, get_benchmark
from .config import EvalConfig
from .datasets import load_benchmark
from . import tensor_parallel as tensor_parallel_eval
from .distributed import (
    DistContext,
    barrier,
    init_distributed,
    shutdown_distributed,
)
from .errors import DatasetFormatError
from .prompts import build_prompt, render_chat
from .response_grading import grade_response
from .results import (
    load_done,
    merge_results,
    open_results_file,
    policy_label,
    rank_file,
    results_stem,
)
from .sandbox import check_containment
from .seeds import derive_seed
from .summary import SummaryRow, write_summary

__all__ = ["EvalReport", "PlannedSample", "plan_samples", "run_eval"]


@dataclass(frozen=True)
class PlannedSample:
    """One sample to generate: a problem and a sample index.

    Attributes:
        index: Position in the global sample list (decides the rank).
        problem: The problem.
        sample_idx: The sample's index among the samples of its problem.
    """

    index: int
    problem: Problem
    sample_idx: int

    def seed(self, base_seed: int) -> int:
        """The sample's seed: ``derive_seed("sample", base_seed, problem id, sample index)``.

        Args:
            base_seed: The run's ``--seed``.

        Returns:
            The seed of this sample's noise generator.
        """
        return derive_seed("sample", base_seed, self.problem.id, self.sample_idx)


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


def plan_samples(problems: Sequence[Problem], samples: int) -> list[PlannedSample]:
    """Every (problem, sample index) of a run, independent of the number of ranks.

    Args:
        problems: The problems, in dataset order.
        samples: Samples per problem.

    Returns:
        The samples, problem by problem; rank ``r`` of ``n`` takes ``planned[r::n]``.
    """
    return [
        PlannedSample(j * samples + i, problem, i)
        for j, problem in enumerate(problems)
        for i in range(samples)
    ]


@dataclass(frozen=True)
class _Prompt:
    """A problem's prompt as token ids (rendered with the chat template) and its reference answer."""

    ids: list[int]
    reference: str | None


def run_eval(
    config: EvalConfig,
    *,
    backend: GenerationBackend | None = None,
    problems: Sequence[Problem] | None = None,
) -> EvalReport:
    """Run (or resume) an evaluation, sharded over the ranks of the process group if any.

    The benchmark and the policy are checked first, then the problems are loaded; the model only
    if some sample is missing, and the results folder is made only after that.

    Args:
        config: The run's configuration.
        backend: Generation backend; ``None`` loads ``config.model`` with the core library, or in
            transformers with ``config.backend == "hf"`` (only if some sample is missing).
        problems: The problems; ``None`` loads them with
            :func:`~beaconkv.eval.datasets.load_benchmark`.

    Returns:
        The :class:`EvalReport` of this rank.

    Raises:
        UnknownBenchmarkError: ``config.benchmark`` is not registered.
        PolicyConfigError: Unknown policy or parameter, or a budget the policy rejects.
        DatasetFormatError: No problem to evaluate (an empty data file, or ``problems=[]``).
        SandboxUnavailable: A code benchmark whose sandbox (``config.sandbox``, namespaces by
            default) cannot start here; raised before anything is loaded or generated.
        ResultsConflictError: If ``out_dir`` holds results of this benchmark/policy/budget made
            with other settings.
        FileNotFoundError: The data file or the model checkpoint does not exist.
        ValueError: The longest pending prompt leaves the model no position for a new token
            (the core backend; it lowers ``max_new_tokens`` to what fits, with a warning, otherwise).
        TensorParallelError: With ``config.tensor_parallel_size > 1`` (and no ``backend`` given: an injected
            backend runs as it is), a size the model cannot be split by or a rank that failed (named); see
            :mod:`beaconkv.eval.tensor_parallel`.
    """
    spec = get_benchmark(config.benchmark)
    policy = config.make_policy()
    if spec.kind == "code":  # before anything is generated: a sandbox that cannot start refuses now
        check_containment(config.sandbox_limits())
    samples = config.samples or spec.default_samples
    device = resolve_device(config.device)
    ctx = init_distributed(device, timeout_min=config.dist_timeout_min)
    try:
        if config.tensor_parallel_size > 1 and backend is None:  # each group of ranks shares one copy of the model
            report = tensor_parallel_eval.run_tensor_parallel(config, device, ctx, functools.partial(
                _run, config, spec.name, samples, device, policy, problems=problems))
            if report is None:  # a rank that mirrored its group's rank 0: it generated nothing and prints nothing
                report = EvalReport(Path(config.out_dir), 0, 0, [], "", rank=ctx.rank,
                                    world_size=ctx.world_size // config.tensor_parallel_size)
            return report
        return _run(config, spec.name, samples, device, policy, ctx, backend, problems)
    finally:
        shutdown_distributed(ctx)


def _run(
    config: EvalConfig,
    benchmark: str,
    samples: int,
    device: str,
    policy: EvictionPolicy | None,
    ctx: DistContext,
    backend: GenerationBackend | None,
    problems: Sequence[Problem] | None,
) -> EvalReport:
    if device.startswith("cuda") and ctx.world_size > 1:
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
    if not problems:
        raise DatasetFormatError(
            f"no problems to evaluate for benchmark {benchmark!r}; pass at least one problem"
        )
    label = policy_label(policy_display_name(config.policy), config.tag)
    budget = config.effective_budget
    out_dir = Path(config.out_dir)
    stem = results_stem(benchmark, label, budget)
    done = load_done(out_dir, stem, config.settings(), rank=ctx.rank, world_size=ctx.world_size)

    mine = plan_samples(problems, samples)[ctx.rank :: ctx.world_size]
    pending = [s for s in mine if (benchmark, s.problem.id, s.sample_idx, label, budget) not in done]
    generated = 0
    if pending:
        if backend is None:
            backend = _load(config, device)
        out_dir.mkdir(parents=True, exist_ok=True)
        generated = _generate(config, benchmark, label, budget, policy, ctx, backend, pending, out_dir, stem)
    if backend is not None and backend.finish is not None:
        backend.finish()
    barrier(ctx)
    rows: list[SummaryRow] = []
    table = ""
    merged = out_dir / f"{stem}.jsonl"
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        merged = merge_results(out_dir, stem)
        rows, table = write_summary(out_dir)
    return EvalReport(
        results_file=merged,
        generated=generated,
        skipped=len(mine) - len(pending),
        rows=rows,
        table=table,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )


def _load(config: EvalConfig, device: str) -> GenerationBackend:
    """The backend ``config.backend`` names, loaded on ``device``: the native one, or the model in transformers."""
    dtype = resolve_eval_dtype(config.dtype, device)
    if config.backend == "hf":
        # late on purpose: transformers is the optional hf extra, and only this choice needs it (no import circle)
        from .hf_backend import load_hf_backend

        return load_hf_backend(config.model, device=device, dtype=dtype)
    return load_backend(config.model, device=device, dtype=dtype)


def _generate(
    config: EvalConfig,
    benchmark: str,
    label: str,
    budget: int | None,
    policy: EvictionPolicy | None,
    ctx: DistContext,
    backend: GenerationBackend,
    pending: list[PlannedSample],
    out_dir: Path,
    stem: str,
) -> int:
    """Run the pending samples through one engine, appending each record as its sample finishes.

    Returns:
        The number of samples generated.
    """
    prompts: dict[str, _Prompt] = {}
    for sample in pending:
        problem = sample.problem
        if problem.id not in prompts:
            built = build_prompt(problem, seed=config.seed)
            text = render_chat(backend.tokenizer, built.messages, enable_thinking=config.enable_thinking)
            ids = [int(t) for t in backend.tokenizer.encode_prompt(text)]
            prompts[problem.id] = _Prompt(ids, built.reference)
    engine = backend.make_engine(
        policy=policy,
        max_batch=config.max_batch,
        prompt_capacity=max(len(p.ids) for p in prompts.values()),
        max_new_tokens=config.max_new_tokens,
        setup=config.decode_setup(),
    )
    sampling = SamplingParams(config.temperature, config.top_p, config.top_k)
    requests = [
        Request(
            prompts[s.problem.id].ids,
            max_new_tokens=engine.max_new_tokens,
            sampling=sampling,
            seed=s.seed(config.seed),
            tag=s,
        )
        for s in pending
    ]
    settings = config.settings()
    limits = config.sandbox_limits()
    part = rank_file(out_dir, stem, ctx.rank)
    desc = f"{benchmark} {label}" + ("" if budget is None else f"@{budget}")
    if ctx.world_size > 1:
        desc += f" [rank {ctx.rank}/{ctx.world_size}]"
    generated = correct = 0
    with (
        open_results_file(part, "ab") as sink,
        tqdm(
            total=len(pending),
            desc=desc,
            unit="sample",
            disable=not config.progress,
            position=ctx.rank if ctx.world_size > 1 else None,
            file=sys.stderr,
        ) as bar,
    ):
        for completion in run_requests(engine, requests):
            sample = cast(PlannedSample, completion.tag)
            prompt = prompts[sample.problem.id]
            grade = grade_response(sample.problem, prompt.reference, completion.text, sandbox_limits=limits)
            figures = engine.cache_figures(completion)
            record: dict[str, Any] = {
                "benchmark": benchmark,
                "problem_id": sample.problem.id,
                "sample_idx": sample.sample_idx,
                "policy": label,
                "budget": budget,
                "model": config.model,
                "seed": sample.seed(config.seed),
                "answer": grade.answer,
                "reference": prompt.reference,
                "correct": grade.correct,
                "grade_detail": grade.detail,
                "grade_error": grade.error,
                "containment": grade.containment,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": completion.prompt_tokens,
                "new_tokens": len(completion.token_ids),
                "peak_cache_tokens": figures.peak_tokens,
                "evictions": completion.evictions,
                "cache_capacity": figures.capacity,
                "seconds": completion.wall_s - completion.queued_s,
                "text": completion.text,
            }
            if config.save_token_ids:
                record["token_ids"] = [int(t) for t in completion.token_ids]
            record["settings"] = settings
            _append(sink, record)
            generated += 1
            correct += grade.correct
            bar.update(1)
            bar.set_postfix(acc=f"{correct / generated:.3f}")
    return generated


def _append(sink: BinaryIO, record: dict[str, Any]) -> None:
    """Append one record as a line and push it to the disk (a kill keeps every finished sample)."""
    sink.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    sink.flush()
    os.fsync(sink.fileno())
