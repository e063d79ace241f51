"""Why a policy loses the needle in the decode: what it still holds of the pass key when the question comes.

Runs the accuracy suite's ``decode_needle`` cases (the pass key in a short prompt, then filler
teacher-forced as decode steps) under each policy with telemetry on, and reads the last eviction of
every layer before the question:

* ``digits kept``: of the pass key's digit tokens in the prompt (both mentions), the share still in the
  cache, over layers x KV heads x cases;
* ``heads with a whole key``: (layer, KV head) pairs that still hold all five digits of one mention;
* ``scorers in prompt``: of the positions of the queries the policy scored with at that eviction
  (BeaconKV's beacons, SnapKV's window), the share inside the prompt, where the only queries that
  looked at the key were;
* ``correct``: the greedy answer graded as the suite grades it.

Usage::

    python scripts/needle_retention.py --cases 10 --decode-length 1024 --compression 4
"""

from __future__ import annotations

import argparse
import time

import torch

from beaconkv.measure.accuracy.suite import cell_tokens
from beaconkv.measure.accuracy.tasks import grade, make_cases, tokenize_case
from beaconkv.models.embedded import embedded_model_path
from beaconkv.models.loading import load_model
from beaconkv.policies.registry import make_policy
from beaconkv.session import Session
from beaconkv.tokenizer import load_tokenizer


def _digit_positions(ids: list[int], decode) -> list[list[int]]:
    """The positions of each mention of the key: runs of single-digit tokens."""
    runs, run = [], []
    for i, t in enumerate(ids):
        if decode([t]).strip().isdigit():
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@torch.inference_mode()
def measure(model, tok, policy_name: str, cases, budget: int, n_prefix: int) -> dict:
    policy = make_policy(policy_name, budget=budget, n_prefix=n_prefix, telemetry=True)
    n = len(cases)
    steps = len(cases[0].decode_ids)
    prompts = [list(c.context_ids) for c in cases]
    session = Session(model, policy, batch=n, capacity=policy.capacity([max(map(len, prompts))], steps + 20) + len(cases[0].question_ids),
                      max_tokens=max(map(len, prompts)) + steps + 40)
    logits = session.prefill(prompts)
    for j in range(steps):
        logits = session.step_logits(torch.tensor([c.decode_ids[j] for c in cases]))
    last = {}  # (layer, row) -> the last eviction's record index
    records = session.state.stats.telemetry
    for k, rec in enumerate(records):
        for r_i, row in enumerate(rec.rows):
            last[(rec.layer, row)] = (k, r_i)
    kept_share, whole, scorers_in, scorers_all = [], 0, 0, 0
    pairs = 0
    for (layer, row), (k, r_i) in last.items():
        rec = records[k]
        mentions = _digit_positions(prompts[row], tok.decode)
        digits = [p for m in mentions for p in m]
        for head in range(rec.kept_positions.shape[1]):
            kept = set(rec.kept_positions[r_i, head].tolist())
            kept_share.append(sum(p in kept for p in digits) / len(digits))
            whole += any(all(p in kept for p in m) for m in mentions if len(m) == 5)
            pairs += 1
        if rec.observed_positions is not None:
            obs = [p for p in rec.observed_positions[r_i].tolist() if p >= 0]
            scorers_all += len(obs)
            scorers_in += sum(p < len(prompts[row]) for p in obs)
    logits = session.extend([list(c.question_ids) for c in cases], list(range(n)))
    tokens = [logits.argmax(-1)]
    for _ in range(cases[0].case.max_new_tokens - 1):
        tokens.append(session.step_logits(tokens[-1]).argmax(-1))
    out = torch.stack(tokens, 1).tolist()
    correct = sum(grade(tok.decode(out[r]), c.case.answers) for r, c in enumerate(cases))
    return {"digits": sum(kept_share) / max(1, len(kept_share)), "whole": whole / max(1, pairs),
            "scorers": (scorers_in / scorers_all) if scorers_all else float("nan"), "correct": correct, "n": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10)
    p.add_argument("--decode-length", type=int, default=1024)
    p.add_argument("--compression", type=float, default=4.0)
    p.add_argument("--n-prefix", type=int, default=4)
    p.add_argument("--policies", default="beacon,beacon_pool,snapkv,h2o,streaming")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = embedded_model_path()
    model, tok = load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)
    raw = make_cases("decode_needle", args.decode_length, args.cases, lambda s: len(tok.encode(s)))
    cases = [tokenize_case(c, tok.encode, tok.encode_prompt, args.decode_length) for c in raw]
    budget = max(8, round(cell_tokens("decode_needle", args.decode_length) / args.compression))
    print(f"decode_needle, {args.decode_length} decode steps, {args.cases} cases, budget {budget} "
          f"({args.compression:g}x), n_prefix {args.n_prefix}; embedded SmolLM2-135M fp32")
    print("| policy | digits kept | heads with a whole key | scorers in prompt | correct | s |")
    print("|---|---|---|---|---|---|")
    for name in args.policies.split(","):
        t0 = time.perf_counter()
        m = measure(model, tok, name, cases, budget, args.n_prefix)
        scorers = "–" if m["scorers"] != m["scorers"] else f"{m['scorers']:.1%}"  # nan: no query positions (H2O)
        print(f"| {name} | {m['digits']:.1%} | {m['whole']:.1%} | {scorers} | {m['correct']}/{m['n']} "
              f"| {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
