"""The prepare pool: a chat-template render stops at its time limit or when interrupted, answering the error it
was stopped with; the exception that stops it never lands outside the render, however the interrupt is timed (the
threads go on serving); a job still queued never runs; closing stops everything; the threads are daemons."""

from __future__ import annotations

import random
import threading
import time

import pytest

from beaconkv.serve.errors import APIError, shutting_down
from beaconkv.serve.prepare_pool import PreparePool


def _spin(seconds: float) -> str:
    """Pure-Python work for ``seconds`` (as a template's loops are)."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return "done"


def _render(seconds: float):
    return lambda job: job.interruptible(_spin, seconds)


@pytest.fixture
def pool():
    p = PreparePool(2, template_timeout_s=0.5, name="test-prepare")
    try:
        yield p
    finally:
        p.close()


def test_a_render_that_outlasts_the_limit_is_stopped_and_the_thread_serves_on(pool):
    t0 = time.monotonic()
    job = pool.submit(_render(60))
    with pytest.raises(APIError) as err:
        job.future.result(10)
    assert 0.4 < time.monotonic() - t0 < 10.0
    assert err.value.status == 400 and err.value.code == "template_timeout" and "0.5 s" in err.value.message
    assert pool.submit(_render(0.01)).future.result(10) == "done"
    assert pool.saturation()[0] == 0


def test_an_interrupt_stops_a_render_with_its_error(pool):
    job = pool.submit(_render(60))
    while job.started_at is None:
        time.sleep(0.005)
    time.sleep(0.05)
    gone = APIError("the client went away", status=499, code="client_closed")
    assert job.interrupt(gone) and not job.interrupt(shutting_down())  # the first error wins
    with pytest.raises(APIError) as err:
        job.future.result(5)
    assert err.value.status == 499 and err.value.code == "client_closed"


def test_an_interrupt_never_lands_outside_the_render(pool):
    """Interrupts timed at random around the end of 150 short renders (and inside 50 longer ones): every job ends
    with its result or its error, never anything else, and both threads still serve."""
    rng = random.Random(0)
    outcomes = []
    for i in range(200):
        started, inside = threading.Event(), i % 4 == 0

        def work(job, started=started, seconds=0.05 if inside else 0.002):
            return (job.interruptible(lambda: (started.set(), _spin(seconds))[1]), _spin(0.002))[0]

        job = pool.submit(work)
        if inside:
            started.wait(5)  # lands inside a 50 ms render
        else:
            time.sleep(rng.uniform(0, 0.006))  # anywhere around the end of a 2 ms render
        job.interrupt(shutting_down())
        try:
            outcomes.append(job.future.result(5))
        except APIError as err:
            outcomes.append(err.code)
        except Exception as err:  # noqa: BLE001 - cancelled in the queue
            outcomes.append(type(err).__name__)
    assert set(outcomes) <= {"done", "service_unavailable", "CancelledError"}, set(outcomes)
    assert "service_unavailable" in outcomes
    results = [pool.submit(lambda job: job.interruptible(lambda: threading.get_ident())) for _ in range(20)]
    assert len({r.future.result(5) for r in results}) >= 1
    assert all(t.is_alive() for t in pool._workers)
    _spin(0.05)  # a stray exception would land here, or in the workers' loop


def test_a_queued_job_that_is_stopped_never_runs(pool):
    holders = [pool.submit(_render(60)) for _ in range(2)]
    deadline = time.monotonic() + 5
    while any(h.started_at is None for h in holders) and time.monotonic() < deadline:
        time.sleep(0.005)
    ran = []
    queued = pool.submit(lambda job: ran.append(1))
    assert queued.interrupt(shutting_down()) and queued.future.cancelled()
    for h in holders:
        h.interrupt(shutting_down())
    for h in holders:
        with pytest.raises(APIError):
            h.future.result(5)
    assert pool.submit(_render(0)).future.result(5) == "done" and ran == []


def test_saturation_counts_busy_threads_and_how_long_they_are_stuck(pool):
    assert pool.saturation() == (0, 0, 0.0)
    jobs = [pool.submit(_render(60)) for _ in range(3)]
    deadline = time.monotonic() + 5
    while pool.saturation()[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    busy, waiting, stuck = pool.saturation()
    assert busy == 2 and waiting == 1 and 0.1 < stuck < 5.0
    for j in jobs:
        j.interrupt(shutting_down())


def test_close_stops_every_job_and_the_threads_are_daemons():
    pool = PreparePool(1, template_timeout_s=60)
    running, queued = pool.submit(_render(60)), pool.submit(_render(60))
    while running.started_at is None:
        time.sleep(0.005)
    assert all(t.daemon for t in pool._workers)
    pool.close()
    with pytest.raises(APIError) as err:
        running.future.result(5)
    assert err.value.status == 503
    assert queued.future.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(_render(0))
    for t in pool._workers:
        t.join(5)
        assert not t.is_alive()
