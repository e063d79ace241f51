"""One decoding session: a model, its cache, a policy's state and the execution strategy, set up once.

:class:`Session` is the single place where a cache is allocated and a policy bound to it. Every
caller that decodes goes through it — :func:`beaconkv.generate`, the continuous-batching engine, the
fidelity study — so they all run the same steps:

1. **allocate** — :class:`~beaconkv.cache.KVCache` with the chosen storage (``"dense"``, ``"int8"``),
   and the policy's :class:`~beaconkv.policies.PolicyState` with its observers (query rings);
2. **prefill** — :meth:`Session.prefill` admits rows (all, or some rows of a slot pool), writes
   their prompts through :meth:`~beaconkv.models.CausalLM.prefill` (the cache stores keys and values,
   the state's observers see the queries) and lets the policy act;
3. **decode** — :meth:`Session.step` runs one decode step for every row (model, in-place cache
   write, attention, each row's own sampling) in the shape its executor asks for
   (:class:`~beaconkv.execution.decode.DecodeStep`: one function eagerly, one graph, or a graph per block
   of layers), then the policy's driver acts (evictions when due);
4. **release** — :meth:`Session.release` ends rows (a finished request leaves its slot to the next).

Rows that are not admitted do not decode: they write nothing that counts, never evict and are never
counted (the cache's ``active`` mask, the state's ``live`` flags).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from .cache import KVCache
from .execution import CompileConfig, make_executor, resolve_compile_config
from .decode_setup import DecodeSetup
from .execution.decode import DecodeStep, Observers
from .models.decoder import CausalLM
from .policies.base import EvictionPolicy, FullKV
from .policies.driver import PolicyDriver
from .preparation import PreparedModel
from .sampling import RowSampling
from .storage import KVStorage


def pad_prompts(prompts: Sequence[Sequence[int]], device: torch.device, pad: int = 0) -> tuple[Tensor, Tensor]:
    """Right-pads token ids: ``(ids (b, L), valid (b, L))`` on ``device``."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])
    valid = torch.arange(L)[None] < lengths[:, None]
    return ids.to(device), valid.to(device)


class Session:
    """A model, a cache of ``batch`` rows, a policy's state over it, and the executors.

    The session runs ``model`` as it is given. To run it with other matmul kernels (a prepacked or
    bf16-weight copy), prepare it first with :func:`~beaconkv.preparation.prepare_model` and pass
    what that returns (its model, cache dtype and compile settings; :meth:`prepared` does this).

    Args:
        model: The model.
        policy: The eviction policy (settings; its state is created here). None = FullKV.
        batch: Rows (sequences, or slots of a pool).
        capacity: Cache slots per (row, KV head); :meth:`for_prompts` sizes it with the policy.
        max_tokens: The longest sequence a row will hold (sizes a policy's query ring; default ``capacity``).
        kv_storage: ``"dense"``, ``"int8"`` or a :class:`~beaconkv.storage.KVStorage` subclass.
        cache_dtype: Dtype a dense storage keeps keys and values in (None: the model's); attention
            computes in the model's dtype.
        compile: Run the decode step and the policy's device work as compiled graphs (see
            :class:`~beaconkv.execution.CompileConfig`).
        query_window: Keep at least this many pre-RoPE queries per head in the observers' rings
            (measurement; the policy's own need is always met).
        setup: ``kv_storage``, ``cache_dtype`` and ``compile`` as one
            :class:`~beaconkv.decode_setup.DecodeSetup` (instead of the keywords, not with them; its
            ``prefill_chunk`` is :meth:`prefill`'s default).

    Attributes:
        model: The model the session runs.
        setup: The session's :class:`~beaconkv.decode_setup.DecodeSetup`.
        cache: The cache.
        driver: The :class:`~beaconkv.policies.PolicyDriver` running the policy over the cache (rows,
            schedule, evictions).
        state: The policy's state, ``driver.state`` (its :attr:`~beaconkv.policies.state.PolicyState.observers` see every
            layer's queries).
        observers: What the decode step hands each layer to report to: the state's observer of that
            layer, or None where it observes nothing during decoding (None: no layer).
        decode: The decode step (:class:`~beaconkv.execution.decode.DecodeStep`) in the executor's shape.
        policy_s: Host seconds spent in the policy between steps.
    """

    def __init__(
        self,
        model: CausalLM,
        policy: EvictionPolicy | None,
        *,
        batch: int,
        capacity: int,
        max_tokens: int | None = None,
        kv_storage: str | type[KVStorage] = "dense",
        cache_dtype: torch.dtype | None = None,
        compile: bool | CompileConfig = False,
        query_window: int = 0,
        setup: DecodeSetup | None = None,
    ) -> None:
        setup = DecodeSetup.of(setup, kv_storage=kv_storage, cache_dtype=cache_dtype, compile=compile)
        cfg = model.config
        self.model = model
        self.policy = policy if policy is not None else FullKV()
        self.device = model.device
        self.setup = setup
        self.decoder, policy_executor = make_executor(resolve_compile_config(setup.compile), self.device)
        self.cache = KVCache.allocate(
            cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.num_attention_heads, capacity, cfg.head_dim,
            dtype=model.dtype, device=self.device, storage=setup.kv_storage, storage_dtype=setup.cache_dtype,
        )
        self.driver = PolicyDriver(self.policy, self.cache, model.rope, policy_executor, max_tokens=max_tokens,
                                   query_window=query_window)  # no row admitted yet
        self.state = self.driver.state
        watched = tuple(o if o.observes_decode else None for o in self.state.observers)
        self.observers: Observers = watched if any(o is not None for o in watched) else None
        self.decoder.prepare(self.cache, self.state)
        self.decode = DecodeStep(self.decoder, model, self.cache, self.observers)
        self.policy_s = 0.0

    @classmethod
    def prepared(cls, prepared: PreparedModel, policy: EvictionPolicy | None, **kwargs) -> Session:
        """A session on a :func:`~beaconkv.preparation.prepare_model` result: its model, with its setup
        (storage, cache dtype and compile settings as the preparation chose them).

        Args:
            prepared: What :func:`~beaconkv.preparation.prepare_model` made.
            policy: The policy (None = FullKV).
            **kwargs: ``batch``, ``capacity``, ``max_tokens``, ``query_window`` (see the class).
        """
        return cls(prepared.model, policy, setup=prepared.setup, **kwargs)

    @classmethod
    def for_prompts(
        cls, model: CausalLM, policy: EvictionPolicy | None, prompt_lengths: Sequence[int], new_tokens: int, **kwargs
    ) -> Session:
        """A session with one row per prompt, its cache sized by the policy for ``new_tokens`` more tokens.

        Args:
            model: The model.
            policy: The policy (None = FullKV).
            prompt_lengths: Prompt length of each row.
            new_tokens: Tokens each row may add.
            **kwargs: ``kv_storage``, ``cache_dtype``, ``compile``, ``query_window`` (see the class).
        """
        policy = policy if policy is not None else FullKV()
        lengths = list(prompt_lengths)
        return cls(model, policy, batch=len(lengths), capacity=policy.capacity(lengths, new_tokens),
                   max_tokens=max(lengths) + new_tokens, **kwargs)

    @property
    def batch(self) -> int:
        """Rows of the session."""
        return self.cache.batch

    @property
    def positions(self) -> Tensor:
        """``(batch,)`` the position each row's next token takes: read from the policy's state, the one
        owner of the rows' positions (:attr:`~beaconkv.policies.state.PolicyState.positions`)."""
        return self.state.positions

    @property
    def compiled(self) -> bool:
        """Whether the decode step runs compiled."""
        return self.decoder.compiled

    # ------------------------------------------------------------------------------- rows
    def admit(self, rows: Sequence[int], prompt_lengths: Sequence[int]) -> None:
        """Starts ``rows`` for prompts of these lengths (before their prefill; see :meth:`prefill`)."""
        self.driver.admit(list(rows), list(prompt_lengths))

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int] | None = None,
                chunk: int | None = None) -> Tensor:
        """Admits ``rows`` (default: all, in order), writes their prompts and lets the policy act.

        With ``chunk=N`` a prompt longer than ``N`` tokens is written ``N`` tokens at a time: the first
        chunk as a prefill, each next one through :meth:`extend` (attending over what the cache holds),
        and the policy evicts after every chunk, so the cache never holds the whole prompt (size it with
        the policy's ``capacity(..., prefill_chunk=N)``: ``n_prefix + budget + N`` slots under the
        default schedule). Prompts of at most ``N`` tokens are prefilled exactly as without ``chunk``.

        Args:
            prompts: Token ids per row (ragged).
            rows: Which rows of the cache they go to.
            chunk: Tokens per prefill chunk (None: the setup's ``prefill_chunk``; whole prompts when that is
                None too).

        Returns:
            ``(len(prompts), vocab)`` float32 logits of each prompt's last token.

        Raises:
            ValueError: ``chunk`` is not a positive int.
        """
        rows = list(range(len(prompts))) if rows is None else list(rows)
        lengths = [len(p) for p in prompts]
        chunk = self.setup.prefill_chunk if chunk is None else chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk={chunk!r} must be a positive int (tokens per prefill chunk) or None.")
        if chunk is None or max(lengths) <= chunk:
            self.admit(rows, lengths)
            logits = self._write(prompts, rows, start=None)
            self.after_prefill(rows)
            return logits
        firsts = [p[:chunk] for p in prompts]
        self.driver.admit(rows, lengths, written=[len(f) for f in firsts])
        logits = self._write(firsts, rows, start=None)
        self.after_prefill(rows)
        for begin in range(chunk, max(lengths), chunk):
            more = [i for i, n in enumerate(lengths) if n > begin]
            logits[more] = self.extend([prompts[i][begin:begin + chunk] for i in more], [rows[i] for i in more])
        return logits

    @torch.inference_mode()
    def extend(self, tokens: Sequence[Sequence[int]], rows: Sequence[int]) -> Tensor:
        """Writes more tokens in some live rows at once, after what each holds, and lets the policy act.

        The tokens take the positions after each row's newest and attend over every token the cache
        still holds (:meth:`~beaconkv.models.CausalLM.extend`); the policy sees their queries
        (:meth:`~beaconkv.policies.EvictionPolicy.observe_chunk`) and evicts the rows now due
        (:meth:`~beaconkv.policies.PolicyDriver.after_chunk`). A prompt's later chunks come this way,
        and so does a question asked on a cache that holds a compressed context (kvpress's protocol:
        compress the context without the question, then ask).

        Args:
            tokens: Token ids per row (ragged; each at least one token, at most the room left).
            rows: The rows, admitted and prefilled.

        Returns:
            ``(len(tokens), vocab)`` float32 logits of each row's last new token.

        Raises:
            ValueError: An empty token list, or a row that is not live.
        """
        rows = list(rows)
        if not tokens or any(len(t) == 0 for t in tokens) or len(tokens) != len(rows):
            raise ValueError(f"extend needs one non-empty token list per row; got {len(tokens)} lists for "
                             f"{len(rows)} rows (lengths {[len(t) for t in tokens]}).")
        idle = [b for b in rows if not self.state.live[b]]
        if idle:
            raise ValueError(f"rows {idle} are not live: prefill them first (extend continues a row's tokens).")
        logits = self._write(tokens, rows, start=[self.state.t[b] + 1 for b in rows])
        t0 = time.perf_counter()
        self.driver.after_chunk(rows, [len(t) for t in tokens])
        self.policy_s += time.perf_counter() - t0
        return logits

    def _write(self, prompts: Sequence[Sequence[int]], rows: list[int], start: list[int] | None) -> Tensor:
        """Runs the model over ``prompts`` into ``rows``: a prefill (``start`` None) or a chunk after each
        row's tokens (starting at positions ``start``); returns each row's last-token logits."""
        ids, valid = pad_prompts(prompts, self.device)
        if rows == list(range(self.batch)):
            target, observers = self.cache, self.state.observers
        else:
            rows_t = self.state.index(rows)
            target, observers = self.cache.rows(rows_t), [o.rows(rows_t) for o in self.state.observers]
        if start is None:
            return self.model.prefill(ids, valid, target, observers)
        return self.model.extend(ids, valid, torch.tensor(start, device=self.device), target, observers)

    def after_prefill(self, rows: Sequence[int]) -> None:
        """The policy's work once the prompts of ``rows`` are written (:meth:`prefill` calls it; a caller that
        writes the prompts itself — a :class:`~beaconkv.measure.fidelity.cache_stack.CacheStack` — calls it
        after)."""
        t0 = time.perf_counter()
        self.driver.after_prefill(list(rows))
        self.policy_s += time.perf_counter() - t0

    def release(self, rows: Sequence[int]) -> None:
        """Ends ``rows``: they stop decoding, evicting and counting; the next admission reuses their slots."""
        self.driver.release(list(rows))

    # ------------------------------------------------------------------------------- decode
    @torch.inference_mode()
    def step(self, tokens: Tensor, sampling: RowSampling, noise: Tensor | None = None) -> Tensor:
        """Decodes ``tokens`` (one per row) and samples the next ones; then the policy acts.

        Args:
            tokens: ``(batch,)`` newest token of each row (anything for rows that are not live).
            sampling: Each row's sampling parameters.
            noise: ``(batch, vocab)`` race noise of the sampled rows (see :func:`~beaconkv.sampling.sample_rows`).

        Returns:
            ``(batch,)`` next tokens (a fresh tensor).
        """
        nxt = self.decode.tokens(tokens, self.positions, sampling, noise)
        self.after_step()
        return nxt

    @torch.inference_mode()
    def step_logits(self, tokens: Tensor) -> Tensor:
        """Decodes ``tokens`` and returns their float32 logits ``(batch, vocab)``; then the policy acts
        (teacher forcing: the accuracy suite's decode text, a measurement's trace)."""
        logits = self.decode.logits(tokens, self.positions)
        self.after_step()
        return logits

    def after_step(self) -> None:
        """The policy's between-step work and the positions' advance, after a decode step wrote a token
        in every live row (:meth:`step` calls it; a caller that decodes through a stack calls it after)."""
        t0 = time.perf_counter()
        self.driver.after_decode_step()
        self.policy_s += time.perf_counter() - t0  # the policy's state advanced every live row's position
