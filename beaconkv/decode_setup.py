"""How a model decodes, as one value: the runtime options every entry point hands down together.

:func:`~beaconkv.generate`, :class:`~beaconkv.engine.Engine`, the server and the evaluation harness all take
the same runtime options — the cache's storage and dtype, the matmul kernels, compilation, chunked prefill,
CPU threads. :class:`DecodeSetup` is them as one frozen value, passed as it is to
:func:`~beaconkv.preparation.prepare_model` and :class:`~beaconkv.session.Session` instead of the same
keywords threaded through every signature (torchtune passes a component, not its five settings).
``generate`` and ``Engine`` take ``setup=`` or the keywords: :meth:`DecodeSetup.of` merges them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .execution import CompileConfig
from .storage import KVStorage

__all__ = ["DecodeSetup"]


@dataclass(frozen=True)
class DecodeSetup:
    """The runtime options of decoding (none of them changes what a policy keeps or a greedy token).

    Attributes:
        kv_storage: How the cache holds keys and values: ``"dense"``, ``"int8"`` or a
            :class:`~beaconkv.storage.KVStorage` class.
        cache_dtype: Dtype a dense storage keeps keys and values in (None: the model's).
        kernels: Matmul kernels: ``"auto"``, ``"model"``, ``"packed"`` or ``"bf16w"``
            (:func:`~beaconkv.kernels.choice.choose_kernels`).
        compile: Run the decode step and the policy's device work as graphs (``True`` or a
            :class:`~beaconkv.execution.CompileConfig`).
        prefill_chunk: Prefill prompts longer than this in chunks, the policy evicting between them
            (:meth:`~beaconkv.session.Session.prefill`); None: whole prompts.
        threads: torch's CPU threads for the run (None: leave torch's setting); :meth:`apply_threads` sets it.

    Raises:
        ValueError: A ``prefill_chunk`` or ``threads`` that is not a positive int, or a ``compile`` that is
            neither a bool nor a ``CompileConfig``.
    """

    kv_storage: str | type[KVStorage] = "dense"
    cache_dtype: torch.dtype | None = None
    kernels: str = "auto"
    compile: bool | CompileConfig = False
    prefill_chunk: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_chunk", "threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or None.")
        if not isinstance(self.compile, (bool, CompileConfig)):
            raise ValueError(f"compile={self.compile!r} must be True, False or a CompileConfig.")

    @classmethod
    def of(cls, setup: DecodeSetup | None = None, **keywords: Any) -> DecodeSetup:
        """The setup a call describes: ``setup`` as it is, or one made of the keywords (not both).

        Args:
            setup: A setup, or None.
            **keywords: The call's runtime keywords (fields of :class:`DecodeSetup`), at their defaults
                unless given.

        Returns:
            The setup.

        Raises:
            ValueError: ``setup`` and a keyword that differs from its default, naming the keyword.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        given = {k: v for k, v in keywords.items() if v is not defaults[k] and v != defaults[k]}
        if setup is None:
            return cls(**keywords)
        if given:
            raise ValueError(f"pass the runtime options either as setup= or as keywords, not both: setup={setup!r} "
                             f"and {', '.join(f'{k}={v!r}' for k, v in given.items())}; put them in the setup "
                             f"(dataclasses.replace(setup, {', '.join(f'{k}=...' for k in given)})).")
        return setup

    def apply_threads(self) -> None:
        """Sets torch's CPU threads to :attr:`threads` (nothing when it is None)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
