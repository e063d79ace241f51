"""Model configuration: one small dataclass parsed from a checkpoint's own ``config.json``, and checked.

Supports the three architectures the project targets: ``llama`` (Llama 3.x, SmolLM2), ``qwen2``
(Qwen2 and the R1-Distill-Qwen models: q/k/v biases) and ``qwen3`` (per-head q/k RMSNorm, a
``head_dim`` independent of ``hidden_size``). Both spellings of the rotary settings are accepted:
the classic ``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters`` dict.

Nothing in a ``config.json`` is trusted: every field the decoder uses is checked for its JSON type
(an integer is an integer, not ``64.0``, ``"64"`` or ``true``) and for a sane range
(:data:`CONFIG_LIMITS`), and settings the decoder cannot honour (another activation, sliding
windows, partial rotary, per-layer-type rope) are refused rather than ignored. Whether the values
also match the checkpoint's tensors is checked by :mod:`beaconkv.models.loading`, from the
safetensors headers, before anything is built.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BeaconKVError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

#: Upper bounds of the integer fields of a ``config.json``. Every real llama / qwen checkpoint is far
#: below them (the largest have ~128 layers, a hidden size of 16384, a vocabulary of ~256k and a
#: context of 10M tokens); a value above one is refused with :class:`ConfigFileError`. To load a model
#: that really is larger, raise the bound first, e.g. ``CONFIG_LIMITS["num_hidden_layers"] = 4096``.
CONFIG_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 4096,
    "max_position_embeddings": 1 << 24,
    "original_max_position_embeddings": 1 << 24,
}

#: The largest ``config.json`` read (a real one is a few KiB).
MAX_CONFIG_BYTES = 16 << 20


class UnsupportedModelError(BeaconKVError, ValueError):
    """The checkpoint's ``model_type`` (or one of its settings) is not supported by beaconkv."""


class ConfigFileError(BeaconKVError, ValueError):
    """A checkpoint's ``config.json`` cannot be trusted: invalid JSON, not an object, a required key
    missing, a value of the wrong JSON type, or a value out of its range (see :data:`CONFIG_LIMITS`)."""


_RESTORE = "restore the value from the checkpoint's original config.json"
# The alternative a refused model_type may have: the transformers backend (which refuses MLA and hybrids itself).
_HF_HINT = ("; other decoders whose attention caches per-head keys and values with RoPE (Mistral, Gemma 3, gpt-oss, "
            "Phi-3, ...) run in transformers with --backend hf.")


def _show(value: Any) -> str:
    """``repr(value)``, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type (``a string``, ``a boolean``, ``null``...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction" if math.isfinite(value) else "a non-finite number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _integer(name: str, value: Any, low: int = 1, high: int | None = None) -> int:
    """Returns ``value`` if it is an ``int`` (not a bool) in ``[low, high]``; raises :class:`ConfigFileError`."""
    if isinstance(value, bool) or not isinstance(value, int):
        fix = _RESTORE
        if isinstance(value, float) and value.is_integer():
            fix = f"write it as a JSON integer ({int(value)}, not {value})"
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            fix = f"write it as a JSON integer, without quotes ({value.strip()})"
        raise ConfigFileError(f"{name}={_show(value)} must be an integer, not {_json_type(value)}; {fix}.")
    key = name.rsplit(".", 1)[-1]
    if value < low:
        raise ConfigFileError(f"{name}={value} must be at least {low}; {_RESTORE}.")
    if high is not None and value > high:
        raise ConfigFileError(f"{name}={value} must be at most {high}; {_RESTORE}.")
    if high is None and key in CONFIG_LIMITS and value > CONFIG_LIMITS[key]:
        raise ConfigFileError(
            f"{name}={value} is above the limit of {CONFIG_LIMITS[key]}; {_RESTORE}, or, for a model that really is "
            f"this large, raise beaconkv.models.config.CONFIG_LIMITS[{key!r}] first."
        )
    return value


def _number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """Returns ``value`` as a float if it is a finite JSON number in ``[low, high]`` (``(low, high]`` when
    ``low_open``); raises :class:`ConfigFileError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigFileError(f"{name}={_show(value)} must be a number, not {_json_type(value)}; {_RESTORE}.")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    below = number <= low if low_open else number < low
    if not math.isfinite(number) or below or number > high:
        def fmt(x: float) -> str:
            return str(int(x)) if x.is_integer() else f"{x:g}"

        bounds = (f"greater than {fmt(low)}" if low_open else f"at least {fmt(low)}") + (
            f" and at most {fmt(high)}" if math.isfinite(high) else "")
        raise ConfigFileError(f"{name}={_show(value)} must be a finite number {bounds}; {_RESTORE}.")
    return number


def _boolean(name: str, value: Any) -> bool:
    """Returns ``value`` if it is a JSON boolean; raises :class:`ConfigFileError`."""
    if not isinstance(value, bool):
        raise ConfigFileError(f"{name}={_show(value)} must be true or false (a JSON boolean), not "
                              f"{_json_type(value)}; {_RESTORE}.")
    return value


def _token_ids(name: str, value: Any, vocab_size: int) -> int | list[int] | None:
    """``null``, an id or a list of ids, each in ``[0, vocab_size)``; raises :class:`ConfigFileError`."""
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        _integer(name, i, low=0, high=1 << 62)  # the type
        if i >= vocab_size:
            raise ConfigFileError(f"{name}={_show(value)}: id {i} is outside the vocabulary (vocab_size={vocab_size}); "
                                  f"{_RESTORE}.")
    return value


@dataclass
class RopeConfig:
    """Rotary embedding settings.

    Attributes:
        theta: Base of the geometric frequency progression (``rope_theta``); finite and above 1.
        rope_type: ``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``.
        factor: Scaling factor for the scaled variants, in ``[1, 2**24]``.
        params: The remaining type-specific parameters, with Hugging Face key names
            (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``,
            ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``).

    Raises:
        UnsupportedModelError: An unknown ``rope_type``.
        ConfigFileError: A value of the wrong type or out of range, or a parameter the type needs is missing.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type={_show(self.rope_type)} is not supported; beaconkv supports {', '.join(_ROPE_TYPES)}."
            )
        self.theta = _number("rope_theta", self.theta, low=1.0, low_open=True)
        self.factor = _number("rope_scaling.factor", self.factor, *_ROPE_RANGES["factor"])
        if not isinstance(self.params, dict):
            raise ConfigFileError(f"rope parameters must be an object, not {_json_type(self.params)}.")
        p = self.params
        for key in _ROPE_REQUIRED.get(self.rope_type, ()):
            if p.get(key) is None:
                raise ConfigFileError(f"{self.rope_type} rope scaling needs {key!r} in rope_scaling (or "
                                      f"rope_parameters); {_RESTORE}.")
        for key, value in p.items():
            where = f"rope_scaling.{key}"
            if value is None:  # absent (a required one is refused above)
                continue
            if key == "original_max_position_embeddings":
                _integer(where, value)
            elif key == "truncate":
                _boolean(where, value)
            elif key in _ROPE_RANGES:
                _number(where, value, *_ROPE_RANGES[key])
            elif key == "partial_rotary_factor":
                if _number(where, value, low=0.0, low_open=True) != 1.0:
                    raise UnsupportedModelError(f"{where}={value} is not supported; beaconkv rotates every "
                                                "dimension of a head.")
            elif isinstance(value, dict):
                raise UnsupportedModelError(
                    f"rope parameters per layer type ({key!r}: {_show(value)}) are not supported; beaconkv runs "
                    "one rotary embedding for every layer."
                )


_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Parameters each type needs (yarn's factor may be derived from the context lengths).
_ROPE_REQUIRED = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "yarn": ("original_max_position_embeddings",)}
# Sane ranges of the numeric parameters, (low, high, low_open): real configs use factors of 2-64, beta_fast 32
# and beta_slow 1, attention factors and mscales near 1. Beyond them the float32 frequencies overflow.
_ROPE_RANGES: dict[str, tuple[float, float, bool]] = {
    "factor": (1.0, float(1 << 24), False),
    "low_freq_factor": (0.0, 1e6, True),
    "high_freq_factor": (0.0, 1e6, True),
    "beta_fast": (1e-3, 1e6, False),
    "beta_slow": (1e-3, 1e6, False),
    "attention_factor": (0.0, 100.0, True),
    "mscale": (0.0, 100.0, False),
    "mscale_all_dim": (0.0, 100.0, False),
}


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only causal LM.

    Every field is checked on construction: integers are ``int`` (not ``bool``) within
    :data:`CONFIG_LIMITS`, ``head_dim`` is even, ``num_key_value_heads`` divides
    ``num_attention_heads``, flags are ``bool``, token ids lie inside the vocabulary.

    Attributes:
        model_type: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
        vocab_size: Vocabulary size.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the SwiGLU MLP.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (GQA); divides ``num_attention_heads``.
        head_dim: Per-head width; not necessarily ``hidden_size // num_attention_heads`` (Qwen3).
        rms_norm_eps: Epsilon of every RMSNorm, in ``(0, 1)``.
        max_position_embeddings: Longest sequence the model accepts.
        tie_word_embeddings: Whether the LM head shares the token embedding matrix.
        attention_bias: q/k/v projections carry biases (Qwen2).
        qk_norm: Per-head RMSNorm on queries and keys before RoPE (Qwen3).
        rope: Rotary embedding settings.
        bos_token_id: Beginning-of-sequence id, if any.
        eos_token_id: End-of-sequence id(s) from the config, if any.

    Raises:
        ConfigFileError: A field of the wrong type or out of range (the message names the field, the
            value and the limit).
        UnsupportedModelError: Another ``model_type``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type={_show(self.model_type)} is not supported; beaconkv supports "
                                        f"{', '.join(SUPPORTED_MODEL_TYPES)}{_HF_HINT}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _integer(name, getattr(self, name))
        if self.head_dim % 2:
            raise ConfigFileError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs of "
                                  f"dimensions); {_RESTORE}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigFileError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA needs whole groups: {_RESTORE}."
            )
        self.rms_norm_eps = _number("rms_norm_eps", self.rms_norm_eps, low=0.0, high=1.0, low_open=True)
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            _boolean(name, getattr(self, name))
        if not isinstance(self.rope, RopeConfig):
            raise ConfigFileError(f"rope must be a RopeConfig, not {type(self.rope).__name__}.")
        _token_ids("bos_token_id", self.bos_token_id, self.vocab_size)
        _token_ids("eos_token_id", self.eos_token_id, self.vocab_size)

    @property
    def n_groups(self) -> int:
        """Query heads per key/value head (the GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parses and checks a Hugging Face ``config.json`` dictionary.

        Keys the decoder does not use are ignored; a key given as ``null`` counts as absent.

        Args:
            raw: The decoded JSON object.

        Returns:
            The parsed configuration.

        Raises:
            UnsupportedModelError: ``model_type`` is missing or not one of llama, qwen2, qwen3, the
                rotary scaling type is unknown, or a setting the decoder cannot honour is on
                (``hidden_act`` other than silu, ``mlp_bias``, ``use_sliding_window``, sliding
                ``layer_types``, ``partial_rotary_factor`` below 1).
            ConfigFileError: ``raw`` is not a dictionary, a required key is missing, or a value has the
                wrong type or is out of range (the message names the key, the value and the fix).
        """
        if not isinstance(raw, dict):
            raise ConfigFileError(f"a config must be a JSON object, got {_json_type(raw)}.")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={_show(model_type)} is not supported; beaconkv supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}{_HF_HINT}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if raw.get(k) is None]
        if missing:
            raise ConfigFileError(f"the {model_type} config lacks integer values for {', '.join(missing)}; "
                                  "restore the checkpoint's original config.json.")
        values = {k: _integer(k, raw[k]) for k in required}
        _refuse_unsupported_settings(raw)
        heads, hidden = values["num_attention_heads"], values["hidden_size"]
        head_dim = raw.get("head_dim")
        if head_dim is None:
            head_dim = hidden // heads
            if head_dim < 2 or head_dim % 2:
                raise ConfigFileError(
                    f"head_dim is absent, and hidden_size // num_attention_heads = {hidden} // {heads} = {head_dim} "
                    "is no head width (an even number of at least 2); add the checkpoint's head_dim to config.json, "
                    "or restore hidden_size and num_attention_heads."
                )
        kv_heads = raw.get("num_key_value_heads")
        eps = raw.get("rms_norm_eps")
        max_positions = raw.get("max_position_embeddings")
        attention_bias = _optional(raw, "attention_bias", False, _boolean)
        return cls(
            model_type=model_type,
            **values,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            rms_norm_eps=1e-6 if eps is None else eps,
            max_position_embeddings=4096 if max_positions is None else max_positions,
            tie_word_embeddings=_optional(raw, "tie_word_embeddings", False, _boolean),
            # Qwen2 always has q/k/v biases; Llama may declare them with attention_bias.
            attention_bias=model_type == "qwen2" or attention_bias,
            qk_norm=model_type == "qwen3",
            rope=_parse_rope(raw, 4096 if max_positions is None else max_positions),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Reads, parses and checks a ``config.json`` file.

        Args:
            path: The file, or the checkpoint directory holding ``config.json``.

        Returns:
            The parsed configuration.

        Raises:
            FileNotFoundError: The file does not exist.
            ConfigFileError: The file is not valid UTF-8 JSON, is larger than :data:`MAX_CONFIG_BYTES`, or a
                value is missing, of the wrong type or out of range (the message names the file).
            UnsupportedModelError: See :meth:`from_dict` (the message names the file).
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"No config.json at {path}; a checkpoint directory needs one.")
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigFileError(f"{path} has {size} bytes, more than the {MAX_CONFIG_BYTES} a config.json may have; "
                                  "restore the checkpoint's original config.json.")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, too many digits, nesting
            where = (f" (line {err.lineno}, column {err.colno}: {err.msg})" if isinstance(err, json.JSONDecodeError)
                     else f" ({type(err).__name__}: {str(err)[:200]})")
            raise ConfigFileError(f"{path} is not valid JSON{where}; restore the checkpoint's original config.json "
                                  "(re-download it or copy it from the model's page).") from None
        try:
            return cls.from_dict(raw)
        except (ConfigFileError, UnsupportedModelError) as err:
            raise type(err)(f"{path}: {err}") from None


def _optional(raw: dict[str, Any], name: str, default: Any, check: Any) -> Any:
    """``check(name, raw[name])``, or ``default`` when the key is absent or null."""
    value = raw.get(name)
    return default if value is None else check(name, value)


def _refuse_unsupported_settings(raw: dict[str, Any]) -> None:
    """Raises :class:`UnsupportedModelError` for a setting the decoder would otherwise silently ignore."""
    act = raw.get("hidden_act")
    if act is not None and act not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act={_show(act)} is not supported; beaconkv's MLP is SwiGLU (silu).")
    if _optional(raw, "mlp_bias", False, _boolean):
        raise UnsupportedModelError("mlp_bias=true is not supported; beaconkv's MLP projections have no biases.")
    if _optional(raw, "use_sliding_window", False, _boolean):
        raise UnsupportedModelError("use_sliding_window=true is not supported; beaconkv attends over the whole "
                                    "context in every layer.")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ConfigFileError(f"layer_types={_show(layer_types)} must be a list, not {_json_type(layer_types)}; "
                                  f"{_RESTORE}.")
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            raise UnsupportedModelError(f"layer_types {_show(other)} are not supported; beaconkv runs full attention "
                                        "in every layer.")
    partial = raw.get("partial_rotary_factor")
    if partial is not None and _number("partial_rotary_factor", partial, low=0.0, low_open=True) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported; beaconkv rotates every "
                                    "dimension of a head.")


def _parse_rope(raw: dict[str, Any], max_positions: Any) -> RopeConfig:
    """Reads either ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling`` (classic)."""
    sources = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigFileError(f"{key}={_show(value)} must be an object or null, not {_json_type(value)}; "
                                  f"{_RESTORE}.")
        sources[key] = value or {}
    params = dict(sources["rope_parameters"])
    params.update({k: v for k, v in sources["rope_scaling"].items() if k not in params})
    theta = params.pop("rope_theta", None)
    theta = raw.get("rope_theta", 10000.0) if theta is None else theta
    theta = 10000.0 if theta is None else theta
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if not isinstance(rope_type, str):
        raise ConfigFileError(f"rope_type={_show(rope_type)} must be a string, not {_json_type(rope_type)}; "
                              f"{_RESTORE}.")
    factor = params.pop("factor", None)
    if rope_type == "yarn" and factor is None and isinstance(params.get("original_max_position_embeddings"), int):
        original = _integer("rope_scaling.original_max_position_embeddings", params["original_max_position_embeddings"])
        factor = _integer("max_position_embeddings", max_positions) / original
    if rope_type in ("linear", "llama3") and factor is None:
        raise ConfigFileError(f"{rope_type} rope scaling needs 'factor' in rope_scaling (or rope_parameters); "
                              f"{_RESTORE}.")
    return RopeConfig(theta=theta, rope_type=rope_type, factor=1.0 if factor is None else factor, params=params)
