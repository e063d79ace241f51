"""Checkpoint loading: sharded files, hub ids, config spellings, a clear error for every bad input (checked
before the model is built), the buffers of injected components made for real, and weights that are NaN,
infinite or beyond the requested dtype refused by name."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import beaconkv
from beaconkv.cache import KVCache
from beaconkv.models import (Attention, CheckpointError, ConfigFileError, ModelConfig, RotaryEmbedding, SwiGLUMLP,
                             UnsupportedModelError, build_model, loading)
from beaconkv.models.loading import MetaTensorError



@pytest.fixture()
def ckpt(tiny_models, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_models["qwen2"][0], d)
    return d


def test_sharded_checkpoint_loads_identically(tiny_models, tmp_path):
    _, hf = tiny_models["llama"]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = beaconkv.load_model(tmp_path)
    single = beaconkv.load_model(tiny_models["llama"][0])
    ids = torch.arange(3, 40)[None]
    torch.testing.assert_close(sharded(ids), single(ids), atol=0, rtol=0)


def test_dtype_and_device_arguments(tiny_models):
    m = beaconkv.load_model(tiny_models["qwen3"][0], dtype="bf16", device="cpu")
    assert m.lm_head.weight.dtype == torch.bfloat16 and m.lm_head.weight is m.model.embed_tokens.weight
    assert m.rope.inv_freq.dtype == torch.float32 and m.rope.inv_freq.device.type == "cpu"


def test_hub_id_resolves_through_huggingface_hub(tiny_models, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(tiny_models["qwen3"][0])

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    m = beaconkv.load_model("Qwen/Qwen3-tiny-test")
    assert m.config.model_type == "qwen3"
    assert calls[0][0] == "Qwen/Qwen3-tiny-test" and "*.safetensors" in calls[0][1]


def test_rope_parameters_spelling_is_parsed():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    new = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16}})
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16}})
    assert new.rope == old.rope and new.rope.theta == 5e5 and new.rope.rope_type == "llama3"


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        beaconkv.load_model("/nonexistent/model/dir")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        beaconkv.load_model(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        beaconkv.load_model(ckpt)


def test_corrupt_safetensors_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
    with pytest.raises(CheckpointError, match="cannot read safetensors file .*model.safetensors"):
        beaconkv.load_model(ckpt)


def _rewrite(ckpt, edit):
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.q_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['model.layers.1.self_attn.q_proj.bias'\]"):
        beaconkv.load_model(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: \['model.layers.0.extra.weight'\]"):
        beaconkv.load_model(ckpt)


def test_misshaped_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(CheckpointError, match=r"model.norm.weight: checkpoint \(63,\) vs model \(64,\)"):
        beaconkv.load_model(ckpt)


def test_unsupported_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="model_type='mistral'.*llama, qwen2, qwen3"):
        beaconkv.load_model(ckpt)


def test_unknown_dtype_and_device(ckpt):
    with pytest.raises(ValueError, match="dtype='float8'"):
        beaconkv.load_model(ckpt, dtype="float8")
    with pytest.raises(ValueError, match="device='gpu0'"):
        beaconkv.load_model(ckpt, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            beaconkv.load_model(ckpt, device="cuda")


def test_no_second_copy_of_weights(tiny_models):
    # parameters are assigned from the loaded tensors, not copied into pre-allocated ones
    m = beaconkv.load_model(tiny_models["llama"][0])
    assert all(p.device.type == "cpu" and not p.is_meta for p in m.parameters())
    assert loading.resolve_dtype(None) is torch.float32


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float64, torch.int8, "float8"])
def test_unsupported_dtypes_are_rejected_before_reading_weights(ckpt, monkeypatch, dtype):
    monkeypatch.setattr(loading, "safe_open", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match=r"dtype=.*not supported.*float32, bfloat16 or float16"):
        beaconkv.load_model(ckpt, dtype=dtype)


def test_broken_config_json_names_the_file(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64,')
    with pytest.raises(ConfigFileError, match=rf"{re.escape(str(ckpt / 'config.json'))} is not valid JSON \(line 1"):
        beaconkv.load_model(ckpt)


def test_config_without_a_required_key_names_it_and_the_file(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigFileError, match=r"config.json: the qwen2 config lacks integer values for num_hidden_la"):
        beaconkv.load_model(ckpt)


def test_broken_shard_index_names_the_file(tiny_models, tmp_path):
    tiny_models["llama"][1].save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a valid safetensors index"):
        beaconkv.load_model(tmp_path)


def test_offline_hub_id_says_why_and_what_to_do(monkeypatch):
    def offline(repo_id, allow_patterns):
        raise OSError("Cannot find an appropriate cached snapshot folder\nfor the specified revision")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'someone/nonexistent-model' is not a local dir.*HF_HUB_OFFLINE"):
        beaconkv.load_model("someone/nonexistent-model")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(FileNotFoundError, match=r"neither a local directory nor a downloadable hub repo .*repo id"):
        beaconkv.load_model("someone/nonexistent-model")


# --------------------------------------------------------------------------------------------
# nothing a config or a header says is trusted


def _set_config(ckpt, **values):
    cfg = json.loads((ckpt / "config.json").read_text())
    for key, value in values.items():
        if value is _DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))


_DELETE = object()


def _edit_header(path, edit):
    """Rewrites the JSON header of a safetensors file in place, keeping its data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


@pytest.fixture()
def never_built(monkeypatch):
    """Fails the test if a model is built (the checks must come first)."""
    monkeypatch.setattr(loading, "build_model", lambda *a, **k: pytest.fail("the model was built"))


@pytest.mark.parametrize(("layers", "error", "message"), [
    (1_000_000_000, ConfigFileError,
     r"config.json: num_hidden_layers=1000000000 is above the limit of 1024.*CONFIG_LIMITS"),
    (1000, CheckpointError, r"config.json: num_hidden_layers=1000, but the checkpoint's tensors hold layers 0..1; "
                            r"set num_hidden_layers to 2"),
    (1, CheckpointError,
     r"num_hidden_layers=1, but the checkpoint's tensors hold layers 0..1; set num_hidden_layers to 2"),
    (0, ConfigFileError, r"num_hidden_layers=0 must be at least 1"),
])
def test_layer_count_is_checked_against_the_checkpoint_before_building(ckpt, never_built, layers, error, message):
    _set_config(ckpt, num_hidden_layers=layers)
    with pytest.raises(error, match=message):
        beaconkv.load_model(ckpt)


def test_a_missing_layer_is_named(ckpt, never_built):
    _rewrite(ckpt, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")])
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=2, but the checkpoint's tensors hold layers 0..0; "
                                              r"set num_hidden_layers to 1"):
        beaconkv.load_model(ckpt)
    _set_config(ckpt, num_hidden_layers=1)
    _rewrite(ckpt, lambda t: t.update({k.replace("layers.0.", "layers.3."): v.clone() for k, v in t.items()}))
    _set_config(ckpt, num_hidden_layers=4)
    with pytest.raises(CheckpointError, match=r"the layer indices \[0, 3\]; restore the tensors of layers \[1, 2\]"):
        beaconkv.load_model(ckpt)


@pytest.mark.parametrize("dtype", ["I32", "U32", "I16", "BOOL", "F8_E4M3", "I64", "F64"])
def test_a_non_float_header_dtype_is_refused_naming_tensor_and_dtype(ckpt, never_built, dtype):
    name = "model.layers.0.self_attn.q_proj.weight"

    def retype(header):  # the same bytes: the F32 shape for a 4-byte dtype, more or fewer rows for the others
        entry = header[name]
        size = {"I32": 4, "U32": 4, "I16": 2, "BOOL": 1, "F8_E4M3": 1, "I64": 8, "F64": 8}[dtype]
        rows, cols = entry["shape"]
        entry["dtype"], entry["shape"] = dtype, [rows * 4 // size, cols]

    _edit_header(ckpt / "model.safetensors", retype)
    listed = rf"\['{re.escape(name)} \({dtype}, in model.safetensors\)'\]"
    with pytest.raises(CheckpointError, match=listed + ".*F32, F16, BF16"):
        beaconkv.load_model(ckpt)


@pytest.mark.parametrize(("value", "message"), [
    (-64, r"head_dim=-64 must be at least 1"),
    (0, r"head_dim=0 must be at least 1"),
    (7, r"head_dim=7 must be even"),
    (10**6, r"head_dim=1000000 is above the limit of 4096"),
    (24.0, r"head_dim=24.0 must be an integer, not a number with a fraction; write it as a JSON integer "
           r"\(24, not 24.0\)"),
    ("24", r"head_dim='24' must be an integer, not a string; write it as a JSON integer, without quotes \(24\)"),
    (True, r"head_dim=True must be an integer, not a boolean"),
])
def test_head_dim_out_of_type_or_range_names_file_field_and_value(tiny_models, tmp_path, never_built, value, message):
    shutil.copytree(tiny_models["qwen3"][0], tmp_path / "q3")
    _set_config(tmp_path / "q3", head_dim=value)
    with pytest.raises(ConfigFileError, match=re.escape(str(tmp_path / "q3" / "config.json")) + ": " + message):
        beaconkv.load_model(tmp_path / "q3")


def test_head_dim_inconsistent_with_the_projections(tiny_models, tmp_path, never_built, monkeypatch):
    q3 = tmp_path / "q3"
    shutil.copytree(tiny_models["qwen3"][0], q3)
    _set_config(q3, head_dim=16)  # the checkpoint's heads are 24 wide
    with pytest.raises(CheckpointError, match=r"config.json: head_dim=16, but model.layers.0.self_attn.q_norm.weight "
                                              r"in .*model.safetensors has shape \(24,\); set head_dim to 24"):
        beaconkv.load_model(q3)
    llama = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"][0], llama)
    # without q/k norms, heads x head_dim is all a checkpoint says: 2 heads of 32 fit the tensors (as in transformers)
    _set_config(llama, head_dim=_DELETE, num_attention_heads=2, num_key_value_heads=1)
    with monkeypatch.context() as m:
        m.setattr(loading, "build_model", build_model)
        assert beaconkv.load_model(llama).config.head_dim == 32
    _set_config(llama, head_dim=8, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(CheckpointError, match=r"num_attention_heads=4 x head_dim=8 = 32 query rows.*q_proj.weight "
                                              r"in .* has shape \(64, 64\); set num_attention_heads and head_dim so "
                                              r"that their product is 64 \(e.g. head_dim=16 with "
                                              r"num_attention_heads=4 or num_attention_heads=8 with head_dim=8\)"):
        beaconkv.load_model(llama)
    _set_config(llama, head_dim=16, num_key_value_heads=4)
    with pytest.raises(CheckpointError, match=r"num_key_value_heads=4 x head_dim=16 = 64 key rows.*k_proj.weight in .* "
                                              r"has shape \(32, 64\); set num_key_value_heads to 2"):
        beaconkv.load_model(llama)


@pytest.mark.parametrize(("values", "message"), [
    ({"vocab_size": 98},
     r"vocab_size=98, but model.embed_tokens.weight in .* has shape \(97, 64\); set vocab_size to 97"),
    ({"hidden_size": 32}, r"hidden_size=32, but model.embed_tokens.weight .* set hidden_size to 64"),
    ({"intermediate_size": 95}, r"intermediate_size=95, but model.layers.0.mlp.gate_proj.weight .* \(96, 64\); "
                                r"set intermediate_size to 96"),
    ({"num_attention_heads": 8}, r"num_key_value_heads=2 x head_dim=8 = 16 key rows \(config.json has no head_dim: it "
                                 r"is hidden_size // num_attention_heads\), but model.layers.0.self_attn.k_proj"
                                 r".weight in .* has shape \(32, 64\); set num_key_value_heads to 4"),
])
def test_widths_are_checked_against_the_tensors(ckpt, never_built, values, message):
    _set_config(ckpt, **values)
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "config.json")) + ": (" + message + ")"):
        beaconkv.load_model(ckpt)


def test_flags_that_disagree_with_the_tensors_say_which_way_to_set_them(tiny_models, tmp_path, never_built):
    llama = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"][0], llama)
    _set_config(llama, tie_word_embeddings=True)  # loads: the checkpoint's lm_head is then ignored
    _set_config(llama, attention_bias=True)
    with pytest.raises(CheckpointError, match=r"attention_bias=true, but the checkpoint has no "
                                              r"model.layers.0.self_attn.q_proj.bias; set attention_bias to false"):
        beaconkv.load_model(llama)
    q3 = tmp_path / "q3"
    shutil.copytree(tiny_models["qwen3"][0], q3)
    _set_config(q3, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings=false, but the checkpoint has no lm_head.weight; "
                                              r"if the model's head shares the token embedding, set "
                                              r"tie_word_embeddings to true"):
        beaconkv.load_model(q3)


@pytest.mark.parametrize(("values", "error", "message"), [
    ({"num_hidden_layers": 2.0}, ConfigFileError, r"num_hidden_layers=2.0 must be an integer.*\(2, not 2.0\)"),
    ({"vocab_size": "97"}, ConfigFileError, r"vocab_size='97' must be an integer, not a string.*without quotes \(97\)"),
    ({"hidden_size": False}, ConfigFileError, r"hidden_size=False must be an integer, not a boolean"),
    ({"num_key_value_heads": 3}, ConfigFileError, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"num_key_value_heads": 0}, ConfigFileError, r"num_key_value_heads=0 must be at least 1"),
    ({"max_position_embeddings": -1}, ConfigFileError, r"max_position_embeddings=-1 must be at least 1"),
    ({"max_position_embeddings": 1 << 40}, ConfigFileError,
     r"max_position_embeddings=1099511627776 is above the limit"),
    ({"rms_norm_eps": 0}, ConfigFileError, r"rms_norm_eps=0 must be a finite number greater than 0 and at most 1;"),
    ({"rms_norm_eps": "1e-6"}, ConfigFileError, r"rms_norm_eps='1e-6' must be a number, not a string"),
    ({"rms_norm_eps": float("nan")}, ConfigFileError, r"rms_norm_eps=nan must be a finite number"),
    ({"tie_word_embeddings": "false"}, ConfigFileError, r"tie_word_embeddings='false' must be true or false \(a JSON "
                                                        r"boolean\), not a string"),
    ({"attention_bias": 1}, ConfigFileError, r"attention_bias=1 must be true or false"),
    ({"eos_token_id": 97}, ConfigFileError, r"eos_token_id=97: id 97 is outside the vocabulary \(vocab_size=97\)"),
    ({"eos_token_id": [2, "x"]}, ConfigFileError, r"eos_token_id='x' must be an integer"),
    ({"bos_token_id": -1}, ConfigFileError, r"bos_token_id=-1 must be at least 0"),
    ({"rope_parameters": {"rope_theta": -5}}, ConfigFileError,
     r"rope_theta=-5 must be a finite number greater than 1;"),
    ({"rope_parameters": None, "rope_theta": "1e6"}, ConfigFileError,
     r"rope_theta='1e6' must be a number, not a string"),
    ({"rope_parameters": "default"}, ConfigFileError,
     r"rope_parameters='default' must be an object or null, not a string"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ConfigFileError,
     r"yarn rope scaling needs 'original_max_position_embeddings'"),
    ({"rope_parameters": {"rope_type": "yarn"}}, ConfigFileError,
     r"yarn rope scaling needs 'original_max_position_embeddings'"),
    ({"rope_parameters": {"rope_type": "linear"}}, ConfigFileError, r"linear rope scaling needs 'factor'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64.5}}, ConfigFileError,
     r"rope_scaling.original_max_position_embeddings=64.5 must be an integer"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, ConfigFileError,
     r"rope_scaling.factor=0 must be a finite number at least 1 and at most 16777216;"),
    ({"rope_parameters": {"rope_type": 3}}, ConfigFileError, r"rope_type=3 must be a string, not an integer"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, UnsupportedModelError,
     r"rope_type='dynamic' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, UnsupportedModelError,
     r"rope parameters per layer type"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, r"hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, UnsupportedModelError, r"use_sliding_window=true is not supported"),
    ({"use_sliding_window": "no"}, ConfigFileError, r"use_sliding_window='no' must be true or false"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, UnsupportedModelError,
     r"layer_types \['sliding_attention'\] are not supported"),
    ({"partial_rotary_factor": 0.5}, UnsupportedModelError, r"partial_rotary_factor=0.5 is not supported"),
    ({"model_type": ["qwen2"]}, UnsupportedModelError, r"model_type=\['qwen2'\] is not supported"),
])
def test_config_values_of_the_wrong_type_or_range(ckpt, never_built, values, error, message):
    _set_config(ckpt, **values)
    with pytest.raises(error, match=re.escape(str(ckpt / "config.json")) + ": " + message):
        beaconkv.load_model(ckpt)


def test_neutral_config_spellings_still_load(ckpt):
    ref = beaconkv.load_model(ckpt)
    ids = torch.arange(3, 30)[None]
    # nulls count as absent; unknown keys are ignored; an integer rope_theta is a number
    _set_config(ckpt, bos_token_id=None, eos_token_id=[2, 1], rope_scaling=None, sliding_window=None,
                some_future_key={"a": [1, 2]}, num_key_value_heads=2, rope_parameters={"rope_theta": 1000000,
                                                                                        "rope_type": "default"})
    torch.testing.assert_close(beaconkv.load_model(ckpt)(ids), ref(ids), atol=0, rtol=0)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"vocab_size": ' + "9" * 5000 + "}", "\xff{}"],
                         ids=["deep nesting", "a 5000-digit integer", "invalid UTF-8"])
def test_config_json_that_json_cannot_decode_names_the_file(ckpt, never_built, text):
    (ckpt / "config.json").write_bytes(text.encode("utf-8") if not text.startswith("\xff") else b"\xff{}")
    with pytest.raises(ConfigFileError, match=rf"{re.escape(str(ckpt / 'config.json'))} is not valid JSON"):
        beaconkv.load_model(ckpt)


def test_shard_index_is_not_trusted(tiny_models, tmp_path, never_built):
    tiny_models["llama"][1].save_pretrained(tmp_path, max_shard_size="20KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))

    def write(weight_map):
        index_path.write_text(json.dumps({**index, "weight_map": weight_map}))

    write({**index["weight_map"], "model.norm.weight": "../../etc/passwd"})
    with pytest.raises(CheckpointError, match=r"weight_map must map tensor names to file names in"):
        beaconkv.load_model(tmp_path)
    write({**index["weight_map"], "model.norm.weight": 3})
    with pytest.raises(CheckpointError, match=r"weight_map must map tensor names to file names"):
        beaconkv.load_model(tmp_path)
    wrong = shards[0] if index["weight_map"]["model.norm.weight"] != shards[0] else shards[1]
    write({**index["weight_map"], "model.norm.weight": wrong})
    with pytest.raises(CheckpointError,
                       match=r"lists tensors that are not in the shard it names: \['model.norm.weight'\]"):
        beaconkv.load_model(tmp_path)
    write(index["weight_map"])
    first = load_file(tmp_path / shards[0])
    other = tmp_path / shards[1]
    save_file({**load_file(other), next(iter(first)): next(iter(first.values()))}, other)
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(next(iter(first)))} is stored twice"):
        beaconkv.load_model(tmp_path)


def test_misshaped_tensors_are_refused_without_reading_data(ckpt, never_built, monkeypatch):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.ones(96, 63)))
    monkeypatch.setattr(loading, "build_model", build_model)  # building is fine here; reading data is not
    real_open = loading.safe_open

    class HeadersOnly:
        def __init__(self, *a, **k):
            self.handle = real_open(*a, **k)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return self.handle.get_slice(name)

        def get_tensor(self, name):
            pytest.fail("tensor data was read")

    monkeypatch.setattr(loading, "safe_open", HeadersOnly)
    with pytest.raises(CheckpointError,
                       match=r"model.layers.1.mlp.up_proj.weight: checkpoint \(96, 63\) vs model \(96, 64\)"):
        beaconkv.load_model(ckpt)


# --------------------------------------------------------------------------------------------
# injected components: their own buffers are real after loading


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class MaskedAttention(Attention):
    """The default attention, with its logit scale and a (neutral) key mask as non-persistent buffers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_buffer("logit_scale", torch.tensor(1.0 / math.sqrt(kwargs["head_dim"])), persistent=False)
        self.register_buffer("head_mask", torch.ones(kwargs["n_heads"], 1, 1), persistent=False)

    def forward(self, x, positions, rotary, valid=None, cache=None, decode=False):
        assert self.logit_scale.device == x.device and self.head_mask.device == x.device
        self.scale = self.logit_scale.item()
        return super().forward(x, positions, rotary, valid, cache, decode)


class CountingMLP(SwiGLUMLP):
    """SwiGLU with a buffer made from constants, and a count of how often it is constructed."""

    made = 0

    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size)
        CountingMLP.made += 1
        self.register_buffer("gain", torch.full((config.hidden_size,), 2.0), persistent=False)

    def forward(self, x):
        return super().forward(x) * (self.gain / 2)


@pytest.mark.parametrize("device", DEVICES)
def test_non_persistent_buffers_of_injected_components_are_materialised(tiny_models, device):
    d = tiny_models["qwen3"][0]
    CountingMLP.made = 0
    model = beaconkv.load_model(d, device=device, attention=MaskedAttention, mlp=CountingMLP)
    assert CountingMLP.made == model.config.num_hidden_layers  # each component's __init__ ran once
    layer = model.model.layers[1]
    assert layer.self_attn.logit_scale.device.type == device and layer.mlp.gain.device.type == device
    assert layer.self_attn.logit_scale.item() == pytest.approx(1 / math.sqrt(24))
    assert torch.equal(layer.mlp.gain.cpu(), torch.full((64,), 2.0))
    assert layer.self_attn.head_mask.dtype == torch.float32
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ids = torch.arange(3, 30, device=device)[None]
    reference = beaconkv.load_model(d, device=device)
    torch.testing.assert_close(model(ids), reference(ids), atol=0, rtol=0)
    cache = KVCache.allocate(2, 1, 2, 4, 40, 24, device=device)
    logits = model.prefill(ids, torch.ones_like(ids, dtype=torch.bool), cache)
    assert torch.isfinite(logits).all()


class OffsetRope(RotaryEmbedding):
    """The checkpoint's rotary embedding at positions shifted by a non-persistent buffer."""

    def __init__(self, config):
        super().__init__(config.head_dim, config.rope)
        self.register_buffer("shift", torch.tensor(3.0), persistent=False)

    def cos_sin(self, positions):
        return super().cos_sin(positions + self.shift)


@pytest.mark.parametrize("device", DEVICES)
def test_the_buffers_of_a_rope_factory_are_on_the_device(tiny_models, device):
    model = beaconkv.load_model(tiny_models["llama"][0], device=device, rope=OffsetRope)
    assert model.rope.shift.device.type == device and model.rope.shift.item() == 3.0
    assert all(layer.self_attn.rope is model.rope for layer in model.model.layers)
    assert torch.isfinite(model(torch.arange(3, 30, device=device)[None])).all()


def test_a_buffer_computed_from_a_parameter_is_named(tiny_models):
    class FromWeight(Attention):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.register_buffer("q_norm_sq", self.q_proj.weight.pow(2).sum(), persistent=False)

    with pytest.raises(MetaTensorError, match=r"model.layers.0.self_attn.q_norm_sq \(a buffer of FromWeight\) is still "
                                              r"on the meta device: its __init__ computed it from a parameter"):
        beaconkv.load_model(tiny_models["qwen2"][0], attention=FromWeight)


def test_buffers_move_to_the_device_keeping_dtype_and_sharing():
    shared = torch.arange(4)
    a, b = torch.nn.Module(), torch.nn.Module()
    a.register_buffer("table", shared, persistent=False)
    b.register_buffer("table", shared, persistent=False)
    b.register_buffer("scale", torch.tensor(0.5, dtype=torch.float64))
    model = torch.nn.ModuleList([a, b])
    loading._place_buffers(model, torch.device("meta"))  # a device this machine surely has
    assert a.table.is_meta and b.scale.is_meta and b.scale.dtype == torch.float64 and a.table.dtype == torch.int64
    assert a.table is b.table


def test_the_parameter_hook_acts_on_the_loading_thread_only():
    import threading

    made = {}
    with loading._parameters_on_meta():
        inside = torch.nn.Linear(2, 2)
        worker = threading.Thread(target=lambda: made.setdefault("other", torch.nn.Linear(2, 2)))
        worker.start()
        worker.join()
    assert inside.weight.is_meta and not made["other"].weight.is_meta


def test_the_parameter_hook_is_gone_after_loading(tiny_models):
    beaconkv.load_model(tiny_models["qwen2"][0])
    assert not torch.nn.Linear(2, 2).weight.is_meta
    with pytest.raises(ZeroDivisionError):
        beaconkv.load_model(tiny_models["qwen2"][0], attention=lambda **kw: 1 / 0)
    assert not torch.nn.Linear(2, 2).weight.is_meta


# ------------------------------------------------------------------------------ weights that are not numbers
@pytest.mark.parametrize("value,kind", [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "-inf")])
def test_a_non_finite_weight_is_refused_naming_the_tensor_and_the_file(ckpt, value, kind):
    """A NaN weight used to load, and the server answered every request with an empty 200."""
    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = value
        t["model.layers.1.mlp.down_proj.weight"][0, 0] = value

    _rewrite(ckpt, poison)
    with pytest.raises(CheckpointError) as err:
        beaconkv.load_model(ckpt)
    message = str(err.value)
    assert "model.layers.1.mlp.down_proj.weight" in message and str(ckpt / "model.safetensors") in message
    assert "has 2 of " in message and "NaN or infinite" in message and "check_finite=False" in message
    model = beaconkv.load_model(ckpt, check_finite=False)  # the documented way out
    assert not torch.isfinite(model.model.layers[1].mlp.down_proj.weight).all()


def test_a_weight_that_overflows_the_requested_dtype_is_refused(ckpt):
    _rewrite(ckpt, lambda t: t["model.norm.weight"].__setitem__(7, 1e6))  # finite in float32, not in float16
    assert torch.isfinite(beaconkv.load_model(ckpt).model.norm.weight).all()
    with pytest.raises(CheckpointError, match=r"model.norm.weight in .* has 1 of 64 values beyond the range of "
                                              r"torch.float16 \(finite as stored in torch.float32\); load the model in "
                                              r"a wider dtype"):
        beaconkv.load_model(ckpt, dtype="float16")


def test_finite_weights_whose_sum_overflows_load(ckpt):
    """The check sums each tensor first; huge but finite values overflow that sum without being refused."""
    def huge(t):
        t["model.norm.weight"][:] = 3e38

    _rewrite(ckpt, huge)
    model = beaconkv.load_model(ckpt)
    assert (model.model.norm.weight == 3e38).all()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([0.0, -1.5, 2.0, 3e38, -3e38, 1e-45, float("nan"), float("inf"), -float("inf")]),
                min_size=1, max_size=12))
def test_the_check_refuses_exactly_the_tensors_with_a_non_finite_value(values):
    tensor = torch.tensor(values, dtype=torch.float32)
    bad = sum(not math.isfinite(v) for v in values)
    if bad:
        with pytest.raises(CheckpointError, match=f"has {bad} of {len(values)} values"):
            loading.refuse_non_finite("w", tensor, Path("f.safetensors"))
    else:
        loading.refuse_non_finite("w", tensor, Path("f.safetensors"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_check_reads_every_dtype(ckpt, dtype):
    """A NaN is found whatever the dtype the model is loaded in (bfloat16 by its bits: numpy has no bfloat16)."""
    _rewrite(ckpt, lambda t: t["model.layers.0.self_attn.k_proj.weight"].__setitem__((1, 2), float("nan")))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj.weight in .* has 1 of \d+ values "
                                              "that are NaN or infinite"):
        beaconkv.load_model(ckpt, dtype=dtype)
    for value in (-float("inf"), 65504.0, -3.0e38):  # bfloat16 bits: an infinity, and large finite values
        t = torch.full((5,), value, dtype=torch.bfloat16)
        assert loading._plausibly_finite(t) == math.isfinite(float(t[0]))
