"""The CPU kernels a decode step can run, and the choice among them.

One job a module:

* :mod:`beaconkv.kernels.choice` — :func:`~beaconkv.kernels.choice.choose_kernels`: per device and rows
  per step, the model's own matmuls, oneDNN-prepacked fp32 or bf16 weights with fp32 arithmetic;
* :mod:`beaconkv.kernels.packed` — linear layers with oneDNN-prepacked weights (``beaconkv::packed_linear``);
* :mod:`beaconkv.kernels.bf16w` — the bf16-weight linear layer on ``beaconkv_cpu::bf16w_linear``;
* :mod:`beaconkv.kernels.attention` — ``beaconkv_cpu::mixed_attention``, decode attention of float32
  queries over a bf16 cache (the dense storage calls it);
* :mod:`beaconkv.kernels.model_copy` — the model's copy with other linear layers, which the two
  linear kernels build on;
* :mod:`beaconkv.kernels.build` — builds the two C++ operators (AVX2, no native bfloat16) together at
  first use; ``torch.compile`` keeps them as extern kernels of a fullgraph decode step.
"""

from .attention import mixed_attention, mixed_attention_applies
from .build import KernelBuildError, SOURCES, kernels_status
from .choice import KERNELS, KernelChoice, choose_kernels
from .packed import PackingError

__all__ = ["KERNELS", "KernelBuildError", "KernelChoice", "PackingError", "SOURCES", "choose_kernels",
           "kernels_status", "mixed_attention", "mixed_attention_applies"]
