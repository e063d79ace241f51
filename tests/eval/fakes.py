"""A model-free generation backend for the runner and CLI tests, and small results-file helpers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from beaconkv.eval.benchmarks import Problem

PROBLEMS = [
    Problem("aime24", "60", "P60", answer="204"),
    Problem("aime24", "61", "P61", answer="113"),
    Problem("aime24", "9", "P9", answer="7"),
]


@dataclass
class FakeStats:
    prompt_tokens: list[int]
    new_tokens: list[int]
    cache_capacity: int
    evictions: list[int]
    peak_cache_tokens: int
    wall_time_s: float


@dataclass
class FakeOutput:
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    stats: FakeStats


class FakeGenerate:
    """Output depends only on (prompt, seed, row): right answer when the seed is even."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls: list[dict] = []
        self.fail_after = fail_after

    def __call__(self, prompts, *, max_new_tokens, temperature, top_p, top_k, seed, policy, kv_storage):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("simulated crash")
        self.calls.append({"n": len(prompts), "seed": seed, "policy": policy, "kv_storage": kv_storage})
        golds = {"P60": "204", "P61": "113", "P9": "7"}
        gold = next((v for k, v in golds.items() if f"{k}\n" in prompts[0]), "204")
        texts, ids = [], []
        for row in range(len(prompts)):
            answer = gold if (seed + row) % 2 == 0 else "0"
            texts.append(f"thinking {seed % 1000} \\boxed{{{answer}}}")
            ids.append([(seed + row + k) % 50000 for k in range(max_new_tokens)])
        n = len(prompts)
        stats = FakeStats([12] * n, [max_new_tokens] * n, 64, [1] * n, 40, 0.01)
        return FakeOutput(ids, texts, ["length"] * n, stats)


class Tok:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return f"<user>{messages[0]['content']}</user><assistant>"


def write_problems(path: Path, problems: list[Problem]) -> Path:
    """The problems as an aime24-style JSONL data file (id, problem, answer)."""
    path.write_text("".join(json.dumps({"id": p.id, "problem": p.question, "answer": p.answer}) + "\n" for p in problems))
    return path


def read(path: Path) -> list[dict]:
    """Every line of a results file as a record: newline-terminated, no blank or torn line."""
    text = path.read_text()
    assert text.endswith("\n"), f"{path} does not end with a newline"
    return [json.loads(line) for line in text.split("\n")[:-1]]


def strip_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]
