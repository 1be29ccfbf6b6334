"""Model configuration: the subset of an HF ``config.json`` our decoder needs, validated."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# HF ``model_type`` values we implement, and the HF architecture class name of each.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Activations by HF name (``hidden_act``, Gemma's ``hidden_activation``) -> the plan's name.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")
# ``rope_scaling`` kinds (``rope_type``) the rotary embedding implements (layers/rotary.py), and
# the keys each needs besides ``rope_type``.
ROPE_TYPES = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
              "yarn": ("factor", "original_max_position_embeddings"),
              "llama3": ("factor", "original_max_position_embeddings")}
# Fields only some architectures have: left out of ``to_hf_dict`` while unset.
_OPTIONAL_FIELDS = ("query_pre_attn_scalar", "sliding_window", "layer_types", "rope_local_base_freq",
                    "final_logit_softcapping", "attn_logit_softcapping")


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family decoder.

    Field names follow HF ``config.json`` so the file maps onto this class directly.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 means hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    # Gemma 3: attention scale 1/sqrt(query_pre_attn_scalar); "sliding_attention" layers see the
    # last ``sliding_window`` positions and rotate with ``rope_local_base_freq``.
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError("hidden_size must be divisible by num_attention_heads when head_dim is unset")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; implemented: {', '.join(ACTIVATIONS)}")
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers
                                             or set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the "
                             f"{self.num_hidden_layers} layers")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) or "default"
            if rope_type not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
            missing = [k for k in ROPE_TYPES[rope_type] if self.rope_scaling.get(k) is None]
            if missing:
                raise ValueError(f"rope_scaling {rope_type!r} needs {', '.join(missing)}")

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of keys and values one cached token holds, all layers, at ``itemsize`` bytes
        per element: what a decode step reads per token of context."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from an HF config dict; unknown keys are kept in ``extra``."""
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: v for k, v in raw.items() if k in known and v is not None}
        if "model_type" not in kwargs:
            raise ValueError("config has no 'model_type'")
        # Qwen2 always has q/k/v biases; HF encodes that in the class, not the config.
        if raw.get("model_type") == "qwen2" and "attention_bias" not in raw:
            kwargs["attention_bias"] = True
        if "hidden_activation" in raw and raw["hidden_activation"] is not None:  # Gemma's name for it
            kwargs["hidden_act"] = raw["hidden_activation"]
        # transformers >= 5 writes rope_theta and the scaling inside "rope_parameters", per layer
        # type where those differ (Gemma 3).
        rope_parameters = raw.get("rope_parameters")
        if isinstance(rope_parameters, dict) and set(rope_parameters) <= set(LAYER_TYPES):
            local = rope_parameters.get("sliding_attention") or {}
            if "rope_local_base_freq" not in kwargs and local.get("rope_theta") is not None:
                kwargs["rope_local_base_freq"] = local["rope_theta"]
            rope_parameters = rope_parameters.get("full_attention")
        if isinstance(rope_parameters, dict):
            if "rope_theta" not in kwargs and rope_parameters.get("rope_theta") is not None:
                kwargs["rope_theta"] = rope_parameters["rope_theta"]
            rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
            if "rope_scaling" not in kwargs and rope_type not in ("default", None):
                kwargs["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        if "torch_dtype" not in kwargs and isinstance(raw.get("dtype"), str):
            kwargs["torch_dtype"] = raw["dtype"]
        extra = {k: v for k, v in raw.items() if k not in known}
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {path}: {exc}") from exc
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` form (loadable by transformers too)."""
        out = {k: v for k, v in asdict(self).items()
               if k != "extra" and not (k in _OPTIONAL_FIELDS and v is None)}
        out.update(self.extra)
        out["architectures"] = [SUPPORTED_MODEL_TYPES[self.model_type]]
        return out
