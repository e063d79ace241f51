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
