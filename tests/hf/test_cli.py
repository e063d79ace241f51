"""``beaconkv generate --backend hf``: the checkpoint in transformers with a PolicyCache, from the command line
(``--prefill-chunk`` included: the prompt compressed in chunks, as the native command does)."""

from __future__ import annotations

import pytest

import beaconkv
from beaconkv.cli import main
from beaconkv.hf.generation import generate_hf, load_hf_model
from beaconkv.policies import BeaconKV

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

POLICY = ["--policy", "beacon", "--budget", "16", "--n-recent", "2", "--n-beacon", "2"]


def test_generate_backend_hf_prints_the_native_decoders_text(tiny_checkpoint, capsys):
    common = ["generate", "--model", str(tiny_checkpoint), "--prompt", "a b c d e f", "--raw", "--max-new-tokens",
              "60", "--ignore-eos", *POLICY]
    assert main([*common, "--backend", "hf"]) == 0
    hf = capsys.readouterr()
    assert main(common) == 0
    native = capsys.readouterr()
    assert "transformers" in hf.err and "new tokens [60]" in hf.err and "evictions [" in hf.err
    assert "evictions [0]" not in hf.err
    assert hf.out.strip() == native.out.strip() != ""


def test_generate_hf_gives_beaconkv_generate_tokens_for_a_batch(tiny_checkpoint):
    model = load_hf_model(str(tiny_checkpoint), dtype="float32", device="cpu")
    tok = beaconkv.load_tokenizer(tiny_checkpoint)
    prompts = ["a b c", "d e f g h i j k"]
    policy = BeaconKV(16, n_recent=2, n_beacon=2)
    out = generate_hf(model, tok, prompts, policy=policy, max_new_tokens=50, eos_token_ids=[])
    want = beaconkv.generate(beaconkv.load_model(tiny_checkpoint), tok, prompts, policy=policy, max_new_tokens=50,
                             eos_token_ids=[])
    assert out.token_ids == want.token_ids and out.texts == want.texts
    assert out.stats.evictions == want.stats.evictions and min(out.stats.evictions) > 0
    assert out.finish_reasons == ["length", "length"] and out.stats.cache_capacity == want.stats.cache_capacity


@pytest.mark.parametrize("option", [["--compile"], ["--kv-storage", "int8"], ["--kernels", "packed"]])
def test_native_only_options_are_refused_with_the_fix(tiny_checkpoint, capsys, option):
    # --prefill-chunk is not one of them (test_generate_backend_hf_prefill_chunk_...)
    rc = main(["generate", "--backend", "hf", "--model", str(tiny_checkpoint), "--prompt", "a", *option])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("beaconkv generate: error: --backend hf") and option[0] in err


def test_generate_backend_hf_prefill_chunk_prints_the_native_decoders_text_and_bound(tiny_checkpoint, capsys):
    prompt = " ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(70))
    common = ["generate", "--model", str(tiny_checkpoint), "--prompt", prompt, "--raw", "--max-new-tokens", "30",
              "--ignore-eos", *POLICY, "--policy-arg", "n_prefix=2", "--prefill-chunk", "8"]
    assert main([*common, "--backend", "hf"]) == 0
    hf = capsys.readouterr()
    assert main(common) == 0
    native = capsys.readouterr()
    assert hf.out.strip() == native.out.strip() != ""
    capacity = next(line for line in hf.err.splitlines() if line.startswith("cache capacity")).split(" (")[0]
    assert int(capacity.split()[2]) <= 2 + 16 + 8  # n_prefix + budget + chunk, not the 70-token prompt
    assert f"{capacity} (" in native.err and "evictions [0]" not in hf.err


def test_generate_hf_prefill_chunk_gives_beaconkv_generate_tokens_for_a_batch(tiny_checkpoint):
    model = load_hf_model(str(tiny_checkpoint), dtype="float32", device="cpu")
    tok = beaconkv.load_tokenizer(tiny_checkpoint)
    prompts = [" ".join(["a b c d e f g"] * 9), "d e f g h i j k " * 4]
    policy = BeaconKV(16, n_recent=2, n_beacon=2, n_prefix=2)
    out = generate_hf(model, tok, prompts, policy=policy, max_new_tokens=40, eos_token_ids=[], prefill_chunk=8)
    want = beaconkv.generate(beaconkv.load_model(tiny_checkpoint), tok, prompts, policy=policy, max_new_tokens=40,
                             eos_token_ids=[], prefill_chunk=8)
    assert out.token_ids == want.token_ids and out.stats.evictions == want.stats.evictions
    assert out.stats.cache_capacity == want.stats.cache_capacity == policy.capacity(
        out.stats.prompt_tokens, 40, prefill_chunk=8) <= 2 + 16 + 8 < min(out.stats.prompt_tokens)
