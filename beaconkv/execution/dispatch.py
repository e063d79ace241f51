"""Calling the graphs ``torch.compile`` cached for a function without its per-call entry path.

A ``torch.compile`` wrapper does more per call than the graph lookup: it installs dynamo's frame
callback and its stance, backend and hook contexts, then dynamo intercepts the frame, checks each cached
graph's guards and runs the transformed code. A layer-by-layer decode step calls a graph 32 times per
step (its inputs, 30 layers, its logits), so that entry costs more than a millisecond per step on a
2-core CPU (the embedded model, BeaconKV: 26.6 ms/step through the wrapper, 25.1 called directly).

:class:`CachedGraphs` does what dynamo does on a cache hit and nothing else: it checks the guards of the
graphs this wrapper compiled (dynamo's own guard managers, every guard kept) against the call's
arguments and runs the transformed code of the first that holds, the code dynamo would have run. A call
that no cached graph serves — the first, a new shape, a changed setting, a dynamo stance other than the
default — returns a miss and goes through the wrapper, which compiles as usual; its new graph serves the
next calls. vLLM dispatches its compiled models to dynamo's code the same way but skips the guards; here
they are checked, and they are most of what a direct call still costs (20-35 µs per layer call replaying one
step's calls on that CPU, about 50 µs inside a generation, against 7 µs in a loop of guard checks alone:
between two calls the layer's kernels evict the guard tree from the cache). A whole-step graph pays the same
check per layer, once per step.

It relies on dynamo internals (``_debug_get_cache_entry_list``, a cache entry's ``code``,
``guard_manager`` and ``backend``); where this torch lacks any of them, or a function takes ``*args``,
``**kwargs``, keyword-only arguments or a closure, every call goes through the wrapper.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import eval_frame

MISS = object()
"""What :meth:`CachedGraphs.call` returns when no cached graph serves the call."""


def _cache_entries() -> Callable[[types.CodeType], list[Any]] | None:
    """Dynamo's reader of the graphs cached on a code object, or None where this torch has none."""
    try:
        from torch._C._dynamo.eval_frame import _CacheEntry
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    except ImportError:
        return None
    if not all(hasattr(_CacheEntry, name) for name in ("code", "guard_manager", "backend")):
        return None
    return entries


_ENTRIES = _cache_entries()


def _default_stance() -> bool:
    """Whether dynamo runs with its default stance (no ``force_eager``, no skipped guards, no other backend)
    and is not tracing (a call inside another compiled function is dynamo's to inline)."""
    stance = getattr(eval_frame, "_stance", None)
    return (getattr(stance, "stance", None) == "default" and not getattr(stance, "skip_guard_eval_unsafe", False)
            and getattr(stance, "backend", None) is None and not torch.compiler.is_compiling())


class CachedGraphs:
    """The graphs one ``torch.compile`` wrapper of ``fn`` compiled (or a wrapper with equal settings, which dynamo
    lets it use too), called without the wrapper's entry path.

    Args:
        fn: The plain function the wrapper compiles.

    Attributes:
        hits: Calls served from a cached graph (the rest went through the wrapper).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        code = getattr(fn, "__code__", None)
        plain = (code is not None and not code.co_freevars and not code.co_kwonlyargcount
                 and not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS))
        self.enabled = _ENTRIES is not None and plain
        self.fn, self.hits = fn, 0
        self._code = code
        self._names = code.co_varnames[:code.co_argcount] if plain else ()
        self._defaults = tuple(fn.__defaults__ or ()) if plain else ()
        self._required = len(self._names) - len(self._defaults)  # arguments without a default
        self._backend: Any = None  # the wrapper's backend object, learnt from the first graph it compiled
        self._functions: dict[types.CodeType, Callable[..., Any]] = {}

    def learn(self) -> None:
        """Takes the wrapper's backend from the graph a call through the wrapper just ran or compiled: dynamo
        keeps a function's graphs most recently used first."""
        if self.enabled and self._backend is None:
            entries = _ENTRIES(self._code)
            if entries:
                self._backend = entries[0].backend

    def call(self, args: tuple[Any, ...]) -> Any:
        """Runs ``fn(*args)`` through the first cached graph of this wrapper whose guards hold, or returns
        :data:`MISS` (nothing ran) when none does."""
        backend = self._backend
        if backend is None or not _default_stance():
            return MISS
        n = len(args)
        if n != len(self._names):
            if n < self._required or n > len(self._names):
                return MISS
            args = args + self._defaults[n - self._required:]  # the omitted trailing arguments' defaults
        frame_locals = dict(zip(self._names, args))
        for entry in _ENTRIES(self._code):
            # dynamo serves a wrapper from the graphs of any wrapper with equal settings (backend ==)
            if (entry.backend is backend or entry.backend == backend) and entry.guard_manager.check(frame_locals):
                self.hits += 1
                return self._function(entry.code)(*args)
        return MISS

    def _function(self, code: types.CodeType) -> Callable[..., Any]:
        """``fn`` with dynamo's transformed ``code`` (same globals, as dynamo runs it in ``fn``'s frame)."""
        function = self._functions.get(code)
        if function is None:
            function = self._functions[code] = types.FunctionType(code, self.fn.__globals__, self.fn.__name__)
        return function
