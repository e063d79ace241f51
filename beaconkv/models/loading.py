"""Checkpoint loading: local directory or hub id, single or sharded safetensors, checked before it is built.

Nothing a checkpoint says is trusted. Before anything is built: ``config.json``'s fields are
checked for type and range (:mod:`beaconkv.models.config`), every tensor's header dtype must be a
float weight dtype (:data:`WEIGHT_DTYPES`: a header saying ``I32`` over float bytes is refused, not
loaded as garbage), and the config must agree with the tensors' names and shapes (the layer count
with the layer indices, the widths with the embedding and layer 0's projections) — all read from
the safetensors headers, without reading tensor data, so no config value can make loading build a
billion layers.

The model is then constructed with its parameters on the ``meta`` device (no memory) and its
buffers for real, each tensor is read from the memory-mapped safetensors file, cast to the
requested dtype on the requested device and assigned in place of its meta placeholder
(``load_state_dict(assign=True)``) — so there is never a second full copy of the weights in memory.
Mismatches between checkpoint and architecture are reported all at once, by name and shape. Every
tensor is checked to hold finite values as loaded (:func:`refuse_non_finite`): a NaN or infinite weight,
or one that overflows the requested dtype, is refused naming the tensor and its file — a model with
one used to load and answer every request with empty text.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..errors import BeaconKVError
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


class CheckpointError(BeaconKVError, ValueError):
    """A checkpoint's files do not match the architecture, disagree with its config, or cannot be read."""


class MetaTensorError(BeaconKVError, ValueError):
    """A tensor of a loaded model is still on the meta device: an injected component computed it from a
    parameter in its ``__init__``, before the checkpoint's values existed."""


class CheckpointShard(Protocol):
    """The part of a checkpoint one process loads: a tensor-parallel rank's shard
    (:class:`beaconkv.distributed.loading.RankShard`). :func:`load_model` checks the whole checkpoint as
    usual, builds the model from :meth:`model_config`, lets :meth:`adapt` swap modules before any weight
    exists, compares each tensor's header with :meth:`stored_shape` and reads only :meth:`read`'s part."""

    def model_config(self, config: ModelConfig) -> ModelConfig:
        """The config this process's model is built from (its local head and MLP counts)."""

    def adapt(self, model: CausalLM) -> None:
        """Changes the freshly built model (parameters on the meta device) before its weights load."""

    def stored_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint shape of tensor ``name``, whose part this process holds with ``shape``."""

    def read(self, stored: Any, name: str) -> torch.Tensor:
        """This process's part of tensor ``name``, read from ``stored`` (safetensors' ``get_slice``: only
        the part's bytes are read)."""


#: The safetensors dtypes a weight may be stored in; any other (an integer, bool or float8) is refused.
WEIGHT_DTYPES = ("F32", "F16", "BF16")


#: The dtypes a model may be loaded as (its parameters, activations and, by default, its KV cache).
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str | None = None) -> torch.dtype:
    """Turns ``torch.bfloat16`` / ``"bf16"`` / ``"float32"`` / ``"auto"`` ... into one of :data:`MODEL_DTYPES`.

    Args:
        dtype: A dtype, its name, ``"auto"`` (bfloat16 on a CUDA device, float32 elsewhere, as the
            evaluation has always chosen) or None (float32).
        device: The device ``"auto"`` chooses for (None: the CPU).

    Raises:
        ValueError: An unknown name, or a dtype the model cannot compute in (integers, float8,
            float64...); the message lists auto, float32, bfloat16 and float16.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype.lower() == "auto":
        return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported for a model: use float32, bfloat16 or float16 "
                             "(e.g. dtype=torch.bfloat16).")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: use auto, float32, bfloat16 or float16 "
                         f"(accepted spellings: {', '.join(sorted(_DTYPES))}).")
    return _DTYPES[key]


def resolve_device(device: torch.device | str | None) -> torch.device:
    """Validates a device string and checks that it is available.

    Args:
        device: A device, its string (``"cpu"``, ``"cuda:1"`` ...), ``"auto"`` (CUDA when this machine
            has it, else the CPU) or None (the CPU).

    Raises:
        ValueError: Malformed device string, or a CUDA/MPS device that this machine does not have.
    """
    if isinstance(device, str) and device.lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's entry in a safetensors header (read without reading the tensor's data).

    Attributes:
        file: The safetensors file holding it.
        dtype: The header's dtype string (``"F32"``, ``"BF16"``, ``"I32"``...).
        shape: The header's shape.
    """

    file: Path
    dtype: str
    shape: tuple[int, ...]


def _listing(names: list[str], limit: int = 20) -> str:
    """``['a', 'b']``, or the first ``limit`` names and how many more."""
    if len(names) <= limit:
        return repr(names)
    return f"{names[:limit]!r} and {len(names) - limit} more"


def _shard_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint's safetensors files, and the index's ``weight_map`` if it is sharded."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError...
            raise CheckpointError(f"{index} is not a valid safetensors index ({type(err).__name__}: {str(err)[:200]}); "
                                  "restore the file from the checkpoint's source.") from None
        bad = [f"{k!r}: {v!r}"[:120] for k, v in (weight_map.items() if isinstance(weight_map, dict) else [])
               if not (isinstance(k, str) and isinstance(v, str) and v not in ("", ".", "..") and Path(v).name == v)]
        if not isinstance(weight_map, dict) or bad:
            what = bad[:3] if isinstance(weight_map, dict) else f"a {type(weight_map).__name__}"
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names in {directory}, got "
                                  f"{what}; restore the file from the checkpoint's source.")
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {missing}")
        return files, weight_map
    single = directory / "model.safetensors"
    if single.is_file():
        return [single], None
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {directory}; "
        "beaconkv loads safetensors checkpoints only."
    )


def read_safetensors_headers(files: list[Path]) -> dict[str, TensorHeader]:
    """Reads the name, dtype and shape of every tensor of some safetensors files, without their data.

    ``safetensors`` validates each header as it opens the file (its length, its JSON, offsets that
    tile the data exactly, byte sizes that match dtype and shape), so a truncated or inconsistent file
    is refused here.

    Args:
        files: The checkpoint's safetensors files.

    Returns:
        ``{tensor name: TensorHeader}`` over all files.

    Raises:
        CheckpointError: A file that cannot be read as safetensors, a tensor stored in two files, or a
            tensor whose dtype is not one of :data:`WEIGHT_DTYPES` (the message names the file, the
            tensors and their dtypes).
    """
    headers: dict[str, TensorHeader] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                entries = [(name, handle.get_slice(name)) for name in handle.keys()]
                entries = [(name, s.get_dtype(), tuple(int(d) for d in s.get_shape())) for name, s in entries]
        except Exception as err:  # safetensors raises its own SafetensorError, OSError...
            raise CheckpointError(f"cannot read safetensors file {f}: {err}") from err
        for name, dtype, shape in entries:
            if name in headers:
                raise CheckpointError(f"tensor {name} is stored twice, in {headers[name].file} and in {f}; restore the "
                                      "checkpoint's files (a shard of another checkpoint may have been copied in).")
            headers[name] = TensorHeader(f, dtype, shape)
    odd = [f"{name} ({h.dtype}, in {h.file.name})" for name, h in headers.items() if h.dtype not in WEIGHT_DTYPES]
    if odd:
        raise CheckpointError(
            f"the safetensors headers in {files[0].parent} give tensors a dtype that is not a float weight: "
            f"{_listing(odd, 5)}; beaconkv loads weights stored as {', '.join(WEIGHT_DTYPES)}. An integer, boolean or "
            "float8 weight means a corrupted header or a quantised checkpoint: restore the file, or load the "
            "unquantised checkpoint."
        )
    return headers


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_config_against_checkpoint(config: ModelConfig, headers: dict[str, TensorHeader], config_path: Path) -> None:
    """Checks the config against the checkpoint's tensor names and shapes, before anything is built.

    The number of layers must be exactly the layer indices the tensors have, the embedding must be
    ``(vocab_size, hidden_size)``, layer 0's projections must have ``num_attention_heads * head_dim``
    query rows, ``num_key_value_heads * head_dim`` key rows and ``intermediate_size`` gate rows, and
    Qwen3's ``q_norm`` must be ``head_dim`` wide. A field is blamed only where the checkpoint
    corroborates the width (a transposed tensor is not a wrong config); every tensor's shape is
    compared with the built model's, still without reading data, in :func:`load_model`.

    Args:
        config: The parsed config.
        headers: The checkpoint's tensors (:func:`read_safetensors_headers`).
        config_path: The ``config.json`` the config came from (for the messages).

    Raises:
        CheckpointError: A config field disagrees with the tensors; the message names the file, the
            field, its value, the tensor and its shape, and the value the checkpoint implies.
    """
    c = config

    def fail(field: str, tensor: str, fix: str) -> CheckpointError:
        h = headers[tensor]
        return CheckpointError(f"{config_path}: {field}, but {tensor} in {h.file} has shape {h.shape}; {fix}.")

    def shape(name: str, ndim: int) -> tuple[int, ...] | None:
        h = headers.get(name)
        return h.shape if h is not None and len(h.shape) == ndim else None

    indices = {int(m.group(1)) for m in map(_LAYER.match, headers) if m}
    n = c.num_hidden_layers
    if indices != set(range(n)):
        shown = sorted(indices)
        held = (f"layers 0..{len(shown) - 1}" if shown == list(range(len(shown))) else
                f"the layer indices {shown[:8]}{'...' if len(shown) > 8 else ''}") if shown else "no decoder layer"
        absent = [i for i in range(n) if i not in indices]
        if shown and shown == list(range(len(shown))):
            fix = f"set num_hidden_layers to {len(shown)}"
        elif absent and (not shown or shown[-1] < n):
            more = "..." if len(absent) > 8 else ""
            fix = f"restore the tensors of layers {absent[:8]}{more} (a shard may be missing)"
        else:
            fix = "restore the checkpoint's files (its layer indices have gaps or go past num_hidden_layers)"
        raise CheckpointError(f"{config_path}: num_hidden_layers={n}, but the checkpoint's tensors hold {held}; {fix}.")

    # A field is blamed only where the checkpoint corroborates the width it implies (a tensor's other
    # dimension is the config's hidden size, its companion agrees: norm / embedding, o_proj / q_proj,
    # v_proj / k_proj, down_proj / gate_proj, k_norm / q_norm); a tensor that is merely mis-shaped
    # (transposed, cut, swapped) is named by the comparison with the built model instead.
    hd_note = _head_dim_note(config_path)
    embed = shape("model.embed_tokens.weight", 2)
    if embed is not None:
        norm = shape("model.norm.weight", 1)
        if embed[1] == c.hidden_size and embed[0] != c.vocab_size:
            raise fail(f"vocab_size={c.vocab_size}", "model.embed_tokens.weight", f"set vocab_size to {embed[0]}")
        if embed[1] != c.hidden_size and norm == (embed[1],):
            raise fail(f"hidden_size={c.hidden_size}", "model.embed_tokens.weight", f"set hidden_size to {embed[1]}")
        if not c.tie_word_embeddings and "lm_head.weight" not in headers:
            raise CheckpointError(
                f"{config_path}: tie_word_embeddings=false, but the checkpoint has no lm_head.weight; if the model's "
                "head shares the token embedding, set tie_word_embeddings to true, else restore the missing weights."
            )
    attn = "model.layers.0.self_attn."
    q_norm = shape(attn + "q_norm.weight", 1)
    if c.qk_norm and q_norm is not None and q_norm[0] != c.head_dim and shape(attn + "k_norm.weight", 1) == q_norm:
        raise fail(f"head_dim={c.head_dim}{hd_note}", attn + "q_norm.weight", f"set head_dim to {q_norm[0]}")
    q, o = shape(attn + "q_proj.weight", 2), shape(attn + "o_proj.weight", 2)
    if q is not None and q[1] == c.hidden_size and q[0] != c.num_attention_heads * c.head_dim and o == q[::-1]:
        rows, hints = q[0], []
        if rows % c.num_attention_heads == 0:
            hints.append(f"head_dim={rows // c.num_attention_heads} with num_attention_heads={c.num_attention_heads}")
        if rows % c.head_dim == 0:
            hints.append(f"num_attention_heads={rows // c.head_dim} with head_dim={c.head_dim}")
        raise fail(f"num_attention_heads={c.num_attention_heads} x head_dim={c.head_dim} = "
                   f"{c.num_attention_heads * c.head_dim} query rows{hd_note}", attn + "q_proj.weight",
                   f"set num_attention_heads and head_dim so that their product is {rows}"
                   + (f" (e.g. {' or '.join(hints)})" if hints else ""))
    k, v = shape(attn + "k_proj.weight", 2), shape(attn + "v_proj.weight", 2)
    if k is not None and k[1] == c.hidden_size and k[0] != c.num_key_value_heads * c.head_dim and v == k:
        fix = (f"set num_key_value_heads to {k[0] // c.head_dim}" if k[0] % c.head_dim == 0 else
               f"set num_key_value_heads and head_dim so that their product is {k[0]}")
        raise fail(f"num_key_value_heads={c.num_key_value_heads} x head_dim={c.head_dim} = "
                   f"{c.num_key_value_heads * c.head_dim} key rows{hd_note}", attn + "k_proj.weight", fix)
    has_bias = attn + "q_proj.bias" in headers
    if c.model_type != "qwen2" and has_bias != c.attention_bias:
        raise CheckpointError(
            f"{config_path}: attention_bias={str(c.attention_bias).lower()}, but the checkpoint "
            f"{'has' if has_bias else 'has no'} {attn}q_proj.bias; set attention_bias to {str(has_bias).lower()}."
        )
    gate = shape("model.layers.0.mlp.gate_proj.weight", 2)
    down = shape("model.layers.0.mlp.down_proj.weight", 2)
    if gate is not None and gate[1] == c.hidden_size and gate[0] != c.intermediate_size and down == gate[::-1]:
        raise fail(f"intermediate_size={c.intermediate_size}", "model.layers.0.mlp.gate_proj.weight",
                   f"set intermediate_size to {gate[0]}")


def _head_dim_note(config_path: Path) -> str:
    """Says how head_dim was derived, when ``config.json`` does not give it (the messages blame it)."""
    try:
        given = json.loads(config_path.read_text(encoding="utf-8")).get("head_dim") is not None
    except (OSError, ValueError, AttributeError, RecursionError):
        given = True
    return "" if given else " (config.json has no head_dim: it is hidden_size // num_attention_heads)"


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Builds modules on the CPU, with each parameter moved to the meta device as it is registered.

    A component's ``__init__`` runs once, for real: the buffers it computes (a rotary table, a mask,
    a scale) hold their values, while parameters (which the checkpoint replaces) take no memory.
    ``nn.Linear``'s ``torch.empty`` is never touched, so it costs no memory either. The hook acts on
    this thread only.
    """
    thread = threading.get_ident()

    def divert(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta or type(param) is not nn.Parameter or threading.get_ident() != thread:
            return None
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(divert)
    try:
        with torch.device("cpu"):
            yield
    finally:
        handle.remove()


def _place_buffers(model: nn.Module, device: torch.device) -> None:
    """Moves every buffer to ``device`` (keeping its dtype, and sharing between modules)."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is None or buf.is_meta or buf.device == device:
                continue
            if id(buf) not in moved:
                moved[id(buf)] = buf.to(device)
            module._buffers[name] = moved[id(buf)]


def refuse_non_finite(name: str, tensor: torch.Tensor, file: Path, stored: torch.Tensor | None = None) -> None:
    """Refuses a weight holding a NaN or an infinity, as it will be used (after the cast to the model's dtype).

    One reduction per tensor (:func:`_plausibly_finite`): only a tensor it cannot clear is looked at element
    by element. About as fast as reading the weights once.

    Args:
        name: The tensor's name (for the message).
        tensor: The tensor as loaded (cast to the model's dtype, on its device).
        file: The safetensors file it came from (for the message).
        stored: The tensor as stored, before the cast, to tell a stored NaN or infinity from a cast that
            overflowed (None: not told apart).

    Raises:
        CheckpointError: The tensor holds non-finite values: names it, the file, how many, and the fix.
    """
    if not tensor.is_floating_point() or _plausibly_finite(tensor):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad == 0:  # the sum overflowed, the values are finite
        return
    if stored is not None and stored.dtype != tensor.dtype and bool(torch.isfinite(stored).all()):
        raise CheckpointError(
            f"{name} in {file} has {bad} of {tensor.numel()} values beyond the range of {tensor.dtype} (finite as "
            f"stored in {stored.dtype}); load the model in a wider dtype (bfloat16 or float32).")
    raise CheckpointError(
        f"{name} in {file} has {bad} of {tensor.numel()} values that are NaN or infinite; the checkpoint is "
        "corrupted (or was saved after a diverged training step): restore the file from the checkpoint's source. "
        "load_model(..., check_finite=False) loads it anyway.")


def _plausibly_finite(tensor: torch.Tensor) -> bool:
    """True when one reduction proves every value finite; False when some value may not be (look closer).

    The float32 sum of finite values is finite unless it overflows, and a NaN or an infinity always makes it
    non-finite. On the CPU the reduction is numpy's, on one thread: a torch reduction per tensor waits on
    torch's other threads each time, which on a busy machine made the check of a 135M-parameter model take
    seconds instead of a tenth of one. numpy has no bfloat16, so a bfloat16 tensor's bits are looked at
    instead (all exponent bits set: an infinity or a NaN).
    """
    if tensor.device.type != "cpu":
        return bool(torch.isfinite(tensor.sum(dtype=torch.float32)))
    flat = tensor.detach().reshape(-1)
    if tensor.dtype == torch.bfloat16:
        exponent = np.bitwise_and(flat.view(torch.int16).numpy(), np.int16(0x7F80))
        return not bool((exponent == 0x7F80).any())
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow or a NaN is the answer, not a warning
        return bool(np.isfinite(np.add.reduce(flat.numpy(), dtype=np.float32)))


def _refuse_meta_tensors(model: nn.Module, directory: Path) -> None:
    """Raises :class:`MetaTensorError` for a parameter, buffer or tensor attribute still on the meta device."""
    for prefix, module in model.named_modules():
        tensors = [("parameter", n, t) for n, t in module._parameters.items()]
        tensors += [("buffer", n, t) for n, t in module._buffers.items()]
        tensors += [("tensor attribute", n, t) for n, t in vars(module).items() if isinstance(t, torch.Tensor)]
        for kind, name, t in tensors:
            if t is not None and t.is_meta:
                full = f"{prefix}.{name}" if prefix else name
                raise MetaTensorError(
                    f"after loading {directory}, {full} (a {kind} of {type(module).__name__}) is still on the meta "
                    "device: its __init__ computed it from a parameter, and parameters hold no values until the "
                    "checkpoint's are assigned. Compute it from constants in __init__ (register_buffer(..., "
                    "persistent=False) of a tensor made there is built on the CPU and moved to the device), or "
                    "from the parameter in forward."
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
    check_finite: bool = True,
    shard: CheckpointShard | None = None,
) -> CausalLM:
    """Loads a llama / qwen2 / qwen3 causal LM from a directory or a hub id.

    Nothing is built before the checkpoint is checked: the config's types and ranges
    (:class:`~beaconkv.models.config.ModelConfig`), then every tensor's header dtype and the config
    against the tensors' names and shapes (:func:`check_config_against_checkpoint`), all from the
    safetensors headers, without reading tensor data. The model is then built with its parameters on
    the meta device and every other tensor for real on the CPU: each component's ``__init__`` runs
    once, so the non-persistent buffers of a custom ``attention``, ``mlp`` or ``norm`` hold the values
    it computed, and are moved to ``device`` (keeping their dtype). The checkpoint's tensors are
    compared with the built model's by name and shape, read, cast, checked to hold finite values
    (:func:`refuse_non_finite`) and assigned in place of the meta parameters.

    Args:
        path_or_id: Checkpoint directory or hub repo id (``"Qwen/Qwen3-4B"``).
        dtype: Parameter dtype (``torch.bfloat16``, ``"bf16"``, ``"float32"`` ..., or ``"auto"``:
            bfloat16 on CUDA, float32 elsewhere).
        device: Target device (``"auto"``: CUDA when available, else the CPU).
        rope: Rotary module or ``rope(config)`` factory (see :func:`~beaconkv.models.decoder.build_model`);
            it is made outside the model's construction, on the CPU like the reference's, and moved to ``device``.
        attention: Attention class or factory (see :func:`~beaconkv.models.decoder.build_model`).
        mlp: ``mlp(config)`` factory (default SwiGLU).
        norm: ``norm(width, eps)`` factory (default RMSNorm).
        check_finite: Refuse a weight holding a NaN or an infinity as loaded (one read of the weights; False
            skips it, for a checkpoint known to be sound on a slow disk).
        shard: Load only this process's part of each tensor (a tensor-parallel rank's shard, see
            :class:`CheckpointShard`; the checks above still cover the whole checkpoint). None: everything.

    Returns:
        The model in eval mode.

    Raises:
        FileNotFoundError: Missing directory, config or weight files.
        UnsupportedModelError: Unsupported ``model_type`` or setting.
        ConfigFileError: ``config.json`` is not valid JSON, or a field has the wrong type or range.
        CheckpointError: Corrupt safetensors, a non-float dtype, a config that disagrees with the tensors,
            missing / unexpected / mis-shaped tensors, or a weight holding a NaN or an infinity.
        MetaTensorError: A component computed a tensor from a parameter in its ``__init__``.
        ValueError: Unknown dtype or device.
    """
    dev = resolve_device(device)
    dtype = resolve_dtype(dtype, dev)
    directory = resolve_checkpoint(path_or_id)
    config = ModelConfig.from_file(directory)
    files, weight_map = _shard_files(directory)
    headers = read_safetensors_headers(files)
    if weight_map is not None:
        wrong = [n for n, f in weight_map.items() if n not in headers or headers[n].file.name != f]
        if wrong:
            raise CheckpointError(f"{directory / 'model.safetensors.index.json'} lists tensors that are not in the "
                                  f"shard it names: {_listing(sorted(wrong), 5)}; restore the checkpoint's files.")
    check_config_against_checkpoint(config, headers, directory / "config.json")
    # the rotary module is made for real (its buffers are not weights), on the CPU like the reference's
    shared_rope = rope if isinstance(rope, nn.Module) else (rope or default_rope)(config)
    with _parameters_on_meta():
        model = build_model(config if shard is None else shard.model_config(config), rope=shared_rope.to(dev),
                            attention=attention, mlp=mlp, norm=norm)
        if shard is not None:
            shard.adapt(model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shard is not None:  # compared with the whole tensors' headers
        expected = {k: tuple(shard.stored_shape(k, v)) for k, v in expected.items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in headers if n not in expected and n not in ignored)
    misshaped = [f"{n}: checkpoint {h.shape} vs model {expected[n]}" for n, h in headers.items()
                 if n in expected and h.shape != expected[n]]
    missing = sorted(set(expected) - set(headers))
    if missing or unexpected or misshaped:
        raise CheckpointError(
            f"checkpoint {directory} does not match the {config.model_type} architecture:"
            + (f"\n  missing tensors: {_listing(missing)}" if missing else "")
            + (f"\n  unexpected tensors: {_listing(unexpected)}" if unexpected else "")
            + (f"\n  mis-shaped tensors: {_listing(misshaped)}" if misshaped else "")
        )
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if name in expected:
                        stored = handle.get_tensor(name) if shard is None else shard.read(handle.get_slice(name),
                                                                                          name)
                        loaded[name] = stored.to(device=dev, dtype=dtype)
                        if check_finite:
                            refuse_non_finite(name, loaded[name], f, stored)
        except CheckpointError:
            raise
        except Exception as err:  # the file changed since its header was read, an I/O error...
            raise CheckpointError(f"cannot read safetensors file {f}: {err}") from err
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _place_buffers(model, dev)
    _refuse_meta_tensors(model, directory)
    model.checkpoint_dir = directory
    return model.eval()
