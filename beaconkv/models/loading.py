"""Checkpoint loading: local directory or hub id, single or sharded safetensors, meta-device build.

The model is constructed on the ``meta`` device (no memory), then each tensor is read from the
memory-mapped safetensors file, cast to the requested dtype on the requested device and assigned
in place of its meta placeholder (``load_state_dict(assign=True)``) — so there is never a second
full copy of the weights in memory. Mismatches between checkpoint and architecture are reported
all at once, by name and shape.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .attention import Attention
from .config import ModelConfig
from .decoder import CausalLM, RopeFactory, build_model, default_rope
from .layers import RMSNorm

HUB_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint's files do not match the architecture or cannot be read."""


#: The dtypes a model may be loaded as (its parameters, activations and, by default, its KV cache).
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """Turns ``torch.bfloat16`` / ``"bf16"`` / ``"float32"`` ... into one of :data:`MODEL_DTYPES`.

    Raises:
        ValueError: An unknown name, or a dtype the model cannot compute in (integers, float8,
            float64...); the message lists float32, bfloat16 and float16.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported for a model: use float32, bfloat16 or float16 "
                             "(e.g. dtype=torch.bfloat16).")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: use float32, bfloat16 or float16 "
                         f"(accepted spellings: {', '.join(sorted(_DTYPES))}).")
    return _DTYPES[key]


def resolve_device(device: torch.device | str | None) -> torch.device:
    """Validates a device string and checks that it is available.

    Raises:
        ValueError: Malformed device string, or a CUDA/MPS device that this machine does not have.
    """
    try:
        dev = torch.device(device if device is not None else "cpu")
    except RuntimeError as err:
        raise ValueError(f"device={device!r} is not a valid torch device (e.g. 'cpu', 'cuda', 'cuda:1'): {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available here; use device='cpu'.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) present.")
    return dev


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """Returns a local checkpoint directory for a path or a Hugging Face hub repo id.

    A string that is not an existing path and looks like ``owner/name`` is fetched with
    ``huggingface_hub.snapshot_download`` (config, tokenizer and safetensors files only).

    Raises:
        FileNotFoundError: A local path does not exist, or the hub id cannot be resolved.
    """
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise FileNotFoundError(f"{p} is a file; pass the checkpoint directory that holds config.json.")
    s = str(path_or_id)
    looks_local = s.startswith((".", "/", "~")) or s.count("/") != 1
    if looks_local:
        raise FileNotFoundError(
            f"checkpoint directory {s!r} does not exist; pass a directory holding config.json and *.safetensors, "
            "a hub id such as Qwen/Qwen3-4B, or 'embedded' for the embedded SmolLM2-135M."
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=s, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # offline, unknown repo, gated...
        reason = (str(err).strip().splitlines() or [""])[0][:300]
        if _hub_offline():
            raise FileNotFoundError(
                f"{s!r} is not a local directory and is not in the Hugging Face cache, and HF_HUB_OFFLINE is set, "
                "so it cannot be downloaded; unset HF_HUB_OFFLINE (and check your network) or pass a local "
                "checkpoint directory."
            ) from err
        raise FileNotFoundError(
            f"{s!r} is neither a local directory nor a downloadable hub repo ({type(err).__name__}: {reason}); "
            "check the repo id (owner/name), your network and HF_TOKEN for gated models, or pass a local directory."
        ) from err


def _hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids hub downloads."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index ({type(err).__name__}: {err}); "
                                  "restore the file from the checkpoint's source.") from None
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {missing}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {directory}; "
        "beaconkv loads safetensors checkpoints only."
    )


def load_model(
    path_or_id: str | Path,
    dtype: torch.dtype | str | None = torch.float32,
    device: torch.device | str | None = "cpu",
    *,
    rope: nn.Module | RopeFactory | None = None,
    attention: Callable[..., nn.Module] = Attention,
    mlp: Callable[[ModelConfig], nn.Module] | None = None,
    norm: Callable[[int, float], nn.Module] = RMSNorm,
) -> CausalLM:
    """Loads a llama / qwen2 / qwen3 causal LM from a directory or a hub id.

    Args:
        path_or_id: Checkpoint directory or hub repo id (``"Qwen/Qwen3-4B"``).
        dtype: Parameter dtype (``torch.bfloat16``, ``"bf16"``, ``"float32"`` ...).
        device: Target device.
        rope: Rotary module or ``rope(config)`` factory (see :func:`~beaconkv.models.decoder.build_model`);
            it is made outside the meta-device construction (so its own buffers are real) and moved to ``device``.
        attention: Attention class or factory (see :func:`~beaconkv.models.decoder.build_model`).
        mlp: ``mlp(config)`` factory (default SwiGLU).
        norm: ``norm(width, eps)`` factory (default RMSNorm).

    Returns:
        The model in eval mode.

    Raises:
        FileNotFoundError: Missing directory, config or weight files.
        UnsupportedModelError: Unsupported ``model_type``.
        CheckpointError: Corrupt safetensors, or missing / unexpected / mis-shaped tensors.
        ValueError: Unknown dtype or device.
    """
    dtype, dev = resolve_dtype(dtype), resolve_device(device)
    directory = resolve_checkpoint(path_or_id)
    config = ModelConfig.from_file(directory)
    files = _shard_files(directory)
    # the rotary module is made for real (its buffers are not weights), on the CPU like the reference's
    shared_rope = rope if isinstance(rope, nn.Module) else (rope or default_rope)(config)
    with torch.device("meta"):
        model = build_model(config, rope=shared_rope.to(dev), attention=attention, mlp=mlp, norm=norm)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    loaded: dict[str, torch.Tensor] = {}
    unexpected, misshaped = [], []
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
        except Exception as err:
            raise CheckpointError(f"cannot read safetensors file {f}: {err}") from err
        with handle:
            for name in handle.keys():
                if name not in expected:
                    if not (config.tie_word_embeddings and name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                t = handle.get_tensor(name)
                if tuple(t.shape) != tuple(expected[name]):
                    misshaped.append(f"{name}: checkpoint {tuple(t.shape)} vs model {tuple(expected[name])}")
                    continue
                loaded[name] = t.to(device=dev, dtype=dtype)
    missing = sorted(set(expected) - set(loaded) - {m.split(":")[0] for m in misshaped})
    if missing or unexpected or misshaped:
        raise CheckpointError(
            f"checkpoint {directory} does not match the {config.model_type} architecture:"
            + (f"\n  missing tensors: {missing}" if missing else "")
            + (f"\n  unexpected tensors: {sorted(unexpected)}" if unexpected else "")
            + (f"\n  mis-shaped tensors: {misshaped}" if misshaped else "")
        )
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.checkpoint_dir = directory
    return model.eval()
