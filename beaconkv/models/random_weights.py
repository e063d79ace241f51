"""Models with random weights of a given architecture, built in place (benchmarks of large shapes), and
the named shapes the benchmarks and the GPU check use (:data:`RANDOM_SHAPES`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import ModelConfig, RopeConfig
from .decoder import CausalLM, build_model, default_rope


def qwen3_4b_config() -> ModelConfig:
    """The architecture of Qwen3-4B (36 layers, hidden 2560, 32 query / 8 KV heads of 128, vocab 151936)."""
    return ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True, rope=RopeConfig(theta=1e6),
    )


def qwen3_tiny_config() -> ModelConfig:
    """A tiny Qwen3 shape with every quirk of the real one (q/k norms, tied embeddings, GQA, ``head_dim``
    unequal to ``hidden / heads``) and the embedded tokenizer's vocabulary (49152), so that any stage of a
    benchmark or of ``scripts/gpu_check.sh --smoke`` runs on a CPU in seconds with real prompts."""
    return ModelConfig(
        model_type="qwen3", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True, rope=RopeConfig(theta=1e6),
    )


def smollm2_135m_config() -> ModelConfig:
    """The architecture of the embedded SmolLM2-135M (llama: 30 layers, hidden 576, 9 query / 3 KV heads of 64,
    vocab 49152), for speed checks where the embedded model's package cannot be installed."""
    return ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=True, rope=RopeConfig(theta=1e5),
    )


RANDOM_SHAPES: dict[str, Callable[[], ModelConfig]] = {
    "qwen3-4b": qwen3_4b_config, "qwen3-tiny": qwen3_tiny_config, "smollm2-135m": smollm2_135m_config}
"""Named architectures a benchmark can run with random weights (``--model qwen3-4b``, ``qwen3-tiny``,
``smollm2-135m``)."""


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> CausalLM:
    """Builds ``config`` with random weights directly in ``dtype`` on ``device`` (no float32 copy).

    Linear and embedding weights are ``N(0, 0.02)``, norms 1: logits of a plausible scale, so the
    generated ids are as varied as a real model's (speed and memory do not depend on the values).

    Args:
        config: The architecture (e.g. a Qwen3-4B shape for a GPU benchmark).
        dtype: Parameter dtype.
        device: Where the weights are created.
        seed: Seed of the weights.
    """
    device = torch.device(device)
    rope = default_rope(config).to(device)  # a real module: its tables are not weights
    with torch.device("meta"):
        model = build_model(config, rope=rope)
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        t = torch.empty(p.shape, dtype=dtype, device=device)
        state[name] = t.fill_(1.0) if "norm" in name else t.normal_(0.0, 0.02, generator=g)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
