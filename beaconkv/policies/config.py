"""Validation of policy settings: one error type, messages that name the value, the limit and the fix."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import BeaconKVError


class PolicyConfigError(BeaconKVError, ValueError):
    """Inconsistent policy settings (budget, ratio, n_recent, n_prefix...)."""


def check_int(name: str, value: Any, minimum: int | None = None, *, optional: bool = False, hint: str = "") -> None:
    """Raises :class:`PolicyConfigError` unless ``value`` is an int (not a bool) ``>= minimum``.

    Args:
        name: The parameter's name, for the message.
        value: The value to check.
        minimum: Smallest allowed value (None: any int).
        optional: Whether None is allowed.
        hint: Appended to the message (e.g. the default).
    """
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = type(value).__name__
        fix = f" (e.g. {name}={int(value)})" if isinstance(value, float) and math.isfinite(value) else ""
        raise PolicyConfigError(f"{name}={value!r} must be an int, not {kind}{fix}.{' ' + hint if hint else ''}")
    if minimum is not None and value < minimum:
        raise PolicyConfigError(f"{name}={value} must be >= {minimum}.{' ' + hint if hint else ''}")


def check_number(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                 open_low: bool = False, open_high: bool = False, hint: str = "") -> None:
    """Raises :class:`PolicyConfigError` unless ``value`` is a finite real number within the bounds.

    Args:
        name: The parameter's name.
        value: The value.
        low: Lower bound (None: none).
        high: Upper bound (None: none).
        open_low: Whether ``low`` itself is excluded.
        open_high: Whether ``high`` itself is excluded.
        hint: Appended to the message.
    """
    tail = f" {hint}" if hint else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PolicyConfigError(f"{name}={value!r} must be a finite number.{tail}")
    below = low is not None and (value <= low if open_low else value < low)
    above = high is not None and (value >= high if open_high else value > high)
    if below or above:
        lo = "" if low is None else f"{'(' if open_low else '['}{low}"
        hi = "" if high is None else f"{high}{')' if open_high else ']'}"
        where = f"in {lo}, {hi}" if low is not None and high is not None else (
            f"{'>' if open_low else '>='} {low}" if low is not None else f"{'<' if open_high else '<='} {high}")
        raise PolicyConfigError(f"{name}={value} must be {where}.{tail}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raises :class:`PolicyConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise PolicyConfigError(f"{name}={value!r} is unknown; use one of {', '.join(map(repr, choices))}.")


def settings_repr(obj: Any) -> str:
    """``Class(setting=value, ...)`` with only the settings of a dataclass that differ from their defaults."""
    if not dataclasses.is_dataclass(obj):
        return f"{type(obj).__name__}()"
    changed = [f"{f.name}={getattr(obj, f.name)!r}" for f in dataclasses.fields(obj)
               if f.repr and getattr(obj, f.name) != f.default]
    return f"{type(obj).__name__}({', '.join(changed)})"


def parse_settings(what: str, spec: Any, base: type, classes: dict[str, type], example: str) -> Any:
    """A settings object from ``name[:key=value,...]``, as ``--policy-arg schedule=...`` / ``allocation=...`` give it.

    Args:
        what: The option's name in messages (``"schedule"``, ``"allocation"``).
        spec: The text, or an instance of ``base`` (returned as it is).
        base: The class every result is an instance of.
        classes: Known names (lower case, ``_`` for ``-``) -> dataclasses.
        example: A spec shown in the unknown-name message.

    Values are ``true``/``false``, ``none``, ints or floats, else the text itself (the class's own check
    names it).

    Raises:
        PolicyConfigError: Not text nor ``base``, an unknown name or setting, or a value the class refuses.
    """
    if isinstance(spec, base):
        return spec
    names = ", ".join(sorted(classes))
    if not isinstance(spec, str):
        raise PolicyConfigError(f"{what}={spec!r} must be a {base.__name__} or its name ({names}).")
    name, _, rest = spec.partition(":")
    cls = classes.get(name.strip().lower().replace("-", "_"))
    if cls is None:
        raise PolicyConfigError(f"{what}={spec!r}: unknown {what} {name!r}; use one of {names} (e.g. {example!r}).")
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise PolicyConfigError(f"{what}={spec!r}: {item!r} is not key=value with a setting of {cls.__name__} "
                                    f"({known}).")
        kwargs[key] = _setting_value(text.strip())
    return cls(**kwargs)


def _setting_value(text: str) -> Any:
    lower = text.lower()
    if lower in ("true", "false"):
        return lower == "true"
    if lower == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def auto_n_recent(budget: int, default: int = 16, ratio: float = 7 / 8) -> int:
    """``n_recent`` for a budget: ``default`` when the eviction step allows it, else ``budget // 8`` (or less,
    where another ``ratio`` leaves a smaller step).

    The base class needs ``budget - floor(ratio * budget) >= n_recent``; with the default 16 and
    ratio 7/8 that means budget >= 128, so smaller budgets scale ``n_recent`` down (64 -> 8). This
    is what ``--n-recent auto`` means on the command line, with the policy's own default and ratio.

    Args:
        budget: ``B_max``.
        default: The policy's own ``n_recent``.
        ratio: The policy's ``ratio`` (``B_min = floor(ratio * budget)``).
    """
    b_min = math.floor(ratio * budget)
    if budget - b_min >= default and b_min >= default:
        return default
    return max(min(budget // 8, budget - b_min, b_min), 1)  # budget // 8 at 7/8; what fits at other ratios
