"""Every compile an executor runs says so on the ``beaconkv.compile`` logger: a line when it starts and one with
its seconds when it ends; a call that compiles nothing (a cached graph, a replay) says nothing."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from beaconkv.execution import CompileConfig, CompiledExecutor, GraphExecutor, OpReplayRecorder
from beaconkv.execution.compiled import compile_logger

from .device_functions import Store, write_and_read

pytestmark = pytest.mark.usefixtures("one_thread")


def scaled_sum(x: torch.Tensor) -> torch.Tensor:
    """A device function to compile."""
    return (x * 2).sum(-1)


@pytest.fixture
def lines():
    """The messages of ``beaconkv.compile`` while the test runs (whatever handlers the command line added)."""
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    handler, level = Keep(), compile_logger.level
    compile_logger.addHandler(handler)
    compile_logger.setLevel(logging.INFO)
    yield got
    compile_logger.removeHandler(handler)
    compile_logger.setLevel(level)


def test_a_compile_is_announced_when_it_starts_and_timed_when_it_ends(lines):
    executor = CompiledExecutor(CompileConfig(backend="aot_eager", dynamic=False), "cpu")
    executor.run(scaled_sum, torch.ones(2, 3))
    assert len(lines) == 2 and lines[0] == "compiling scaled_sum…", lines
    assert re.fullmatch(r"compiled scaled_sum in \d+\.\d s", lines[1]), lines
    executor.run(scaled_sum, torch.ones(2, 3))  # the same shape: the graph is reused
    assert len(lines) == 2
    with pytest.warns(UserWarning, match="another graph"):  # a new shape: a recompile, said the same way
        executor.run(scaled_sum, torch.ones(4, 5))
    assert lines[2:3] == ["compiling scaled_sum…"] and lines[3].startswith("compiled scaled_sum in ")


def test_a_graph_recording_is_announced_and_timed_and_replays_are_silent(lines):
    executor = GraphExecutor(OpReplayRecorder(), record_after=0)
    store = Store()
    for _ in range(3):
        executor.run(write_and_read, store, torch.ones(3), 0.5)
    assert lines[0].startswith("recording write_and_read") and lines[0].endswith("…"), lines
    assert re.fullmatch(r"recorded write_and_read of Store in \d+\.\d s", lines[1]), lines
    assert len(lines) == 2 and executor.replays == 2
