"""Rank 0 leads, the other ranks mirror: one engine's scheduling, every rank's session.

Under tensor parallelism rank 0 owns the tokenizer, the requests, the sampling and the engine's
scheduling — it runs an ordinary :class:`~beaconkv.engine.Engine` (:class:`MirroredEngine`) — and every
call that changes its :class:`~beaconkv.session.Session` is first sent to the other ranks
(:class:`SessionMirror`): the engine's opening (its settings, from which each rank builds the same
session over its own heads), each admission's prefill (the prompts' token ids and rows), each decode
step (the step's input tokens, which rank 0 sampled) and each release. The other ranks run
:func:`follow`: they apply the same calls to their own sessions, so every rank runs the same forward
(its collectives meet rank 0's) and its policy driver counts, schedules and evicts exactly as rank 0's
does — the decisions are host integers computed from the same calls. The other ranks never sample:
their step computes the logits (the vocab-parallel head's all-gather needs them) and drops them.

A step costs rank 0 two broadcasts (the op, then the tokens) on top of the model's collectives; an
admission or a release one more (its arguments, pickled).

After :meth:`MirroredEngine.run`, a policy with ``telemetry=True`` has every rank's kept positions
gathered to rank 0 and joined head by head (:func:`join_telemetry`): rank 0's records then cover every
KV head of the model, as a single process's do.

Under ``torchrun`` every rank loads its shard, then rank 0 generates inside :func:`lead` (which tells
the others to stop when it is done) while the others call :func:`follow`::

    tp = TensorParallel.split(2)
    model = load_shard(path, tp)
    if tp.is_main:
        with lead(model):
            out = beaconkv.generate(model, tokenizer, prompts, policy=policy)
    else:
        follow(model)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from ..engine import Completion, Engine, Request
from ..models.decoder import CausalLM
from ..policies.base import FullKV
from ..policies.state import EvictionRecord
from ..sampling import RowSampling
from ..session import Session
from .group import TensorParallel, TensorParallelError
from .heads import attach, for_rank
from .plan import ShardPlan

__all__ = ["MirroredEngine", "SessionMirror", "follow", "join_telemetry", "lead", "send_exit"]

logger = logging.getLogger("beaconkv.distributed")
"""Where a following rank logs a call that failed on it (rank 0's engine reports it to the request)."""

# the ops rank 0 sends; a header is (op, number of tokens that follow)
_OPEN, _PREFILL, _EXTEND, _STEP, _RELEASE, _TELEMETRY, _EXIT = range(7)
_NAMES = ["open", "prefill", "extend", "step", "release", "telemetry", "exit"]


def _group(model: CausalLM) -> tuple[TensorParallel, ShardPlan]:
    tp, plan = getattr(model, "tensor_parallel", None), getattr(model, "shard_plan", None)
    if tp is None or plan is None:
        raise TensorParallelError("this model is not a tensor-parallel shard; load it with "
                                  "beaconkv.distributed.load_shard(path, tp).")
    return tp, plan


class _Channel:
    """Rank 0's ops to the other ranks: a two-integer header, then the op's tokens or its pickled arguments, on
    the group's control group (gloo, CPU tensors, the long idle timeout: a server may wait for requests)."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.header = torch.zeros(2, dtype=torch.long)  # on the CPU: the control group is gloo's

    def send(self, op: int, tokens: Tensor | None = None, args: Any = None) -> None:
        self.header[0], self.header[1] = op, 0 if tokens is None else tokens.numel()
        self.tp.broadcast(self.header, control=True)
        if tokens is not None:
            self.tp.broadcast(tokens.to(device="cpu", dtype=torch.long).contiguous(), control=True)
        elif op in (_OPEN, _PREFILL, _EXTEND, _RELEASE):
            self.tp.broadcast_object(args, control=True)

    def receive(self) -> tuple[int, Tensor | None, Any]:
        """The next op; waits as long as rank 0 is idle (the control group's long timeout)."""
        self.tp.broadcast(self.header, control=True)
        op, n = int(self.header[0]), int(self.header[1])
        if op == _STEP:
            tokens = self.tp.broadcast(torch.empty(n, dtype=torch.long), control=True)
            return op, tokens.to(self.tp.device), None
        if op in (_OPEN, _PREFILL, _EXTEND, _RELEASE):
            return op, None, self.tp.broadcast_object(control=True)
        return op, None, None


class SessionMirror:
    """Rank 0's session: each call that changes it is sent to the other ranks, then run here.

    Everything else (``state``, ``cache``, ``decoder``, ...) is the session's own.

    Args:
        session: Rank 0's session.
        tp: The group.
    """

    def __init__(self, session: Session, tp: TensorParallel) -> None:
        self.session = session
        self._channel = _Channel(tp)

    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int] | None = None,
                chunk: int | None = None) -> Tensor:
        """See :meth:`~beaconkv.session.Session.prefill`."""
        prompts = [list(map(int, p)) for p in prompts]
        rows = None if rows is None else list(rows)
        self._channel.send(_PREFILL, args=(prompts, rows, chunk))
        return self.session.prefill(prompts, rows, chunk=chunk)

    def extend(self, tokens: Sequence[Sequence[int]], rows: Sequence[int]) -> Tensor:
        """See :meth:`~beaconkv.session.Session.extend`."""
        tokens, rows = [list(map(int, t)) for t in tokens], list(rows)
        self._channel.send(_EXTEND, args=(tokens, rows))
        return self.session.extend(tokens, rows)

    def step(self, tokens: Tensor, sampling: RowSampling, noise: Tensor | None = None) -> Tensor:
        """See :meth:`~beaconkv.session.Session.step` (the other ranks get ``tokens``, never the sampling)."""
        self._channel.send(_STEP, tokens=tokens)
        return self.session.step(tokens, sampling, noise)

    def step_logits(self, tokens: Tensor) -> Tensor:
        """See :meth:`~beaconkv.session.Session.step_logits`."""
        self._channel.send(_STEP, tokens=tokens)
        return self.session.step_logits(tokens)

    def release(self, rows: Sequence[int]) -> None:
        """See :meth:`~beaconkv.session.Session.release`."""
        self._channel.send(_RELEASE, args=list(rows))
        self.session.release(rows)

    def gather_telemetry(self) -> list[list[EvictionRecord]]:
        """Every rank's eviction records, in rank order (rank 0's first)."""
        self._channel.send(_TELEMETRY)
        return self._channel.tp.gather_objects(list(self.session.state.stats.telemetry))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


class MirroredEngine(Engine):
    """Rank 0's :class:`~beaconkv.engine.Engine` over a shard: the same engine, its session mirrored on every
    rank (:class:`SessionMirror`). :func:`beaconkv.generate` makes one for a shard's rank 0.

    Args:
        model: Rank 0's shard (:func:`~beaconkv.distributed.loading.load_shard`).
        tokenizer: The tokenizer (rank 0 only).
        **kwargs: :class:`~beaconkv.engine.Engine`'s keyword arguments; ``kernels`` must be ``"auto"`` or
            ``"model"`` (the shard runs its own kernels: a prepacked copy would drop its collectives).

    Raises:
        TensorParallelError: Not rank 0, ``compile`` asked for, or other kernels than the model's.
    """

    def __init__(self, model: CausalLM, tokenizer: Any = None, **kwargs: Any) -> None:
        tp, plan = _group(model)
        if not tp.is_main:
            raise TensorParallelError(f"rank {tp.rank} runs no engine: only rank 0 schedules; the other ranks call "
                                      "beaconkv.distributed.follow(model).")
        setup = kwargs.get("setup")  # the runtime options as one value, or as keywords
        kernels = getattr(setup, "kernels", None) or kwargs.get("kernels", "auto")
        if kernels not in ("auto", "model"):
            raise TensorParallelError(f"kernels={kernels!r} replaces the shard's linear layers and their collectives; "
                                      "under tensor parallelism use kernels='model' (or 'auto').")
        if getattr(setup, "compile", False) or kwargs.get("compile"):
            raise TensorParallelError("compile is not supported with tensor parallelism yet; decode eagerly "
                                      "(compile=False).")
        if setup is not None:
            kwargs["setup"] = dataclasses.replace(setup, kernels="model")
        else:
            kwargs["kernels"] = "model"
        policy = kwargs.get("policy") or FullKV()
        kwargs["policy"] = for_rank(policy, tp, plan)
        super().__init__(model, tokenizer, **kwargs)
        attach(self.session.cache, policy, tp, plan)
        # the other ranks build the same session (no collectives in a construction that failed here)
        sent = {k: v for k, v in kwargs.items() if k not in ("on_step", "max_queue")}
        sent["policy"] = policy
        self.tp, self._telemetry_joined = tp, 0
        self.session = SessionMirror(self.session, tp)  # type: ignore[assignment]
        self.session._channel.send(_OPEN, args=sent)

    def run(self, requests: Sequence[Request] = ()) -> list[Completion]:
        """See :meth:`~beaconkv.engine.Engine.run`; then, for a policy with ``telemetry=True``, every rank's
        kept positions are joined into rank 0's records (:func:`join_telemetry`)."""
        done = super().run(requests)
        if self.policy.telemetry and self.tp.size > 1:
            per_rank = self.session.gather_telemetry()
            records = self.session.state.stats.telemetry
            start = self._telemetry_joined
            plan = _group(self.model)[1]
            records[start:] = join_telemetry([r[start:] for r in per_rank], plan.replicas)
            self._telemetry_joined = len(records)
        return done


def join_telemetry(per_rank: list[list[EvictionRecord]], replicas: int = 1) -> list[EvictionRecord]:
    """The ranks' eviction records as one process's: each record's kept positions joined along the KV heads.

    Args:
        per_rank: Each rank's records, in rank order (every rank evicts the same rows of the same layers at
            the same steps, so record ``i`` of each rank is the same eviction over other heads).
        replicas: Ranks holding each KV head (a replicated head counts once: its first replica's).

    Raises:
        TensorParallelError: The ranks' records disagree (another count, step, layer or rows: the ranks did
            not run the same evictions), or the replicas of a KV head kept different positions.
    """
    if len({len(r) for r in per_rank}) > 1:
        raise TensorParallelError(f"the ranks recorded different numbers of evictions: {[len(r) for r in per_rank]}")
    out = []
    for records in zip(*per_rank):
        head = records[0]
        if any((r.step, r.layer, r.rows) != (head.step, head.layer, head.rows) for r in records):
            raise TensorParallelError(f"the ranks' evictions disagree at step {head.step}, layer {head.layer}: "
                                      f"{[(r.step, r.layer, r.rows) for r in records]}")
        for first in range(0, len(records), replicas):  # a replicated head's replicas keep the same tokens
            copies = records[first:first + replicas]
            if any(not torch.equal(c.kept_positions, copies[0].kept_positions) for c in copies[1:]):
                raise TensorParallelError(f"the replicas of a KV head (ranks {first}..{first + replicas - 1}) kept "
                                          f"different positions at step {head.step}, layer {head.layer}")
        kept = torch.cat([r.kept_positions for r in records[::replicas]], dim=1)  # (rows, kv_heads, K)
        out.append(EvictionRecord(head.step, head.layer, list(head.rows), kept, head.observed_positions))
    return out


def follow(model: CausalLM) -> None:
    """Mirrors rank 0's engine on this rank until rank 0 sends its exit (:func:`lead`, :func:`send_exit`).

    Each opening builds this rank's engine (and session) from rank 0's settings, over this rank's heads;
    each call then runs on it. A call that fails here is logged and the rank goes on: rank 0's engine
    fails the same request (an error that stops rank 0 mid-forward leaves this rank waiting in a collective,
    which fails at the timeout).

    Args:
        model: This rank's shard.

    Raises:
        TensorParallelError: This is rank 0.
        torch.distributed.DistBackendError: Rank 0 died or stopped answering (after the timeout).
    """
    tp, plan = _group(model)
    if tp.is_main:
        raise TensorParallelError("rank 0 leads (it runs the engine); follow() is for the other ranks.")
    channel = _Channel(tp)
    session: Session | None = None
    while True:
        op, tokens, args = channel.receive()
        if op == _EXIT:
            return
        try:
            with torch.inference_mode():
                if op == _OPEN:
                    session = None  # free the previous engine's cache first
                    settings = dict(args)
                    settings["policy"] = for_rank(settings["policy"], tp, plan)
                    session = Engine(model, None, **settings).session
                    attach(session.cache, settings["policy"], tp, plan)
                elif op == _TELEMETRY:
                    tp.gather_objects([] if session is None else list(session.state.stats.telemetry))
                elif session is None:
                    raise TensorParallelError(f"rank 0 sent {_NAMES[op]} before opening an engine")
                elif op == _PREFILL:
                    prompts, rows, chunk = args
                    session.prefill(prompts, rows, chunk=chunk)
                elif op == _EXTEND:
                    session.extend(*args)
                elif op == _STEP:
                    session.step_logits(tokens)
                elif op == _RELEASE:
                    session.release(args)
        except Exception as err:  # rank 0 met the same failure and reports it
            if _is_collective_failure(err):
                raise
            logger.warning("beaconkv rank %d: %s failed here too (%s: %s)", tp.rank, _NAMES[op], type(err).__name__,
                           err)


def _is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` comes from the process group (a dead peer, a timeout): the rank must stop."""
    import torch.distributed as dist

    return isinstance(err, getattr(dist, "DistError", RuntimeError)) or "gloo" in str(err).lower() or (
        "nccl" in str(err).lower())


def send_exit(model: CausalLM) -> None:
    """Tells the other ranks to leave :func:`follow` (rank 0, once it is done with the shard)."""
    tp, _ = _group(model)
    _Channel(tp).send(_EXIT)


@contextlib.contextmanager
def lead(model: CausalLM) -> Iterator[CausalLM]:
    """Rank 0's side of a ``torchrun`` run: yields the shard, and tells the other ranks to stop when the block
    ends (even on an error, so that they end rather than wait for the timeout)."""
    _group(model)
    try:
        yield model
    except BaseException:
        with contextlib.suppress(Exception):  # the group may be what failed; the first error is the one to see
            send_exit(model)
        raise
    send_exit(model)
