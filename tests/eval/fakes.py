"""A model-free generation backend for the runner and CLI tests, and small results-file helpers.

:class:`FakeEngines` is a backend's ``make_engine``: its :class:`FakeEngine` has the interface of
:class:`beaconkv.eval.backend.EvalEngine` and simulates continuous batching step by step (a fixed pool
of slots, one token per running request per step, a finished request's slot taken by the next
waiting one), so completion order is that of a real engine. A request's output depends only on its
prompt and seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from beaconkv.engine import Completion, Event, Request
from beaconkv.eval.backend import CacheFigures
from beaconkv.eval.benchmarks import Problem

PROBLEMS = [
    Problem("aime24", "60", "P60", answer="204"),
    Problem("aime24", "61", "P61", answer="113"),
    Problem("aime24", "9", "P9", answer="7"),
]
GOLDS = {"P60": "204", "P61": "113", "P9": "7"}


def fake_output(prompt: str, seed: int, length: int) -> tuple[str, list[int]]:
    """The text and token ids of a request: the right answer when the seed is even (for a code
    problem, a program that adds two numbers from stdin, or one that prints 0)."""
    ids = [(seed + k) % 50000 for k in range(length)]
    if "```" in prompt or "Python" in prompt:
        body = "a, b = map(int, input().split())\nprint(a + b)" if seed % 2 == 0 else "print(0)"
        return f"thinking {seed % 1000}\n```python\n{body}\n```\n", ids
    gold = next((v for k, v in GOLDS.items() if f"{k}\n" in prompt), "204")
    answer = gold if seed % 2 == 0 else "0"
    return f"thinking {seed % 1000} \\boxed{{{answer}}}", ids


@dataclass
class _Running:
    id: int
    request: Request
    admitted: int
    produced: int = 0


class FakeEngine:
    """A pool of ``max_batch`` slots; every step admits waiting requests and gives each running one a token."""

    def __init__(self, owner: FakeEngines, *, policy, max_batch, prompt_capacity, max_new_tokens, setup) -> None:
        self.owner, self.policy, self.kv_storage, self.setup = owner, policy, setup.kv_storage, setup
        self.max_batch, self.prompt_capacity, self.max_new_tokens = max_batch, prompt_capacity, max_new_tokens
        self.waiting: list[tuple[int, Request]] = []
        self.slots: list[_Running | None] = [None] * max_batch
        self.steps = 0
        self._crash = False

    @property
    def idle(self) -> bool:
        return not self.waiting and all(s is None for s in self.slots)

    def submit(self, request: Request) -> int:
        assert 1 <= len(request.prompt) <= self.prompt_capacity, "a prompt longer than the engine's prompt_capacity"
        assert 1 <= request.max_new_tokens <= self.max_new_tokens, "more new tokens than the engine allows"
        assert request.seed is not None, "every sample brings its own seed"
        rid = self.owner.next_id
        self.owner.next_id += 1
        self.waiting.append((rid, request))
        return rid

    def step(self) -> list[Event]:
        if self._crash:
            raise KeyboardInterrupt("simulated crash")
        self.steps += 1
        for s, slot in enumerate(self.slots):
            if slot is None and self.waiting:
                rid, request = self.waiting.pop(0)
                self.slots[s] = _Running(rid, request, self.steps)
        running = [r for r in self.slots if r is not None]
        self.owner.peak_running = max(self.owner.peak_running, len(running))
        if self.owner.on_step is not None:
            self.owner.on_step(self)
        events = []
        for s, run in enumerate(self.slots):
            if run is None:
                continue
            run.produced += 1
            length = self.owner.length(run.request)
            text, ids = fake_output("".join(map(chr, run.request.prompt)), run.request.seed, length)
            if run.produced < length:
                events.append(Event(run.id, ids[run.produced - 1], ""))
                continue
            fail_after = self.owner.fail_after
            if fail_after is not None and len(self.owner.calls) >= fail_after:
                self._crash = True  # what finished before is delivered; the next step dies
                return events
            self.slots[s] = None
            reason = "length" if length == run.request.max_new_tokens else "stop"
            completion = Completion(
                run.id, ids, text, reason, len(run.request.prompt), 1, queued_s=0.001 * run.admitted,
                time_to_first_token_s=0.001 * run.admitted + 0.001, wall_s=0.001 * self.steps + 0.001, slot=s,
                tag=run.request.tag,
            )  # fmt: skip
            self.owner.calls.append({"seed": run.request.seed, "policy": self.policy, "kv_storage": self.kv_storage,
                                     "max_batch": self.max_batch, "tokens": length})  # fmt: skip
            events.append(Event(run.id, ids[-1], text, completion))
        return events

    def cache_figures(self, completion: Completion) -> CacheFigures:
        return CacheFigures(peak_tokens=40, capacity=64)


@dataclass
class FakeEngines:
    """A backend's ``make_engine``: makes :class:`FakeEngine` s and logs what they did.

    Attributes:
        fail_after: Raise ``KeyboardInterrupt`` (a kill) once this many requests have finished.
        lengths: New tokens of the request with this seed (default: its ``max_new_tokens``).
        on_step: Called with the engine at every step, after admission.
        engines: The keyword arguments of every ``make_engine`` call.
        calls: One entry per finished request, in completion order: seed, policy, kv_storage, max_batch, tokens.
        peak_running: Most requests running at once.
    """

    fail_after: int | None = None
    lengths: dict[int, int] = field(default_factory=dict)
    on_step: object = None
    engines: list[dict] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    peak_running: int = 0
    next_id: int = 0

    def __call__(self, **kwargs) -> FakeEngine:
        self.engines.append(kwargs)
        return FakeEngine(self, **kwargs)

    def length(self, request: Request) -> int:
        return min(self.lengths.get(request.seed, request.max_new_tokens), request.max_new_tokens)


class Tok:
    """A chat template and an encoder (one id per character)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return f"<user>{messages[0]['content']}</user><assistant>"

    def encode_prompt(self, text: str) -> list[int]:
        return [ord(c) for c in text]


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
