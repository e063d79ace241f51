"""Golden runs: the greedy tokens and kept positions of every policy on the embedded model.

The fixture ``tests/fixtures/golden_policies.json`` was recorded with the code *before* the core was
opened up (explicit policy state, execution strategies, KV storage); ``tests/test_golden.py`` checks
that every policy still produces exactly those tokens and keeps exactly those positions, eviction by
eviction and layer by layer. Regenerate (only for an intended behaviour change) with
``python -m tests.golden --write``; a policy added later is recorded with
``python -m tests.golden --write --only NAME[,NAME...]``, which leaves every other entry as it was.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "fixtures" / "golden_policies.json"
PROMPTS = ["What is 7 * 8? Think step by step.",
           "Name three prime numbers, explain in one sentence each why it is prime, then add them up."]
NEW_TOKENS = 64
#: (case name, policy keyword arguments shared by every policy): the whole prompt protected (every row
#: evicts at the same steps), and an int prefix (rows reach the budget at different steps: ragged).
CASES = {"prompt_prefix": {}, "int_prefix": {"n_prefix": 16}}
POLICIES = ("full", "beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming",
            # recorded after the refactor, with the code that introduced them
            "expected_attention", "tova", "keydiff", "knorm", "lazy_eviction", "triattention")
BUDGET, N_RECENT = 32, 4


def digest(records: list[tuple[int, int, list[int], list]]) -> str:
    """sha256 of the (step, layer, rows, kept positions) records, in eviction order."""
    return hashlib.sha256(json.dumps(records, separators=(",", ":")).encode()).hexdigest()


def record_run(run, names: tuple[str, ...] = POLICIES) -> dict:
    """Tokens, eviction counts, a digest of every eviction's kept positions, and layer 0's kept sets.

    Args:
        run: ``run(name, kwargs) -> (token_ids, evictions, records)`` with records as
            ``(step, layer, rows, kept_positions as nested lists)`` in eviction order.
        names: The policies to record (default: all of :data:`POLICIES`).
    """
    out: dict = {}
    for case, extra in CASES.items():
        for name in names:
            kwargs = {} if name == "full" else {"budget": BUDGET, "n_recent": N_RECENT, **extra}
            tokens, evictions, records = run(name, kwargs)
            out[f"{case}/{name}"] = {
                "tokens": tokens,
                "evictions": evictions,
                "kept_digest": digest(records),
                "layer0_kept": [r for r in records if r[1] == 0],
            }
    return out


def merged(old: dict, new: dict) -> dict:
    """The fixture's entries with ``new`` ones added or replaced, in :data:`CASES` x :data:`POLICIES` order."""
    order = [f"{case}/{name}" for case in CASES for name in POLICIES]
    both = {**old, **new}
    return {key: both[key] for key in order if key in both}


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.golden --write`` regenerates the fixture with the current code (``--only``: some
    policies, the other entries kept as recorded)."""
    import beaconkv
    from beaconkv.policies import make_policy

    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated policy names to (re)record")
    args = parser.parse_args(argv)
    names = tuple(n for n in args.only.split(",") if n) or POLICIES
    unknown = sorted(set(names) - set(POLICIES))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not in POLICIES ({', '.join(POLICIES)})")
    torch.set_num_threads(1)
    path = beaconkv.embedded_model_path()
    model = beaconkv.load_model(path, dtype=torch.float32)
    tok = beaconkv.load_tokenizer(path)

    def run(name, kwargs):
        policy = make_policy(name, telemetry=True, **kwargs)
        out = beaconkv.generate(model, tok, PROMPTS, chat=True, max_new_tokens=NEW_TOKENS, eos_token_ids=[],
                                policy=policy)
        records = [(r.step, r.layer, list(r.rows), r.kept_positions.tolist()) for r in out.telemetry]
        return out.token_ids, out.stats.evictions, records

    data = record_run(run, names)
    if args.only:
        data = merged(json.loads(FIXTURE.read_text()), data)
    if args.write:
        FIXTURE.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
    else:
        print(json.dumps({k: (v["evictions"], v["kept_digest"][:12]) for k, v in data.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
