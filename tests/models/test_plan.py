"""The decoder plan: every field, in a small random model, run by the module path against a
plain whole-sequence oracle written from the plan here, and by every executor this machine has
(the C++ step on each ISA variant, the CUDA step through Triton's interpreter) against the module
path; an executor that does not implement a field shows its refusal instead."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fastdraft.kernels import triton_ops
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.layers.kv_cache import SequenceCache
from fastdraft.model_config import ModelConfig
from fastdraft.models.causal_lm import CausalLM
from fastdraft.models.cuda_decoder import CudaDecoder
from fastdraft.models.fused_decoder import FusedDecoder
from fastdraft.models.plan import DecoderPlan, NormSpec, decoder_plan
from fastdraft.quant.quant_config import QuantConfig
from fastdraft.quant.quantizer import quantize_model

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
# Chunks of one sequence: a prompt, a decode step, a verification, a chunk past the per-token
# path, then decode steps beyond the sliding window.
CHUNKS = [7, 1, 3, 12, 1, 1]


def _layers(plan: DecoderPlan, fn) -> DecoderPlan:
    return replace(plan, layers=tuple(fn(i, layer) for i, layer in enumerate(plan.layers)))


def _attention(plan: DecoderPlan, **fields) -> DecoderPlan:
    return _layers(plan, lambda i, layer: replace(layer, attention=replace(layer.attention, **fields)))


def _offset(norm: NormSpec | None) -> NormSpec | None:
    return None if norm is None else replace(norm, is_offset=True)


def _offset_norms(plan: DecoderPlan) -> DecoderPlan:
    plan = _layers(plan, lambda i, layer: replace(
        layer, pre_attention_norm=_offset(layer.pre_attention_norm), pre_mlp_norm=_offset(layer.pre_mlp_norm)))
    return replace(plan, final_norm=_offset(plan.final_norm))


# Each plan field beyond the plain Llama layer: the feature's name -> the plan using it.
FEATURES = {
    "embedding_scale": lambda p: replace(p, embedding_scale=8.0),
    "final_logit_softcap": lambda p: replace(p, final_logit_softcap=2.0),
    "offset_norm": _offset_norms,
    "post_norm": lambda p: _layers(p, lambda i, layer: replace(
        layer, post_attention_norm=NormSpec("post_attention_norm", 1e-6),
        post_mlp_norm=NormSpec("post_feedforward_layernorm", 1e-6))),
    "missing_pre_norm": lambda p: _layers(p, lambda i, layer: replace(layer, pre_mlp_norm=None)),
    "mixed_norm_eps": lambda p: _layers(p, lambda i, layer: replace(layer, pre_mlp_norm=replace(
        layer.pre_mlp_norm, eps=0.5))),
    "qk_norm": lambda p: _attention(p, q_norm=NormSpec("q_norm", 1e-6), k_norm=NormSpec("k_norm", 1e-6)),
    "sliding_window": lambda p: _attention(p, sliding_window=5),
    "attention_logit_softcap": lambda p: _attention(p, logit_softcap=0.5),
    "partial_rotary": lambda p: _layers(p, lambda i, layer: replace(layer, attention=replace(
        layer.attention, rotary=replace(layer.attention.rotary, rotary_dim=8)))),
    "per_layer_rotary": lambda p: _layers(p, lambda i, layer: replace(layer, attention=replace(
        layer.attention, rotary=replace(layer.attention.rotary, base=10.0 ** (2 + 2 * i))))),
    "activation_gelu_tanh": lambda p: _layers(p, lambda i, layer: replace(layer, mlp=replace(
        layer.mlp, activation="gelu_tanh"))),
    "ungated_mlp": lambda p: _layers(p, lambda i, layer: replace(layer, mlp=replace(layer.mlp, is_gated=False))),
    "per_layer_shapes": lambda p: _layers(p, lambda i, layer: replace(layer, mlp=replace(
        layer.mlp, intermediate_size=96 - 32 * i))),
}


def _all_features(plan: DecoderPlan) -> DecoderPlan:
    """Gemma-like: every feature at once (less the ones that exclude each other)."""
    for name, fn in FEATURES.items():
        if name not in ("missing_pre_norm", "ungated_mlp"):
            plan = fn(plan)
    return plan


def _model(plan_fn, dtype=torch.float32, seed: int = 0, **config) -> CausalLM:
    config = ModelConfig(**{**CONFIG, **config})
    torch.manual_seed(seed)
    model = CausalLM(config, plan=plan_fn(decoder_plan(config)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # random norms, so that a misplaced one shows
                p.copy_((0.5 if p.abs().sum() == 0 else 1.0) + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(0.15 * torch.randn_like(p))
    return model.to(dtype).eval()


def _tokens(n: int = sum(CHUNKS)) -> list[int]:
    return torch.randint(3, CONFIG["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)).tolist()


@torch.inference_mode()
def _paged_logits(model: CausalLM, decoder=None) -> torch.Tensor:
    """Every row's logits [num_tokens, vocab], the sequence run in CHUNKS over a paged cache."""
    tokens, cache, out, start = _tokens(), SequenceCache.from_config(model.config, 64, dtype=model.dtype), [], 0
    for n in CHUNKS:
        ids, meta = cache.append(tokens[start:start + n])
        out.append(model.logits(ids, meta.positions, cache.kv_cache, meta, list(range(n)), decoder))
        start += n
    return torch.cat(out)


def _norm(x: torch.Tensor, module, spec: NormSpec | None) -> torch.Tensor:
    if spec is None:
        return x
    w = getattr(module, spec.name).weight
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)
    return x * (1 + w) if spec.is_offset else x * w


def _rope(x: torch.Tensor, base: float, rotary_dim: int) -> torch.Tensor:
    """x [T, heads, D], its first rotary_dim dims rotated (rotate-half) by position."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = torch.arange(x.shape[0]).float()[:, None] * inv_freq  # [T, rotary_dim / 2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2, rest = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _act(x: torch.Tensor, name: str) -> torch.Tensor:
    return F.silu(x) if name == "silu" else 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


@torch.no_grad()
def _oracle_logits(model: CausalLM) -> torch.Tensor:
    """The plan computed over the whole sequence at once in fp32, from its definition."""
    plan, decoder = model.plan, model.model
    ids = torch.tensor(_tokens())
    num_tokens = len(ids)
    h = decoder.embed_tokens.weight[ids] * (plan.embedding_scale or 1.0)
    pos = torch.arange(num_tokens)
    for spec, layer in zip(plan.layers, decoder.layers):
        a, attn, mlp = spec.attention, layer.self_attn, layer.mlp
        x = _norm(h, layer, spec.pre_attention_norm)
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(num_tokens, a.num_heads, a.head_dim)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(num_tokens, a.num_kv_heads, a.head_dim)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(num_tokens, a.num_kv_heads, a.head_dim)
        q, k = _norm(q, attn, a.q_norm), _norm(k, attn, a.k_norm)
        q, k = _rope(q, a.rotary.base, a.rotary.rotary_dim), _rope(k, a.rotary.base, a.rotary.rotary_dim)
        group = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * a.scale
        if a.logit_softcap is not None:
            scores = a.logit_softcap * torch.tanh(scores / a.logit_softcap)
        visible = pos[None, :] <= pos[:, None]
        if a.sliding_window is not None:
            visible &= pos[None, :] > pos[:, None] - a.sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(num_tokens, -1)
        h = h + _norm(F.linear(out, attn.o_proj.weight), layer, spec.post_attention_norm)
        x = _norm(h, layer, spec.pre_mlp_norm)
        up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
        act = _act(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias), spec.mlp.activation) * up \
            if spec.mlp.is_gated else _act(up, spec.mlp.activation)
        h = h + _norm(F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias), layer, spec.post_mlp_norm)
    logits = F.linear(_norm(h, decoder, plan.final_norm), model.lm_head.weight)
    cap = plan.final_logit_softcap
    return logits if cap is None else cap * torch.tanh(logits / cap)


PLANS = {"plain": lambda p: p, **FEATURES, "all": _all_features}


@pytest.mark.parametrize("name", PLANS)
def test_module_path_computes_the_plan(name):
    model = _model(PLANS[name], attention_bias=name == "plain")
    if name in FEATURES:
        assert name in model.plan.features()
    torch.testing.assert_close(_paged_logits(model), _oracle_logits(model), atol=2e-4, rtol=1e-4)


def test_the_oracle_sees_each_field():
    """Each feature changes the logits: none of the tests above passes by ignoring it."""
    plain = _oracle_logits(_model(PLANS["plain"]))
    for name, fn in FEATURES.items():
        assert not torch.allclose(_oracle_logits(_model(fn)), plain, atol=1e-3), name


def test_llama_and_qwen2_plans_use_no_feature():
    for model_type in ("llama", "qwen2"):
        plan = decoder_plan(ModelConfig.from_dict({**CONFIG, "model_type": model_type}))
        assert plan.features() == set() and plan.refusal("x", set()) is None
        assert plan.layers[0].attention.has_qkv_bias == (model_type == "qwen2")


@pytest.mark.skipif(load_cpu_kernels() is None, reason="x86 kernels unavailable on this CPU")
@pytest.mark.usefixtures("each_isa")
@pytest.mark.parametrize("name", PLANS)
def test_cpp_step_runs_the_plan_or_refuses_it(name, caplog):
    model = _model(PLANS[name], dtype=torch.bfloat16)
    if name != "ungated_mlp":  # the quantizer knows the gated MLP's linears; the refusal needs no weights
        quantize_model(model, QuantConfig(method="rtn", group_size=32, sym=True), show_progress=False)
    missing = model.plan.features() - FusedDecoder.IMPLEMENTS
    with caplog.at_level(logging.INFO, logger="fastdraft.models.causal_lm"):
        decoder = model.fused_decoder()
    if missing:
        assert decoder is None
        assert f"the C++ step does not implement {', '.join(sorted(missing))}" in caplog.text
        return
    assert isinstance(decoder, FusedDecoder) and decoder.has_head
    assert torch.equal(_paged_logits(model, decoder), _paged_logits(model))


@pytest.mark.skipif(not triton_ops.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by conftest)")
@pytest.mark.parametrize("name", PLANS)
def test_cuda_step_runs_the_plan_or_refuses_it(name):
    model = _model(PLANS[name])
    refusal = model.plan.refusal(CudaDecoder.NAME, CudaDecoder.IMPLEMENTS)
    missing = model.plan.features() - CudaDecoder.IMPLEMENTS
    if missing:
        assert refusal is not None and all(feature in refusal for feature in missing)
        return
    assert refusal is None
    decoder = CudaDecoder(model, model.dtype, model.device, model.min_rows)  # the interpreter runs it on the CPU
    torch.testing.assert_close(_paged_logits(model, decoder), _paged_logits(model), atol=2e-4, rtol=1e-4)
