"""Expected Attention: score each key by the attention a Gaussian model of the *future* queries expects it to get.

The recent pre-RoPE queries of each head (the query ring) give a mean and a covariance; rotated to the
positions still to come, they describe where the next queries will land, and the expected softmax
numerator ``E[exp(q·k / sqrt(d))]`` of a Gaussian ``q`` has a closed form. No attention weights are
observed, so decoding keeps the fused attention path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..rotary import rotate
from .config import PolicyConfigError, check_int, check_number
from .observer import ObservedLayer
from .scoring import group_queries, last_queries, pool_slots
from .state import PolicyState
from .window import RecentWindowPolicy


def mean_rotation(rope: Any, t: Tensor, n_future: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """The rotation averaged over the positions ``t + 1 .. t + n_future``, as per-dimension ``(cos, sin)``.

    With the rotate-half convention a rotation to position ``p`` is ``x * cos_p + rotate_half(x) * sin_p``
    with cos/sin the same in both halves of the head, so the average rotation
    ``R = mean_p R_p`` is the same expression with the averaged cos and sin. They are read off the
    rope itself by rotating the probe ``(1, ..., 1, 0, ..., 0)``, which comes back as
    ``(cos_p[:half], sin_p[half:])`` — so any rotary module with ``rotate(x, positions)`` of that
    convention serves (scaled frequencies and YaRN's attention factor included).

    Args:
        rope: The rotary module (``rotate(x (b, heads, n, d), positions (b, n))``).
        t: ``(b,)`` newest positions.
        n_future: Future positions averaged over.
        head_dim: Width of a head (even).

    Returns:
        ``(cos, sin)``, each ``(b, head_dim)`` float32: ``R x = x * cos + rotate_half(x) * sin``.
    """
    half = head_dim // 2
    probe = (torch.arange(head_dim, device=t.device) < half).float()  # (d,)
    future = t[:, None] + 1 + torch.arange(n_future, device=t.device)  # (b, F)
    rotated = rope.rotate(probe.expand(t.shape[0], 1, n_future, head_dim), future).float()  # (b, 1, F, d)
    avg = rotated.mean((1, 2))  # (b, d): (mean cos of the first half, mean sin of the second)
    cos, sin = avg[:, :half], avg[:, half:]
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def apply_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``R x`` along the last dimension for the rotation :func:`mean_rotation` describes (any leading shape;
    ``cos``/``sin`` broadcastable to ``x``)."""
    return rotate(x, cos, sin)


@dataclass
class ExpectedAttention(RecentWindowPolicy):
    """Expected Attention (Devoto et al., 2025; NVIDIA kvpress's ``ExpectedAttentionPress``), SPEC §5.

    Recipe, per sequence, layer and query head, at each eviction at step ``t``:

    1. the last ``window`` pre-RoPE queries of the ring: mean ``mu`` and covariance
       ``S = mean_n (q_n - mu)(q_n - mu)^T`` (normalised by the number of queries, as kvpress does);
    2. ``R``: the RoPE rotation averaged over the next ``n_future_positions`` positions
       ``t + 1 .. t + n_future_positions`` (:func:`mean_rotation`); the future queries are modelled as
       ``N(R mu, R S R^T)``;
    3. expected logit of every cached (post-RoPE) key ``k``:
       ``k·(R mu) / sqrt(d) + k^T (R S R^T) k / (2 d)`` — the log of ``E[exp(q·k / sqrt(d))]`` for that
       Gaussian (without ``use_covariance``, the first term only);
    4. softmax over every filled slot of the KV head (prefix included);
    5. mean over the query heads of the GQA group;
    6. with ``use_vnorm``: ``(score + epsilon) * ||v||_2``, the value norm of each slot;
    7. average pooling along the cache, kernel ``kernel`` (default 1: none, as in kvpress).

    The quadratic term is computed without forming ``R S R^T``: it equals
    ``mean_n (k·R(q_n - mu))^2``, one dot product per observed query and key, which costs what SnapKV's
    attention over ``window`` queries costs.

    kvpress compresses the prompt with statistics of the prompt's queries (its decoding wrapper buffers
    up to 256 recent hidden states); here the statistics come from the last ``window`` queries
    (decode queries, and the last prompt queries early on), at each eviction of the shared schedule
    (SPEC §2). kvpress keeps ``n_sink`` first tokens out of the softmax and always keeps them; here the
    protected prefix plays that role.

    Observes: the query ring, ``query_window = window``.

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        window: Recent queries the statistics are taken over (default 64).
        kernel: Odd average-pooling kernel (default 1: no pooling).
        n_future_positions: Future positions the rotation is averaged over (default 512, kvpress's).
        use_covariance: Include the covariance term (default True).
        use_vnorm: Weight the scores by the value norms (default True).
        epsilon: Added to the scores before the value-norm weighting, ``>= 0`` (default 0).

    Raises:
        PolicyConfigError: Bad ``window``/``kernel``/``n_future_positions``/``epsilon``, a flag that is
            not a bool, or inconsistent base settings.
    """

    window: int = 64
    kernel: int = 1
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    name: ClassVar[str] = "expected_attention"

    def validate(self) -> None:
        super().validate()
        check_int("n_future_positions", self.n_future_positions, 1, hint="(default 512)")
        check_number("epsilon", self.epsilon, 0.0, hint="(default 0)")
        for flag in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, flag), bool):
                raise PolicyConfigError(f"{flag}={getattr(self, flag)!r} must be True or False.")

    def expected_logits(self, state: PolicyState, cache: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        """``(b, kv_heads, group, capacity)`` float32 expected logits of every slot (steps 1-3 of the recipe)."""
        q, _, q_mask = last_queries(cache, rows, t, self.window)  # (b, heads, R, d), (b, R)
        q, m = q.float(), q_mask[:, None, :, None].float()
        n = m.sum(2, keepdim=True).clamp(min=1)
        mu = (q * m).sum(2, keepdim=True) / n  # (b, heads, 1, d)
        cos, sin = mean_rotation(state.rope, t, self.n_future_positions, cache.head_dim)
        cos, sin = cos[:, None, None], sin[:, None, None]  # (b, 1, 1, d)
        keys = cache.keys(rows).float()  # (b, kv_heads, C, d)
        d = cache.head_dim
        mu_rot = group_queries(apply_rotation(mu, cos, sin), cache.n_kv_heads)  # (b, kv, g, 1, d)
        logits = torch.einsum("bkgnd,bkcd->bkgc", mu_rot, keys) / math.sqrt(d)
        if self.use_covariance:
            centred = group_queries(apply_rotation((q - mu) * m, cos, sin), cache.n_kv_heads)  # (b, kv, g, R, d)
            proj = torch.einsum("bkgnd,bkcd->bkgnc", centred, keys)  # k·R(q_n - mu), zero for missing queries
            quad = proj.square().sum(3) / n  # (b, kv, g, C): k^T R S R^T k
            logits = logits + quad / (2 * d)
        return logits

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        logits = self.expected_logits(state, layer, rows, t)
        filled = (layer.positions(rows) >= 0)[:, :, None]  # (b, kv, 1, C)
        probs = torch.softmax(logits.masked_fill(~filled, -math.inf), dim=-1).nan_to_num(0.0)
        scores = probs.mean(2)  # (b, kv_heads, capacity): mean over the GQA group
        if self.use_vnorm:
            scores = (scores + self.epsilon) * layer.values(rows).float().norm(dim=-1)
        return pool_slots(scores, self.kernel, "avg")
