"""Server metrics: counters the engine thread and the routes keep, and their Prometheus text rendering.

``GET /metrics`` answers in the Prometheus text exposition format (version 0.0.4), with no client
library: gauges of the pool (requests running and queued, slots used and total, recent tokens per
second) and counters since the server started (generated and prompt tokens, finished requests by
finish reason, evictions, decode steps, prefill and decode seconds, refused calls by reason).

Each counter of :class:`ServerCounters` is written by one thread only (finishes by the engine
thread, refusals and submissions by the event loop), so no lock is needed; a scrape may read a
value one step old.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of the Prometheus text format."""
FINISH_REASONS = ("stop", "length", "cancelled", "error")
"""Finish reasons counted (every one is exported, zero or not)."""
REFUSAL_REASONS = ("invalid_request", "model_not_found", "too_large", "queue_full", "unavailable", "bad_host",
                   "unsupported_media_type", "body_timeout")
"""Why a call was refused: HTTP 400, 404 (an unknown model), 413, 429, 503, 400 for a ``Host`` that is not the
server's, 415 for a body not declared JSON, 408 for a body that came too slowly."""


class ThroughputMeter:
    """Generated tokens per second over a sliding window (0 when the engine is idle).

    Args:
        window_s: Seconds the rate averages over.
        clock: Returns seconds (``time.perf_counter`` by default).
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.window_s, self._clock = window_s, clock
        self._samples: deque[tuple[float, int]] = deque([(clock(), 0)])
        self._lock = threading.Lock()

    def record(self, total_tokens: int) -> None:
        """Notes the engine's generated-token total after a step (engine thread)."""
        now = self._clock()
        with self._lock:
            self._samples.append((now, total_tokens))
            while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
                self._samples.popleft()

    def rate(self, total_tokens: int) -> float:
        """Tokens per second over the last ``window_s`` seconds.

        Args:
            total_tokens: The engine's generated-token total now.
        """
        now = self._clock()
        with self._lock:
            samples = list(self._samples)
        base = samples[0]
        for t, n in samples:  # the latest sample at or before the window's start, else the oldest
            if t <= now - self.window_s:
                base = (t, n)
        elapsed = now - base[0]
        return (total_tokens - base[1]) / elapsed if elapsed > 0 else 0.0


@dataclass
class ServerCounters:
    """What the server counts beside the engine's own :class:`~beaconkv.engine.EngineStats`.

    Attributes:
        submitted: Engine requests submitted (a call with ``n`` choices submits ``n``).
        prompt_tokens: Prompt tokens of finished requests.
        finished: Finished requests by finish reason.
        refused: Refused calls by reason (see :data:`REFUSAL_REASONS`).
        started: Unix seconds when the server started.
    """

    submitted: int = 0
    prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    started: float = field(default_factory=time.time)


@dataclass
class Metric:
    """One metric family of the exposition.

    Attributes:
        name: The metric name (``beaconkv_...``; counters end with ``_total``).
        kind: ``gauge`` or ``counter``.
        help: One line of description.
        samples: ``(labels, value)`` pairs.
    """

    name: str
    kind: str
    help: str
    samples: list[tuple[dict[str, str], float]]


def _value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def render(metrics: Iterable[Metric]) -> str:
    """The Prometheus text exposition of ``metrics`` (``# HELP``, ``# TYPE`` and sample lines)."""
    lines = []
    for m in metrics:
        lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}"]
        for labels, value in m.samples:
            tag = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            lines.append(f"{m.name}{tag} {_value(value)}")
    return "\n".join(lines) + "\n"


def server_metrics(engine: Engine, meter: ThroughputMeter, counters: ServerCounters) -> list[Metric]:
    """Every metric of a running server.

    Args:
        engine: The engine (pool size, running and queued requests, its stats).
        meter: The recent throughput.
        counters: The server's own counters.
    """
    s = engine.stats
    running = engine.running

    def one(name: str, kind: str, help: str, value: float) -> Metric:
        return Metric(name, kind, help, [({}, value)])

    return [
        one("beaconkv_requests_running", "gauge", "Requests in cache slots, decoding.", running),
        one("beaconkv_requests_queued", "gauge", "Requests waiting for a free slot.", engine.queued),
        one("beaconkv_slots_used", "gauge", "Cache slots holding a request.", running),
        one("beaconkv_slots_total", "gauge", "Cache slots of the pool (--max-batch).", engine.max_batch),
        one("beaconkv_tokens_per_second", "gauge", "Generated tokens per second over the last "
            f"{meter.window_s:g} seconds.", meter.rate(s.generated_tokens)),
        one("beaconkv_generated_tokens_total", "counter", "Tokens generated (first tokens included).",
            s.generated_tokens),
        one("beaconkv_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", counters.prompt_tokens),
        one("beaconkv_requests_submitted_total", "counter", "Engine requests submitted (n per call).",
            counters.submitted),
        Metric("beaconkv_requests_finished_total", "counter", "Requests finished, by finish reason.",
               [({"finish_reason": r}, v) for r, v in counters.finished.items()]),
        Metric("beaconkv_requests_refused_total", "counter",
               "Calls refused, by reason (400, 404, 408, 413, 415, 429, 503).",
               [({"reason": r}, v) for r, v in counters.refused.items()]),
        one("beaconkv_evictions_total", "counter", "KV-cache evictions of finished requests.", s.evictions),
        one("beaconkv_decode_steps_total", "counter", "Decode steps run.", s.steps),
        one("beaconkv_prefill_seconds_total", "counter", "Seconds spent in prefill.", s.prefill_s),
        one("beaconkv_decode_seconds_total", "counter", "Seconds spent in decode steps (policy work included).",
            s.decode_s),
    ]
