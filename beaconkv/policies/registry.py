"""Policy names -> classes (with default settings): the one factory of the CLI, the measures, the eval and the tests.

A registry entry is a policy class plus keyword defaults, so a variant of a policy (BeaconKV with
another aggregation, say) is one line: ``register_policy("beacon_mean", BeaconKV, aggregation="mean")``.
:func:`make_policy` validates the keyword arguments against the class's dataclass fields before
constructing, so a typo fails at once with the list of valid names.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from .base import EvictionPolicy, FullKV
from .beacon import BeaconKV, InitialRecent
from .config import PolicyConfigError
from .event_beacon import EventBeaconKV
from .group_beacon import GroupBeaconKV
from .memory_beacon import MemoryBeaconKV
from .h2o import H2O
from .rkv import RKV
from .rpc import RPC
from .snapkv import SnapKV
from .streaming import StreamingLLM

_ENTRIES: dict[str, tuple[type[EvictionPolicy], dict[str, Any]]] = {}
_ALIASES = {"fullkv": "full", "beaconkv": "beacon", "streamingllm": "streaming", "r-kv": "rkv",
            "initial+recent": "initial_recent"}


def register_policy(name: str, cls: type[EvictionPolicy], **defaults: Any) -> None:
    """Makes a policy class available to :func:`make_policy` and the CLI under ``name``.

    Args:
        name: Registry name (case-insensitive).
        cls: An :class:`~beaconkv.policies.EvictionPolicy` subclass.
        **defaults: Settings this name implies (overridable by :func:`make_policy`'s arguments).

    Raises:
        PolicyConfigError: ``cls`` is not a policy class, or a default is not one of its parameters.
    """
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise PolicyConfigError(f"register_policy({name!r}, {cls!r}): the class must subclass EvictionPolicy.")
    _check_parameters(name, cls, defaults)
    _ENTRIES[name.lower()] = (cls, dict(defaults))


def policy_names() -> list[str]:
    """All names :func:`make_policy` accepts (aliases excluded)."""
    return sorted(_ENTRIES)


def _entry(name: str) -> tuple[type[EvictionPolicy], dict[str, Any]]:
    if not isinstance(name, str):
        raise PolicyConfigError(f"policy={name!r} must be a registry name; choose one of {', '.join(policy_names())}.")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _ENTRIES:
        close = difflib.get_close_matches(key, [*_ENTRIES, *_ALIASES], n=1)
        hint = f" (did you mean {_ALIASES.get(close[0], close[0])!r}?)" if close else ""
        raise PolicyConfigError(f"policy={name!r} is unknown{hint}; choose one of {', '.join(policy_names())}.")
    return _ENTRIES[key]


def policy_class(name: str) -> type[EvictionPolicy]:
    """Resolves a policy name (case-insensitive, with aliases) to its class.

    Raises:
        PolicyConfigError: Unknown name.
    """
    return _entry(name)[0]


def policy_defaults(name: str) -> dict[str, Any]:
    """The settings a registry name implies beyond its class's own defaults (empty for the built-ins)."""
    return dict(_entry(name)[1])


def policy_parameters(name_or_cls: str | type[EvictionPolicy]) -> dict[str, Any]:
    """A policy's parameters and their defaults (the registry name's defaults applied).

    Raises:
        PolicyConfigError: Unknown name.
    """
    cls, defaults = _entry(name_or_cls) if isinstance(name_or_cls, str) else (name_or_cls, {})
    if cls is FullKV or issubclass(cls, FullKV):
        return {"telemetry": False}
    params = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
    params.update(defaults)
    return params


def _check_parameters(name: str, cls: type[EvictionPolicy], kwargs: dict[str, Any]) -> None:
    if not dataclasses.is_dataclass(cls):
        return  # a hand-written subclass: its constructor checks its own arguments
    known = set(policy_parameters(cls))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise PolicyConfigError(f"policy {name!r} has no parameter {', '.join(unknown)}; "
                                f"its parameters are {', '.join(sorted(known))}.")


for _cls in (FullKV, BeaconKV, InitialRecent, SnapKV, RPC, RKV, H2O, StreamingLLM, GroupBeaconKV, EventBeaconKV,
             MemoryBeaconKV):
    register_policy(_cls.name, _cls)
#: Variants beyond the paper that are a setting of BeaconKV (docs/benchmarks.md, "Beyond the paper").
register_policy("beacon_lse", BeaconKV, aggregation="logsumexp", temperature=0.02)
register_policy("beacon_evictable", BeaconKV, normalize="evictable")
#: The paper's mean-aggregation ablation, by name: better than max on this project's runs, more so with
#: more beacons (``--n-beacon``); see docs/benchmarks.md, "Variants beyond the paper".
register_policy("beacon_mean", BeaconKV, aggregation="mean")
#: The two that moved the standard run's figures, together: soft aggregation, scores that decay over cycles.
register_policy("beacon_lse_memory", MemoryBeaconKV, aggregation="logsumexp", temperature=0.02)


def make_policy(name: str, budget: int | None = None, **kwargs: Any) -> EvictionPolicy:
    """Builds a policy by name.

    Args:
        name: ``full``, ``beacon``, ``initial_recent``, ``snapkv``, ``rpc``, ``rkv``, ``h2o``,
            ``streaming`` or a registered name.
        budget: ``B_max`` (ignored by ``full``).
        **kwargs: The policy's parameters (``n_recent``, ``n_prefix``, ``n_beacon`` ...), over the
            registry name's defaults.

    Returns:
        A policy object (settings only: it may serve any number of generations).

    Raises:
        PolicyConfigError: Unknown name or parameter, a budget missing for an evicting policy, or
            settings the policy rejects.
    """
    cls, defaults = _entry(name)
    if cls is FullKV or issubclass(cls, FullKV):
        return cls(**{k: v for k, v in kwargs.items() if k == "telemetry"})
    settings = {**defaults, **kwargs}
    _check_parameters(name, cls, settings)
    if budget is None and "budget" in settings:
        budget = settings.pop("budget")
    settings.pop("budget", None)
    return cls(budget, **settings)
