"""``beaconkv serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

One engine thread steps a :class:`~beaconkv.engine.Engine` (a fixed pool of compressed-cache
slots); FastAPI routes on the event loop submit requests to it and stream its tokens back. Any
OpenAI client — the ``openai`` package, ``curl``, lm-evaluation-harness's ``local-chat-completions``
— can talk to it.

Modules, each with one job:

* :mod:`~beaconkv.serve.cli` — the command's options and their validation (no fastapi needed);
* :mod:`~beaconkv.serve.schema` — request bodies, their checks and their engine requests;
* :mod:`~beaconkv.serve.limits` — what a request may cost before it is admitted (body size, prompt length);
* :mod:`~beaconkv.serve.responses` — response objects, stream chunks, SSE framing;
* :mod:`~beaconkv.serve.errors` — OpenAI-style error bodies;
* :mod:`~beaconkv.serve.worker` — the engine thread and the bridge to asyncio;
* :mod:`~beaconkv.serve.metrics` — counters and the Prometheus text format;
* :mod:`~beaconkv.serve.app` — the FastAPI routes;
* :mod:`~beaconkv.serve.server` — uvicorn, and a Ctrl-C that stops the engine thread first.

Only :mod:`~beaconkv.serve.cli` is imported here, so importing the package does not need the
``serve`` extra (fastapi, uvicorn).
"""

from .cli import add_serve_arguments, run_serve

__all__ = ["add_serve_arguments", "run_serve"]
