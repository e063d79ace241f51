"""Argument types and option groups shared by the ``beaconkv`` subcommands."""

from __future__ import annotations

import argparse

from .models.cpu_linear import KERNELS
from .models.embedded import embedded_model_path
from .storage import storage_names


def int_list(text: str) -> list[int]:
    """``"64,128"`` -> ``[64, 128]`` (an argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def str_list(text: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]`` (an argparse type)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def int_or_auto(text: str) -> int | None:
    """An int, or ``auto``/``prompt``/``none`` for None (an argparse type)."""
    if text.lower() in ("auto", "prompt", "none"):
        return None
    try:
        return int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from err


def positive_int(text: str) -> int:
    """An int >= 1 (an argparse type)."""
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_kv_storage_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--kv-storage {dense,int8}``: how the KV cache holds keys and values."""
    parser.add_argument("--kv-storage", default="dense", choices=storage_names(),
                        help="KV cache storage: dense (default) or int8 (per-token, per-KV-head scales)")


def add_kernels_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--kernels {auto,model,packed,bf16w}``: the matmul kernels of the decode steps."""
    parser.add_argument("--kernels", default="auto", choices=KERNELS,
                        help="matmul kernels: auto (default: when 4+ sequences decode together on a CPU without "
                             "native bf16, bf16 weights with fp32 arithmetic (bf16w) for a bf16 model, "
                             "oneDNN-prepacked fp32 linears (packed) otherwise), model (the model's own), packed "
                             "or bf16w")


def add_model_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, device: bool = True) -> None:
    """``--model``, ``--dtype`` (and ``--device``): which checkpoint to load, as what."""
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or hub id (default / 'embedded': the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    if device:
        parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")


def model_path(name: str | None) -> str:
    """The checkpoint ``--model`` names: the embedded model for None or ``"embedded"``."""
    return str(embedded_model_path()) if name in (None, "embedded") else name
