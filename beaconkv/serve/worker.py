"""The engine thread of the server, and the bridge that hands its events to asyncio.

:class:`~beaconkv.engine.Engine` is stepped from one thread only. :class:`EngineWorker` owns that
thread: it loops :meth:`~beaconkv.engine.Engine.step` while requests run or wait, and sleeps on a
:class:`threading.Event` when the engine is idle (a submit or a cancel wakes it at once). The
routes run on the event loop: :meth:`EngineWorker.submit` queues the engine requests of one HTTP
call (its ``n`` choices) as a :class:`RequestGroup`, whose events the engine thread hands over with
``loop.call_soon_threadsafe`` into the group's :class:`asyncio.Queue` — the engine thread never
touches asyncio objects directly, and the event loop never runs model code.

Stopping: :meth:`EngineWorker.request_stop` only sets a flag (safe inside a signal handler); the
thread notices it within a step or ``idle_wait_s``, ends, and closes every open group, so a route
still waiting raises :class:`WorkerStopped` (HTTP 503) instead of hanging.

No request stops the thread: the engine ends a request whose own work fails (and, when a decode step
fails, the requests of that step) with ``finish_reason="error"`` and goes on (see
:mod:`beaconkv.engine`). A step that raises anyway is a bug outside any one request: the thread logs
it, ends the running requests with an error (:meth:`~beaconkv.engine.Engine.abort`) and goes on
serving; only a failure of that recovery itself stops it, closing the groups as a shutdown does,
and ``/health`` then reports the failure.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch

from ..engine import Completion, Engine, Event, Request
from ..errors import BeaconKVError
from .metrics import ServerCounters, ThroughputMeter

logger = logging.getLogger("beaconkv.serve")
"""The server's logger (engine failures)."""


class WorkerStopped(BeaconKVError, RuntimeError):
    """The engine thread has stopped (shutdown or a failed step): the request will not complete."""


class RequestGroup:
    """The engine requests of one HTTP call (its choices), with their events delivered on the event loop.

    Made by :meth:`EngineWorker.submit`; read it from the loop that submitted it.

    Args:
        worker: The worker that runs the requests (for cancelling them).
        loop: The event loop the events are delivered to.

    Attributes:
        ids: The engine request ids, in choice order.
        completions: Finished choices by choice index, filled as :meth:`next_event` sees them.
    """

    def __init__(self, worker: EngineWorker, loop: asyncio.AbstractEventLoop) -> None:
        self.ids: list[int] = []
        self.completions: dict[int, Completion] = {}
        self._index: dict[int, int] = {}
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._loop, self._worker = loop, worker

    def _add(self, request_id: int) -> None:
        self._index[request_id] = len(self.ids)
        self.ids.append(request_id)

    def index(self, request_id: int) -> int:
        """The choice index of an engine request of this group."""
        return self._index[request_id]

    @property
    def finished(self) -> bool:
        """Every choice has finished."""
        return len(self.completions) == len(self.ids)

    def deliver(self, event: Event | None) -> None:
        """Hands an event (None: the worker stopped) to the event loop. Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event of any choice, or None when ``timeout`` seconds pass without one.

        Raises:
            WorkerStopped: The engine thread stopped before the group finished.
        """
        if self._queue.empty():
            try:
                event = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:
                return None
        else:
            event = self._queue.get_nowait()
        if event is None:
            raise WorkerStopped(self._worker.stop_reason)
        if event.completion is not None:
            self.completions[self.index(event.request_id)] = event.completion
        return event

    def cancel(self) -> None:
        """Cancels the choices that have not finished (a client that went away); their slots free at the next step."""
        for i, request_id in enumerate(self.ids):
            if i not in self.completions:
                self._worker.cancel(request_id)


class EngineWorker:
    """The one thread that steps an :class:`~beaconkv.engine.Engine`, and the server's door to it.

    Args:
        engine: The engine; nothing else may call its :meth:`~beaconkv.engine.Engine.step`.
        threads: ``torch.set_num_threads`` for the engine thread (None: torch's choice). Set on the
            thread itself, since OpenMP's thread count is per thread.
        idle_wait_s: Longest sleep of an idle engine thread before it looks at the stop flag again.
        counters: Where finishes and submissions are counted (a new one by default).
        meter: The throughput meter fed after every step (a new one by default).

    Attributes:
        error: The exception that stopped the thread, if a step and its recovery failed.
        faults: Steps that raised and were recovered from (their running requests failed).
    """

    def __init__(self, engine: Engine, *, threads: int | None = None, idle_wait_s: float = 0.25,
                 counters: ServerCounters | None = None, meter: ThroughputMeter | None = None) -> None:
        self.engine, self.threads, self.idle_wait_s = engine, threads, idle_wait_s
        self.counters = counters if counters is not None else ServerCounters()
        self.meter = meter if meter is not None else ThroughputMeter()
        self.error: BaseException | None = None
        self.faults = 0
        self._reason = "the server is shutting down"
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._groups: dict[int, RequestGroup] = {}
        self._stopping = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="beaconkv-engine", daemon=True)

    # ---------------------------------------------------------------------------- control
    def start(self) -> None:
        """Starts the engine thread."""
        self._thread.start()

    def request_stop(self) -> None:
        """Asks the thread to stop, without waiting; sets a flag only, so a signal handler may call it."""
        self._stopping = True

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread and waits for it (at most ``timeout`` seconds: one step)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The thread runs and takes requests."""
        return self._thread.is_alive() and not self._stopping

    @property
    def stop_reason(self) -> str:
        """Why the thread stopped (shutdown, or the failure of a step)."""
        return self._reason

    # ---------------------------------------------------------------------------- requests
    def submit(self, requests: Sequence[Request], loop: asyncio.AbstractEventLoop) -> RequestGroup:
        """Queues the engine requests of one call; their events arrive on ``loop``.

        All or none are queued: when one is refused, the ones already queued are cancelled.

        Args:
            requests: One request per choice (their ``on_event`` is replaced).
            loop: The running event loop of the caller.

        Raises:
            beaconkv.engine.EngineError: The engine refuses a request.
            beaconkv.engine.QueueFullError: The waiting queue is full.
            WorkerStopped: The thread has stopped.
        """
        group = RequestGroup(self, loop)
        with self._lock:  # with the registration, so that shutdown closes every group it has to
            if self._stopped or self._stopping:
                raise WorkerStopped(self._reason)
            try:
                for request in requests:
                    request_id = self.engine.submit(replace(request, on_event=partial(self._on_event, group)))
                    group._add(request_id)
                    self._groups[request_id] = group
            except BaseException:
                for request_id in group.ids:
                    self.engine.cancel(request_id)
                raise
            finally:
                self.counters.submitted += len(group.ids)
        self._wake.set()
        return group

    def cancel(self, request_id: int) -> None:
        """Cancels an engine request: it ends, and its slot frees, at the next step. Thread-safe."""
        self.engine.cancel(request_id)
        self._wake.set()

    # ---------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            while not self._stopping:
                if self.engine.idle:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                try:
                    self.engine.step()
                except Exception as err:  # a bug outside any request: fail what runs, keep serving
                    self.faults += 1
                    logger.exception("beaconkv serve: an engine step failed; its running requests fail")
                    self.engine.abort(f"an engine step failed ({type(err).__name__}: {err})")
                self.meter.record(self.engine.stats.generated_tokens)
        except Exception as err:  # the recovery failed too: report it to every waiting call and on /health
            self.error = err
            self._reason = f"the engine failed ({type(err).__name__}: {err})"
            logger.exception("beaconkv serve: the engine thread failed")
        finally:
            with self._lock:
                self._stopped = self._stopping = True
                groups = {id(g): g for g in self._groups.values()}
                self._groups.clear()
            for group in groups.values():
                group.deliver(None)

    def _on_event(self, group: RequestGroup, event: Event) -> None:
        """An engine event (engine thread): count a finish first, so a client that has its answer sees it counted."""
        c = event.completion
        if c is not None:
            with self._lock:
                self._groups.pop(c.request_id, None)
            self.counters.finished[c.finish_reason] = self.counters.finished.get(c.finish_reason, 0) + 1
            self.counters.prompt_tokens += c.prompt_tokens
        group.deliver(event)
