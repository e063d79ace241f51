"""The embedded real model through beaconkv's own loader: logits match transformers on the same directory."""

from __future__ import annotations

import torch

import beaconkv


def test_embedded_logits_match_transformers_on_converted_directory():
    from transformers import LlamaForCausalLM

    path = beaconkv.embedded_model_path()
    ours = beaconkv.load_model(path)
    ref = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    tok = beaconkv.load_tokenizer(path)
    ids = torch.tensor([tok.encode(tok.chat_prompt("The capital of France is"))])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=0)
    assert ours.config.num_hidden_layers == 30 and ours.config.head_dim == 64


def test_embedded_model_writes_english():
    path = beaconkv.embedded_model_path()
    model, tok = beaconkv.load_model(path), beaconkv.load_tokenizer(path)
    out = beaconkv.generate(model, tok, ["What is the capital of France?"], chat=True, max_new_tokens=12)
    assert "Paris" in out.texts[0]


def test_the_random_smollm2_shape_is_the_embedded_models():
    """``--model smollm2-135m`` (random weights, for a machine without the embedded model's package) must keep
    the embedded model's architecture, or its speed figures stop standing for the embedded model's."""
    from beaconkv.models.config import ModelConfig
    from beaconkv.models.random_weights import smollm2_135m_config

    embedded = ModelConfig.from_file(beaconkv.embedded_model_path() / "config.json")
    shape = smollm2_135m_config()
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "qk_norm",
                  "attention_bias"):
        assert getattr(shape, field) == getattr(embedded, field), field
    assert shape.rope.theta == embedded.rope.theta
    assert abs(shape.rms_norm_eps - embedded.rms_norm_eps) < 1e-9
