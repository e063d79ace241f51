"""Compiled decode ms/step of the embedded model, for before/after comparisons of a restructuring.

Uses only API every tree since issue #41 began has (``beaconkv.generate(..., compile=True)`` and its stats), so
the same file times an older checkout: ``PYTHONPATH=/path/to/old/tree python scripts/decode_ms_per_step.py old``.
BeaconKV(64, n_recent=8), batch 4, 64-token prompts, 256 new tokens, one thread; a compile warm-up call, then 3
timed calls, each ``(wall - prefill - compile) / decode steps``.

Usage: python scripts/decode_ms_per_step.py LABEL
"""

from __future__ import annotations

import statistics
import sys

import torch

import beaconkv


def main() -> None:
    """Prints ``LABEL ms/step a b c median m``."""
    torch.set_num_threads(1)
    model = beaconkv.load_model(beaconkv.embedded_model_path())
    prompts = [[(7 * i + 3 * r) % 40000 + 100 for i in range(64)] for r in range(4)]
    kwargs = dict(max_new_tokens=256, policy=beaconkv.BeaconKV(64, n_recent=8), compile=True, eos_token_ids=[])
    beaconkv.generate(model, None, prompts, **kwargs)
    ms = []
    for _ in range(3):
        stats = beaconkv.generate(model, None, prompts, **kwargs).stats
        ms.append(1000 * (stats.wall_time_s - stats.prefill_s - stats.compile_s) / stats.decode_steps)
    label = sys.argv[1] if len(sys.argv) > 1 else "tree"
    print(f"{label} ms/step {' '.join(f'{m:.2f}' for m in ms)} median {statistics.median(ms):.2f}")


if __name__ == "__main__":
    main()
