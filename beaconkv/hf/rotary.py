"""A transformers model's RoPE, as beaconkv's policies use it: rotate stored pre-RoPE queries, and undo a rotation.

Policies keep queries **pre-RoPE** and re-rotate them to the positions they score at
(``state.rope.rotate(x, positions)``, the contract of :class:`~beaconkv.models.rope.RotaryEmbedding`).
Inside transformers, attention only ever sees the rotated query, so the integration recovers the pre-RoPE
one by inverting the rotation with the very ``(cos, sin)`` tables the layer used, and rotates with the
model's own rotary module, whatever its frequency scheme (default, llama3, YaRN, Gemma 3's per layer type).

Three layouts of ``(cos, sin)`` exist among transformers' decoders, all the same rotate-half rotation:

* ``full``: ``(..., head_dim)``, both halves equal (Llama, Qwen, Mistral, Gemma 3, OLMo 2);
* ``partial``: ``(..., rotary_dim)`` with ``rotary_dim < head_dim``, the rest of each head unrotated (Phi-3
  with ``partial_rotary_factor < 1``);
* ``half``: ``(..., head_dim // 2)``, one value per pair (gpt-oss's ``_apply_rotary_emb``).
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
from torch import Tensor, nn

from ..errors import BeaconKVError
from ..rotary import rotate, rotate_half

Layout = Literal["full", "partial", "half"]


class RotaryLayoutError(BeaconKVError, ValueError):
    """A model's rotary tables have a shape this integration does not know how to apply."""


def _tables(cos: Tensor, sin: Tensor, layout: Layout) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` in the rotate-half layout over the rotated width."""
    if layout == "half":
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos, sin


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, layout: Layout) -> Tensor:
    """Rotates ``x`` (``(..., head_dim)``) with tables broadcastable to it, in ``x``'s dtype."""
    cos, sin = (t.to(x.dtype) for t in _tables(cos, sin, layout))
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return rotate(x, cos, sin)
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rotate(rot, cos, sin), rest), dim=-1)


def invert_rotary(x: Tensor, cos: Tensor, sin: Tensor, layout: Layout) -> Tensor:
    """Undoes :func:`apply_rotary`: the pre-RoPE vector of ``x`` rotated with these tables.

    With ``C = s cos``, ``S = s sin`` (``s``: a scheme's attention scaling, YaRN's), ``y = x C + rh(x) S``
    gives ``y C - rh(y) S = (C² + S²) x``, since ``rh(rh(x)) = -x``.
    """
    cos, sin = (t.to(x.dtype) for t in _tables(cos, sin, layout))
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    back = (rot * cos - rotate_half(rot) * sin) / (cos * cos + sin * sin)
    return back if r == x.shape[-1] else torch.cat((back, rest), dim=-1)


class HFRotary:
    """A transformers rotary module behind the interface policies use (``rotate(x, positions)``).

    Args:
        module: The model's rotary embedding (``model.model.rotary_emb``): called as
            ``module(x, position_ids[, layer_type])``, returning ``(cos, sin)`` of shape
            ``(batch, seq, width)``.
        head_dim: Width of a head.
        layer_type: The layer type whose tables to use, for modules that keep one set per type (Gemma 3);
            ignored by the others.

    Attributes:
        layout: How the module's tables are laid out (see the module docstring).

    Raises:
        RotaryLayoutError: Tables wider than a head, or of an odd width.
    """

    def __init__(self, module: nn.Module, head_dim: int, layer_type: str = "full_attention") -> None:
        self.module, self.head_dim = module, head_dim
        takes_type = "layer_type" in inspect.signature(module.forward).parameters
        self._extra = (layer_type,) if takes_type else ()
        self.layout = self._probe()

    def cos_sin(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The module's ``(cos, sin)`` at ``positions`` ``(batch, seq)``, in ``x``'s dtype and device."""
        return self.module(x, positions, *self._extra)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotates ``x`` ``(batch, heads, seq, head_dim)`` to ``positions`` ``(batch, seq)``, or
        ``(batch, heads, seq)`` to rotate every head to its own positions."""
        b = positions.shape[0]
        cos, sin = self.cos_sin(x, positions.reshape(b, -1))  # (b, m, width)
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, seq, width): every head alike
        else:
            cos, sin = (t.view(*positions.shape, t.shape[-1]) for t in (cos, sin))
        return apply_rotary(x, cos, sin, self.layout)

    def _probe(self) -> Layout:
        """Reads the layout off the tables at one position: duplicated halves are rotate-half tables."""
        param = next(self.module.buffers(), None)
        device = param.device if param is not None else torch.device("cpu")
        x = torch.zeros(1, 1, self.head_dim, device=device)
        cos, _ = self.cos_sin(x, torch.ones(1, 1, dtype=torch.long, device=device))
        width = cos.shape[-1]
        if width > self.head_dim or width % 2:
            raise RotaryLayoutError(f"rotary tables of width {width} do not fit heads of {self.head_dim}; "
                                    "beaconkv.hf knows rotate-half RoPE over the whole head, a leading part of it, "
                                    "or one value per pair (gpt-oss).")
        if width == self.head_dim:
            return "full"
        a, b = cos[..., : width // 2], cos[..., width // 2:]
        if torch.equal(a, b):
            return "partial"
        if 2 * width != self.head_dim:
            raise RotaryLayoutError(f"rotary tables of width {width} (not rotate-half) must hold one value per pair of "
                                    f"a head of {self.head_dim}, i.e. be {self.head_dim // 2} wide.")
        return "half"
