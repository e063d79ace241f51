"""``beaconkv serve``: its options, their validation, and the start of the server.

This module needs neither fastapi nor uvicorn, so ``beaconkv.cli`` can import it at the top and
every other command works without the ``serve`` extra: :func:`run_serve` checks every setting
(policy and budget, limits against the model's positions, dtype, device, the port) before it
imports the server and before it loads the model, so a mistake costs a second and one line
(``beaconkv serve: error: ...``, exit status 2), never a model load.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..arguments import (
    add_backend_argument,
    add_kernels_argument,
    add_prefill_chunk_argument,
    add_kv_storage_argument,
    add_max_batch_argument,
    add_model_arguments,
    add_n_beacon_argument,
    add_policy_arguments,
    add_threads_argument,
    model_path,
    policy_from_args,
    positive_int,
    print_thread_hint,
)
from ..decode_setup import DecodeSetup
from ..distributed.cli import add_tensor_parallel_argument
from ..distributed.cli import start_run as start_tensor_parallel_run
from ..distributed.group import TensorParallelError
from ..engine import Engine
from ..errors import BeaconKVError
from ..execution import CompileConfig
from ..models.config import ModelConfig
from ..models.loading import (
    load_model,
    resolve_checkpoint,
    resolve_device,
    resolve_dtype,
)
from ..tokenizer import load_tokenizer
from .browsers import ANY_HOST, default_allowed_hosts
from .limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_ANSWER_TOKENS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_TEMPLATE_TIMEOUT_S,
    ConnectionLimits,
    RequestLimits,
)
from .special_tokens import SPECIAL_TOKEN_MODES

if TYPE_CHECKING:
    from ..distributed.launch import TensorParallelRun
    from ..policies import EvictionPolicy
    from .hf_engine import HFEngine

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""``--log-level`` choices (uvicorn's)."""

DEFAULT_PROMPT_CAPACITY = 1024
"""``--prompt-capacity`` without it or ``--max-model-len``: the longest prompt a slot takes."""
RESERVED_FILES = 64
"""File descriptors kept free beside ``--max-connections`` (the checkpoint, logs, the listening socket...)."""


class ServeError(BeaconKVError, ValueError):
    """A server setting that cannot work (a busy port, limits beyond the model, the ``serve`` extra missing)."""


def port_number(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535 (an argparse type)."""
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}") from err
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {value}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (an argparse type)."""
    try:
        value = float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from err
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def size_text(n: int) -> str:
    """``4194304`` -> ``"4 MiB"``, ``1536`` -> ``"1.5 KiB"``, ``100`` -> ``"100 bytes"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} bytes"


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``beaconkv serve`` options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = ("An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, "
                          "/health, /metrics) over the continuous-batching engine (or, with --backend hf, over a "
                          "transformers model whose cache is a beaconkv.hf.PolicyCache).")
    m = parser.add_argument_group("model")
    add_model_arguments(m)
    add_backend_argument(m)
    m.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names requests may use as 'model' (default: the --model directory's name, the hub id, "
                        "or 'embedded')")
    add_threads_argument(m)
    m.add_argument("--compile", action="store_true",
                   help="compile the decode step and the policy's work (the first request pays for it)")
    add_kv_storage_argument(m)
    add_kernels_argument(m)
    add_prefill_chunk_argument(m)
    add_tensor_parallel_argument(m)
    p = parser.add_argument_group("eviction policy")
    add_policy_arguments(p)
    add_n_beacon_argument(p)
    e = parser.add_argument_group("engine")
    add_max_batch_argument(e)
    e.add_argument("--prompt-capacity", type=positive_int, default=None, metavar="TOKENS",
                   help=f"longest prompt a slot takes, in tokens (default {DEFAULT_PROMPT_CAPACITY}, or "
                        "--max-model-len minus --max-new-tokens)")
    e.add_argument("--max-model-len", type=positive_int, default=None, metavar="TOKENS",
                   help="vLLM's option: the most tokens of a request, prompt and new tokens together; sets "
                        "--prompt-capacity to MAX_MODEL_LEN - --max-new-tokens (give one of the two)")
    e.add_argument("--max-new-tokens", type=positive_int, default=2048,
                   help="most new tokens a request may ask for; also the default max_tokens (default 2048)")
    e.add_argument("--max-queue", type=positive_int, default=256,
                   help="requests waiting for a slot before calls get HTTP 429 (default 256)")
    e.add_argument("--seed", type=int, default=0, help="seeds the sampling of requests sent without a seed (default 0)")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0 = any free port)")
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="uvicorn's log level (default info)")
    s.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host names requests may use; any other gets HTTP 400, so that a web page cannot reach the "
                        "server by pointing its own domain at this address (DNS rebinding). '.example.com' allows "
                        "the domain and its subdomains, '*' any host (default: localhost, 127.0.0.1, ::1 and --host; "
                        "with --host 0.0.0.0 also this machine's name and addresses)")
    s.add_argument("--special-tokens-in-content", choices=SPECIAL_TOKEN_MODES, default="escape",
                   help="special-token text (e.g. '<|im_start|>') in a chat message: 'escape' reads it as plain text, "
                        "never as the token; 'refuse' answers HTTP 400 (default escape)")
    s.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="largest request body; a larger one gets HTTP 413 before it is read "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES}, {size_text(DEFAULT_MAX_REQUEST_BYTES)})")
    s.add_argument("--max-answer-tokens", type=positive_int, default=DEFAULT_MAX_ANSWER_TOKENS, metavar="TOKENS",
                   help="most n x max_tokens x (1 + top_logprobs) of one call, every token and every alternative "
                        "reported counting one; more gets HTTP 400 before any work "
                        f"(default {DEFAULT_MAX_ANSWER_TOKENS})")
    s.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections at once; one more closes the oldest connection not being served (a "
                        "request still arriving, or idle), else gets HTTP 503. Keep it above --max-batch + "
                        f"--max-queue (default {DEFAULT_MAX_CONNECTIONS})")
    s.add_argument("--header-timeout", type=seconds, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="seconds a request's head (request line and headers) may take to arrive; then the "
                        f"connection closes (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    s.add_argument("--body-timeout", type=seconds, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help="seconds a request's body may take to arrive after its head; then HTTP 408, and the part "
                        f"read is dropped (default {DEFAULT_BODY_TIMEOUT_S:g})")
    s.add_argument("--template-timeout", type=seconds, default=DEFAULT_TEMPLATE_TIMEOUT_S, metavar="SECONDS",
                   help="seconds the chat template may take to render a conversation; then it is stopped and the "
                        f"call gets HTTP 400 (default {DEFAULT_TEMPLATE_TIMEOUT_S:g})")
    return parser


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """What one request may cost, from the parsed options."""
    return RequestLimits(max_request_bytes=args.max_request_bytes, body_timeout_s=args.body_timeout,
                         max_answer_tokens=args.max_answer_tokens, template_timeout_s=args.template_timeout)


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The connection cap and head timeout, from the parsed options."""
    return ConnectionLimits(max_connections=args.max_connections, header_timeout_s=args.header_timeout)


def allowed_hosts(args: argparse.Namespace) -> list[str]:
    """``--allowed-hosts``, or the names a server on ``--host`` answers to by default.

    Raises:
        ServeError: An empty name.
    """
    if args.allowed_hosts is None:
        return default_allowed_hosts(args.host)
    names = [h.strip() for h in args.allowed_hosts]
    if any(not n or n == "." for n in names):
        raise ServeError(f"--allowed-hosts {args.allowed_hosts!r} holds an empty name; give host names, "
                         f"'.domain' or '{ANY_HOST}'.")
    return list(dict.fromkeys(names))


def ensure_file_limit(connections: int, reserve: int = RESERVED_FILES) -> None:
    """Makes room for ``connections`` sockets in the process's file-descriptor limit, raising its soft limit up
    to the hard one if needed (Linux and macOS; elsewhere nothing is checked).

    A server that runs out of descriptors stops accepting connections altogether; ``--max-connections`` keeps
    it from getting there only if the limit leaves room for it.

    Args:
        connections: ``--max-connections``.
        reserve: Descriptors kept free for everything else.

    Raises:
        ServeError: The hard limit leaves no room (the message names both numbers and the fixes).
    """
    try:
        import resource
    except ImportError:  # not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + reserve
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return
    raise ServeError(f"--max-connections {connections} needs {need} file descriptors, but this process may open at "
                     f"most {hard} (ulimit -Hn); pass --max-connections {max(1, hard - reserve)} or less, or raise "
                     "the limit (ulimit -n).")


def prompt_capacity(args: argparse.Namespace) -> int:
    """The slots' prompt capacity: ``--prompt-capacity``, or ``--max-model-len`` less ``--max-new-tokens``.

    Raises:
        ServeError: Both options given, or a ``--max-model-len`` that leaves no room for a prompt.
    """
    if args.max_model_len is None:
        return args.prompt_capacity if args.prompt_capacity is not None else DEFAULT_PROMPT_CAPACITY
    if args.prompt_capacity is not None:
        raise ServeError(f"--max-model-len {args.max_model_len} and --prompt-capacity {args.prompt_capacity} both size "
                         "the prompts; give one of them.")
    if args.max_model_len <= args.max_new_tokens:
        raise ServeError(f"--max-model-len {args.max_model_len} leaves no room for a prompt after --max-new-tokens "
                         f"{args.max_new_tokens}; raise --max-model-len or lower --max-new-tokens.")
    return args.max_model_len - args.max_new_tokens


def served_names(model: str | None, names: list[str] | None) -> list[str]:
    """The names the server answers to: ``--served-model-name``, else one derived from ``--model``.

    Args:
        model: ``--model`` as given (None: the embedded model).
        names: ``--served-model-name`` values, if any.

    Returns:
        ``names``; else ``"embedded"`` for the embedded model, a local directory's name, or the hub id.

    Raises:
        ServeError: An empty name.
    """
    if names:
        if any(not n.strip() for n in names):
            raise ServeError(f"--served-model-name {names!r} holds an empty name; give non-empty names.")
        return list(dict.fromkeys(names))
    if model in (None, "embedded"):
        return ["embedded"]
    path = Path(model).expanduser()
    return [path.resolve().name] if path.is_dir() else [model]


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: until the server starts, clients are refused).

    Raises:
        ServeError: The address is taken, not local, or not allowed.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ServeError(f"--host {host!r} is not an address of this machine ({err.strerror}); "
                         "use 127.0.0.1, 0.0.0.0 or a local address.") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        hint = ("another server listens there; stop it or pass another --port"
                if err.errno == errno.EADDRINUSE else "pass another --host or --port")
        raise ServeError(f"cannot listen on {host}:{port}: {err.strerror}; {hint}.") from None
    sock.set_inheritable(True)
    return sock


def _check_limits(args: argparse.Namespace, directory: Path, capacity: int) -> None:
    if args.backend == "hf":  # any transformers decoder: its own config names the positions
        from transformers import AutoConfig

        limit = AutoConfig.from_pretrained(directory).get_text_config(decoder=True).max_position_embeddings
    else:
        limit = ModelConfig.from_file(directory).max_position_embeddings
    if capacity + args.max_new_tokens > limit:
        given = (f"--max-model-len {args.max_model_len}" if args.max_model_len is not None
                 else f"--prompt-capacity {capacity} + --max-new-tokens {args.max_new_tokens}")
        raise ServeError(f"{given} = {capacity + args.max_new_tokens} tokens exceeds the model's "
                         f"max_position_embeddings={limit}; lower it.")


def _load_engine(args: argparse.Namespace, directory: Path, policy: EvictionPolicy, capacity: int,
                 device: torch.device, dtype: torch.dtype,
                 run: TensorParallelRun | None = None) -> tuple[Engine | HFEngine, str]:
    """The engine ``--backend`` names over the loaded checkpoint (``run``: rank 0's shard, its engine mirrored on
    the other ranks), and how the banner names the model."""
    tokenizer = load_tokenizer(directory)
    sizes = dict(policy=policy, max_batch=args.max_batch, prompt_capacity=capacity,
                 max_new_tokens=args.max_new_tokens, max_queue=args.max_queue, seed=args.seed)
    if args.backend == "hf":
        from ..hf.generation import load_hf_model
        from .hf_engine import HFEngine

        model = load_hf_model(str(directory), dtype=dtype, device=str(device))
        engine = HFEngine(model, tokenizer, prefill_chunk=args.prefill_chunk, **sizes)
        return engine, f"transformers {type(model).__name__}, {model.config._attn_implementation}"
    setup = DecodeSetup(kv_storage=args.kv_storage, kernels=args.kernels, prefill_chunk=args.prefill_chunk,
                        compile=CompileConfig() if args.compile else False)
    if run is not None:
        return (run.engine(tokenizer, setup=setup, **sizes),
                f"{run.model.config.model_type}, tensor parallel {run.size}: {run.model.shard_plan.describe()}")
    model = load_model(directory, dtype=dtype, device=device)
    return Engine(model, tokenizer, setup=setup, **sizes), model.config.model_type


def _slots_text(args: argparse.Namespace, engine: Engine | HFEngine) -> str:
    """The banner's words for the engine's places and cache."""
    if args.backend == "hf":
        return (f"{args.max_batch} requests at once (one forward each per step), each cache up to "
                f"{engine.slot_capacity} tokens per KV head of a full-attention layer")
    return (f"{args.max_batch} slots of {engine.slot_capacity} tokens ({engine.cache_bytes / 2**20:.0f} MiB, "
            f"{args.kv_storage})")


def run_serve(args: argparse.Namespace) -> int:
    """``beaconkv serve``: checks the settings, loads the model and serves until Ctrl-C.

    Args:
        args: Parsed :func:`add_serve_arguments` options.

    Returns:
        0 after a clean stop (1 if the engine thread failed); Ctrl-C ends with KeyboardInterrupt,
        which :func:`beaconkv.command.run_command` turns into exit status 130.

    Raises:
        beaconkv.policies.PolicyConfigError: An unknown policy, a budget it rejects, or a budget with
            ``--policy full``.
        TensorParallelError: ``--tensor-parallel-size`` with ``--compile`` or ``--backend hf``, a size the model
            cannot be split by, or a rank that failed or died (the server stops; the message names the rank).
        ServeError: Limits beyond the model's positions, ``--max-model-len`` with ``--prompt-capacity``,
            ``--max-batch`` below 1, a busy port, an empty name, a ``--max-connections`` beyond the file limit,
            or fastapi and uvicorn missing.
        beaconkv.hf.generation.HFBackendError: ``--backend hf`` with ``--compile``, a storage other than dense or
            kernels other than ``auto``.
        ValueError: An unknown dtype or an unavailable device.
        FileNotFoundError: No such checkpoint.
    """
    policy = policy_from_args(args)
    if args.backend == "hf":
        from ..hf.generation import check_hf_options

        check_hf_options(args.compile, args.kv_storage, args.kernels)
    if args.max_batch < 1:
        raise ServeError(f"max_batch={args.max_batch} must be >= 1; pass --max-batch N (vLLM: --max-num-seqs) "
                         "with N >= 1.")
    capacity = prompt_capacity(args)
    names = served_names(args.model, args.served_model_name)
    limits, connections, hosts = request_limits(args), connection_limits(args), allowed_hosts(args)
    ensure_file_limit(connections.max_connections)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = model_path(args.model)
    directory = resolve_checkpoint(path)
    _check_limits(args, directory, capacity)
    try:
        # The one function-level import of this package: beaconkv.serve.server needs fastapi and uvicorn
        # (the optional `serve` extra), and importing it here keeps `beaconkv.cli`, which imports this
        # module, working for every other command when they are not installed.
        from . import server
    except ImportError as err:
        raise ServeError(f"beaconkv serve needs fastapi and uvicorn ({err}); install them with "
                         "pip install 'beaconkv[serve]'.") from None
    sock = bind_socket(args.host, args.port)
    run: TensorParallelRun | None = None
    failed: list[str] = []
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        run = start_tensor_parallel_run(args, directory)  # --tensor-parallel-size > 1: rank 0 here, others spawned
        if run is not None:
            def stop(message: str) -> None:  # a rank that died while the server waits stops it, as one Ctrl-C does
                failed.append(message)
                os.kill(os.getpid(), signal.SIGINT)

            run.watch(stop)
        engine, loaded = _load_engine(args, directory, policy, capacity, device, dtype, run)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"beaconkv serve: loaded {path} ({loaded}, {str(dtype).removeprefix('torch.')}, {device}) in "
              f"{time.perf_counter() - t0:.1f}s; {_slots_text(args, engine)}, {policy!r}", file=sys.stderr)
        print_thread_hint()
        banner = (f"beaconkv serve: serving {', '.join(names)} at http://{shown}:{port}/v1 "
                  f"(prompts up to {capacity} tokens, up to {args.max_new_tokens} new tokens; Host names "
                  f"{', '.join(hosts)}; Ctrl-C stops)")
        code = server.serve(engine, engine.tokenizer, names, sock, threads=args.threads, log_level=args.log_level,
                            banner=banner, limits=limits, connections=connections, allowed_hosts=hosts,
                            special_tokens=args.special_tokens_in_content)
    except BaseException as err:
        if run is not None:
            _close_run(run, stopped=isinstance(err, KeyboardInterrupt) and not failed)
        if failed:
            raise TensorParallelError(failed[0]) from err
        raise
    finally:
        sock.close()
    if run is not None:
        _close_run(run, stopped=not failed)
        if failed:
            raise TensorParallelError(failed[0])
    return code


def _close_run(run: TensorParallelRun, stopped: bool) -> None:
    """Ends the ranks of a tensor-parallel server: told to exit after a clean stop (``stopped``, a Ctrl-C or a
    return; ranks that the same Ctrl-C ended are no error), else stopped at once."""
    if not stopped:
        run.close(failed=True)
        return
    with contextlib.suppress(TensorParallelError):
        run.close()
