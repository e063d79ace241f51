"""The threads that check, render and tokenize calls off the event loop: a time limit on the chat template, its
interruption when the client leaves or the server stops, and the saturation ``/health`` reports.

Every step of preparing a call is bounded by the size of what the client sent (see
:mod:`beaconkv.serve.limits`) except one: rendering the chat template, third-party code run on the client's
values, which no size bound limits. :meth:`PrepareJob.interruptible` runs that render so that it can be stopped:
when it outlasts ``template_timeout_s`` (a watchdog thread of the pool sees to it), when its client leaves, or when
the server stops.

The trap: a Python thread cannot be killed, only interrupted — CPython raises an exception in it at its next
bytecode (``PyThreadState_SetAsyncExc``). Jinja compiles a template to Python code, so a render stops within
microseconds (a single long C call, such as building a huge string, stops when it returns). The exception
(:class:`Interrupted`, a ``BaseException`` that no ``except Exception`` of a library swallows) is set under the
job's lock and only while the thread is inside the render; if the render returns before the exception fires, the
thread clears it under the same lock, so it can never land in the pool's own loop. A job is interrupted at most
once.

The threads are daemon threads: an interpreter that exits never waits for a render (a ``ThreadPoolExecutor`` joins
its threads at exit, which once made Ctrl-C wait for a slow template until a second Ctrl-C).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from .errors import APIError, shutting_down, template_timeout

T = TypeVar("T")

SATURATED_AFTER_S = 1.0
"""``/health`` reports ``degraded`` once every prepare thread has been busy with the same call for this long (a
call takes milliseconds to prepare)."""


class Interrupted(BaseException):
    """Raised inside a chat-template render that its :class:`PrepareJob` stopped (never seen outside the job)."""


def _raise_in_thread(ident: int, exc: type[BaseException] | None) -> None:
    """Sets (or with None, clears) the exception the thread ``ident`` raises at its next bytecode."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                               ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(None))


class PrepareJob:
    """One call's work on a :class:`PreparePool`: when it started, and the stopping of its chat-template render.

    Made by :meth:`PreparePool.submit`.

    Attributes:
        started_at: ``time.monotonic()`` when a thread took the job (None while it waits).
    """

    def __init__(self, pool: PreparePool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._thread: int | None = None  # the thread's ident while it is inside the render
        self._fired = False  # the exception was set in the thread (once at most)
        self._entered = False
        self._error: APIError | None = None  # why the job was stopped
        self.started_at: float | None = None
        self.deadline: float | None = None
        self.future: Future[Any] | None = None

    @property
    def stopped(self) -> APIError | None:
        """The error the job was stopped with (None while it may run)."""
        return self._error

    def interruptible(self, render: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs ``render(*args, **kwargs)`` (a chat-template render) on this thread, stoppably.

        Call it once per job, from the job's thread. The render has ``template_timeout_s`` seconds.

        Raises:
            APIError: The render was stopped: HTTP 400 ``template_timeout`` when it ran out of time, or the error
                it was stopped with (:meth:`interrupt`).
            RuntimeError: Called a second time.
        """
        if self._entered:
            raise RuntimeError("PrepareJob.interruptible runs one render per job; submit another job.")
        self._entered = True
        try:
            try:
                with self._lock:
                    if self._error is not None:
                        raise Interrupted
                    self.deadline = time.monotonic() + self._pool.template_timeout_s
                self._pool._watch(self)  # before the thread is exposed: nothing can fire during it
                with self._lock:
                    if self._error is not None:
                        raise Interrupted
                    self._thread = threading.get_ident()
                return render(*args, **kwargs)
            finally:
                with self._lock:
                    ident, self._thread = self._thread, None
                    if self._fired and ident is not None:
                        _raise_in_thread(ident, None)  # set but maybe not raised yet: it must not land later
                self._pool._unwatch(self)
        except Interrupted:
            error = self._error or shutting_down()
            raise APIError(error.message, status=error.status, type=error.type, param=error.param, code=error.code,
                           headers=error.headers) from None

    def interrupt(self, error: APIError) -> bool:
        """Stops the job: a render under way raises, a render not begun never begins, a job still queued never
        runs. Thread-safe; the first error given wins.

        Args:
            error: What the call answers (its client may be gone, then nobody reads it).

        Returns:
            Whether this call stopped the job (False: it was stopped already).
        """
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            if self._thread is not None and not self._fired:
                self._fired = True
                _raise_in_thread(self._thread, Interrupted)
        if self.future is not None:
            self.future.cancel()  # a job still in the queue never starts
        return True


class PreparePool:
    """Daemon threads that prepare calls, a watchdog that stops chat-template renders that run out of time, and
    the pool's saturation.

    Args:
        threads: Threads preparing calls at once.
        template_timeout_s: Seconds a chat-template render may take.
        name: The threads' name prefix.

    Raises:
        ValueError: ``threads`` below 1 or a timeout that is not positive.
    """

    def __init__(self, threads: int = 2, template_timeout_s: float = 5.0, name: str = "beaconkv-prepare") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads={threads!r} must be an int >= 1.")
        if not template_timeout_s > 0:
            raise ValueError(f"template_timeout_s={template_timeout_s!r} must be > 0 (the server's "
                             "--template-timeout).")
        self.threads, self.template_timeout_s, self.name = threads, template_timeout_s, name
        self._queue: queue.SimpleQueue[tuple[PrepareJob, Callable[[PrepareJob], Any]] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._busy: set[PrepareJob] = set()
        self._timed: set[PrepareJob] = set()
        self._workers: list[threading.Thread] = []
        self._closed = False

    # ------------------------------------------------------------------------------ use
    def submit(self, work: Callable[[PrepareJob], T]) -> PrepareJob:
        """Queues ``work(job)``; its result (or exception) comes in ``job.future``.

        Raises:
            RuntimeError: The pool is closed.
        """
        job = PrepareJob(self)
        job.future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the prepare pool is closed (the server is stopping).")
            if not self._workers:
                self._start()
        self._queue.put((job, work))
        return job

    def saturation(self) -> tuple[int, int, float]:
        """``(busy threads, calls waiting, seconds the youngest busy call has run)``; the seconds are 0 unless
        every thread is busy (a saturated pool makes every new call wait that long at least)."""
        now = time.monotonic()
        with self._cond:
            started = [j.started_at for j in self._busy if j.started_at is not None]
        busy = len(started)
        return busy, self._queue.qsize(), (now - max(started)) if busy >= self.threads else 0.0

    def interrupt_all(self, error: APIError) -> None:
        """Stops every job running or waiting (a server that is stopping)."""
        with self._cond:
            jobs = list(self._busy)
        for job in jobs:
            job.interrupt(error)
        self._drain(error)

    def close(self, error: APIError | None = None) -> None:
        """Stops every job (with ``error``, by default HTTP 503 ``service_unavailable``) and the threads."""
        with self._cond:
            self._closed = True
            workers = len(self._workers)
            self._cond.notify_all()
        self.interrupt_all(error or shutting_down())
        for _ in range(workers):
            self._queue.put(None)

    # ------------------------------------------------------------------------------ the threads
    def _start(self) -> None:
        for i in range(self.threads):
            thread = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
            thread.start()
            self._workers.append(thread)
        threading.Thread(target=self._watchdog, name=f"{self.name}-watchdog", daemon=True).start()

    def _drain(self, error: APIError) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:  # a stop sentinel: keep it for a thread
                self._queue.put(None)
                return
            item[0].interrupt(error)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, work = item
            assert job.future is not None
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            job.started_at = time.monotonic()
            with self._cond:
                self._busy.add(job)
            try:
                result, error = work(job), None
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the job
                result, error = None, err
            with self._cond:  # not busy any more before anyone hears of the outcome
                self._busy.discard(job)
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def _watch(self, job: PrepareJob) -> None:
        with self._cond:
            self._timed.add(job)
            self._cond.notify_all()

    def _unwatch(self, job: PrepareJob) -> None:
        with self._cond:
            self._timed.discard(job)

    def _watchdog(self) -> None:
        with self._cond:
            while not self._closed:
                now, wait = time.monotonic(), None
                for job in list(self._timed):
                    assert job.deadline is not None
                    if job.deadline <= now:
                        self._timed.discard(job)
                        job.interrupt(template_timeout(self.template_timeout_s))
                    else:
                        wait = job.deadline - now if wait is None else min(wait, job.deadline - now)
                self._cond.wait(wait)
