"""The decoder stack: decoder layer, causal-LM model, and one builder for llama/qwen2/qwen3.

Every component is built outside and injected (norms, rotary module, attention, MLP), so a user
can swap any of them — by hand, or through :func:`build_model`'s keyword-only hooks (``rope``,
``attention``, ``mlp``, ``norm``), which :func:`~beaconkv.models.loading.load_model` passes through.
:func:`build_model` is the one place that knows how the three supported architectures differ (q/k/v
biases for Qwen2, per-head q/k norms for Qwen3, tied or untied head). Parameter names are Hugging
Face's, so checkpoints load without a renaming table.

The rotary tables (``cos``, ``sin``) are computed once per forward by :class:`DecoderModel` and
handed to every layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..cache import LayerCache, ModelCache
from ..observation import LayerObserver, ModelObserver
from .attention import Attention, Rotary
from .config import ModelConfig
from .layers import RMSNorm, SwiGLUMLP
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Args:
        self_attn: The attention module.
        mlp: The feed-forward module.
        input_layernorm: Norm before attention.
        post_attention_layernorm: Norm before the MLP.
    """

    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module, post_attention_layernorm: nn.Module
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, x: Tensor, positions: Tensor, rotary: Rotary, valid: Tensor | None, cache: LayerCache | None,
                decode: bool, observer: LayerObserver | None = None, chunk: bool = False) -> Tensor:
        """Applies the block (see :meth:`Attention.forward` for the arguments). ``observer`` and ``chunk`` are
        passed on only when set, so an attention written before they existed still runs without them."""
        h = self.input_layernorm(x)
        if chunk:
            x = x + self.self_attn(h, positions, rotary, valid, cache, decode, observer=observer, chunk=True)
        elif observer is None:
            x = x + self.self_attn(h, positions, rotary, valid, cache, decode)
        else:
            x = x + self.self_attn(h, positions, rotary, valid, cache, decode, observer=observer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Token embedding, decoder layers and final norm (HF's ``model.*`` submodule), and the rotary module.

    Args:
        embed_tokens: Token embedding.
        layers: Decoder layers.
        norm: Final norm.
        rope: The rotary module shared by every layer; its ``cos_sin(positions)`` tables are computed
            here once per forward and handed to each layer.
    """

    def __init__(self, embed_tokens: nn.Embedding, layers: list[nn.Module], norm: nn.Module,
                 rope: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rope = rope

    def embed(self, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, Rotary]:
        """The first hidden states ``(batch, seq, hidden)`` and the rotary tables every layer uses."""
        return self.embed_tokens(input_ids), self.rope.cos_sin(positions)  # tables: (batch, seq, head_dim) each

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        valid: Tensor | None = None,
        cache: ModelCache | None = None,
        decode: bool = False,
        observers: ModelObserver | None = None,
        chunk: bool = False,
    ) -> Tensor:
        """Returns the final hidden states ``(batch, seq, hidden)``; layer ``i`` writes ``cache[i]`` and
        reports to ``observers[i]`` (see :mod:`beaconkv.observation`); ``chunk``: ``input_ids`` continue
        what the cache holds (see :meth:`CausalLM.extend`)."""
        x, rotary = self.embed(input_ids, positions)  # the tables once for all layers
        extra = {"chunk": True} if chunk else {}
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rotary, valid, None if cache is None else cache[i], decode,
                      None if observers is None else observers[i], **extra)
        return self.norm(x)


class CausalLM(nn.Module):
    """A decoder-only causal language model.

    ``model(input_ids)`` is a plain causal forward returning logits ``(batch, seq, vocab)``.
    Generation uses :meth:`prefill` and :meth:`decode_step` against a :class:`~beaconkv.cache.KVCache` (or anything that implements
    :class:`~beaconkv.cache.ModelCache`).

    Args:
        config: The architecture.
        model: The decoder stack (``model.*`` parameters).
        lm_head: Output projection; its weight is the embedding matrix when embeddings are tied.
    """

    def __init__(self, config: ModelConfig, model: DecoderModel, lm_head: nn.Linear) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = lm_head
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        """Where the weights live (the token embedding's device)."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the token embedding's dtype)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def rope(self) -> nn.Module:
        """The rotary module of every layer (eviction policies re-rotate stored queries with it)."""
        return self.model.rope

    def forward(self, input_ids: Tensor, valid: Tensor | None = None) -> Tensor:
        """Plain causal forward, no cache.

        Args:
            input_ids: ``(batch, seq)`` token ids (right-padded if ``valid`` is given).
            valid: Optional ``(batch, seq)`` bool mask, False on padding.

        Returns:
            Logits ``(batch, seq, vocab)`` in float32.
        """
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return self.lm_head(self.model(input_ids, positions, valid)).float()

    def prefill(self, input_ids: Tensor, valid: Tensor, cache: ModelCache, observers: ModelObserver | None = None
                ) -> Tensor:
        """Runs right-padded prompts, fills ``cache`` and returns each sequence's last-token logits.

        Args:
            input_ids: ``(batch, L)`` prompt ids, right-padded.
            valid: ``(batch, L)`` bool, False on padding.
            cache: The generation's cache (capacity >= L).
            observers: Who observes each layer's prompt queries (a policy's state's
                :attr:`~beaconkv.policies.state.PolicyState.observers`); None: nobody.

        Returns:
            ``(batch, vocab)`` float32 logits at each prompt's last real token.
        """
        B, L = input_ids.shape
        positions = torch.arange(L, device=input_ids.device).expand(B, -1)
        hidden = self.model(input_ids, positions, valid, cache, observers=observers)
        last = valid.sum(-1) - 1  # (batch,)
        h_last = hidden[torch.arange(B, device=hidden.device), last]
        return self.lm_head(h_last).float()

    def extend(self, input_ids: Tensor, valid: Tensor, start: Tensor, cache: ModelCache,
               observers: ModelObserver | None = None) -> Tensor:
        """Runs right-padded chunks that continue what ``cache`` holds; returns each row's last-token logits.

        Row ``b``'s tokens take positions ``start[b], start[b] + 1, ...``; each layer writes them after
        the row's filled slots and attends over every filled slot at or before each token's position
        (:class:`~beaconkv.cache.ChunkedLayerCache`), whatever an eviction left there. Used for a prompt
        prefilled in chunks (policies evict between them) and for a question asked on a cache that
        holds a compressed context.

        Args:
            input_ids: ``(batch, L)`` token ids, right-padded.
            valid: ``(batch, L)`` bool, False on padding.
            start: ``(batch,)`` the position of each row's first token (one past its newest).
            cache: The cache (a :class:`~beaconkv.cache.ChunkedLayerCache` per layer).
            observers: Who observes each layer's chunk queries (see :meth:`prefill`).

        Returns:
            ``(batch, vocab)`` float32 logits at each row's last real token.
        """
        B, L = input_ids.shape
        positions = start[:, None] + torch.arange(L, device=input_ids.device)
        hidden = self.model(input_ids, positions, valid, cache, observers=observers, chunk=True)
        last = valid.sum(-1) - 1
        return self.lm_head(hidden[torch.arange(B, device=hidden.device), last]).float()

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: ModelCache,
                    observers: ModelObserver | None = None) -> Tensor:
        """One decode step for the whole batch: static shapes, in-place cache writes.

        It is :meth:`decode_inputs`, :func:`decode_layers` over the layers, then :meth:`decode_logits`: the
        pieces an executor may run separately (:mod:`beaconkv.execution.decode` owns how).

        Args:
            tokens: ``(batch,)`` the newest token of each sequence.
            positions: ``(batch,)`` its absolute position.
            cache: The generation's cache.
            observers: Who observes each layer's step (None: nobody; see :meth:`prefill`).

        Returns:
            ``(batch, vocab)`` float32 logits.
        """
        x, positions_2d, rotary = self.decode_inputs(tokens, positions)
        n = len(cache)
        x = decode_layers(tuple(self.model.layers), x, positions_2d, rotary, tuple(cache[i] for i in range(n)),
                          None if observers is None else tuple(observers[i] for i in range(n)))
        return self.decode_logits(x)

    def decode_inputs(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Rotary]:
        """A decode step's first hidden states ``(batch, 1, hidden)``, positions ``(batch, 1)`` and rotary tables."""
        positions = positions[:, None]
        x, rotary = self.model.embed(tokens[:, None], positions)
        return x, positions, rotary

    def decode_logits(self, x: Tensor) -> Tensor:
        """The ``(batch, vocab)`` float32 logits of a decode step's last hidden states ``(batch, 1, hidden)``."""
        return self.lm_head(self.model.norm(x)[:, 0]).float()


def decode_layers(layers: tuple[nn.Module, ...], x: Tensor, positions: Tensor, rotary: Rotary,
                  caches: tuple[LayerCache, ...], observers: tuple[LayerObserver | None, ...] | None = None) -> Tensor:
    """Consecutive decoder layers of a decode step (see :meth:`CausalLM.decode_step`), each appending to and
    attending over its own layer's cache in ``caches`` and reporting to its observer in ``observers``.

    Every layer runs the same code with the same shapes, so a compiled step compiles this once for a
    block of layers and calls it for every block."""
    for layer, cache, observer in zip(layers, caches, observers or (None,) * len(layers)):
        x = layer(x, positions, rotary, None, cache, True, observer)
    return x


#: ``rope=`` of :func:`build_model`: a rotary module, or a function of the config that makes one.
RopeFactory = Callable[[ModelConfig], nn.Module]


def default_rope(config: ModelConfig) -> RotaryEmbedding:
    """The checkpoint's own rotary embedding (``rope_theta`` and ``rope_scaling`` of its config)."""
    return RotaryEmbedding(config.head_dim, config.rope)


def build_model(
    config: ModelConfig,
    *,
    rope: nn.Module | RopeFactory | None = None,
    attention: Callable[..., nn.Module] = Attention,
    mlp: Callable[[ModelConfig], nn.Module] | None = None,
    norm: Callable[[int, float], nn.Module] = RMSNorm,
) -> CausalLM:
    """Builds an (uninitialised) model for a llama, qwen2 or qwen3 configuration.

    Construct it under ``torch.device("meta")`` to allocate nothing before loading weights.

    Args:
        config: The architecture.
        rope: The rotary module shared by every layer, or ``rope(config)`` making one (default: the
            config's own, :func:`default_rope`). Contract: ``cos_sin(positions) -> (cos, sin)`` float32
            tables of shape ``positions.shape + (head_dim,)``; ``apply(x, cos, sin)`` rotates ``x``
            ``(batch, heads, seq, head_dim)`` with tables broadcast over heads; ``rotate(x, positions)``
            does both (eviction policies use it to re-rotate stored pre-RoPE queries).
        attention: Called with :class:`Attention`'s keyword arguments (``q_proj``, ``k_proj``,
            ``v_proj``, ``o_proj``, ``rope``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``q_norm``,
            ``k_norm``) once per layer; a subclass of :class:`Attention` fits as it is. It must honour
            the attention ↔ cache contract of :mod:`beaconkv.cache`.
        mlp: ``mlp(config)`` making each layer's feed-forward (default :class:`SwiGLUMLP`, whose
            ``gate_proj``/``up_proj``/``down_proj`` names the checkpoints use).
        norm: ``norm(width, eps)`` making every RMS norm (layer norms, final norm, Qwen3's q/k norms).

    Returns:
        The model, with Hugging Face parameter names.
    """
    c = config
    shared_rope = rope(c) if rope is not None and not isinstance(rope, nn.Module) else rope
    shared_rope = shared_rope if shared_rope is not None else default_rope(c)
    make_mlp = mlp or (lambda cfg: SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size))
    layers = []
    for _ in range(c.num_hidden_layers):
        attn = attention(
            q_proj=nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias),
            k_proj=nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias),
            v_proj=nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias),
            o_proj=nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False),
            rope=shared_rope,
            n_heads=c.num_attention_heads,
            n_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            q_norm=norm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None,
            k_norm=norm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None,
        )
        layers.append(DecoderLayer(attn, make_mlp(c), norm(c.hidden_size, c.rms_norm_eps),
                                   norm(c.hidden_size, c.rms_norm_eps)))
    decoder = DecoderModel(nn.Embedding(c.vocab_size, c.hidden_size), layers, norm(c.hidden_size, c.rms_norm_eps),
                           shared_rope)
    return CausalLM(c, decoder, nn.Linear(c.hidden_size, c.vocab_size, bias=False))
