"""The command line: generate (embedded model by default, policies) and demo, end to end."""

from __future__ import annotations

from beaconkv.cli import main


def test_generate_with_embedded_model_and_policy(capsys):
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "6",
               "--policy", "beacon", "--budget", "128"])
    out = capsys.readouterr()
    assert rc == 0
    assert "BeaconKV(budget=128" in out.err and "new tokens [6]" in out.err
    assert out.out.strip()  # streamed text


def test_generate_batch_of_prompts(tiny_models, capsys):
    rc = main(["generate", "--prompt", "one", "--prompt", "a longer second prompt", "--max-new-tokens", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "--- [0] ---" in out and "--- [1] ---" in out


def test_demo_prints_text_and_stats(capsys):
    rc = main(["demo", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and "tokens/s" in out and "cache capacity" in out
