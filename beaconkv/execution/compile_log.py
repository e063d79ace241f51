"""What a compile reports: the error it raises, the logger it announces itself on, and how both name the function.

Both strategies that compile the device work — :class:`~beaconkv.execution.CompiledExecutor`
(``torch.compile``) and :class:`~beaconkv.execution.GraphExecutor` (recorded graphs) — raise
:class:`CompileError` when nothing may fall back to eager, and announce each compile on
:data:`compile_logger` (``beaconkv.compile``, level INFO) when it starts and when it ends, naming the function
as :func:`compile_subject` does. This module is what they share, so neither imports the other for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ..errors import BeaconKVError

__all__ = ["CompileError", "compile_logger", "compile_subject", "describe_call"]


class CompileError(BeaconKVError, RuntimeError):
    """``torch.compile`` is unavailable here or failed to compile a step; nothing fell back to eager."""


compile_logger = logging.getLogger("beaconkv.compile")
"""Where every compile an executor runs is announced (INFO): ``compiling <what>…``, then
``compiled <what> in N s``."""


def describe_call(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> str:
    """``fn``'s name, and the class of the object it runs for (a policy) when that is its first argument:
    ``evict_layer of BeaconKV``.

    Args:
        fn: The device function.
        args: The arguments it is called with.
    """
    owner = f" of {type(args[0]).__name__}" if args and not isinstance(args[0], (Tensor, nn.Module)) else ""
    return f"{fn.__qualname__}{owner}"


def compile_subject(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> str:
    """How a compile line names ``fn``: ``the decode step (decode_and_sample)``, ``evict_layer of BeaconKV``."""
    if fn.__module__.endswith(".execution.decode") or fn.__qualname__ == "decode_layers":
        return f"the decode step ({fn.__qualname__})"
    return describe_call(fn, args)
