"""Model components, configuration, builders and checkpoint loading."""

from .attention import Attention
from .config import ConfigFileError, ModelConfig, RopeConfig, UnsupportedModelError
from .decoder import CausalLM, DecoderLayer, DecoderModel, build_model
from .layers import RMSNorm, SwiGLUMLP
from .loading import CheckpointError, load_model
from .rope import RotaryEmbedding

__all__ = [
    "Attention", "CausalLM", "CheckpointError", "ConfigFileError", "DecoderLayer", "DecoderModel", "ModelConfig",
    "RMSNorm", "RopeConfig", "RotaryEmbedding", "SwiGLUMLP", "UnsupportedModelError", "build_model", "load_model",
]
