"""Models with random weights of a given architecture, built in place (benchmarks of large shapes)."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .decoder import CausalLM, build_model, default_rope


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
