"""Starting a tensor-parallel group from one process: this process is rank 0, the others are spawned.

:class:`TensorParallelRun` is what :func:`beaconkv.generate` (``tensor_parallel_size=N``) and the command
line (``--tensor-parallel-size N``) use when they were not started by ``torchrun``: it spawns ranks
``1 .. N-1`` with ``torch.multiprocessing`` (the ``spawn`` method: fresh interpreters, safe with threads
and CUDA), joins them in a process group as rank 0 over a free local port, and every rank loads its own
shard from the checkpoint (:func:`~beaconkv.distributed.loading.load_shard`); the spawned ranks then
mirror rank 0's engine (:func:`~beaconkv.distributed.mirror.follow`) until :meth:`TensorParallelRun.close`.

**A failure stops the group with one error.** A spawned rank that raises (a shard that cannot load) or
dies (killed, out of memory) makes rank 0's next collective fail — at once when its connection closes,
else at the group's timeout — and :meth:`TensorParallelRun.guard` turns that into one
:class:`~beaconkv.distributed.group.TensorParallelError` naming the rank and what happened to it (its
exception, or its exit signal), after stopping the ranks still running. Rank 0 failing ends the others
the same way (their next collective fails), so nothing waits forever.

Under ``torchrun`` (one process per rank, started by the launcher) use
:meth:`~beaconkv.distributed.group.TensorParallel.split`, :func:`~beaconkv.distributed.loading.load_shard`,
:func:`~beaconkv.distributed.mirror.lead` and :func:`~beaconkv.distributed.mirror.follow` instead (see
:mod:`beaconkv.distributed.mirror`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed
import torch.multiprocessing as mp

from ..models.config import ModelConfig
from ..models.decoder import CausalLM
from .group import DEFAULT_TIMEOUT_S, TensorParallel, TensorParallelError, under_torchrun
from .loading import load_shard
from .mirror import MirroredEngine, follow, send_exit
from .plan import check_tensor_parallel_size

__all__ = ["TensorParallelRun", "rank_device"]

logger = logging.getLogger("beaconkv.distributed")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device | str, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` (offset by the given index) for a CUDA device, else ``device``.

    Raises:
        TensorParallelError: A CUDA rank beyond the GPUs this machine has.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise TensorParallelError(f"rank {rank} needs cuda:{index}, but this machine has {torch.cuda.device_count()} "
                                  "GPU(s); lower the tensor-parallel size.")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class _RankSpec:
    """What a spawned rank needs to join and load (pickled to it)."""

    address: str
    size: int
    checkpoint: str
    dtype: Any
    device: str
    vocab_parallel: bool
    timeout_s: float
    threads: int | None
    log_level: int


def _rank_main(index: int, spec: _RankSpec) -> None:
    """A spawned rank: join, load the shard, mirror rank 0 until it exits."""
    logging.basicConfig(level=spec.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every rank: rank 0 stops the group
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    rank = index + 1
    tp = TensorParallel.join(spec.address, rank, spec.size, timeout_s=spec.timeout_s,
                             device=rank_device(spec.device, rank))
    try:
        model = load_shard(spec.checkpoint, tp, spec.dtype, vocab_parallel=spec.vocab_parallel)
        tp.barrier()  # every shard loaded
        follow(model)
    finally:
        tp.close()


class TensorParallelRun:
    """A tensor-parallel group started from this process: rank 0 here, ranks ``1 .. size-1`` spawned.

    Use it as a context manager (:meth:`close` on exit); :attr:`model` is rank 0's shard, which
    :func:`beaconkv.generate` runs (its engine mirrored on every rank) as often as wanted::

        with TensorParallelRun("Qwen/Qwen3-32B", 4, dtype="bf16", device="cuda") as run:
            out = beaconkv.generate(run.model, tokenizer, prompts, policy=beaconkv.BeaconKV(2048))

    The shard carries the run's :meth:`guard` as ``model.tensor_parallel_guard``: :func:`beaconkv.generate`
    runs under it, so a rank that fails or dies during the call ends it with one
    :class:`~beaconkv.distributed.group.TensorParallelError` naming that rank.

    Args:
        checkpoint: Checkpoint directory or hub id (every rank reads its own slices of it).
        size: Ranks (the tensor-parallel size), at least 2.
        dtype: Parameter dtype.
        device: ``"cpu"`` (gloo: every rank on this CPU) or ``"cuda"``/``"cuda:i"`` (NCCL: rank ``r`` on
            ``cuda:i+r``).
        vocab_parallel: Split the embedding and LM head (default) or replicate them.
        timeout_s: Seconds a collective waits for a rank before the group fails (a dead rank is usually
            noticed at once; this bounds the rest).
        threads: torch CPU threads of every rank (None: the spawned ranks take torch's default and this
            process keeps its own).

    Attributes:
        model: Rank 0's shard (its ``tensor_parallel_guard`` is this run's :meth:`guard`).
        tp: Rank 0's group.

    Raises:
        TensorParallelError: ``size`` below 2 or not a split of the model, a process that already belongs to
            a process group (use the ``torchrun`` recipe), or a rank that failed to start or load (named).
    """

    def __init__(self, checkpoint: str | Path, size: int, *, dtype: torch.dtype | str | None = torch.float32,
                 device: torch.device | str = "cpu", vocab_parallel: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise TensorParallelError(f"tensor_parallel_size={size!r}: a tensor-parallel run needs an int >= 2 "
                                      "(1 runs in this process: load_model and generate as usual).")
        if under_torchrun():
            raise TensorParallelError(
                "this process was started by torchrun: its ranks are already running, so spawning more would "
                "double them; use TensorParallel.split(size), load_shard, lead and follow (beaconkv.distributed).")
        from ..models.loading import resolve_checkpoint, resolve_device, resolve_dtype

        directory = resolve_checkpoint(checkpoint)  # a hub download happens once, here
        check_tensor_parallel_size(ModelConfig.from_file(directory), size)  # before any process starts
        base = resolve_device(device)
        for r in range(size):
            rank_device(base, r)
        if threads is not None:
            torch.set_num_threads(threads)
        self.size, self.processes = size, None
        spec = _RankSpec(f"tcp://127.0.0.1:{_free_port()}", size, str(directory), resolve_dtype(dtype, base),
                         str(base), vocab_parallel, timeout_s, threads, logging.getLogger().level)
        if torch.distributed.is_initialized():
            raise TensorParallelError(
                "this process already belongs to a torch.distributed group (another TensorParallelRun still open, or "
                "a launcher's group): close it first, or under torchrun use TensorParallel.split and load_shard.")
        self.processes = mp.start_processes(_rank_main, args=(spec,), nprocs=size - 1, join=False,
                                            start_method="spawn")
        self.tp: TensorParallel | None = None
        self._closed = False
        try:
            with self.guard("starting the ranks"):
                self.tp = TensorParallel.join(spec.address, 0, size, timeout_s=timeout_s,
                                              device=rank_device(base, 0))
                self.model: CausalLM = load_shard(directory, self.tp, spec.dtype, vocab_parallel=vocab_parallel)
                self.model.tensor_parallel_guard = self.guard  # what beaconkv.generate runs the shard under
                self.tp.barrier()
        except BaseException:
            self._stop()  # no rank outlives a run that did not start
            raise

    def __enter__(self) -> TensorParallelRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(failed=exc[0] is not None)

    def engine(self, tokenizer: Any = None, **kwargs: Any) -> MirroredEngine:
        """A continuous-batching :class:`~beaconkv.engine.Engine` on the shard, its session mirrored on every rank
        (what a server steps: it may sit idle between requests for up to
        :data:`~beaconkv.distributed.group.IDLE_TIMEOUT_S`).

        Args:
            tokenizer: The tokenizer (None: token ids only).
            **kwargs: :class:`~beaconkv.engine.Engine`'s keyword arguments (see
                :class:`~beaconkv.distributed.mirror.MirroredEngine`).
        """
        return MirroredEngine(self.model, tokenizer, **kwargs)

    def watch(self, on_failure: Callable[[str], None], interval_s: float = 0.5) -> None:
        """Calls ``on_failure(message)`` once, from a daemon thread, when a spawned rank ends while the run is open
        (what a server that waits for requests needs: no collective runs to notice a rank that died meanwhile).

        Args:
            on_failure: Called with ``"tensor parallelism stopped: rank 1 died of SIGKILL ..."``; it must be quick
                and may not close the run (a server stops itself there, and closes the run on its way out).
            interval_s: Seconds between two looks at the ranks.
        """
        def look() -> None:
            while not self._closed:
                for i, p in enumerate(self.processes.processes):
                    if p.exitcode is not None and not self._closed:
                        on_failure(f"tensor parallelism stopped: rank {i + 1} {_ended(p.exitcode, self.processes, i)}")
                        return
                time.sleep(interval_s)

        threading.Thread(target=look, name="beaconkv-tp-watch", daemon=True).start()

    @contextlib.contextmanager
    def guard(self, doing: str) -> Iterator[None]:
        """Turns a failure while ``doing`` something into one :class:`TensorParallelError` naming the rank that
        failed or died (the ranks still running are stopped), or lets rank 0's own error through."""
        try:
            yield
        except Exception as err:
            # a collective that failed: wait a moment for the rank that caused it to be seen ending
            failure = self._rank_failure(5.0 if _group_broken(err) else 0.0)
            if failure is not None:
                self._stop()
                raise TensorParallelError(f"tensor parallelism stopped while {doing}: {failure}") from err
            if _group_broken(err):
                self._stop()
                raise TensorParallelError(f"tensor parallelism stopped while {doing}: the group failed on rank 0 "
                                          f"({type(err).__name__}: {str(err).strip()[:300]})") from err
            raise

    def _rank_failure(self, wait_s: float = 5.0) -> str | None:
        """What happened to a spawned rank that ended (waiting up to ``wait_s`` for one to be seen ending), or None."""
        if self.processes is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            for i, p in enumerate(self.processes.processes):
                if p.exitcode is not None and p.exitcode != 0:
                    return f"rank {i + 1} {_ended(p.exitcode, self.processes, i)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _stop(self) -> None:
        """Ends the spawned ranks and leaves the group (after a failure)."""
        self._closed = True
        if self.processes is not None:
            for p in self.processes.processes:
                if p.is_alive():
                    p.terminate()
            for p in self.processes.processes:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if self.tp is not None:
            with contextlib.suppress(Exception):
                self.tp.close()

    def close(self, failed: bool = False) -> None:
        """Tells the ranks to exit, waits for them and leaves the group (idempotent).

        Args:
            failed: The block using the run raised (the ranks are stopped without waiting on them).

        Raises:
            TensorParallelError: A rank ended with an error.
        """
        if self._closed:
            return
        self._closed = True
        if failed or self.tp is None:
            self._stop()
            return
        try:
            send_exit(self.model)
            deadline = time.monotonic() + self.tp.timeout_s
            while not self.processes.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"the ranks did not exit within {self.tp.timeout_s:g}s")
        except Exception as err:
            failure = self._rank_failure(0.0)
            self._stop()
            raise TensorParallelError(f"tensor parallelism failed while stopping: {failure or err}") from err
        finally:
            if self.tp is not None:
                self.tp.close()
        self._stop()


def _ended(code: int, context: Any, index: int) -> str:
    """``"died of SIGKILL"`` / ``"failed: ValueError: ..."`` for a spawned rank's exit."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"died of {signal.Signals(-code).name} (killed, or out of memory)"
        return f"died of signal {-code}"
    error_file = getattr(context, "error_files", [None] * (index + 1))[index]
    message = ""
    if error_file is not None:
        with contextlib.suppress(OSError, EOFError, ValueError):
            import pickle

            with open(error_file, "rb") as f:
                message = pickle.load(f)
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    return f"failed: {lines[-1].strip()}" if lines else f"exited with code {code}"


def _group_broken(err: BaseException) -> bool:
    """Whether ``err`` is the process group failing (a peer gone, a timeout), not rank 0's own error."""
    import torch.distributed as dist

    text = f"{type(err).__name__} {err}".lower()
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        w in text for w in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout"))

