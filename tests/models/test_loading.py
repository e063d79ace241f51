"""Checkpoint loading: sharded files, hub ids, config spellings, and a clear error for every bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import beaconkv
from beaconkv.models import CheckpointError, ConfigFileError, ModelConfig, UnsupportedModelError, loading



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
