"""``beaconkv bench --sections tp`` on a tiny model: every setup's row, the same tokens, the per-rank memory."""

from __future__ import annotations

import argparse

import pytest
import torch

from beaconkv.measure.speed.machine import BenchError
from beaconkv.measure.speed.tensor_parallel import markdown_tp, run_tp_section

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tp_section_rows_and_table(tiny_models):
    path = tiny_models["qwen3"][0]  # 2 KV heads, tied embeddings, 97-token vocabulary
    args = argparse.Namespace(tp_ranks=2, tp_batches="2", tp_new_tokens=12, budget=16, repeats=1)
    threads = torch.get_num_threads()
    section = run_tp_section(args, path, torch.device("cpu"), lambda msg: None)
    assert torch.get_num_threads() == threads
    rows = section["rows"]
    assert [r["setup"] for r in rows] == ["1 rank x 2 threads", "1 rank x 1 thread",
                                          "2 ranks x 1 thread, vocab-parallel", "2 ranks x 1 thread, vocab replicated"]
    assert all(r["batch"] == 2 for r in rows)
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in rows)
    one, split, replicated = rows[0], rows[2], rows[3]
    assert split["kv_mib_per_rank"] == pytest.approx(one["kv_mib_per_rank"] / 2)  # one of the 2 KV heads
    assert split["weight_mib_per_rank"] < replicated["weight_mib_per_rank"] < one["weight_mib_per_rank"]
    table = markdown_tp(section)
    assert "| 2 ranks x 1 thread, vocab-parallel | 2 |" in table and "| NO |" not in table


def test_tp_section_refuses_one_rank(tiny_models):
    args = argparse.Namespace(tp_ranks=1, tp_batches="1", tp_new_tokens=4, budget=16, repeats=1)
    with pytest.raises(BenchError, match="--tp-ranks=1 must be at least 2"):
        run_tp_section(args, tiny_models["qwen3"][0], torch.device("cpu"), lambda msg: None)


def test_bench_takes_vllms_name_for_the_ranks() -> None:
    from beaconkv.cli import build_parser

    args = build_parser().parse_args(["bench", "--sections", "tp", "--tensor-parallel-size", "4"])
    assert args.tp_ranks == 4
    assert build_parser().parse_args(["bench", "--sections", "tp"]).tp_ranks == 2
