"""beaconkv: long chain-of-thought decoding with a compressed KV cache, in pure PyTorch.

Public API::

    model = beaconkv.load_model(path_or_hub_id, dtype=torch.bfloat16, device="cuda")
    tok = beaconkv.load_tokenizer(path_or_hub_id)
    out = beaconkv.generate(model, tok, prompts, max_new_tokens=256, policy=BeaconKV(budget=2048))
"""

from .cache import KVCache, LayerKVCache
from .engine import Completion, Engine, Request
from .execution import CompileConfig, CompileError
from .generation import GenerationOutput, GenerationStats, PromptError, generate
from .models import CausalLM, ModelConfig, build_model, load_model
from .models.embedded import embedded_model_path
from .session import Session
from .storage import DenseKV, Int8KV, KVStorage
from .tokenizer import Tokenizer, load_tokenizer


__version__ = "0.1.0"
"""The package version."""
__all__ = [
    "CausalLM", "CompileConfig", "CompileError", "Completion", "DenseKV", "Engine", "GenerationOutput", "GenerationStats", "Int8KV",
    "KVCache", "KVStorage", "LayerKVCache", "ModelConfig", "PromptError", "Request", "Session", "Tokenizer", "build_model",
    "embedded_model_path", "generate", "load_model", "load_tokenizer",
]
