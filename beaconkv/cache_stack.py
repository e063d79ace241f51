"""The former name of :mod:`beaconkv.measure.fidelity.cache_stack` (several caches driven as one batch), kept
for one release: only the measurements use it. Importing this module warns."""

from __future__ import annotations

import warnings

from .measure.fidelity.cache_stack import CacheStack, LayerStack

__all__ = ["CacheStack", "LayerStack"]

warnings.warn("beaconkv.cache_stack is now beaconkv.measure.fidelity.cache_stack", DeprecationWarning, stacklevel=2)
