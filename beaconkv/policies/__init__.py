"""KV-cache eviction policies: BeaconKV and its baselines, behind one base class.

Every policy subclasses :class:`EvictionPolicy` (a dataclass of settings) and returns per-slot
scores; a :class:`PolicyDriver` runs it over a cache — rows, counters, when to evict, protection of the
prefix and recent tokens, top-k and in-place compaction, the same for every policy. What a
policy remembers while decoding lives in the :class:`PolicyState` it creates for a cache, with one
:class:`ObservedLayer` per layer: what the policy sees of it (the cache's keys and positions, its own
query ring and per-slot buffers), and what attention reports the layer's queries to. Build one
by class or by name with :func:`make_policy`. When it evicts and how much survives is its ``schedule``
(:class:`AtBudget`, the default; :class:`Buffered`; :class:`Periodic`), which any scorer takes. The building blocks of the shipped policies (the keep
selection, BeaconKV's state, the query set) stay in their modules
(:mod:`beaconkv.policies.selection`, :mod:`beaconkv.policies.beacon`, :mod:`beaconkv.policies.query_set`).
"""

from .allocation import Allocation, HeadAdaptive, Shared, Uniform, parse_allocation
from .base import EvictionPolicy, FullKV
from .beacon import BeaconKV, InitialRecent
from .config import PolicyConfigError
from .driver import PolicyDriver
from .event_beacon import EventBeaconKV
from .expected_attention import ExpectedAttention
from .group_beacon import GroupBeaconKV
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .lazy_eviction import LazyEviction
from .memory_beacon import MemoryBeaconKV
from .observer import ObservedLayer, QueryRing
from .registry import (
    make_policy,
    policy_class,
    policy_names,
    policy_parameters,
    register_policy,
)
from .rkv import RKV
from .rpc import RPC
from .query_selection import FPS, KMeans, QuerySelector, make_selector, parse_selector
from .schedules import AtBudget, Buffered, Periodic, Schedule, parse_schedule
from .snapkv import SnapKV
from .state import EvictionRecord, PolicyState, PolicyStats
from .streaming import StreamingLLM
from .tova import TOVA
from .triattention import TriAttention
from .window import RecentWindowPolicy

__all__ = [
    # the policies (every registered one)
    "BeaconKV", "EventBeaconKV", "FullKV", "GroupBeaconKV", "H2O", "InitialRecent", "MemoryBeaconKV", "RKV", "RPC",
    "SnapKV", "StreamingLLM",
    # rivals from the literature beyond the paper's baselines (docs/spec.md, §5)
    "ExpectedAttention", "KeyDiff", "KNorm", "LazyEviction", "TOVA", "TriAttention",
    # writing a policy: the base classes, its driver, state and records, what it sees of a layer, query selection
    "EvictionPolicy", "EvictionRecord", "FPS", "KMeans", "ObservedLayer", "PolicyDriver", "PolicyState", "PolicyStats",
    "QueryRing", "QuerySelector", "RecentWindowPolicy", "make_selector", "parse_selector",
    # when a policy evicts and how much it keeps: the schedules
    "AtBudget", "Buffered", "Periodic", "Schedule", "parse_schedule",
    # how an eviction's keep count is split between a layer's KV heads: the allocations
    "Allocation", "HeadAdaptive", "Shared", "Uniform", "parse_allocation",
    # the registry: names -> policies
    "make_policy", "policy_class", "policy_names", "policy_parameters", "register_policy",
    "PolicyConfigError",
]
