"""``PolicyCache``: a transformers ``Cache`` that runs any beaconkv eviction policy while a model decodes.

::

    cache = PolicyCache(model, policy=BeaconKV(budget=1024))
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=4096)

It is a second host of the policies (as ``tests/policies/test_second_host.py`` shows one can be): the
full-attention layers store their keys and values in a :class:`~beaconkv.cache.KVCache` of fixed capacity
(post-RoPE keys, a position per slot, compacted in place by the policy), the policy's state is created over
that store with the model's own rotary module (:class:`~beaconkv.hf.rotary.HFRotary`), and the layers'
queries reach the policy's observers through transformers' attention registry
(:mod:`beaconkv.hf.attention`) and forward hooks (:mod:`beaconkv.hf.hooks`). The policy objects are the
native path's, unchanged.

* **Which layers.** Layers of type ``full_attention`` evict; the layers transformers already bounds
  (sliding-window, chunked) keep transformers' own layer.
* **Which models.** Those whose full-attention layers cache per-head keys and values with RoPE; any other
  (multi-head latent attention, linear-attention hybrids, ...) is refused when the cache is made, in one line
  (:mod:`beaconkv.hf.support`).
* **Batches.** Left-padded prompts (transformers' convention) are stored right-packed per row, positions
  ``0 .. L_b - 1`` as ``generate`` numbers them; every row then evicts at its own steps, as in the native
  engine.
* **Positions.** The cache reports its logical length (tokens seen) to transformers; a decode step's
  positions are the ``position_ids`` of the forward (``generate`` passes them), so a new token is rotated
  at its logical position however many slots eviction freed.
* **Forwards of several tokens after the prefill** (a question asked on a compressed context, the rest of a
  prompt) are written after each row's held slots and attended over the store
  (:mod:`beaconkv.hf.chunk_forward`); the policy sees them as chunks and acts after them.
* **Prompt compression** (``prefill_chunk=N``): a forward of more than ``N`` tokens per row is cut into model
  calls at each row's ``N``-token boundaries (:mod:`beaconkv.hf.chunks`) by the model's forward pre-hook, the
  policy evicting after each row's chunk, so the store is sized ``policy.capacity(..., prefill_chunk=N)``
  (``n_prefix + budget + N`` slots under the default schedule) instead of the whole prompt. The forward then
  returns the logits of its last call only (``generate`` reads the last token's).

One cache serves one generation: a prefill, then forwards of one token (decode steps) or more per row.
:meth:`PolicyCache.reset` makes it ready for the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from ..cache import KVCache
from ..policies import EvictionPolicy, FullKV, PolicyDriver
from ..policies.state import PolicyState
from .attention import attend_with_sinks, use_policy_attention
from .chunk_forward import ChunkedForward
from .chunks import plan_pieces
from .errors import PolicyCacheError, UnsupportedArchitectureError
from .hooks import install_hooks
from .layer import PolicyLayer
from .rotary import HFRotary, invert_rotary
from .support import SUPPORTED, architecture_name, check_model, head_dim


class PolicyCache(Cache):
    """A transformers cache whose full-attention layers a beaconkv policy keeps at a fixed capacity.

    Args:
        model: The transformers causal LM it serves (``sdpa`` or ``eager`` attention). It is switched to the
            ``beaconkv:<implementation>`` attention function, which computes exactly what the model's own did
            with any other cache, and gets forward hooks that act only for a ``PolicyCache``.
        policy: The eviction policy (settings; its state is created at the prefill). None: keep everything
            (:class:`~beaconkv.policies.FullKV`, which then needs ``max_new_tokens``).
        max_new_tokens: Most tokens each row will add after its prompt (a question's and the answer's); sizes
            the store (``policy.capacity``) and the policy's query ring. None: the model's
            ``max_position_embeddings`` less the prompt (a budgeted policy's store is bounded by its budget anyway).
        prefill_chunk: Write a forward of more than this many tokens per row (a long prompt, a long question)
            this many tokens at a time from each row's first, the policy evicting between chunks, so the store
            holds at most ``n_prefix + budget + prefill_chunk`` slots per KV head instead of the whole prompt
            (give the policy an int ``n_prefix``: the default protects the whole prompt). The model's forward
            then returns the logits of its last call only. None: whole forwards.

    Attributes:
        policy: The policy.
        architecture: The model as refusals name it (class and ``model_type``).
        state: The policy's state over :attr:`store` (None before the prefill): its counters, telemetry,
            observers.
        store: The policy layers' :class:`~beaconkv.cache.KVCache` (None before the prefill), in the order of
            the model's full-attention layers.
        prefill_chunk: The chunk size (None: whole forwards).
        seen: Tokens seen per row, padding included: the logical length transformers is told.
        observers: What each policy layer's attention reports to (one per policy layer): the policy's
            observers (``state.observers``) from the prefill on; a measurement may wrap them (e.g. to keep the
            decode weights), as the native session hands the model observers of its choice.
        on_written: Called with the cache after every layer wrote a forward's tokens and before the policy
            acts (its schedule, its evictions), once per model call of a forward cut into chunks; None: nothing.
            A measurement reads the held positions there.
        splitting: True while the hooks run the earlier model calls of a forward cut into chunks.

    Raises:
        UnsupportedArchitectureError: A model whose full-attention layers do not cache per-head keys and values
            with RoPE (a :class:`PolicyCacheError`; :func:`~beaconkv.hf.support.check_model` says which):
            multi-head latent attention, a linear-attention hybrid, layers sharing keys and values, no
            full-attention layer, no rotary module.
        AttentionImplementationError: The model runs an attention implementation other than sdpa or eager.
        PolicyCacheError: ``prefill_chunk`` is not a positive int.
    """

    def __init__(self, model: nn.Module, policy: EvictionPolicy | None = None, *,
                 max_new_tokens: int | None = None, prefill_chunk: int | None = None) -> None:
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise PolicyCacheError(f"prefill_chunk={prefill_chunk!r} must be a positive int (tokens per chunk) or None "
                                   "(whole forwards).")
        check_model(model)  # per-head keys and values with RoPE, else one line naming the architecture
        config = model.config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        self._index: dict[int, int] = {}
        layers = []
        for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                self._index[i] = len(self._index)
                layers.append(PolicyLayer(self, self._index[i]))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
        super().__init__(layers=layers)
        self.policy = policy if policy is not None else FullKV()
        self.max_new_tokens = max_new_tokens
        self.prefill_chunk = prefill_chunk
        self.architecture = architecture_name(model)
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.dtype = model.dtype
        self.rope = HFRotary(model.get_decoder().rotary_emb, self.head_dim)
        use_policy_attention(model)
        install_hooks(model, PolicyCache)
        self.driver: PolicyDriver | None = None
        self.state: PolicyState | None = None
        self.store: KVCache | None = None
        self.seen = 0
        self.observers: list[Any] = []
        self.on_written: Callable[[PolicyCache], None] | None = None
        self.splitting = False
        self._phase: str | None = None
        self._chunks: ChunkedForward | None = None

    # ------------------------------------------------------------------------------- what the hooks call
    def policy_index(self, layer_idx: int) -> int | None:
        """The index among the policy's layers of model layer ``layer_idx`` (None: a layer transformers keeps)."""
        return self._index.get(layer_idx)

    @property
    def phase(self) -> str | None:
        """The forward under way: ``"prefill"`` (a whole prompt, the model's own attention), ``"chunk"``
        (tokens written after each row's held slots, see :mod:`beaconkv.hf.chunk_forward`), ``"decode"`` (one
        token per row), or None between forwards."""
        return self._phase

    @property
    def decoding(self) -> bool:
        """Whether the forward under way is a decode step."""
        return self._phase == "decode"

    def begin_forward(self, batch: int, n_tokens: int, device: torch.device, attention_mask: Tensor | None,
                      position_ids: Tensor | None) -> list[tuple[int, int]]:
        """Starts a forward; returns the column ranges of the model calls it is run as (one unless split).

        The first forward is the prefill (it admits the rows): a whole prompt, or with ``prefill_chunk`` a prompt
        longer than that cut at each row's chunk ends. A later forward of one token per row is a decode step; of
        more, a chunk forward (cut likewise with ``prefill_chunk``).

        Raises:
            PolicyCacheError: Another batch size than the prefill's; an attention mask that is not 2D over the
                columns seen and this forward's; positions that do not continue the rows' (a padded batch needs
                its ``position_ids``); a keep-everything policy past its ``max_new_tokens``.
        """
        if self.state is None:
            valid, lengths = self._start(batch, n_tokens, device, attention_mask)
            if self.prefill_chunk is None or max(lengths) <= self.prefill_chunk:
                self._phase = "prefill"
                return [(0, n_tokens)]
            return self._begin_chunks(valid, [0] * batch, position_ids, prompt=True)
        if batch != self.store.batch:
            raise PolicyCacheError(
                f"this forward has {batch} rows and the PolicyCache holds {self.store.batch}: a cache serves the rows "
                "it was prefilled with. Use a new PolicyCache (or reset() this one) for other prompts.")
        if n_tokens > 1:
            valid = self._new_columns(batch, n_tokens, device, attention_mask)
            if not self.policy.evicts:
                room = self._new_tokens - (self.seen - self._prompt_columns)
                if n_tokens > room:
                    raise PolicyCacheError(
                        f"{self.policy!r} keeps every token and the store has room for {room} more after the prompt; "
                        f"this forward brings {n_tokens}: pass a larger max_new_tokens (a question's tokens count).")
            return self._begin_chunks(valid, [t + 1 for t in self.state.t], position_ids, prompt=False)
        if not self.policy.evicts and self.seen - self._prompt_columns >= self._new_tokens:
            raise PolicyCacheError(f"{self.policy!r} keeps every token and the store holds prompt + "
                                   f"max_new_tokens={self._new_tokens}; pass a larger max_new_tokens.")
        if position_ids is not None:
            self._positions = position_ids.reshape(batch, -1)[:, -1]
        else:  # what the model itself numbers the token: the logical length
            self._positions = torch.full((batch,), self.seen, dtype=torch.long, device=device)
        self._phase = "decode"
        return [(0, 1)]

    def begin_piece(self, k: int) -> None:
        """Starts model call ``k`` of the forward (:meth:`begin_forward`'s ``k``-th column range).

        Raises:
            PolicyCacheError: A row's store has no room for the call's tokens.
        """
        if self._chunks is not None:
            self._chunks.begin(k)

    def end_piece(self) -> None:
        """Ends a model call: its observations, :attr:`on_written`, then the policy's work (its schedule and
        evictions) for the rows whose prompt, chunk or decode step it completed."""
        if self._phase is None:
            return
        if self._chunks is not None:
            self._chunks.end()
        if self.on_written is not None:
            self.on_written(self)
        if self._phase == "prefill":
            self.seen += self._prompt_columns
            self.driver.after_prefill(list(range(self.store.batch)))
        elif self._phase == "decode":
            self.seen += 1
            self.driver.after_decode_step()
        else:
            piece = self._chunks.current.piece
            self.seen += piece.end - piece.begin
            self._chunks.act()

    def end_forward(self) -> None:
        """Ends the forward's last model call (:meth:`end_piece`); the next forward starts afresh."""
        self.end_piece()
        self._phase, self._chunks = None, None

    def write(self, index: int, keys: Tensor, values: Tensor) -> None:
        """Writes a forward's keys and values of policy layer ``index``: the prompt, packed to the left of each
        row; a chunk after each row's held slots; or one decode token per row.

        Raises:
            PolicyCacheError: Called outside a forward of the model the cache was made for.
            UnsupportedArchitectureError: Keys or values other than per-head ``(batch, kv_heads, tokens,
                head_dim)`` (a layer the construction's probe could not run).
        """
        layer = self._store_layer(index)
        if (keys.dim() != 4 or keys.shape[1] != self.n_kv_heads or keys.shape[3] != self.head_dim
                or values.shape != keys.shape):
            raise UnsupportedArchitectureError(
                f"{self.architecture} is not supported by a PolicyCache: policy layer {index} wrote keys "
                f"{tuple(keys.shape)} and values {tuple(values.shape)}, not per-head keys and values (batch, "
                f"num_key_value_heads={self.n_kv_heads}, tokens, head_dim={self.head_dim}). {SUPPORTED}.")
        if self._phase == "prefill":
            layer.write_prefill(self._packed(keys), self._packed(values), self._prompt_positions, self._valid)
        elif self._phase == "chunk":
            self._chunks.write(index, keys, values)
        else:
            layer.append(keys, values, self._positions)

    def observe_prefill(self, index: int, query: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Hands policy layer ``index``'s prompt queries ``(batch, heads, L, head_dim)``, rotation undone, to
        its observer."""
        q_pre = invert_rotary(query, cos.unsqueeze(1), sin.unsqueeze(1), self.rope.layout)
        self.observers[index].prefill(self._packed(q_pre), self._prompt_positions, self._valid)

    def chunk_attention(self, index: int, query: Tensor, cos: Tensor, sin: Tensor, scaling: float,
                        sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
        """A chunk's attention of policy layer ``index`` over its store (every held slot at or before each
        query's position); its observer sees the queries. See
        :meth:`~beaconkv.hf.chunk_forward.ChunkedForward.attend` for the arguments.

        Returns:
            ``(batch, columns, heads, head_dim)``, transformers' layout of an attention output.
        """
        self._store_layer(index)
        return self._chunks.attend(index, query, cos, sin, scaling, sinks=sinks, softcap=softcap)

    def decode_attention(self, index: int, query: Tensor, cos: Tensor, sin: Tensor, scaling: float,
                         sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
        """One decode step's attention of policy layer ``index`` over its store; its observer sees the step.

        Args:
            index: The policy layer.
            query: ``(batch, heads, 1, head_dim)`` post-RoPE queries.
            cos: The layer's rotary ``cos`` ``(batch, 1, width)``.
            sin: Its ``sin``.
            scaling: Logit scale.
            sinks: ``(heads,)`` attention-sink logits (gpt-oss), or None.
            softcap: Logit soft-cap, or None.

        Returns:
            ``(batch, 1, heads, head_dim)``, transformers' layout of an attention output.
        """
        layer, observer = self._store_layer(index), self.observers[index]
        need = observer.needs_weights
        if sinks is None and softcap is None:
            out, weights = layer.attend(query, scaling, need_weights=need)  # the native decode's own attention
        else:
            B = query.shape[0]
            qg = query.reshape(B, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)
            out, weights = attend_with_sinks(qg, layer.keys(), layer.values(), layer.positions() >= 0, scaling,
                                             sinks, softcap)
            out = out.reshape(B, self.n_heads, 1, self.head_dim)
        if getattr(observer, "observes_decode", True):  # a policy's observer says; any other observes
            q_pre = invert_rotary(query, cos.unsqueeze(1), sin.unsqueeze(1), self.rope.layout)
            observer.decode(q_pre, self._positions, weights if need else None)
        return out.transpose(1, 2)

    def refuse(self, what: str) -> None:
        """Raises for an operation a policy cache cannot do.

        Raises:
            PolicyCacheError: Always.
        """
        raise PolicyCacheError(f"a PolicyCache cannot {what}: evicted tokens are gone and the policy's state "
                               "follows its rows; use greedy or sampled decoding without beams or rollback.")

    # ------------------------------------------------------------------------------- transformers' Cache API
    def reset(self) -> None:
        """Forgets the generation: the next forward is a new prefill."""
        super().reset()
        self.driver, self.state, self.store, self.seen, self._phase, self.observers = None, None, None, 0, None, []
        self._chunks, self.splitting = None, False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The logical length (tokens seen per row, padding included), whatever the layer."""
        if layer_idx < len(self.layers) and not isinstance(self.layers[layer_idx], PolicyLayer):
            return super().get_seq_length(layer_idx)
        return self.seen

    # ------------------------------------------------------------------------------- internals
    def _start(self, batch: int, n_tokens: int, device: torch.device,
               attention_mask: Tensor | None) -> tuple[Tensor, list[int]]:
        """Allocates the store and the policy's state for the prefill's prompts and admits every row; returns
        the prompt's ``(batch, n_tokens)`` real-token mask and each row's length."""
        if attention_mask is None:
            valid = torch.ones(batch, n_tokens, dtype=torch.bool, device=device)
        else:
            valid = attention_mask.to(device=device, dtype=torch.bool)
        if valid.shape != (batch, n_tokens):
            raise PolicyCacheError(f"the prefill's attention_mask has shape {tuple(valid.shape)}, its input "
                                   f"({batch}, {n_tokens}); a PolicyCache starts empty, with the whole prompt.")
        lengths = valid.sum(-1).tolist()
        if min(lengths) < 1:
            raise PolicyCacheError("a prompt of the batch has no token (its attention_mask row is all 0).")
        longest = max(lengths)
        if self.max_new_tokens is not None:
            new = self.max_new_tokens
        elif self.policy.evicts and self.max_positions:
            new = max(self.max_positions - longest, 1)
        else:
            raise PolicyCacheError(f"{self.policy!r} keeps every token: pass PolicyCache(..., max_new_tokens=N) "
                                   "to size its store.")
        capacity = self.policy.capacity(lengths, new, prefill_chunk=self.prefill_chunk)
        with torch.inference_mode(False):  # plain tensors: a context prefilled under inference_mode, then generate
            self.store = KVCache.allocate(len(self._index), batch, self.n_kv_heads, self.n_heads, capacity,
                                          self.head_dim, dtype=self.dtype, device=device)
            self.driver = PolicyDriver(self.policy, self.store, self.rope, max_tokens=longest + new)
            self.state = self.driver.state
        self.observers = list(self.state.observers)
        chunk = self.prefill_chunk
        written = None if chunk is None else [min(n, chunk) for n in lengths]  # a chunked prompt: its first chunk
        self.driver.admit(list(range(batch)), lengths, written=written)
        self._new_tokens, self._prompt_columns = new, n_tokens
        # the prompt's valid columns first, in order: left (or any) padding packed to the right
        self._order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
        self._prompt_positions = torch.arange(n_tokens, device=device).expand(batch, n_tokens)
        self._valid = self._prompt_positions < torch.tensor(lengths, device=device)[:, None]
        return valid, lengths

    def _new_columns(self, batch: int, n_tokens: int, device: torch.device, attention_mask: Tensor | None) -> Tensor:
        """``(batch, n_tokens)`` which columns of a later forward hold real tokens (the last ``n_tokens`` columns
        of its 2D mask over every column seen; no mask: all)."""
        if attention_mask is None:
            return torch.ones(batch, n_tokens, dtype=torch.bool, device=device)
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, self.seen + n_tokens):
            raise PolicyCacheError(
                f"a forward of {n_tokens} tokens after {self.seen} columns takes a 2D attention_mask of shape "
                f"({batch}, {self.seen + n_tokens}) (every column seen and this forward's), as generate passes it; "
                f"got {tuple(attention_mask.shape)}.")
        return attention_mask[:, -n_tokens:].to(device=device, dtype=torch.bool)

    def _begin_chunks(self, valid: Tensor, starts: list[int], position_ids: Tensor | None,
                      prompt: bool) -> list[tuple[int, int]]:
        """Plans a chunk forward (its model calls, each row's chunks) after checking the positions it is rotated at."""
        batch, n = valid.shape
        pieces = plan_pieces(valid.tolist(), starts, self.prefill_chunk, prompt)
        # the positions the model rotates the tokens at must be the ones the store records for them
        used = (position_ids.reshape(-1, n).expand(batch, n) if position_ids is not None
                else torch.arange(self.seen, self.seen + n, device=valid.device).expand(batch, n)).tolist()
        for piece in pieces:
            for r in piece.rows:
                wrong = next(((c, p) for c, p in zip(r.columns, r.positions) if used[r.row][c] != p), None)
                if wrong is not None:
                    raise PolicyCacheError(
                        f"row {r.row}'s token in column {wrong[0]} of this forward is position {wrong[1]} of the row "
                        f"(the cache numbers each row's real tokens) but the model rotates it at "
                        f"{used[r.row][wrong[0]]}: pass position_ids counting each row's real tokens (generate does: "
                        "the attention mask's cumulative sum less one).")
        self._chunks = ChunkedForward(pieces, self.store, self.observers, self.driver, self.rope.layout)
        self._phase = "chunk"
        return self._chunks.columns

    def _packed(self, x: Tensor) -> Tensor:
        """``x`` ``(batch, heads, L, head_dim)`` with each row's prompt tokens moved to its first slots."""
        B, H, L, D = x.shape
        return torch.gather(x, 2, self._order.view(B, 1, L, 1).expand(B, H, L, D))

    def _store_layer(self, index: int):
        if self._phase is None or self.store is None:
            raise PolicyCacheError("a PolicyCache layer was written outside a forward of the model it was made for; "
                                   "pass the cache to that model (model.generate(..., cache=cache)).")
        return self.store[index]
