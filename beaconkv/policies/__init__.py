"""KV-cache eviction policies: BeaconKV and its baselines, behind one base class.

Every policy subclasses :class:`EvictionPolicy` (a dataclass of settings) and returns per-slot
scores; protection of the prefix and recent tokens, top-k and in-place compaction are shared. What a
policy remembers while decoding lives in the :class:`PolicyState` it creates for a cache. Build one
by class or by name with :func:`make_policy`.
"""

from .base import EvictionPolicy, FullKV
from .beacon import BeaconKV, BeaconState, InitialRecent
from .config import PolicyConfigError
from .event_beacon import EventBeaconKV
from .group_beacon import GroupBeaconKV
from .h2o import H2O
from .memory_beacon import MemoryBeaconKV
from .query_set import QuerySet
from .registry import (
    make_policy,
    policy_class,
    policy_names,
    policy_parameters,
    register_policy,
)
from .rkv import RKV
from .rpc import RPC
from .samplers import FPS, ContinualFPS, KMeans, NaiveFPS, QuerySampler
from .selection import select_keep
from .snapkv import SnapKV
from .state import EvictionRecord, PolicyState, PolicyStats
from .streaming import StreamingLLM
from .window import RecentWindowPolicy

__all__ = [
    "BeaconKV", "BeaconState", "ContinualFPS", "EventBeaconKV", "EvictionPolicy", "EvictionRecord", "FPS", "FullKV",
    "GroupBeaconKV", "H2O",
    "InitialRecent", "KMeans", "MemoryBeaconKV", "NaiveFPS", "PolicyConfigError", "PolicyState", "PolicyStats", "QuerySampler",
    "QuerySet", "RKV", "RPC", "RecentWindowPolicy", "SnapKV", "StreamingLLM", "make_policy", "policy_class",
    "policy_names", "policy_parameters", "register_policy", "select_keep",
]
