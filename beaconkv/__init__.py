"""beaconkv: long chain-of-thought decoding with a compressed KV cache, in pure PyTorch.

Public API::

    import beaconkv

    model = beaconkv.load_model(path_or_hub_id, dtype=torch.bfloat16, device="cuda")
    tok = beaconkv.load_tokenizer(path_or_hub_id)
    out = beaconkv.generate(model, tok, prompts, max_new_tokens=256, policy=beaconkv.BeaconKV(budget=2048))

A policy comes from its class (``beaconkv.SnapKV(budget=1024)``) or from its registry name
(``beaconkv.make_policy("snapkv", budget=1024)``, the one factory the command line uses). Every error
beaconkv raises on purpose is a :class:`BeaconKVError`.
"""

from .cache import CacheCapacityError, KVCache, LayerKVCache
from .engine import Completion, Engine, EngineError, QueueFullError, Request
from .errors import BeaconKVError
from .execution import CompileConfig, CompileError, HostSyncError
from .generation import GenerationOutput, GenerationStats, PromptError, generate
from .models import CausalLM, ModelConfig, build_model, load_model
from .models.config import ConfigFileError, UnsupportedModelError
from .models.embedded import embedded_model_path
from .models.loading import CheckpointError, MetaTensorError
from .policies import (
    RKV,
    RPC,
    AtBudget,
    BeaconKV,
    Buffered,
    EventBeaconKV,
    EvictionPolicy,
    ExpectedAttention,
    FullKV,
    GroupBeaconKV,
    H2O,
    HeadAdaptive,
    InitialRecent,
    KeyDiff,
    KNorm,
    LazyEviction,
    MemoryBeaconKV,
    Periodic,
    PolicyConfigError,
    Schedule,
    Shared,
    SnapKV,
    StreamingLLM,
    TOVA,
    TriAttention,
    Uniform,
    make_policy,
    policy_names,
    register_policy,
)
from .sampling import SamplingError, SamplingParams
from .decode_setup import DecodeSetup
from .session import Session
from .storage import DenseKV, Int8KV, KVStorage, StorageError
from .tokenizer import Tokenizer, TokenizerFileError, load_tokenizer


__version__ = "0.1.0"
"""The package version."""
__all__ = [
    # loading and generating
    "CausalLM", "ModelConfig", "Tokenizer", "build_model", "embedded_model_path", "generate", "load_model",
    "load_tokenizer", "GenerationOutput", "GenerationStats", "SamplingParams",
    # serving many requests
    "Completion", "DecodeSetup", "Engine", "Request", "Session",
    # policies: by class, or by registry name
    "BeaconKV", "EventBeaconKV", "EvictionPolicy", "FullKV", "GroupBeaconKV", "H2O", "InitialRecent", "MemoryBeaconKV",
    "RKV", "RPC", "SnapKV", "StreamingLLM", "ExpectedAttention", "KeyDiff", "KNorm", "LazyEviction", "TOVA",
    "TriAttention",
    "make_policy", "policy_names", "register_policy",
    # when a policy evicts: the schedules
    "AtBudget", "Buffered", "Periodic", "Schedule",
    # how a layer's keep count is split between its KV heads: the allocations
    "HeadAdaptive", "Shared", "Uniform",
    # cache, storage, execution
    "CompileConfig", "DenseKV", "Int8KV", "KVCache", "KVStorage", "LayerKVCache",
    # the error family
    "BeaconKVError", "CacheCapacityError", "CheckpointError", "CompileError", "ConfigFileError", "EngineError",
    "HostSyncError", "MetaTensorError", "PolicyConfigError", "PromptError", "QueueFullError", "SamplingError",
    "StorageError", "TokenizerFileError", "UnsupportedModelError",
]
