"""``run_requests``: completions as they finish, and a failed request raised, never graded."""

from __future__ import annotations

import pytest

from beaconkv.engine import Completion, Event, Request
from beaconkv.eval.backend import run_requests
from beaconkv.sampling import SamplingParams


class ScriptedEngine:
    """Finishes one request per step, in submission order; the request ids in ``fail`` fail."""

    def __init__(self, fail: dict[int, BaseException | None]) -> None:
        self.fail, self.waiting, self.submitted = fail, [], 0

    @property
    def idle(self) -> bool:
        return not self.waiting

    def submit(self, request: Request) -> int:
        self.waiting.append(self.submitted)
        self.submitted += 1
        return self.waiting[-1]

    def step(self) -> list[Event]:
        rid = self.waiting.pop(0)
        failed = rid in self.fail
        comp = Completion(rid, [] if failed else [7], "" if failed else "x", "error" if failed else "stop", 1,
                          0 if failed else 1, 0.0, 0.0, 0.0, 0)
        if failed:
            comp.error, comp.exception = "the request failed: boom", self.fail[rid]
        return [Event(rid, None if failed else 7, comp.text, comp)]


def _requests(n: int) -> list[Request]:
    return [Request([1, 2], 4, SamplingParams(), seed=i) for i in range(n)]


def test_completions_come_in_the_order_they_finish():
    assert [c.request_id for c in run_requests(ScriptedEngine({}), _requests(3))] == [0, 1, 2]


@pytest.mark.parametrize("exception", [ValueError("bad logits"), None], ids=["its exception", "its message"])
def test_a_failed_request_is_raised_after_the_ones_before_it(exception):
    done = []
    expected = (ValueError, "bad logits") if exception is not None else (RuntimeError, "boom")
    with pytest.raises(expected[0], match=expected[1]):
        for comp in run_requests(ScriptedEngine({1: exception}), _requests(3)):
            done.append(comp.request_id)
    assert done == [0]  # the one before it was yielded (and written); nothing after it is graded
