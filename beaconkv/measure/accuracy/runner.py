"""Runs one cell of the accuracy suite through beaconkv's own session: a policy, a budget, a protocol, N cases.

A cell's cases are run in batches through one :class:`~beaconkv.session.Session` each (ragged prompts,
right-padded; a row's tokens do not depend on the rows beside it), with the real model, the real cache
and the policy's real evictions:

* ``aware`` (question-aware): context and question are one prompt, prefilled together; the policy's
  eviction after the prefill sees the question (SnapKV's window holds it). The cache holds the whole
  prompt during the prefill unless ``prefill_chunk`` is set.
* ``agnostic`` (question-agnostic, kvpress's pipeline protocol): the context is prefilled (in chunks of
  ``prefill_chunk`` when set, evicting between them) and compressed before the question exists; the
  question then comes as one more chunk (:meth:`~beaconkv.session.Session.extend`) on the compressed
  cache.
* ``decode`` (the needle in the decode): the context (the fact) is prefilled, then the decode text is
  teacher-forced one token per decode step (:meth:`~beaconkv.session.Session.step_logits`), so
  decode-time eviction runs between the fact and the question, which comes after as one chunk.

Then every row generates greedily and is graded (:func:`~beaconkv.measure.accuracy.tasks.grade`).
Memory is the policy's own bound for each case (:meth:`~beaconkv.policies.EvictionPolicy.capacity`,
plus the question's tokens, which arrive as one chunk): the cache slots a sequence needs, and their
bytes for this model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...models.decoder import CausalLM
from ...policies.base import EvictionPolicy, FullKV
from ...session import Session
from .tasks import TokenizedCase, grade

__all__ = ["PROTOCOLS", "CaseOutcome", "kv_bytes_per_slot", "run_cases"]

PROTOCOLS = ("aware", "agnostic", "decode")
"""The protocols of :func:`run_cases` (see the module docstring)."""


@dataclass(frozen=True)
class CaseOutcome:
    """What one case gave.

    Attributes:
        index: The case's index in its cell.
        correct: Whether every expected string appeared.
        output: The greedy continuation.
        prompt_tokens: Context (+ question for ``aware``) tokens.
        slots: Cache slots per KV head the case needs (the policy's bound; for FullKV its whole sequence).
        kv_bytes: Those slots' keys and values for this model, in bytes.
        evictions: Eviction rounds of the case's row.
        prefill_s: Seconds of the batch's prefill (and question), divided among its rows.
        decode_s: Seconds of the batch's decode steps (teacher-forced and answer), divided among its rows.
    """

    index: int
    correct: bool
    output: str
    prompt_tokens: int
    slots: int
    kv_bytes: int
    evictions: int
    prefill_s: float
    decode_s: float


def kv_bytes_per_slot(model: CausalLM) -> int:
    """Bytes one cache slot (one token, every layer and KV head, key and value) takes in ``model``'s dtype."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * torch.finfo(model.dtype).bits // 8


def _prompt(case: TokenizedCase, protocol: str) -> list[int]:
    return list(case.context_ids) + (list(case.question_ids) if protocol == "aware" else [])


def _slots(policy: EvictionPolicy, case: TokenizedCase, protocol: str, prefill_chunk: int | None) -> int:
    """The cache slots one case needs: the policy's bound, plus the question's tokens where they come as a chunk."""
    prompt = len(_prompt(case, protocol))
    question = 0 if protocol == "aware" else len(case.question_ids)
    new = len(case.decode_ids) + case.case.max_new_tokens
    full = prompt + question + new
    if not policy.evicts:
        return full
    return min(policy.capacity([prompt], new, prefill_chunk=prefill_chunk) + question, full)


def run_cases(
    model: CausalLM,
    decode_text: Callable[[list[int]], str],
    policy: EvictionPolicy | None,
    cases: Sequence[TokenizedCase],
    protocol: str,
    *,
    prefill_chunk: int | None = None,
    batch: int = 8,
    on_batch: Callable[[int], None] | None = None,
) -> list[CaseOutcome]:
    """Runs the cases of one cell under one policy and protocol; returns one outcome per case, in order.

    Args:
        model: The model (its dtype sets the bytes per slot).
        decode_text: Token ids -> text (the tokenizer's decode).
        policy: The policy (None: FullKV).
        cases: The cell's cases (same task; for ``decode``, the same number of decode tokens).
        protocol: ``"aware"``, ``"agnostic"`` or ``"decode"``.
        prefill_chunk: Prefill in chunks of this many tokens (None: whole prompts).
        batch: Cases run together in one session.
        on_batch: Called with the number of cases each finished batch held (a progress bar).

    Returns:
        The outcomes.

    Raises:
        ValueError: An unknown protocol, or decode cases of different decode lengths.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    policy = policy if policy is not None else FullKV()
    per_slot = kv_bytes_per_slot(model)
    out: list[CaseOutcome] = []
    for start in range(0, len(cases), batch):
        part = list(cases[start:start + batch])
        out.extend(_run_batch(model, decode_text, policy, part, protocol, prefill_chunk, per_slot))
        if on_batch is not None:
            on_batch(len(part))
    return out


@torch.inference_mode()
def _run_batch(model: CausalLM, decode_text: Callable[[list[int]], str], policy: EvictionPolicy,
               part: list[TokenizedCase], protocol: str, prefill_chunk: int | None, per_slot: int) -> list[CaseOutcome]:
    steps = {len(c.decode_ids) for c in part}
    if len(steps) > 1:
        raise ValueError(f"the cases of a batch must have as many decode tokens; got {sorted(steps)}")
    n_decode = steps.pop()
    prompts = [_prompt(c, protocol) for c in part]
    slots = [_slots(policy, c, protocol, prefill_chunk) for c in part]
    answer = max(c.case.max_new_tokens for c in part)
    session = Session(model, policy, batch=len(part), capacity=max(slots),
                      max_tokens=max(len(p) for p in prompts) + max(len(c.question_ids) for c in part) + n_decode
                      + answer)
    rows = list(range(len(part)))
    t0 = time.perf_counter()
    logits = session.prefill(prompts, chunk=prefill_chunk)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for j in range(n_decode):  # teacher forcing: the decode text, one decode step per token
        logits = session.step_logits(torch.tensor([c.decode_ids[j] for c in part], device=session.device))
    decode_s = time.perf_counter() - t0
    if protocol != "aware":
        t0 = time.perf_counter()
        logits = session.extend([list(c.question_ids) for c in part], rows)
        prefill_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = [logits.argmax(-1)]
    for _ in range(answer - 1):
        tokens.append(session.step_logits(tokens[-1]).argmax(-1))
    decode_s += time.perf_counter() - t0
    generated = torch.stack(tokens, 1).tolist()
    outcomes = []
    for r, case in enumerate(part):
        text = decode_text(generated[r][: case.case.max_new_tokens])
        outcomes.append(CaseOutcome(
            index=case.case.index, correct=grade(text, case.case.answers), output=text, prompt_tokens=len(prompts[r]),
            slots=slots[r], kv_bytes=slots[r] * per_slot, evictions=session.state.stats.evictions[r],
            prefill_s=prefill_s / len(part), decode_s=decode_s / len(part),
        ))
    return outcomes
