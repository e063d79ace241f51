"""Decode-speed benchmark (``beaconkv bench``): throughput, bandwidth roofline, cost curve, memory, Table 4.

One process, one run, side by side on one model (default: the embedded SmolLM2-135M):

1. **throughput** (:mod:`.throughput`) — decode ms/step and tokens/s of beaconkv eager, beaconkv
   compiled (:mod:`beaconkv.execution`), transformers' ``generate`` eager and with its static cache
   compiled, per batch and dtype (FullKV everywhere: the same work as transformers);
2. **roofline** — achieved bandwidth (weight bytes + KV bytes read per step ÷ step time) next to the
   machine's streaming-read bandwidth measured here (:mod:`.machine`);
3. **cost curve** (:mod:`.curve`) — ms/step as the context grows: FullKV vs BeaconKV(budget);
4. **policies** (:mod:`.policies`) — KV-cache bytes, peak memory and steady-state step time with the
   eviction share, for FullKV and every policy at one budget;
5. the paper's Table 4 (:mod:`.table4`).

Every figure is the best of ``--repeats`` runs (a shared machine only ever adds time). Single steps
are timed through generation's public ``on_step`` hook (:mod:`.timing`). Outputs: ``bench.json``,
``bench.md`` (:mod:`.report`) and ``cost_curve.png`` in ``--out``; :mod:`.targets` checks the goals.
"""
