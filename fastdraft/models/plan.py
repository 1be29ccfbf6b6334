"""A decoder described once: the plan that every executor runs.

An architecture is one function from its :class:`~fastdraft.model_config.ModelConfig` to a
:class:`DecoderPlan`: the embedding, each layer's norms, projections, attention and MLP, the
final norm and the head. The module path (``models/causal_lm.py``, the reference and where
hooks live), the C++ step (``models/fused_decoder.py``) and the CUDA step
(``models/cuda_decoder.py``) all execute that plan; an executor refuses, by name, the
:meth:`DecoderPlan.features` it does not implement, and the model then runs on the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from fastdraft.model_config import ACTIVATIONS, ModelConfig


@dataclass(frozen=True)
class NormSpec:
    """An RMSNorm: its module name (the HF weight name), eps, and kind: ``weight * x̂`` or,
    with ``is_offset``, Gemma's ``x̂ * (1 + weight)`` (see :mod:`~fastdraft.kernels.ops.norm_ops`)."""

    name: str
    eps: float
    is_offset: bool = False


@dataclass(frozen=True)
class RotarySpec:
    """Rotary embedding: its base, its scaling (``rope_scaling`` items, frozen) and how many of
    a head's dimensions it rotates (the rest pass through)."""

    base: float
    rotary_dim: int
    scaling: tuple[tuple[str, Any], ...] = ()

    @property
    def scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.scaling) or None


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query attention over the paged cache. ``sliding_window``: a token sees that many
    keys up to its own; ``logit_softcap``: scores become ``cap * tanh(s / cap)``; ``q_norm`` /
    ``k_norm``: an RMSNorm over each head before rotary."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rotary: RotarySpec
    has_qkv_bias: bool = False
    q_norm: NormSpec | None = None
    k_norm: NormSpec | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None


@dataclass(frozen=True)
class MlpSpec:
    """The MLP: ``down(act(gate(x)) * up(x))`` when gated, else ``down(act(up(x)))``."""

    intermediate_size: int
    activation: str = "silu"  # or "gelu_tanh"
    is_gated: bool = True
    has_bias: bool = False


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: ``h += post_attn(attn(pre_attn(h)))``, then
    ``h += post_mlp(mlp(pre_mlp(h)))``; a norm that is None is not there."""

    attention: AttentionSpec
    mlp: MlpSpec
    pre_attention_norm: NormSpec | None
    pre_mlp_norm: NormSpec | None
    post_attention_norm: NormSpec | None = None
    post_mlp_norm: NormSpec | None = None

    def norms(self) -> list[NormSpec]:
        return [n for n in (self.pre_attention_norm, self.post_attention_norm, self.pre_mlp_norm,
                            self.post_mlp_norm) if n is not None]


@dataclass(frozen=True)
class DecoderPlan:
    """The whole model: the embedding (scaled by ``embedding_scale`` in the activations'
    dtype, if set), the layers, the final norm, the head (tied to the embedding or its own)
    and an optional soft-cap of the final logits."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerPlan, ...]
    final_norm: NormSpec
    is_head_tied: bool = False
    embedding_scale: float | None = None
    final_logit_softcap: float | None = None

    def features(self) -> set[str]:
        """The plan's fields beyond the plain Llama layer, by name: what an executor must
        implement to run this plan."""
        found = set()
        if self.embedding_scale is not None:
            found.add("embedding_scale")
        if self.final_logit_softcap is not None:
            found.add("final_logit_softcap")
        if self.final_norm.is_offset:
            found.add("offset_norm")
        first = self.layers[0]
        for layer in self.layers:
            attn, mlp = layer.attention, layer.mlp
            if layer.pre_attention_norm is None or layer.pre_mlp_norm is None:
                found.add("missing_pre_norm")
            if layer.post_attention_norm is not None or layer.post_mlp_norm is not None:
                found.add("post_norm")
            if any(n.is_offset for n in layer.norms() + [n for n in (attn.q_norm, attn.k_norm) if n is not None]):
                found.add("offset_norm")
            if len({n.eps for n in layer.norms()}) > 1:
                found.add("mixed_norm_eps")
            if attn.q_norm is not None or attn.k_norm is not None:
                found.add("qk_norm")
            if attn.sliding_window is not None:
                found.add("sliding_window")
            if attn.logit_softcap is not None:
                found.add("attention_logit_softcap")
            if attn.rotary.rotary_dim != attn.head_dim:
                found.add("partial_rotary")
            if attn.rotary != first.attention.rotary:
                found.add("per_layer_rotary")
            if mlp.activation != "silu":
                found.add(f"activation_{mlp.activation}")
            if not mlp.is_gated:
                found.add("ungated_mlp")
            if (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size) != (
                    first.attention.num_heads, first.attention.num_kv_heads, first.attention.head_dim,
                    first.mlp.intermediate_size):
                found.add("per_layer_shapes")
        return found

    def refusal(self, executor: str, implemented: set[str]) -> str | None:
        """Why ``executor``, which implements the features ``implemented``, cannot run this plan
        (None: it can)."""
        missing = self.features() - implemented
        if not missing:
            return None
        return f"{executor} does not implement {', '.join(sorted(missing))} ({self.architecture})"


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _scaling(config: ModelConfig) -> tuple[tuple[str, Any], ...]:
    """``config.rope_scaling``, frozen, with what the rotary embedding needs from the config:
    ``dynamic`` NTK scales against ``max_position_embeddings`` (as HF does)."""
    scaling = dict(config.rope_scaling or {})
    if scaling.get("rope_type", scaling.get("type")) == "dynamic":
        scaling.setdefault("max_position_embeddings", config.max_position_embeddings)
    return _frozen(scaling)


def llama_plan(config: ModelConfig) -> DecoderPlan:
    """Llama, SmolLM2 and Qwen2: pre-norms ``x * w``, SiLU-gated MLP, full rotary, one shape."""
    rotary = RotarySpec(config.rope_theta, config.head_dim, _scaling(config))
    attention = AttentionSpec(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                              config.head_dim ** -0.5, rotary, has_qkv_bias=config.attention_bias)
    mlp = MlpSpec(config.intermediate_size, "silu", has_bias=config.mlp_bias)
    layer = LayerPlan(attention, mlp, NormSpec("input_layernorm", config.rms_norm_eps),
                      NormSpec("post_attention_layernorm", config.rms_norm_eps))
    return DecoderPlan(config.model_type, config.vocab_size, config.hidden_size, (layer,) * config.num_hidden_layers,
                       NormSpec("norm", config.rms_norm_eps), is_head_tied=config.tie_word_embeddings)


def _windows(config: ModelConfig) -> list[int | None]:
    """Each layer's sliding window: ``sliding_window`` on the layers ``layer_types`` calls
    ``sliding_attention`` (none without ``layer_types``)."""
    kinds = config.layer_types or ["full_attention"] * config.num_hidden_layers
    return [config.sliding_window if kind == "sliding_attention" else None for kind in kinds]


def qwen3_plan(config: ModelConfig) -> DecoderPlan:
    """Qwen3: Llama's layer with an RMSNorm (``x * w``) over each query and key head before
    rotary, a head size of its own; windows only where ``layer_types`` has them (HF's
    ``use_sliding_window``)."""
    plan = llama_plan(config)
    eps = config.rms_norm_eps
    layers = tuple(replace(layer, attention=replace(layer.attention, q_norm=NormSpec("q_norm", eps),
                                                    k_norm=NormSpec("k_norm", eps), sliding_window=window))
                   for layer, window in zip(plan.layers, _windows(config)))
    return replace(plan, layers=layers)


def mistral_plan(config: ModelConfig) -> DecoderPlan:
    """Mistral: Llama's layer, every layer's attention over a window of ``sliding_window`` keys
    where it is set (none where it is null), a head size of its own (Mistral-Nemo)."""
    plan = llama_plan(config)
    window = config.sliding_window
    return replace(plan, layers=tuple(replace(layer, attention=replace(layer.attention, sliding_window=window))
                                      for layer in plan.layers))


# What Gemma 3 takes where its config is silent (as transformers and llama.cpp do): every sixth
# layer global, the local layers' rotary base.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def gemma3_plan(config: ModelConfig) -> DecoderPlan:
    """Gemma 3: four norms a layer and q/k norms, all ``x̂ * (1 + w)``; a GELU-tanh gated MLP;
    the embedding scaled by sqrt(hidden_size); local layers (``sliding_attention``) with their
    own rotary base and a window, global ones with ``rope_theta`` and its scaling."""
    eps, dim = config.rms_norm_eps, config.head_dim
    layer_types = config.layer_types or [
        "full_attention" if (i + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
        for i in range(config.num_hidden_layers)]
    scale = (config.query_pre_attn_scalar or dim) ** -0.5
    rotaries = {"full_attention": RotarySpec(config.rope_theta, dim, _scaling(config)),
                "sliding_attention": RotarySpec(config.rope_local_base_freq or GEMMA3_LOCAL_ROPE_BASE, dim)}
    mlp = MlpSpec(config.intermediate_size, ACTIVATIONS[config.hidden_act])

    def norm(name: str) -> NormSpec:
        return NormSpec(name, eps, is_offset=True)

    layers = tuple(LayerPlan(
        AttentionSpec(config.num_attention_heads, config.num_key_value_heads, dim, scale, rotaries[kind],
                      has_qkv_bias=config.attention_bias, q_norm=norm("q_norm"), k_norm=norm("k_norm"),
                      sliding_window=config.sliding_window if kind == "sliding_attention" else None,
                      logit_softcap=config.attn_logit_softcapping),
        mlp, norm("input_layernorm"), norm("pre_feedforward_layernorm"),
        post_attention_norm=norm("post_attention_layernorm"), post_mlp_norm=norm("post_feedforward_layernorm"))
        for kind in layer_types)
    return DecoderPlan(config.model_type, config.vocab_size, config.hidden_size, layers, norm("norm"),
                       is_head_tied=config.tie_word_embeddings, embedding_scale=config.hidden_size ** 0.5,
                       final_logit_softcap=config.final_logit_softcapping)


# model_type -> its plan function: adding an architecture adds one entry (and its weight names).
PLAN_BUILDERS: dict[str, Callable[[ModelConfig], DecoderPlan]] = {
    "llama": llama_plan,
    "qwen2": llama_plan,
    "qwen3": qwen3_plan,
    "mistral": mistral_plan,
    "gemma3_text": gemma3_plan,
}


def decoder_plan(config: ModelConfig) -> DecoderPlan:
    """The plan of ``config``'s architecture."""
    builder = PLAN_BUILDERS.get(config.model_type)
    if builder is None:
        raise ValueError(f"no decoder plan for model_type {config.model_type!r}; known: {sorted(PLAN_BUILDERS)}")
    return builder(config)
