"""KV-cache eviction policies: BeaconKV and its baselines, behind one base class."""

from .base import EvictionPolicy, EvictionRecord, FullKV, PolicyConfigError, select_keep

__all__ = ["EvictionPolicy", "EvictionRecord", "FullKV", "PolicyConfigError", "select_keep"]
