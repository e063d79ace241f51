"""Shared fixtures: tiny random-weight transformers models saved as checkpoints (the parity oracle), one
of them with a word tokenizer for the command line; and the Hypothesis profiles.

Hypothesis profiles: ``ci`` (the default: ``derandomize=True``, no example database, so every run of
``make test`` on any machine draws the same examples) and ``dev`` (random examples, a fresh seed each
run). Choose one with ``HYPOTHESIS_PROFILE=dev`` or ``pytest --hypothesis-profile dev``; a failing
random example is reproduced with the ``--hypothesis-seed`` (or the ``@reproduce_failure`` blob) it
prints.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)  # random; failures replay from .hypothesis/
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def tiny_hf_config(kind: str):
    """A tiny transformers config of each supported architecture, exercising its quirks."""
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.2)
    if kind == "llama":  # llama3 rope scaling, untied embeddings
        return tf.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "qwen2":  # q/k/v biases
        return tf.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
    if kind == "qwen3":  # q/k norms, tied embeddings, head_dim != hidden / heads
        return tf.Qwen3Config(**common, head_dim=24, tie_word_embeddings=True, rope_theta=1e6)
    if kind == "qwen3_yarn":
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True, rope_theta=1e6,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 128})
    raise ValueError(kind)


def save_tiny_model(kind: str, directory: Path, seed: int = 0):
    """Builds a random transformers model of ``kind``, saves it, returns the HF model (fp32, eval)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_hf_config(kind), attn_implementation="eager")
    with torch.no_grad():  # make norms and biases non-trivial so parity checks them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Maps kind -> (checkpoint dir, transformers model)."""
    out = {}
    for kind in ("llama", "qwen2", "qwen3"):
        d = tmp_path_factory.mktemp(kind)
        out[kind] = (d, save_tiny_model(kind, d))
    return out


@pytest.fixture(scope="module")
def llama(tiny_models):
    """The tiny random llama loaded by beaconkv (fp32, CPU), once per test module."""
    import beaconkv

    return beaconkv.load_model(tiny_models["llama"][0])


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: tiny tensors only pay for more threads, worst on a shared machine.
    A module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_models, tmp_path_factory) -> Path:
    """The tiny random llama as a checkpoint the CLI can load: weights, config and a 97-token word tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    d = tmp_path_factory.mktemp("tiny_cli")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_models["llama"][0] / name, d / name)
    words = ["<unk>", "<s>", "</s>", *string.ascii_lowercase, *[f"w{i}" for i in range(97 - 29)]]
    tok = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return d
