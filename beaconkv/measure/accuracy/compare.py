"""A suite cell run by a kvpress press: the same cases, the same token ids, the same budget, kvpress's protocol.

The cell's budget becomes kvpress's settings through the count our policies keep (a BeaconKV of the
cell's budget and ``n_prefix`` stands for every policy: they share the budget semantics):

* ``aware`` and ``agnostic``: kvpress compresses the prompt once, at its prefill (its pipeline protocol),
  to exactly as many tokens as our policy keeps of it (:func:`~beaconkv.measure.accuracy.kvpress.kvpress_ratio`
  of :func:`~beaconkv.measure.accuracy.kvpress.tokens_kept_of_prompt`). ``aware`` gives it context and
  question as one prompt; ``agnostic`` the context only, the question coming after on the compressed cache.
  (Our side evicts when the budget fills, down to 7/8 of it; kvpress keeps the ratio's count: the same
  count, so the same memory after the prefill.)
* ``decode``: kvpress's ``DecodingPress`` around the press, compressing every ``budget - B_min`` decode
  steps down to ``n_prefix + B_min`` tokens: our schedule's cadence and sizes. SnapKV's observation window
  must be shorter than that interval in kvpress: it is set to ``min(32, interval - 1)`` there (32 is our
  SnapKV's window).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .kvpress import KvpressCase, kvpress_ratio, run_kvpress, tokens_kept_of_prompt, unsupported_reason
from .tasks import TokenizedCase, grade

__all__ = ["kvpress_settings", "run_kvpress_cell"]


def kvpress_settings(cell: Any, reference: Any, case: TokenizedCase) -> dict[str, Any]:
    """The ``run_kvpress`` settings of one case of a cell (``reference``: a policy of the cell's budget)."""
    if cell.protocol == "decode":
        if reference is None:
            return {"mode": "decode", "compression_ratio": 0.0, "decode": None, "press_kwargs": None}
        interval = reference.budget - reference.b_min
        prefix = reference.prefix_lengths([len(case.context_ids)])[0]  # an int n_prefix (the suite's), or the prompt
        decode = {"compression_interval": interval, "target_size": prefix + reference.b_min}
        kwargs = {"window_size": min(32, interval - 1)} if cell.policy in ("snapkv", "adakv-snapkv") else None
        return {"mode": "decode", "compression_ratio": 0.0, "decode": decode, "press_kwargs": kwargs}
    prompt = len(case.context_ids) + (len(case.question_ids) if cell.protocol == "aware" else 0)
    ratio = 0.0 if reference is None else kvpress_ratio(tokens_kept_of_prompt(reference, prompt), prompt)
    return {"mode": "prefill", "compression_ratio": ratio, "decode": None, "press_kwargs": None}


def _kvpress_case(cell: Any, case: TokenizedCase) -> KvpressCase:
    aware = cell.protocol == "aware"
    return KvpressCase(
        id=str(case.case.index),
        context_ids=case.context_ids + (case.question_ids if aware else ()),
        decode_ids=case.decode_ids,
        question_ids=() if aware else case.question_ids,
        max_new_tokens=case.case.max_new_tokens,
    )


def run_kvpress_cell(config: Any, cell: Any, cases: Sequence[TokenizedCase], model_dir: Path,
                     decode_text: Callable[[list[int]], str], reference: Any) -> list[dict[str, Any]]:
    """Runs the cell's press on its cases; one outcome per case (the runner's fields, plus ``error`` and ``note``).

    Cases are grouped by their kvpress settings (the prefill ratio depends on each prompt's length), one
    driver run per group.
    """
    press = cell.policy
    groups: dict[str, list[TokenizedCase]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for case in cases:
        s = kvpress_settings(cell, reference, case)
        key = repr(sorted(s.items()))
        groups.setdefault(key, []).append(case)
        settings[key] = s
    outcomes: dict[int, dict[str, Any]] = {}
    for key, group in groups.items():
        s = settings[key]
        first = _kvpress_case(cell, group[0])
        note = unsupported_reason(press, s["mode"], decode=s["decode"], press_kwargs=s["press_kwargs"],
                                  context_len=len(first.context_ids))
        results = run_kvpress([_kvpress_case(cell, c) for c in group], press=press, python=config.kvpress_python
                              and Path(config.kvpress_python), model_dir=model_dir, **s)
        for case, result in zip(group, results):
            text = "" if result.error else decode_text(list(result.generated_ids))
            outcomes[case.case.index] = {
                "index": case.case.index, "correct": bool(not result.error and grade(text, case.case.answers)),
                "output": text, "prompt_tokens": len(case.context_ids), "evictions": None,
                "slots": result.kv_tokens_after_prefill, "kv_bytes": result.peak_kv_bytes,
                "prefill_s": result.prefill_s, "decode_s": result.decode_s, "error": result.error, "note": note,
            }
    return [outcomes[c.case.index] for c in cases]
