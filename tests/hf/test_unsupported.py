"""Architectures a PolicyCache cannot serve are refused when it is made, in one line naming them (issue #39).

Tiny random-weight configs, fp32, CPU: multi-head latent attention (DeepSeek-V3, and V3.2 with its indexer),
linear-attention hybrids (Qwen3-Next, Qwen3.5, LFM2's convolutions), layers sharing keys and values (Gemma 4).
Then the structural checks on their own (a latent cache or a hybrid whose config fields do not say so, a write
no probe saw), the supported decoders still accepted, and the command line: ``generate`` and ``eval`` with
``--backend hf`` print one ``error:`` line and exit 2, before any weight loads; the native loader points to
``--backend hf``.
"""

from __future__ import annotations

import pytest
import torch

from beaconkv.cli import main
from beaconkv.hf import PolicyCache, PolicyCacheError, UnsupportedArchitectureError
from beaconkv.hf.support import SUPPORTED, check_config, check_model
from beaconkv.paths import data_dir
from beaconkv.policies import BeaconKV

from .helpers import greedy, random_prompts

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
           topk_group=1, first_k_dense_replace=1)
LINEAR = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16)


def tiny_config(kind: str):
    """A tiny config of each refused architecture."""
    if kind == "deepseek_v3":  # MLA: the layers cache a latent (b, 1, L, kv_lora_rank) and one shared RoPE key
        return tf.DeepseekV3Config(**{**COMMON, **MLA}, num_hidden_layers=2)
    if kind == "deepseek_v32":  # MLA plus a sparse-attention indexer with keys of its own
        return tf.DeepseekV32Config(**{**COMMON, **MLA}, num_hidden_layers=2, index_n_heads=2, index_head_dim=16,
                                    index_topk=8)
    if kind == "qwen3_next":  # three gated-delta-net (linear attention) layers, one full
        return tf.Qwen3NextConfig(**COMMON, **LINEAR, num_hidden_layers=4, moe_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2, shared_expert_intermediate_size=32)
    if kind == "qwen3_5":
        return tf.Qwen3_5TextConfig(**COMMON, **LINEAR, num_hidden_layers=4)
    if kind == "lfm2":  # short convolutions between attention layers
        return tf.Lfm2Config(**COMMON, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2)
    if kind == "gemma4":  # the last two layers attend over the keys and values of earlier ones
        return tf.Gemma4TextConfig(**COMMON, num_hidden_layers=4, head_dim=16, global_head_dim=16, sliding_window=16,
                                   num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2)
    raise ValueError(kind)


LATENT = "its attention is multi-head latent attention (kv_lora_rank=32)"
HYBRID = "it is a linear-attention (recurrent) hybrid: layers {} of 4 are of type {!r}"
# kind -> (model class, model_type, what the refusal says is wrong)
REFUSED = {
    "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3", LATENT),
    "deepseek_v32": ("DeepseekV32ForCausalLM", "deepseek_v32", LATENT),
    "qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next", HYBRID.format("0, 1, 2", "linear_attention")),
    "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text", HYBRID.format("0, 1, 2", "linear_attention")),
    "lfm2": ("Lfm2ForCausalLM", "lfm2", HYBRID.format("0, 2", "conv")),
    "gemma4": ("Gemma4ForCausalLM", "gemma4_text", "layers 2, 3 of 4 are fed keys and values another layer cached"),
}


def build(kind: str):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="sdpa").float().eval()


def assert_one_line_refusal(message: str, cls: str, model_type: str, what: str) -> None:
    assert "\n" not in message
    assert message.startswith(f"{cls} (model_type {model_type!r}) is not supported by a PolicyCache: {what}"), message
    assert SUPPORTED in message and "DynamicCache" in message


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_cache_refuses_the_architecture_when_made_naming_it(kind):
    model = build(kind)
    with pytest.raises(UnsupportedArchitectureError) as err:
        PolicyCache(model, BeaconKV(16, n_recent=2, n_beacon=2))
    assert isinstance(err.value, PolicyCacheError)
    assert_one_line_refusal(str(err.value), *REFUSED[kind])
    assert not model.config._attn_implementation.startswith("beaconkv:")  # refused before the model was touched


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_config_alone_is_refused_before_any_weight(kind):
    with pytest.raises(UnsupportedArchitectureError) as err:
        check_config(tiny_config(kind), REFUSED[kind][0])
    cls, model_type, what = REFUSED[kind]
    assert str(err.value).startswith(f"{cls} is not supported by a PolicyCache: {what}")


def test_a_latent_cache_the_config_does_not_declare_is_found_by_what_the_layer_writes():
    """A future MLA without ``kv_lora_rank``: the probe sees each layer write one (1, 1, 3, 32) latent."""
    model = build("deepseek_v3")
    object.__setattr__(model.config, "kv_lora_rank", None)  # past the field's validator: a config that lacks it
    with pytest.raises(UnsupportedArchitectureError) as err:
        PolicyCache(model, BeaconKV(16, n_recent=2, n_beacon=2))
    message = str(err.value)
    assert "layer 0 (DeepseekV3Attention) caches keys (1, 1, 3, 32) and values (1, 1, 3, 8) for 3 tokens" in message
    assert "latent KV cache" in message and "(1, num_key_value_heads=4, 3, head_dim=8)" in message


def test_a_hybrid_whose_layer_types_do_not_say_so_is_found_by_its_layers():
    model = build("qwen3_next")
    model.config.layer_types = ["full_attention"] * 4
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 \(Qwen3NextDecoderLayer\) has no self_attn "
                                                           r"attention module \(its modules: linear_attn, "):
        PolicyCache(model, BeaconKV(16, n_recent=2, n_beacon=2))


def test_a_write_no_probe_saw_is_refused_in_one_line_not_a_shape_mismatch(monkeypatch):
    """Where the probe cannot run a layer's attention, the cache's check of every write still refuses at the
    prefill (the issue's ``shape mismatch ... [2, 1, 30, 32] ... [2, 4, 30, 8]`` is what came before)."""
    model = build("deepseek_v3")
    monkeypatch.setattr("beaconkv.hf.cache.check_model", lambda model: None)
    cache = PolicyCache(model, BeaconKV(16, n_recent=2, n_beacon=2))
    with pytest.raises(UnsupportedArchitectureError) as err:
        greedy(model, random_prompts((30, 30), seed=0), cache, 5)
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "DeepseekV3ForCausalLM (model_type 'deepseek_v3') is not supported by a PolicyCache: policy layer 0 wrote "
        "keys (2, 1, 30, 32) and values (2, 1, 30, 8), not per-head keys and values (batch, num_key_value_heads=4")


def test_the_supported_decoders_pass_the_check(tiny_models):
    for kind, (_, model) in tiny_models.items():
        check_model(model)  # llama, qwen2, qwen3 (test_architectures.py makes a cache of six more)
        check_config(model.config)


def test_a_refusal_is_not_remembered_as_a_pass():
    model = build("deepseek_v3")
    for _ in range(2):
        with pytest.raises(UnsupportedArchitectureError):
            check_model(model)


# ------------------------------------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> a saved checkpoint folder of the refused architecture, weights and config."""
    out = {}
    for kind in ("deepseek_v3", "qwen3_next"):
        d = tmp_path_factory.mktemp(kind)
        build(kind).save_pretrained(d, safe_serialization=True)
        out[kind] = d
    return out


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"beaconkv {command}: error: "), err
    return lines[0].removeprefix(f"beaconkv {command}: error: ")


def test_generate_backend_hf_refuses_mla_in_one_line_with_exit_2(checkpoints, capsys):
    argv = ["generate", "--backend", "hf", "--model", str(checkpoints["deepseek_v3"]), "--prompt", "a b c",
            "--max-new-tokens", "5", "--budget", "16", "--n-recent", "2", "--n-beacon", "2"]
    assert main(argv) == 2
    assert_one_line_refusal(_one_error_line(capsys, "generate"), *REFUSED["deepseek_v3"])


def test_generate_backend_hf_refuses_from_the_config_before_the_weights(checkpoints, tmp_path, capsys):
    (tmp_path / "config.json").write_text((checkpoints["qwen3_next"] / "config.json").read_text())
    assert main(["generate", "--backend", "hf", "--model", str(tmp_path), "--prompt", "a"]) == 2
    assert_one_line_refusal(_one_error_line(capsys, "generate"), *REFUSED["qwen3_next"])


def test_eval_backend_hf_refuses_a_hybrid_in_one_line_with_exit_2(checkpoints, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["eval", "--backend", "hf", "--model", str(checkpoints["qwen3_next"]), "--benchmark", "aime24",
            "--data", str(data_dir() / "aime24.jsonl"), "--limit", "1", "--samples", "1", "--max-new-tokens", "4",
            "--device", "cpu", "--no-progress", "--out", str(out)]
    assert main(argv) == 2
    assert_one_line_refusal(_one_error_line(capsys, "eval"), *REFUSED["qwen3_next"])
    assert not out.exists()


def test_load_hf_backend_refuses_mla(checkpoints):
    from beaconkv.eval.hf_backend import load_hf_backend

    with pytest.raises(UnsupportedArchitectureError, match="multi-head latent attention"):
        load_hf_backend(str(checkpoints["deepseek_v3"]), device="cpu", dtype="float32")


def test_the_native_loader_points_an_unsupported_model_type_to_backend_hf(checkpoints, capsys):
    assert main(["generate", "--model", str(checkpoints["deepseek_v3"]), "--prompt", "a"]) == 2
    line = _one_error_line(capsys, "generate")
    assert line.startswith(f"{checkpoints['deepseek_v3'] / 'config.json'}: model_type='deepseek_v3' is not supported; "
                           "beaconkv supports llama, qwen2, qwen3")
    assert line.endswith("run in transformers with --backend hf.")

