"""Shared pieces of the transformers-integration tests: left-padded batches, greedy generate, kept sets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from beaconkv.policies import EvictionPolicy
from beaconkv.policies.state import EvictionRecord


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``prompts``, left-padded (transformers' convention for decoders)."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    return ids, mask


def greedy(model, prompts: list[list[int]], cache, new_tokens: int) -> list[list[int]]:
    """``model.generate`` greedy from left-padded ``prompts`` into ``cache``; each row's new tokens."""
    ids, mask = left_padded(prompts)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:].tolist()


def random_prompts(lengths: tuple[int, ...], seed: int, vocab: int = 97) -> list[list[int]]:
    """Prompts of these lengths, token ids in ``[3, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def same_evictions(a: list[EvictionRecord], b: list[EvictionRecord]) -> str | None:
    """None when both runs evicted the same rows of the same layers at the same steps, keeping the same
    positions; else what differs first."""
    if len(a) != len(b):
        return f"{len(a)} eviction records against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if (x.step, x.layer, x.rows) != (y.step, y.layer, y.rows):
            return f"record {i}: step/layer/rows {(x.step, x.layer, x.rows)} against {(y.step, y.layer, y.rows)}"
        if not torch.equal(x.kept_positions, y.kept_positions):
            return f"record {i} (step {x.step}, layer {x.layer}): different kept positions"
    return None


@dataclass
class NewestQuery(EvictionPolicy):
    """A user's policy: keeps what the newest query attends to most (its logits, max over the GQA group)."""

    name: ClassVar[str] = "newest_query"

    def query_window(self, max_tokens: int) -> int:
        return 1

    def score(self, layer: Any, rows: Tensor, t: Tensor) -> Tensor:
        q, _ = layer.ring_at(rows, t[:, None])  # (b, heads, 1, head_dim), pre-RoPE
        q = layer.state.rope.rotate(q, t[:, None])
        b = q.shape[0]
        qg = q.view(b, layer.n_kv_heads, layer.group, layer.head_dim)
        return torch.matmul(qg, layer.keys(rows).transpose(-1, -2)).amax(2)  # (b, kv_heads, capacity)
