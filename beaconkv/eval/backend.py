"""What the evaluation loop needs from a model, :class:`GenerationBackend`, and how the core library provides it.

:func:`load_backend` loads a checkpoint (a folder, a hub id, or ``"embedded"``) with
:func:`beaconkv.load_model` and :func:`beaconkv.load_tokenizer` and wraps
:func:`beaconkv.generate`. Tests and other model runtimes inject their own backend instead, so
the loop runs without a model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from beaconkv.arguments import model_path
from beaconkv.generation import generate
from beaconkv.models.loading import load_model, resolve_dtype
from beaconkv.tokenizer import load_tokenizer

__all__ = ["GenerationBackend", "load_backend", "resolve_device", "resolve_eval_dtype"]


@dataclass
class GenerationBackend:
    """What the loop needs from a model: a tokenizer with a chat template and a generate function.

    Attributes:
        tokenizer: Has ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``.
        generate: ``generate(prompts, *, max_new_tokens, temperature, top_p, top_k, seed, policy,
            kv_storage)`` returning an object with ``token_ids``, ``texts``, ``finish_reasons`` and
            ``stats`` (``prompt_tokens``, ``new_tokens``, ``cache_capacity``, ``evictions``,
            ``peak_cache_tokens``, ``wall_time_s``), like :func:`beaconkv.generate`. ``policy`` is
            one policy object (or ``None`` for FullKV) shared by every call of a run.
    """

    tokenizer: Any
    generate: Callable[..., Any]


def resolve_device(device: str) -> str:
    """Turn ``"auto"`` into ``"cuda"`` when a GPU is present, else ``"cpu"``.

    Args:
        device: ``"auto"`` or a torch device string.

    Returns:
        The device string (unchanged unless ``"auto"``).
    """
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_eval_dtype(dtype: str, device: str) -> torch.dtype:
    """Turn ``--dtype`` into a torch dtype: ``"auto"`` is bfloat16 on CUDA and float32 elsewhere.

    Args:
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"`` (or an alias such as ``bf16``).
        device: The resolved device.

    Returns:
        The dtype.

    Raises:
        ValueError: Unknown dtype name.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return resolve_dtype(dtype)


def load_backend(model: str, *, device: str, dtype: torch.dtype | str) -> GenerationBackend:
    """Load a model and tokenizer with the core library and wrap :func:`beaconkv.generate`.

    Args:
        model: Checkpoint folder, hub id, or ``"embedded"``.
        device: Torch device string.
        dtype: Torch dtype of the weights (or its name).

    Returns:
        The :class:`GenerationBackend`.

    Raises:
        FileNotFoundError: The checkpoint folder does not exist or the hub id cannot be resolved.
    """
    path = model_path(model)
    try:
        loaded = load_model(path, dtype=dtype, device=device)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"{err} Fix: --model takes a checkpoint folder holding config.json, a hub model id "
            f"(owner/name) or 'embedded'."
        ) from err
    tokenizer = load_tokenizer(path)
    return GenerationBackend(tokenizer, functools.partial(generate, loaded, tokenizer))
