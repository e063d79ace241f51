"""``beaconkv generate --tensor-parallel-size 2`` on a saved tiny random Qwen3: the single process's text."""

from __future__ import annotations

import pytest
import torch

from beaconkv.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(checkpoint, capsys, *extra: str) -> tuple[str, str]:
    threads = torch.get_num_threads()
    try:
        code = main(["generate", "--model", str(checkpoint), "--prompt", "a b c d e f g", "--raw", "--ignore-eos",
                     "--max-new-tokens", "40", "--budget", "16", "--threads", "1", *extra])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def test_tensor_parallel_generate_prints_the_single_process_text(qwen3_cli_checkpoint, capsys):
    one, _ = _generate(qwen3_cli_checkpoint, capsys)
    two, err = _generate(qwen3_cli_checkpoint, capsys, "--tensor-parallel-size", "2")
    assert len(one.split()) == 40  # 40 words, evicting (budget 16)
    assert two == one
    assert "tensor parallel 2: rank 0/2: KV heads 0..0 (1 of 2)" in err
    assert "MiB, dense per rank" in err


def test_tensor_parallel_refusals_name_the_option(qwen3_cli_checkpoint, capsys):
    code = main(["generate", "--model", str(qwen3_cli_checkpoint), "--prompt", "a", "--tensor-parallel-size", "3"])
    assert code == 2
    assert "tensor_parallel_size=3 cannot split" in capsys.readouterr().err
    code = main(["generate", "--model", str(qwen3_cli_checkpoint), "--prompt", "a", "--tensor-parallel-size", "2",
                 "--compile"])
    assert code == 2
    assert "--compile is not supported with --tensor-parallel-size" in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "--prompt", "a"]).tensor_parallel_size == 1
