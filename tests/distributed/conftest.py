"""Fixtures of the tensor-parallel tests: tiny random checkpoints of every architecture, one with a single KV
head (GQA with fewer KV heads than ranks: the head is replicated), one with 3 KV heads (split 2 and 1), saved
once per session."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_hf_config

#: The checkpoints the gloo tests split: the three architectures; Qwen3 with one KV head for four query heads
#: (both ranks hold it: replicated); a llama with 3 KV heads (2 on rank 0, 1 on rank 1: an uneven split, as the
#: embedded SmolLM2-135M's 9 query / 3 KV heads over 2 ranks).
KINDS = ("qwen3", "llama", "qwen2", "gqa1", "kv3")

#: ``kind -> (architecture, config changes, seed)`` of the checkpoints not in ``tests/conftest.py``.
VARIANTS = {"gqa1": ("qwen3", {"num_key_value_heads": 1}, 1),
            "kv3": ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}, 2)}


def save_variant(kind: str, directory) -> None:
    """A tiny random checkpoint of :data:`VARIANTS`, with non-trivial norms (as ``save_tiny_model`` makes them)."""
    import transformers as tf

    base, changes, seed = VARIANTS[kind]
    config = tiny_hf_config(base)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.float().eval().save_pretrained(directory, safe_serialization=True)


@pytest.fixture(scope="session")
def tp_checkpoints(tiny_models, tmp_path_factory):
    """Maps kind -> checkpoint directory, for :data:`KINDS`."""
    out = {kind: tiny_models[kind][0] for kind in ("qwen3", "llama", "qwen2")}
    for kind in VARIANTS:
        out[kind] = tmp_path_factory.mktemp(kind)
        save_variant(kind, out[kind])
    return out


@pytest.fixture(scope="session")
def qwen3_cli_checkpoint(tiny_models, tiny_checkpoint, tmp_path_factory):
    """The tiny random Qwen3 with the 97-word tokenizer of ``tiny_checkpoint``: what the command line loads."""
    import shutil

    d = tmp_path_factory.mktemp("qwen3_cli")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_models["qwen3"][0] / name, d / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, d / name)
    return d
