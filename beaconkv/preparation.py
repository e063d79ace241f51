"""The one preparation step before decoding: which model runs, with which kernels, and what that implies.

A :class:`~beaconkv.session.Session` runs the model it is given. Choosing the matmul kernels — and so
possibly running a *copy* of the caller's model with other linears — happens here, once, in the open:
:func:`prepare_model` returns a :class:`PreparedModel` that says what it made and why, and what the
choice implies for the rest of the setup:

* the dense cache keeps the caller's model dtype (a bf16 model run with fp32 arithmetic must not
  double its cache);
* inductor's matrix-vector pass stays off when the linears are extern kernels (it has nothing of
  theirs to take, and with it on, compiled bf16w steps corrupted the heap on an AVX-512 CPU).

:func:`beaconkv.generate` and :class:`beaconkv.Engine` call it; a user composing a
:class:`~beaconkv.session.Session` by hand calls it too, or passes the model as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .decode_setup import DecodeSetup
from .execution import CompileConfig, resolve_compile_config
from .kernels.choice import KernelChoice, choose_kernels
from .models.decoder import CausalLM
from .storage import KVStorage

__all__ = ["PreparedModel", "prepare_model"]


@dataclass(frozen=True)
class PreparedModel:
    """What :func:`prepare_model` made.

    Attributes:
        source: The caller's model.
        choice: The kernels chosen, the model that runs them and the one-sentence reason.
        cache_dtype: The dtype a dense cache keeps keys and values in (None: the running model's).
        compile: The compile settings the session must use (None: eager).
        setup: The caller's :class:`~beaconkv.decode_setup.DecodeSetup` with what the choice implies
            (``cache_dtype``, ``compile``): what a session on :attr:`model` takes.
    """

    source: CausalLM
    choice: KernelChoice
    cache_dtype: torch.dtype | None
    compile: CompileConfig | None
    setup: DecodeSetup = DecodeSetup()

    @property
    def model(self) -> CausalLM:
        """The model to run: the caller's, or a copy of it with other linear kernels (``choice.model``)."""
        return self.choice.model

    @property
    def kernels(self) -> str:
        """``"model"``, ``"packed"`` or ``"bf16w"``."""
        return self.choice.kernels


def prepare_model(
    model: CausalLM,
    rows: int,
    setup: DecodeSetup | None = None,
    *,
    kernels: str = "auto",
    kv_storage: str | type[KVStorage] = "dense",
    cache_dtype: torch.dtype | None = None,
    compile: bool | CompileConfig = False,
) -> PreparedModel:
    """Chooses the model a decode session with ``rows`` rows runs, and what that implies.

    Args:
        model: The caller's model (never modified).
        rows: Rows each decode step runs (the batch, or the engine's slot pool).
        setup: The runtime options as one value (or the keywords below, not both; see
            :meth:`~beaconkv.decode_setup.DecodeSetup.of`).
        kernels: ``"auto"``, ``"model"``, ``"packed"`` or ``"bf16w"``
            (see :func:`~beaconkv.kernels.choice.choose_kernels`).
        kv_storage: The cache's storage (a dense cache of a copy keeps the caller's dtype).
        cache_dtype: The caller's cache dtype (None: the caller's model dtype).
        compile: The caller's compile setting.

    Returns:
        The model to run, the caller's model, the choice, and the cache dtype and compile settings a
        session on it must use.

    Raises:
        ValueError: An unknown ``kernels``, or ``"bf16w"`` for a model whose weights are not bf16.
        beaconkv.kernels.packed.PackingError: ``"packed"`` where packing is impossible.
        beaconkv.kernels.build.KernelBuildError: ``"bf16w"`` where the kernel cannot be built.
        TypeError: ``compile`` is neither a bool nor a :class:`~beaconkv.execution.CompileConfig`.
    """
    setup = DecodeSetup.of(setup, kernels=kernels, kv_storage=kv_storage, cache_dtype=cache_dtype, compile=compile)
    choice = choose_kernels(model, rows, setup.kernels)
    config = resolve_compile_config(setup.compile)
    cache_dtype = setup.cache_dtype
    if choice.model is not model and cache_dtype is None and setup.kv_storage == "dense":
        cache_dtype = model.dtype  # the cache the caller sized: fp32 compute does not double it
    if config is not None and config.cpu_gemv and choice.kernels != "model":
        config = dataclasses.replace(config, cpu_gemv=False)
    prepared = dataclasses.replace(setup, cache_dtype=cache_dtype, compile=config if config is not None else False)
    return PreparedModel(model, choice, cache_dtype, config, prepared)
