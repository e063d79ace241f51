"""The transformers integration's errors: a model or a call a :class:`~beaconkv.hf.PolicyCache` cannot serve.

In a module of their own so that both the cache and the architecture check it runs first
(:mod:`beaconkv.hf.support`, which the cache imports) raise the same types.
"""

from __future__ import annotations

from ..errors import BeaconKVError


class PolicyCacheError(BeaconKVError, ValueError):
    """A model or a call a :class:`~beaconkv.hf.PolicyCache` cannot serve; the message names the fix."""


class UnsupportedArchitectureError(PolicyCacheError):
    """A model whose layers do not cache per-head keys and values with RoPE (multi-head latent attention,
    linear-attention hybrids, layers sharing another layer's keys and values, ...); the message names the
    architecture, what its layers cache instead, and what a :class:`~beaconkv.hf.PolicyCache` serves."""
