"""The ``torchrun`` recipe: every process a rank, the world cut into tensor-parallel groups (data parallel x
tensor parallel), rank 0 of each group leading its engine while the others follow.

The processes are started as ``torchrun`` would start them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` in their environment), 4 of them: 2 groups of 2 ranks, each group generating for its own
prompt, both equal to one process's tokens.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import beaconkv
from beaconkv import BeaconKV, HeadAdaptive

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 11, 3, 7, 20, 40, 33, 12, 8], [1, 4, 4, 60, 70, 2, 9]]


def _policy():
    return BeaconKV(16, allocation=HeadAdaptive(), telemetry=True)


def _rank(index: int, world: int, port: int, checkpoint: str, out: str) -> None:
    """One process of the run: what a user's script does under ``torchrun --nproc-per-node 4``."""
    os.environ.update(RANK=str(index), WORLD_SIZE=str(world), LOCAL_RANK=str(index), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from beaconkv.distributed import TensorParallel, follow, lead, load_shard

    tp = TensorParallel.split(2, timeout_s=120)  # a loaded 2-core box: a rank may reach a collective late
    data_rank = torch.distributed.get_rank() // tp.size  # which group: which prompt
    model = load_shard(checkpoint, tp)
    if tp.is_main:
        with lead(model):
            result = beaconkv.generate(model, None, [PROMPTS[data_rank]], max_new_tokens=20, policy=_policy())
        kept = [r.kept_positions.tolist() for r in result.telemetry]
        with open(f"{out}.{data_rank}", "w") as f:
            json.dump({"tokens": result.token_ids[0], "kept": kept, "tp_rank": tp.rank}, f)
    else:
        follow(model)
    torch.distributed.destroy_process_group()


def test_data_parallel_times_tensor_parallel_under_torchrun(tp_checkpoints, tmp_path):
    checkpoint = tp_checkpoints["llama"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "result")
    mp.start_processes(_rank, args=(4, port, str(checkpoint), out), nprocs=4, start_method="spawn")
    whole = beaconkv.load_model(checkpoint)
    for data_rank, prompt in enumerate(PROMPTS):
        got = json.loads((tmp_path / f"result.{data_rank}").read_text())
        want = beaconkv.generate(whole, None, [prompt], max_new_tokens=20, policy=_policy())
        assert got["tokens"] == want.token_ids[0]
        assert got["kept"] == [r.kept_positions.tolist() for r in want.telemetry] and got["kept"]
        assert got["tp_rank"] == 0
