"""BeaconKV inside Hugging Face transformers: any beaconkv policy on a transformers decoder's cache.

:class:`PolicyCache` is a transformers ``Cache``: pass it to ``model.generate(..., cache=cache)``
and the model's full-attention layers keep a fixed capacity, evicted by the policy (BeaconKV, the
baselines, the variants or a user's subclass: the same objects as the native path) while it decodes.
Needs the optional dependency ``transformers`` (``pip install beaconkv[hf]``).

Modules: :mod:`~beaconkv.hf.cache` (the cache), :mod:`~beaconkv.hf.layer` (its layers),
:mod:`~beaconkv.hf.attention` (the attention function it runs through), :mod:`~beaconkv.hf.hooks`
(the forward hooks), :mod:`~beaconkv.hf.chunks` (how a forward is cut at each row's chunks),
:mod:`~beaconkv.hf.chunk_forward` (a forward of several tokens per row written after the held slots: a
chunked prompt, a question on a compressed context), :mod:`~beaconkv.hf.rotary` (the model's RoPE as policies use it),
:mod:`~beaconkv.hf.generation` (``beaconkv generate --backend hf``), :mod:`~beaconkv.hf.support` (which
architectures it serves: per-head keys and values with RoPE; others are refused in one line),
:mod:`~beaconkv.hf.errors` (its exceptions).
"""

from .attention import AttentionImplementationError
from .cache import PolicyCache
from .errors import PolicyCacheError, UnsupportedArchitectureError
from .layer import PolicyLayer
from .rotary import HFRotary, RotaryLayoutError

__all__ = ["AttentionImplementationError", "HFRotary", "PolicyCache", "PolicyCacheError", "PolicyLayer",
           "RotaryLayoutError", "UnsupportedArchitectureError"]
