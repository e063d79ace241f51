"""KV-cache eviction policies: BeaconKV and its baselines, behind one base class.

Every policy subclasses :class:`EvictionPolicy` and returns per-slot scores; protection of the
prefix and recent tokens, top-k and in-place compaction are shared. Build one by class or by name
with :func:`make_policy`.
"""

from .base import EvictionPolicy, EvictionRecord, FullKV, PolicyConfigError, select_keep
from .beacon import BeaconKV, InitialRecent
from .registry import make_policy, policy_class, policy_names, register_policy
from .samplers import FPS, ContinualFPS, KMeans, NaiveFPS, QuerySampler

__all__ = [
    "BeaconKV", "ContinualFPS", "EvictionPolicy", "EvictionRecord", "FPS", "FullKV", "InitialRecent", "KMeans",
    "NaiveFPS", "PolicyConfigError", "QuerySampler", "make_policy", "policy_class", "policy_names",
    "register_policy", "select_keep",
]


def __getattr__(name: str):
    """Lazily exposes the baselines (``SnapKV``, ``RPC``, ``RKV``, ``H2O``, ``StreamingLLM``)."""
    lazy = {"SnapKV": "snapkv", "RPC": "rpc", "RKV": "rkv", "H2O": "h2o", "StreamingLLM": "streaming"}
    if name in lazy:
        return policy_class(lazy[name])
    raise AttributeError(name)
