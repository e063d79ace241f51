"""The project's own CPU kernels, for CPUs with AVX2 and no native bfloat16.

Two C++ operators, built together at first use (:mod:`beaconkv.kernels.build`) and kept by
``torch.compile`` as extern kernels of a fullgraph decode step:

* ``beaconkv_cpu::bf16w_linear`` — a linear layer on bf16 weights with float32 arithmetic
  (:mod:`beaconkv.models.bf16w` wraps it as a layer);
* ``beaconkv_cpu::mixed_attention`` — decode attention of float32 queries over a bf16 cache
  (:mod:`beaconkv.kernels.attention`; the dense storage calls it).
"""

from .attention import mixed_attention, mixed_attention_applies
from .build import KernelBuildError, SOURCES, kernels_status

__all__ = ["KernelBuildError", "SOURCES", "kernels_status", "mixed_attention", "mixed_attention_applies"]
