"""The settings of one evaluation run, :class:`EvalConfig`, checked before anything is loaded.

Every value the command line passes is validated here — numbers, ``--limit``, ``--dtype``,
``--kv-storage``, ``--backend`` (and what ``--backend hf`` cannot run), and the policy with its
budget and arguments (:meth:`EvalConfig.make_policy`)
— so a mistake fails in one line before a model is loaded or a folder is made. The runner
(:mod:`beaconkv.eval.runner`) only reads a config; the command line (:mod:`beaconkv.eval.cli`)
builds one.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..arguments import BACKENDS
from ..decode_setup import DecodeSetup
from ..models.loading import resolve_dtype
from ..policies import EvictionPolicy, make_policy
from ..policies.registry import is_policy_spec
from ..storage import storage_names
from .sandbox import SandboxLimits

__all__ = ["DTYPE_CHOICES", "SANDBOX_CHOICES", "EvalConfig"]

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""What ``--dtype`` accepts (besides the aliases ``fp32``, ``bf16``, ``fp16``, ``half``...)."""

SANDBOX_CHOICES = ("namespaces", "rlimits")
"""What ``--sandbox`` accepts: the containments of :class:`beaconkv.eval.sandbox.SandboxLimits`."""


def _at_least_one(name: str, flag: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):  # a ValueError, as every config error
        raise ValueError(  # noqa: TRY004
            f"{name}={value!r} must be a whole number >= 1; pass {flag} N with N >= 1"
        )
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1; pass {flag} N with N >= 1")


@dataclass
class EvalConfig:
    """Everything that defines an evaluation run.

    Attributes:
        model: Local checkpoint folder, hub model id, or ``"embedded"`` (the bundled SmolLM2-135M).
        benchmark: Benchmark name (see :data:`beaconkv.eval.benchmarks.BENCHMARKS`).
        data: Local data file; ``None`` reads the project's copy of the benchmark
            (``<repo>/data/<benchmark>.jsonl``) if there is one, else downloads the benchmark's
            default hub file.
        hub_repo: Hub dataset repository overriding the benchmark's default.
        hub_file: File in the hub repository overriding the default.
        hub_revision: Branch, tag or commit of the hub repository.
        field_map: Column overrides, role -> column(s).
        limit: Evaluate only the first ``limit`` problems (``>= 1``).
        policy: KV policy name (``full``, ``beacon``, ``snapkv``, ``rpc``, ``rkv``, ``h2o``,
            ``streaming``, ``initial_recent``), or a class of one's own as ``module:Class`` or
            ``path/to/file.py:Class`` (file names and tables call it by its class name).
        budget: KV budget (ignored and recorded as ``None`` for ``full``).
        policy_kwargs: Extra keyword arguments for :func:`beaconkv.policies.make_policy`.
        tag: Label distinguishing variants of one policy in file names and tables.
        samples: Samples per problem; ``None`` uses the benchmark's default (AIME24 8, others 4).
        max_new_tokens: Generation limit per sample.
        temperature: Sampling temperature (paper: 0.6).
        top_p: Nucleus sampling threshold (paper: 0.95).
        top_k: Top-k (0: off).
        seed: Base seed of every per-sample seed and of the GPQA choice shuffle.
        max_batch: Cache slots of the run's engine: samples decoded together (continuous
            batching — a finished sample's slot goes to the next pending one). Results do not
            depend on it (every sample has its own seed), so it is not a resume setting.
        out_dir: Results folder.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``,
            ``"float16"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (each rank uses ``cuda:<local rank>``).
        kv_storage: How the KV cache holds keys and values: ``"dense"`` or ``"int8"`` (see
            :mod:`beaconkv.storage`).
        compile: Compile the decode step and the policy's device work (``torch.compile``; CUDA
            graphs on CUDA). Not a resume setting.
        backend: ``"native"`` (beaconkv's own decoder, :func:`~beaconkv.eval.backend.load_backend`) or
            ``"hf"`` (the model in transformers with a :class:`~beaconkv.hf.PolicyCache`,
            :func:`~beaconkv.eval.hf_backend.load_hf_backend`; needs the ``hf`` extra, stores keys and
            values densely and decodes eagerly, so it takes neither ``kv_storage="int8"`` nor ``compile``).
            Used when :func:`~beaconkv.eval.runner.run_eval` loads the model itself; a resume setting
            (the backends draw samples from different generators).
        prefill_chunk: Prefill prompts longer than this in chunks, the policy evicting between them
            (see :class:`~beaconkv.engine.Engine`); ``None``: whole prompts. A resume setting.
        enable_thinking: Passed to the chat template when not ``None``.
        save_token_ids: Store the generated token ids in each record.
        code_timeout_s: Wall time limit per code test.
        code_memory_mb: Memory limit per code test.
        sandbox: Containment of generated programs (code benchmarks): ``"namespaces"`` (the
            default; the run stops before generating anything where it cannot start) or
            ``"rlimits"`` (the weaker fallback, an explicit opt-in; see
            :mod:`beaconkv.eval.sandbox`). Every record states the containment that ran.
        progress: Show progress bars.
        dist_timeout_min: Timeout of distributed collectives (the final barrier), in minutes.
        tensor_parallel_size: Processes each copy of the model is split over (tensor parallelism, see
            :mod:`beaconkv.distributed`): started alone, the run spawns them; under ``torchrun`` the world is
            ``data parallel x tensor parallel``, each group of ``tensor_parallel_size`` ranks one data-parallel
            rank. Native backend, eager only. Not a resume setting: the tokens are the single process's.

    Raises:
        ValueError: On construction, for a value out of range or unknown; the message names the
            value, the flag that sets it and what to pass instead.
    """

    model: str
    benchmark: str
    data: str | Path | None = None
    hub_repo: str | None = None
    hub_file: str | None = None
    hub_revision: str | None = None
    field_map: dict[str, str | list[str]] = field(default_factory=dict)
    limit: int | None = None
    policy: str = "beacon"
    budget: int | None = 1024
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    tag: str | None = None
    samples: int | None = None
    max_new_tokens: int = 32768
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0
    max_batch: int = 8
    out_dir: str | Path = "results"
    dtype: str = "auto"
    device: str = "auto"
    kv_storage: str = "dense"
    compile: bool = False
    backend: str = "native"
    prefill_chunk: int | None = None
    enable_thinking: bool | None = None
    save_token_ids: bool = False
    code_timeout_s: float = 6.0
    code_memory_mb: int = 1024
    sandbox: str = "namespaces"
    progress: bool = True
    dist_timeout_min: float = 24 * 60
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self.policy = self.policy.strip()
        if not is_policy_spec(self.policy):  # a spec's path and class name keep their case
            self.policy = self.policy.lower()
        _at_least_one("max_new_tokens", "--max-new-tokens", self.max_new_tokens)
        _at_least_one("max_batch", "--max-batch", self.max_batch)
        _at_least_one("samples", "--samples", self.samples)
        _at_least_one("prefill_chunk", "--prefill-chunk", self.prefill_chunk)
        _at_least_one("tensor_parallel_size", "--tensor-parallel-size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and (self.compile or self.backend != "native"):
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} runs the native backend eagerly; "
                             "drop --compile and --backend hf.")
        if self.limit is not None and self.limit < 1:
            raise ValueError(
                f"limit={self.limit} must be >= 1; pass --limit N with N >= 1, or leave --limit "
                f"out to evaluate every problem"
            )
        if self.temperature < 0:
            raise ValueError(
                f"temperature={self.temperature} must be >= 0; pass --temperature 0 for greedy "
                f"decoding or a positive value"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; pass --top-p P with 0 < P <= 1")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0; pass --top-k 0 (off) or K >= 1")
        if not self.is_full and (self.budget is None or self.budget < 1):
            raise ValueError(
                f"policy {self.policy!r} needs a budget >= 1, got {self.budget}; "
                f"pass --budget N (or --policy full for no eviction)"
            )
        if self.dtype != "auto":
            try:
                resolve_dtype(self.dtype)
            except ValueError:
                raise ValueError(
                    f"dtype={self.dtype!r} is unknown; pass --dtype with one of "
                    f"{', '.join(DTYPE_CHOICES)}"
                ) from None
        if self.sandbox not in SANDBOX_CHOICES:
            raise ValueError(
                f"sandbox={self.sandbox!r} is unknown; pass --sandbox with one of {', '.join(SANDBOX_CHOICES)}"
            )
        if self.kv_storage not in storage_names():
            raise ValueError(
                f"kv_storage={self.kv_storage!r} is unknown; pass --kv-storage with one of "
                f"{', '.join(storage_names())}"
            )
        self._check_backend()

    def _check_backend(self) -> None:
        """Refuses an unknown backend, and what ``backend="hf"`` cannot run, before anything loads."""
        if self.backend not in BACKENDS:
            raise ValueError(
                f"backend={self.backend!r} is unknown; pass --backend with one of {', '.join(BACKENDS)}"
            )
        if self.backend != "hf":
            return
        if self.compile:
            raise ValueError(
                "--backend hf runs transformers' eager decode step; drop --compile (the native backend compiles)."
            )
        if self.kv_storage != "dense":
            raise ValueError(f"--backend hf stores keys and values densely; drop --kv-storage {self.kv_storage}.")
        if importlib.util.find_spec("transformers") is None:
            raise ValueError(
                "--backend hf runs the model in Hugging Face transformers, which is not installed; "
                "pip install 'beaconkv[hf]', or pass --backend native."
            )

    @property
    def is_full(self) -> bool:
        """Whether the policy is FullKV (no eviction, no budget)."""
        return self.policy.lower() in ("full", "fullkv")

    @property
    def effective_budget(self) -> int | None:
        """The budget as recorded: ``None`` for FullKV."""
        return None if self.is_full else self.budget

    def make_policy(self) -> EvictionPolicy | None:
        """Build the run's policy with :func:`beaconkv.policies.make_policy`, validating it.

        A policy holds settings only, so the one object serves every cache slot of the run.
        The runner calls this before it loads the problems or the model, so an unknown policy,
        parameter or budget fails at once.

        Returns:
            The policy; ``None`` for FullKV without extra arguments (the engine's default).

        Raises:
            PolicyConfigError: Unknown policy or parameter, or settings the policy rejects.
        """
        if self.is_full and not self.policy_kwargs:
            return None
        return make_policy(self.policy, budget=self.budget, **self.policy_kwargs)

    def sandbox_limits(self) -> SandboxLimits:
        """The sandbox limits each code test runs under (``--code-timeout``, ``--code-memory-mb``,
        ``--sandbox``)."""
        return SandboxLimits(timeout_s=self.code_timeout_s, memory_mb=self.code_memory_mb,
                             containment=self.sandbox)  # type: ignore[arg-type]

    def decode_setup(self) -> DecodeSetup:
        """The run's runtime options as one :class:`~beaconkv.decode_setup.DecodeSetup` (what its engine takes)."""
        return DecodeSetup(kv_storage=self.kv_storage, compile=self.compile, prefill_chunk=self.prefill_chunk)

    def settings(self) -> dict[str, Any]:
        """The settings that must match for a resume (stored in every record).

        ``max_batch`` and ``compile`` are not among them: a sample's tokens do not depend on how
        many samples share the engine, nor on whether its decode step is compiled.

        Returns:
            A JSON-serialisable dict.
        """
        return {
            "model": self.model,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "policy_kwargs": json.loads(json.dumps(self.policy_kwargs, sort_keys=True)),
            "enable_thinking": self.enable_thinking,
            "kv_storage": self.kv_storage,
            "backend": self.backend,
            "prefill_chunk": self.prefill_chunk,
        }
