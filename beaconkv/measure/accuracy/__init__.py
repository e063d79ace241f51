"""Outcomes, not proxies: does a policy keep the answer, and how much memory does it save.

``beaconkv accuracy`` (:mod:`~beaconkv.measure.accuracy.cli`) runs synthetic long-context tasks
(:mod:`~beaconkv.measure.accuracy.tasks`: passkey, multi-key and multi-value needles, variable tracking, and
the needle in the decode) through beaconkv's session under every policy, budget and protocol
(:mod:`~beaconkv.measure.accuracy.runner`, :mod:`~beaconkv.measure.accuracy.suite`), optionally side by side
with NVIDIA kvpress's presses on the same token ids (:mod:`~beaconkv.measure.accuracy.compare`,
:mod:`~beaconkv.measure.accuracy.kvpress`), and reports accuracy with 95% intervals, memory and time
(:mod:`~beaconkv.measure.accuracy.report`).
"""
