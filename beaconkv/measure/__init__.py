"""Measuring tools built on the decoding session: fidelity against FullKV, trace analysis, speed.

* :mod:`beaconkv.measure.fidelity` — teacher-forced KL, top-1 agreement and attention recall of
  every policy x budget against FullKV (``beaconkv fidelity``);
* :mod:`beaconkv.measure.analysis` — global vs local queries on one trace, their pre-RoPE geometry,
  and the beacons BeaconKV held when they arrived (``beaconkv analyze``);
* :mod:`beaconkv.measure.speed` — decode speed, bandwidth and memory, and the paper's Table 4
  (``beaconkv bench``).
* :mod:`beaconkv.measure.memory` — the memory each policy needs and the largest batch that fits a
  device, from the model's config alone (``beaconkv memory``);
* :mod:`beaconkv.measure.demo` — BeaconKV beside FullKV on a reasoning prompt: memory, evictions, speed,
  agreement (``beaconkv demo``).
"""
