"""Policy names -> classes (with default settings): the one factory of the CLI, the measures, the eval and the tests.

A registry entry is a policy class plus keyword defaults, so a variant of a policy (BeaconKV with
another aggregation, say) is one line: ``register_policy("beacon_mean", BeaconKV, aggregation="mean")``.
:func:`make_policy` validates the keyword arguments against the class's dataclass fields before
constructing, so a typo fails at once with the list of valid names. Wherever a name is taken, so is
a class of the user's own, unregistered: ``module:Class`` or ``path/to/file.py:Class``
(:func:`load_policy_class`): ``module:Class`` imports the module from ``sys.path``,
``path/to/file.py:Class`` runs that file as a module of its own, once per process. Every failure is
a :class:`~beaconkv.policies.config.PolicyConfigError` naming the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .base import EvictionPolicy, FullKV
from .beacon import BeaconKV, InitialRecent
from .config import PolicyConfigError, auto_n_recent  # noqa: F401 - auto_n_recent stays importable from here
from .event_beacon import EventBeaconKV
from .expected_attention import ExpectedAttention
from .group_beacon import GroupBeaconKV
from .memory_beacon import MemoryBeaconKV
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .lazy_eviction import LazyEviction
from .rkv import RKV
from .rpc import RPC
from .snapkv import SnapKV
from .streaming import StreamingLLM
from .tova import TOVA
from .triattention import TriAttention

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
    if is_policy_spec(name):
        return load_policy_class(name), {}
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _ENTRIES:
        close = difflib.get_close_matches(key, [*_ENTRIES, *_ALIASES], n=1)
        hint = f" (did you mean {_ALIASES.get(close[0], close[0])!r}?)" if close else ""
        raise PolicyConfigError(f"policy={name!r} is unknown{hint}; choose one of {', '.join(policy_names())}, "
                                "or name a class of your own as module:Class or path/to/file.py:Class.")
    return _ENTRIES[key]


def policy_class(name: str) -> type[EvictionPolicy]:
    """Resolves a policy name (case-insensitive, with aliases) or spec (``module:Class``, ``file.py:Class``).

    Raises:
        PolicyConfigError: Unknown name, or a spec that names no policy class (see
            :func:`load_policy_class`).
    """
    return _entry(name)[0]


def policy_display_name(name: str) -> str:
    """The name a policy goes by in file names, tables and logs.

    Args:
        name: A registry name or a spec.

    Returns:
        A registry name as given; for a spec, the class's own ``name`` when the class sets one
        (an inherited one would pass a subclass off as its parent), else its class name — with
        any character other than letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``.

    Raises:
        PolicyConfigError: A spec that names no policy class.
    """
    if not is_policy_spec(name):
        return name
    cls = policy_class(name)
    own = cls.__dict__.get("name")
    return re.sub(r"[^A-Za-z0-9._-]", "_", own if isinstance(own, str) and own else cls.__name__)


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
             MemoryBeaconKV, ExpectedAttention, TOVA, KeyDiff, KNorm, LazyEviction, TriAttention):
    register_policy(_cls.name, _cls)
#: Variants beyond the paper that are a setting of BeaconKV (docs/benchmarks.md, "Beyond the paper").
register_policy("beacon_lse", BeaconKV, aggregation="logsumexp", temperature=0.02)
register_policy("beacon_evictable", BeaconKV, normalize="evictable")
#: The paper's mean-aggregation ablation, by name: better than max on this project's runs, more so with
#: more beacons (``--n-beacon``); see docs/benchmarks.md, "Variants beyond the paper".
register_policy("beacon_mean", BeaconKV, aggregation="mean")
#: The two that moved the standard run's figures, together: soft aggregation, scores that decay over cycles.
register_policy("beacon_lse_memory", MemoryBeaconKV, aggregation="logsumexp", temperature=0.02)
#: Scores max-pooled over 7 neighbouring slots, so a fact's whole span stays when a query looks at its start:
#: what kept the passkey at 4x in the accuracy suite (docs/benchmarks.md, "Outcomes: long-context accuracy").
register_policy("beacon_pool", BeaconKV, kernel=7, pool="max")


def make_policy(name: str, budget: int | None = None, **kwargs: Any) -> EvictionPolicy:
    """Builds a policy by name.

    Args:
        name: ``full``, ``beacon``, ``initial_recent``, ``snapkv``, ``rpc``, ``rkv``, ``h2o``,
            ``streaming``, ``expected_attention``, ``tova``, ``keydiff``, ``knorm``, ``lazy_eviction``,
            ``triattention``, a registered name, or a class of one's own as ``module:Class`` or
            ``path/to/file.py:Class`` (:func:`load_policy_class`).
        budget: ``B_max`` (ignored by ``full``).
        **kwargs: The policy's parameters (``n_recent``, ``n_prefix``, ``n_beacon`` ...), over the
            registry name's defaults.

    Returns:
        A policy object (settings only: it may serve any number of generations).

    Raises:
        PolicyConfigError: Unknown name or parameter, a spec that names no policy class, a budget
            missing for an evicting policy, or settings the policy rejects.
    """
    cls, defaults = _entry(name)
    if cls is FullKV or issubclass(cls, FullKV):
        return cls(**{k: v for k, v in kwargs.items() if k == "telemetry"})
    settings = {**defaults, **kwargs}
    _check_parameters(name, cls, settings)
    if budget is None and "budget" in settings:
        budget = settings.pop("budget")
    settings.pop("budget", None)
    try:  # a hand-written __init__ may take other arguments than the dataclass fields
        inspect.signature(cls).bind(budget, **settings)
    except TypeError as err:
        raise PolicyConfigError(f"policy {name!r} ({cls.__qualname__}) does not take budget={budget!r} with "
                                f"{settings}: {err}; pass the parameters its constructor takes.") from None
    return cls(budget, **settings)


# ------------------------------------------------------------------ classes of one's own (specs)
#: Modules made from policy files, by resolved path (a file runs once per process).
_FILE_MODULES: dict[Path, ModuleType] = {}

_FORMS = "module:Class or path/to/file.py:Class"


def is_policy_spec(name: object) -> bool:
    """Whether ``name`` is a policy spec (``module:Class``, ``file.py:Class``) rather than a registry name."""
    return isinstance(name, str) and ":" in name


def load_policy_class(spec: str) -> type[EvictionPolicy]:
    """The policy class a spec names, importing its module or running its file.

    Args:
        spec: ``module:Class`` (a module importable from ``sys.path``, dotted names allowed) or
            ``path/to/file.py:Class`` (a path ending in ``.py`` or holding a ``/``); ``Class``
            may be dotted (``Outer.Inner``).

    Returns:
        The class, a subclass of :class:`~beaconkv.policies.base.EvictionPolicy`.

    Raises:
        PolicyConfigError: A malformed spec, a missing file or module, a module that fails to
            import, no such class, or a class that is not an ``EvictionPolicy`` subclass; the
            message names the spec and the fix.
    """
    where, _, qualname = spec.strip().rpartition(":")
    if not where or not qualname:
        raise PolicyConfigError(f"policy={spec!r} is not a policy spec: write {_FORMS} (e.g. my_policy.py:ValueNorm).")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _file_module(spec, where) if is_file else _import_module(spec, where)
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            found = ", ".join(_policy_classes(module)) or "none"
            raise PolicyConfigError(f"policy={spec!r}: {where} has no class {qualname!r} (its EvictionPolicy "
                                    f"subclasses: {found}); check the name after ':'.")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        what = f"the class {obj.__qualname__}" if isinstance(obj, type) else f"a {type(obj).__name__}, not a class"
        raise PolicyConfigError(f"policy={spec!r}: {qualname} in {where} is {what}, which does not subclass "
                                "beaconkv.policies.EvictionPolicy; derive it from EvictionPolicy (see "
                                "docs/guides/custom-policy.md).")
    return obj


def _file_module(spec: str, where: str) -> ModuleType:
    """Runs a policy file as a module (once per resolved path)."""
    path = Path(where).expanduser()
    if not path.is_file():
        hint = "it is a directory; name the .py file in it" if path.is_dir() else "no such file"
        raise PolicyConfigError(f"policy={spec!r}: {path} cannot be read as a policy file ({hint}, relative to "
                                f"{Path.cwd()}); give the path of the .py file that defines the class.")
    key = path.resolve()
    if key in _FILE_MODULES:
        return _FILE_MODULES[key]
    # A name of its own per file, registered before the file runs: dataclasses look the module up in
    # sys.modules while the class body is processed.
    name = f"beaconkv_policy_file_{key.stem}_{hashlib.sha1(str(key).encode()).hexdigest()[:10]}"
    loader_spec = importlib.util.spec_from_file_location(name, key)
    if loader_spec is None or loader_spec.loader is None:
        raise PolicyConfigError(f"policy={spec!r}: {path} cannot be loaded as Python; give a .py file.")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise PolicyConfigError(f"policy={spec!r}: running {path} failed ({type(err).__name__}: {err}); fix the "
                                f"file (python {path} shows the traceback).") from err
    _FILE_MODULES[key] = module
    return module


def _import_module(spec: str, name: str) -> ModuleType:
    """Imports a policy module by its dotted name."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and name.split(".")[: len(err.name.split("."))] == err.name.split("."):
            raise PolicyConfigError(f"policy={spec!r}: no module named {err.name!r} can be imported (sys.path "
                                    f"starts {sys.path[:2]}); give path/to/file.py:Class for a file, or install "
                                    "the module.") from err
        raise PolicyConfigError(f"policy={spec!r}: importing {name} failed ({err}); install what it imports.") from err
    except Exception as err:
        raise PolicyConfigError(f"policy={spec!r}: importing {name} failed ({type(err).__name__}: {err}); fix the "
                                "module.") from err


def _policy_classes(module: ModuleType) -> list[str]:
    """Names of the EvictionPolicy subclasses a module defines (for the 'no such class' message)."""
    return sorted(n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, EvictionPolicy)
                  and v.__module__ == module.__name__)
