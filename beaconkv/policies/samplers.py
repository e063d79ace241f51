"""The former name of :mod:`beaconkv.policies.query_selection`, kept for one release.

``QuerySampler`` is :class:`~beaconkv.policies.query_selection.QuerySelector` and ``make_sampler``
:func:`~beaconkv.policies.query_selection.make_selector`. ``ContinualFPS`` and ``NaiveFPS`` are gone: they
were FPS under two names, the difference being how many queries BeaconKV keeps to select from, which is
now BeaconKV's own ``query_memory`` setting (``"bounded"`` / ``"history"``). Importing this module warns.
"""

from __future__ import annotations

import warnings

from .query_selection import (  # noqa: F401 - the re-exported names
    FPS,
    SELECTOR_NAMES,
    TIE_RTOL,
    KMeans,
    QuerySelector,
    farthest_point_sampling,
    make_selector,
    parse_selector,
)

__all__ = ["FPS", "KMeans", "QuerySampler", "farthest_point_sampling", "make_sampler"]

warnings.warn("beaconkv.policies.samplers is now beaconkv.policies.query_selection (QuerySampler is QuerySelector, "
              "make_sampler is make_selector); ContinualFPS/NaiveFPS are FPS with BeaconKV(query_memory='bounded' / "
              "'history')", DeprecationWarning, stacklevel=2)

QuerySampler = QuerySelector
"""The former name of :class:`~beaconkv.policies.query_selection.QuerySelector`."""

make_sampler = make_selector
"""The former name of :func:`~beaconkv.policies.query_selection.make_selector`."""
