"""Reasoning traces to teacher-force: a prompt (rendered with the chat template) and the output to force.

Records are JSONL lines with at least ``problem`` and, to force, ``output`` — the format of the
project's ``data/traces`` (real R1-distilled outputs on AIME24, see ``data/traces/SOURCE.md``),
which is the default source. ``--generate`` lets the model write its own text instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...generation import generate
from ...models.decoder import CausalLM
from ...paths import traces_path
from ...tokenizer import Tokenizer
from .errors import FidelityError


@dataclass
class Trace:
    """One teacher-forced token stream.

    Attributes:
        name: Identifier (the JSONL ``id``, or ``"generated-<i>"``).
        prompt_ids: The prompt, rendered with the chat template and tokenized.
        output_ids: The assistant text that is forced token by token.
    """

    name: str
    prompt_ids: list[int]
    output_ids: list[int]


def read_trace_records(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Reads trace records from a JSONL file or every ``*.jsonl`` file of a directory (sorted).

    Args:
        path: A ``.jsonl`` file or a directory (default: the project's ``data/traces``).

    Returns:
        The records, each a dict with at least ``problem`` (str) and, for forcing, ``output`` (str).

    Raises:
        FidelityError: The path does not exist, holds no JSONL, or a line is not a JSON object
            with a string ``problem``.
    """
    p = traces_path() if path is None else Path(path)
    if not p.exists():
        raise FidelityError(f"traces path {p} does not exist; pass --traces FILE.jsonl or a directory of them.")
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise FidelityError(f"no *.jsonl file in {p}; pass --traces FILE.jsonl.")
    records = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise FidelityError(f"{f}:{n} is not valid JSON ({err}).") from err
            if not isinstance(rec, dict) or not isinstance(rec.get("problem"), str):
                raise FidelityError(f"{f}:{n} needs a JSON object with a string 'problem' field.")
            rec.setdefault("id", f"{f.stem}:{n}")
            records.append(rec)
    return records


def select_records(
    records: list[dict[str, Any]], ids: Sequence[str] | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Picks records by id (in the given order) or the first ``limit``.

    Raises:
        FidelityError: An id is unknown, or ``limit < 1``.
    """
    if ids:
        by_id = {str(r["id"]): r for r in records}
        missing = [i for i in ids if str(i) not in by_id]
        if missing:
            raise FidelityError(f"trace id(s) {missing} not found; available: {', '.join(by_id)}.")
        return [by_id[str(i)] for i in ids]
    if limit is not None:
        if limit < 1:
            raise FidelityError(f"--num-traces={limit} must be >= 1.")
        return records[:limit]
    return records


def trace_from_record(record: dict[str, Any], tokenizer: Tokenizer, chat: bool = True) -> Trace:
    """Renders one record: the problem as the user turn of the chat template, the output as assistant text.

    Raises:
        FidelityError: The record has no string ``output``.
    """
    if not isinstance(record.get("output"), str) or not record["output"]:
        raise FidelityError(f"trace {record.get('id')!r} has no 'output' text to force; use --generate instead.")
    prompt = tokenizer.chat_prompt(record["problem"]) if chat else record["problem"]
    return Trace(str(record["id"]), tokenizer.encode_prompt(prompt), tokenizer.encode(record["output"]))


def load_traces(
    path: str | Path | None,
    tokenizer: Tokenizer,
    ids: Sequence[str] | None = None,
    limit: int | None = None,
    chat: bool = True,
) -> list[Trace]:
    """Loads and tokenizes reasoning traces (``problem`` + ``output``) from JSONL.

    Args:
        path: A JSONL file or a directory of them (see :func:`read_trace_records`; None: the project's).
        tokenizer: The model's tokenizer (its chat template renders the problem).
        ids: Record ids to take, in order (default: the first ``limit``).
        limit: How many records to take when ``ids`` is not given.
        chat: Render the problem through the chat template (False: raw text).

    Returns:
        The traces.
    """
    return [trace_from_record(r, tokenizer, chat) for r in select_records(read_trace_records(path), ids, limit)]


def generate_traces(
    model: CausalLM,
    tokenizer: Tokenizer,
    problems: Sequence[str],
    n_tokens: int,
    temperature: float = 0.6,
    top_p: float = 0.95,
    seed: int = 0,
) -> list[Trace]:
    """Lets the model write its own traces (FullKV, end-of-sequence ignored) to force afterwards.

    Args:
        model: The model.
        tokenizer: Its tokenizer.
        problems: User turns.
        n_tokens: Tokens to generate per problem.
        temperature: Sampling temperature (0 = greedy; small models loop when greedy).
        top_p: Nucleus mass.
        seed: Sampling seed.

    Returns:
        One trace per problem, named ``generated-<i>``.
    """
    out = generate(
        model, tokenizer, [tokenizer.chat_prompt(p) for p in problems], max_new_tokens=n_tokens,
        temperature=temperature, top_p=top_p, seed=seed, eos_token_ids=[],
    )
    return [Trace(f"generated-{i}", p, t) for i, (p, t) in enumerate(zip(out.prompt_ids, out.token_ids))]


def forced_tokens(traces: Sequence[Trace], n_tokens: int) -> Tensor:
    """The ``(batch, n_tokens)`` decode inputs: the first ``n_tokens`` output tokens of each trace.

    Raises:
        FidelityError: ``n_tokens < 1`` or a trace is shorter (the message names it and its length).
    """
    if n_tokens < 1:
        raise FidelityError(f"tokens={n_tokens} must be >= 1.")
    short = [(t.name, len(t.output_ids)) for t in traces if len(t.output_ids) < n_tokens]
    if short:
        name, n = short[0]
        raise FidelityError(f"trace {name!r} has only {n} output tokens < --tokens={n_tokens}; lower --tokens.")
    return torch.tensor([t.output_ids[:n_tokens] for t in traces], dtype=torch.long)
