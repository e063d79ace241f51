"""``beaconkv serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

One engine thread steps a :class:`~beaconkv.engine.Engine` (a fixed pool of compressed-cache
slots); FastAPI routes on the event loop submit requests to it and stream its tokens back. Any
OpenAI client — the ``openai`` package, ``curl``, lm-evaluation-harness's ``local-chat-completions``
— can talk to it.

Modules, each with one job:

* :mod:`~beaconkv.serve.cli` — the command's options and their validation (no fastapi needed);
* :mod:`~beaconkv.serve.schema` — request bodies and the checks of their fields;
* :mod:`~beaconkv.serve.prepare` — a parsed body checked against the engine and made into its engine requests;
* :mod:`~beaconkv.serve.limits` — what a client may cost (connections, body size and time, prompt length,
  answer size);
* :mod:`~beaconkv.serve.connections` — uvicorn's protocol with a connection cap and a head timeout (slow-loris);
* :mod:`~beaconkv.serve.browsers` — the ``Host`` check and JSON-only bodies (a web page cannot drive the server);
* :mod:`~beaconkv.serve.special_tokens` — special-token text in chat messages kept as text, or refused;
* :mod:`~beaconkv.serve.prepare_pool` — the threads that prepare calls, and the chat template's time limit;
* :mod:`~beaconkv.serve.responses` — response objects, stream chunks, SSE framing, sliced JSON;
* :mod:`~beaconkv.serve.errors` — OpenAI-style error bodies;
* :mod:`~beaconkv.serve.worker` — the engine thread and the bridge to asyncio;
* :mod:`~beaconkv.serve.hf_engine` — ``--backend hf``: the engine over a transformers model, each request's cache
  a :class:`~beaconkv.hf.PolicyCache`;
* :mod:`~beaconkv.serve.metrics` — counters and the Prometheus text format;
* :mod:`~beaconkv.serve.app` — the FastAPI routes;
* :mod:`~beaconkv.serve.server` — uvicorn, and a Ctrl-C that stops the engine and prepare threads first.

Only :mod:`~beaconkv.serve.cli` is imported here, so importing the package does not need the
``serve`` extra (fastapi, uvicorn).
"""

from .cli import add_serve_arguments, run_serve

__all__ = ["add_serve_arguments", "run_serve"]
