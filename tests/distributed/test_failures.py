"""Tensor parallelism's failures: a killed rank ends the run with one error naming it, well within the
collectives' timeout; sizes and models it cannot split are refused before any process starts."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import beaconkv
from beaconkv import BeaconKV
from beaconkv.distributed import TensorParallelError, TensorParallelRun
from beaconkv.engine import Request

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 11, 3, 7, 20, 40, 33, 12, 8], [1, 4, 4, 60, 70]]
TIMEOUT_S = 30.0


def test_replicated_vocabulary_then_a_killed_rank(tp_checkpoints):
    """With the embedding and head replicated the tokens are the single process's; then rank 1 is killed
    mid-generation: one TensorParallelError naming it, in well under the timeout, and no rank left running."""
    whole = beaconkv.load_model(tp_checkpoints["qwen3"])
    want = beaconkv.generate(whole, None, PROMPTS, max_new_tokens=12, policy=BeaconKV(16))
    threads = torch.get_num_threads()
    run = TensorParallelRun(tp_checkpoints["qwen3"], 2, vocab_parallel=False, timeout_s=TIMEOUT_S, threads=1)
    try:
        assert not run.model.shard_plan.vocab_parallel
        assert run.model.lm_head.weight.shape[0] == whole.config.vocab_size
        got = beaconkv.generate(run.model, None, PROMPTS, max_new_tokens=12, policy=BeaconKV(16))
        assert got.token_ids == want.token_ids
        victim = run.processes.pids()[0]
        killed: list[float] = []

        def stream(i: int, token: int, text: str) -> None:
            if not killed:
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic())

        with pytest.raises(TensorParallelError, match=r"while generating: rank 1 died of SIGKILL"):
            beaconkv.generate(run.model, None, [[1, 2, 3]], max_new_tokens=500, eos_token_ids=[], stream=stream)
        assert time.monotonic() - killed[0] < TIMEOUT_S / 2
        assert not any(p.is_alive() for p in run.processes.processes)
    finally:
        run.close()
        torch.set_num_threads(threads)
    assert not torch.distributed.is_initialized()  # the group is gone: the next run may start


def test_sizes_and_models_refused_before_any_process_starts(tp_checkpoints):
    whole = beaconkv.load_model(tp_checkpoints["qwen3"])
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=3 cannot split .* use one of 1, 2, 4"):
        beaconkv.generate(whole, None, PROMPTS, tensor_parallel_size=3)
    with pytest.raises(TensorParallelError, match="needs an int >= 2"):
        TensorParallelRun(tp_checkpoints["qwen3"], 1)
    with pytest.raises(TensorParallelError, match="needs the model's checkpoint"):
        beaconkv.generate(beaconkv.build_model(whole.config), None, PROMPTS, tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


def test_an_idle_group_outlives_the_collectives_timeout(tp_checkpoints):
    """Rank 0 idle for longer than the model collectives' timeout (a server between requests): the other rank
    waits on the control group's long timeout, and the next generation runs."""
    threads = torch.get_num_threads()
    with TensorParallelRun(tp_checkpoints["qwen3"], 2, timeout_s=4.0, threads=1) as run:
        assert run.tp.control is not run.tp.group
        first = beaconkv.generate(run.model, None, PROMPTS, max_new_tokens=6, policy=BeaconKV(16))
        time.sleep(5.0)
        again = beaconkv.generate(run.model, None, PROMPTS, max_new_tokens=6, policy=BeaconKV(16))
        assert again.token_ids == first.token_ids
        engine = run.engine(None, policy=BeaconKV(16), max_batch=1, prompt_capacity=16, max_new_tokens=6)
        time.sleep(5.0)  # a server waiting for its first request
        with torch.inference_mode():
            done = engine.run([Request(p, 6) for p in PROMPTS])  # one slot: the second request waits for the first
        assert [c.token_ids for c in done] == first.token_ids
    torch.set_num_threads(threads)


def test_rank_zero_refusals_leave_the_run_usable(tp_checkpoints):
    """A setting tensor parallelism refuses fails on rank 0 before anything is sent: at once, and the run goes on."""
    threads = torch.get_num_threads()
    with TensorParallelRun(tp_checkpoints["qwen3"], 2, timeout_s=TIMEOUT_S, threads=1) as run:
        for kwargs, message in ((dict(compile=True), "compile is not supported with tensor parallelism"),
                                (dict(kernels="packed"), "kernels='packed' replaces the shard's linear layers"),
                                (dict(policy=beaconkv.TOVA(16, group_reduce="all_heads")), "averages scores over")):
            t0 = time.monotonic()
            with pytest.raises(TensorParallelError, match=message):
                beaconkv.generate(run.model, None, PROMPTS, max_new_tokens=4, **kwargs)
            assert time.monotonic() - t0 < 2.0
        assert len(beaconkv.generate(run.model, None, PROMPTS, max_new_tokens=4).token_ids) == 2
    torch.set_num_threads(threads)
