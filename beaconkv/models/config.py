"""Model configuration: one small dataclass parsed from a checkpoint's own ``config.json``.

Supports the three architectures the project targets: ``llama`` (Llama 3.x, SmolLM2), ``qwen2``
(Qwen2 and the R1-Distill-Qwen models: q/k/v biases) and ``qwen3`` (per-head q/k RMSNorm, a
``head_dim`` independent of ``hidden_size``). Both spellings of the rotary settings are accepted:
the classic ``rope_theta`` + ``rope_scaling`` and the newer ``rope_parameters`` dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The checkpoint's ``model_type`` (or one of its settings) is not supported by beaconkv."""


class ConfigFileError(ValueError):
    """A checkpoint's ``config.json`` cannot be parsed: invalid JSON, not an object, or a required key missing."""


@dataclass
class RopeConfig:
    """Rotary embedding settings.

    Attributes:
        theta: Base of the geometric frequency progression (``rope_theta``).
        rope_type: ``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``.
        factor: Scaling factor for the scaled variants.
        params: The remaining type-specific parameters, with Hugging Face key names
            (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``,
            ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only causal LM.

    Attributes:
        model_type: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
        vocab_size: Vocabulary size.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the SwiGLU MLP.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Query heads.
        num_key_value_heads: Key/value heads (GQA); divides ``num_attention_heads``.
        head_dim: Per-head width; not necessarily ``hidden_size // num_attention_heads`` (Qwen3).
        rms_norm_eps: Epsilon of every RMSNorm.
        max_position_embeddings: Longest sequence the model accepts.
        tie_word_embeddings: Whether the LM head shares the token embedding matrix.
        attention_bias: q/k/v projections carry biases (Qwen2).
        qk_norm: Per-head RMSNorm on queries and keys before RoPE (Qwen3).
        rope: Rotary embedding settings.
        bos_token_id: Beginning-of-sequence id, if any.
        eos_token_id: End-of-sequence id(s) from the config, if any.
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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA needs whole groups."
            )

    @property
    def n_groups(self) -> int:
        """Query heads per key/value head (the GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parses a Hugging Face ``config.json`` dictionary.

        Args:
            raw: The decoded JSON object.

        Returns:
            The parsed configuration.

        Raises:
            UnsupportedModelError: ``model_type`` is missing or not one of llama, qwen2, qwen3, or the
                rotary scaling type is unknown.
            ConfigFileError: ``raw`` is not a dictionary, or a required key is missing or not a number.
        """
        if not isinstance(raw, dict):
            raise ConfigFileError(f"a config must be a JSON object, got {type(raw).__name__}.")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} is not supported; beaconkv supports {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool)]
        if missing:
            raise ConfigFileError(f"the {model_type} config lacks integer values for {', '.join(missing)}; "
                                  "restore the checkpoint's original config.json.")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // heads
        eos = raw.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama may declare them with attention_bias.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=_parse_rope(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Reads and parses a ``config.json`` file.

        Args:
            path: The file, or the checkpoint directory holding ``config.json``.

        Returns:
            The parsed configuration.

        Raises:
            FileNotFoundError: The file does not exist.
            ConfigFileError: The file is not valid JSON or lacks a required key (the message names the file).
            UnsupportedModelError: See :meth:`from_dict`.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"No config.json at {path}; a checkpoint directory needs one.")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            where = (f" (line {err.lineno}, column {err.colno}: {err.msg})"
                     if isinstance(err, json.JSONDecodeError) else "")
            raise ConfigFileError(f"{path} is not valid JSON{where}; restore the checkpoint's original config.json "
                                  "(re-download it or copy it from the model's page).") from None
        try:
            return cls.from_dict(raw)
        except ConfigFileError as err:
            raise ConfigFileError(f"{path}: {err}") from None


_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Reads either ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling`` (classic)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type={rope_type!r} is not supported; beaconkv supports {', '.join(_ROPE_TYPES)}."
        )
    factor = params.pop("factor", None)
    if rope_type == "yarn" and factor is None:
        factor = raw["max_position_embeddings"] / params["original_max_position_embeddings"]
    return RopeConfig(theta=theta, rope_type=rope_type, factor=float(factor or 1.0), params=params)
