"""Policy names -> classes, for the CLI, the benchmarks and the evaluation harness."""

from __future__ import annotations

import importlib
from typing import Any

from .base import EvictionPolicy, PolicyConfigError

_BUILTIN = {
    "full": "beaconkv.policies.base:FullKV",
    "beacon": "beaconkv.policies.beacon:BeaconKV",
    "initial_recent": "beaconkv.policies.beacon:InitialRecent",
    "snapkv": "beaconkv.policies.snapkv:SnapKV",
    "rpc": "beaconkv.policies.rpc:RPC",
    "rkv": "beaconkv.policies.rkv:RKV",
    "h2o": "beaconkv.policies.h2o:H2O",
    "streaming": "beaconkv.policies.streaming:StreamingLLM",
}
_ALIASES = {"fullkv": "full", "beaconkv": "beacon", "streamingllm": "streaming", "r-kv": "rkv",
            "initial+recent": "initial_recent"}
_registered: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str, cls: type[EvictionPolicy]) -> None:
    """Makes a custom policy class available to :func:`make_policy` and the CLI under ``name``."""
    _registered[name.lower()] = cls


def policy_names() -> list[str]:
    """All names :func:`make_policy` accepts (aliases excluded)."""
    return sorted(set(_BUILTIN) | set(_registered))


def policy_class(name: str) -> type[EvictionPolicy]:
    """Resolves a policy name (case-insensitive, with aliases) to its class.

    Raises:
        PolicyConfigError: Unknown name.
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key in _registered:
        return _registered[key]
    if key not in _BUILTIN:
        raise PolicyConfigError(f"policy={name!r} is unknown; choose one of {', '.join(policy_names())}.")
    module, attr = _BUILTIN[key].split(":")
    return getattr(importlib.import_module(module), attr)


def make_policy(name: str, budget: int | None = None, **kwargs: Any) -> EvictionPolicy:
    """Builds a policy by name.

    Args:
        name: ``full``, ``beacon``, ``initial_recent``, ``snapkv``, ``rpc``, ``rkv``, ``h2o``,
            ``streaming`` or a registered name.
        budget: ``B_max`` (ignored by ``full``).
        **kwargs: Passed to the policy's constructor (``n_recent``, ``n_prefix``, ``n_beacon`` ...).

    Returns:
        A fresh policy object (one per generation call).

    Raises:
        PolicyConfigError: Unknown name, or a budget missing for an evicting policy.
    """
    cls = policy_class(name)
    if cls.__name__ == "FullKV":
        return cls(**{k: v for k, v in kwargs.items() if k == "telemetry"})
    if budget is None:
        raise PolicyConfigError(f"policy {name!r} needs a budget (e.g. budget=1024).")
    return cls(budget, **kwargs)
